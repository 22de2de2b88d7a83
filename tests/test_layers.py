"""The elementwise layers' C++ operators (loom/kernels/elementwise.cpp), which eager steps run,
against the plain functions."""
from __future__ import annotations

import pytest
import torch

from loom import LLM
from loom.kernels import load_kernels
from loom.layers.activation import silu_and_mul
from loom.layers.norm import rms_norm
from loom.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_layers_equal_the_plain_functions(dtype):
    """For any number of tokens, on strided views as the models pass them (Llama's q and k are
    slices of one projection; GPT-NeoX's heads interleave q, k and v, and rotate part of each
    head); bf16 rounds where the plain function casts."""
    load_kernels()
    g = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(16, 512, 10000.0, None)
    partial = RotaryEmbedding(16, 512, 10000.0, None, rotary_dim=8)
    weight = torch.randn(48, generator=g).to(dtype)
    for tokens in (1, 7, 300):
        qkv = torch.randn(tokens, 3 * 48, generator=g).to(dtype)
        q, k = (t.view(tokens, 3, 16) for t in qkv.split(48, dim=1)[:2])
        per_head = qkv.view(tokens, 3, 48)  # head h: [q | k | v] of 16 each
        hq, hk = per_head[..., :16], per_head[..., 16:32]
        positions = torch.randint(0, 512, (tokens,), generator=g)
        cases = [(rms_norm, (qkv[:, :48], weight, 1e-6)), (silu_and_mul, (qkv[:, :96],)),
                 *((apply_rotary, (positions, a, b, r.cos, r.sin, r.rotary_dim))
                   for r in (rotary, partial) for a, b in ((q, k), (hq, hk)))]
        for fn, args in cases:
            plain, kernel = fn(*args), fn(*args, kernel=True)
            for a, b in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (plain, kernel))):
                assert a.dtype == b.dtype == dtype and a.shape == b.shape
                torch.testing.assert_close(b, a, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_kernel_layers_refuse_bad_input():
    load_kernels()
    ops = torch.ops.loom
    rotary = RotaryEmbedding(16, 8, 10000.0, None)
    q = torch.randn(2, 3, 16)
    with pytest.raises(RuntimeError, match="position 8 outside the tables' 8"):
        ops.rotary(torch.tensor([0, 8]), q, q, rotary.cos, rotary.sin, 0)
    with pytest.raises(RuntimeError, match="rotary_dim 5 must be even"):
        ops.rotary(torch.tensor([0, 1]), q, q, rotary.cos, rotary.sin, 5)
    with pytest.raises(RuntimeError, match="weight \\[H\\] of one dtype"):
        ops.rms_norm(torch.randn(2, 16), torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(torch.randn(2, 16, dtype=torch.float64))


def test_engines_on_loom_kernels_use_the_operators(hf_models):
    model_dir, _ = hf_models("llama_gqa")

    def kernels(llm: LLM) -> set[bool]:
        return {m.kernel for m in llm.engine.runner.model.modules() if hasattr(m, "kernel")}

    assert kernels(LLM(str(model_dir), enforce_eager=True)) == {True}  # operators, not a compiler
    assert kernels(LLM(str(model_dir), attention_backend="torch")) == {False}  # the plain reference
