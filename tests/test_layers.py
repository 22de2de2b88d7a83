"""The elementwise layers' fused eager path (loom/layers/fused.py) against the plain functions."""
from __future__ import annotations

import pytest
import torch

from loom import LLM
from loom.layers.activation import silu_and_mul
from loom.layers.norm import rms_norm
from loom.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_equal_the_plain_functions(dtype):
    """For any number of tokens (one compiled function serves them all), on strided views as
    the model passes them; bf16 rounds where the plain function casts."""
    g = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(16, 512, 10000.0, None)
    partial = RotaryEmbedding(16, 512, 10000.0, None, rotary_dim=8)
    weight = torch.randn(48, generator=g).to(dtype)
    for tokens in (1, 7, 300):
        qkv = torch.randn(tokens, 3 * 48, generator=g).to(dtype)
        q, k = (t.view(tokens, 3, 16) for t in qkv.split(48, dim=1)[:2])
        positions = torch.randint(0, 512, (tokens,), generator=g)
        cases = [(rms_norm, (qkv[:, :48], weight, 1e-6)), (silu_and_mul, (qkv[:, :96],)),
                 *((apply_rotary, (positions, q, k, r.cos, r.sin, r.rotary_dim)) for r in (rotary, partial))]
        for fn, args in cases:
            plain, fused = fn(*args), fn(*args, fuse=True)
            for a, b in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (plain, fused))):
                assert a.dtype == b.dtype == dtype
                torch.testing.assert_close(b, a, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_only_compiling_engines_fuse(hf_models):
    model_dir, _ = hf_models("llama_gqa")

    def fusing(llm: LLM) -> set[bool]:
        return {m.fuse for m in llm.engine.runner.model.modules() if hasattr(m, "fuse")}

    assert fusing(LLM(str(model_dir), enforce_eager=True)) == {False}  # no compiler at all
    assert fusing(LLM(str(model_dir), enforce_eager=False, max_num_seqs=2)) == {True}
