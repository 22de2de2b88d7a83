"""The FLOP count behind every MFU figure, against a token-by-token count and against torch's
own FLOP counter on the Hugging Face model; and the GEMM roof it divides by."""
from __future__ import annotations

import torch

from loom.bench.mfu import gemm_roof, request_flops, workload_flops
from loom.layers.dispatch import candidates, panels_available
from loom.models.config import ModelConfig


def test_request_flops_counts_every_token(hf_models):
    model_dir, hf = hf_models("llama_gqa")
    c = ModelConfig.from_dir(model_dir)
    prompt, output = 7, 4
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    expected = 0
    for position in range(prompt + output - 1):  # every token fed to the model
        for _ in range(c.num_layers):
            expected += 2 * per_layer + 2 * 2 * c.num_heads * c.head_dim * (position + 1)
    expected += output * 2 * c.hidden_size * c.vocab_size  # a sampled row per output token
    assert request_flops(c, prompt, output) == expected
    assert workload_flops(c, [prompt, 3], [output, 2]) == expected + request_flops(c, 3, 2)

    # torch's counter on one forward of the dense model: its matmuls are the linear layers and
    # the LM head of every row (attention goes through SDPA, counted apart).
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        hf(torch.randint(3, c.vocab_size, (1, prompt)))
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counts.items() if "mm" in str(op) and "scaled_dot" not in str(op))
    ours_linear = request_flops(c, prompt, 1) - 4 * c.num_layers * c.num_heads * c.head_dim * prompt * (prompt + 1) // 2
    assert matmuls == ours_linear + (prompt - 1) * 2 * c.hidden_size * c.vocab_size


def test_gemm_roof_is_the_faster_kernel(hf_models):
    """Every kernel a linear layer can dispatch to is run, and the roof is the fastest (on a fake
    clock: the bookkeeping, not the rates, is under test)."""
    model_dir, _ = hf_models("llama_gqa")
    rates = gemm_roof(ModelConfig.from_dir(model_dir), torch.float32, tokens=32, repeats=2)
    kernels = {k: v for k, v in rates.items() if k != "roof"}
    assert set(kernels) == set(candidates("fp32", panels_available())) and all(v > 0 for v in kernels.values())
    assert rates["roof"] == max(kernels.values())
