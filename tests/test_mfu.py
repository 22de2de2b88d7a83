"""The FLOP count behind every MFU figure, against a token-by-token count and against torch's
own FLOP counter on the Hugging Face model; and the GEMM roof it divides by."""
from __future__ import annotations

import pytest
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


def test_gemm_roof_is_the_faster_kernel(hf_models, monkeypatch):
    """Every kernel a linear layer can dispatch to runs, each is given a time here (nothing is
    timed), its rate is the layer's FLOPs over that time, and the roof is the fastest."""
    from loom.bench import mfu

    model_dir, _ = hf_models("llama_gqa")
    c = ModelConfig.from_dir(model_dir)
    given_s = iter([4e-3, 1e-3, 2e-3, 3e-3])
    runs = []
    monkeypatch.setattr(mfu, "best_time", lambda fn, repeats: runs.append(fn()) or next(given_s))
    rates = gemm_roof(c, torch.float32, tokens=32, repeats=2)
    kernels = candidates("fp32", panels_available())
    flops = 2 * 32 * sum(i * o for i, o in mfu.layer_shapes(c))
    assert list(rates) == [*kernels, "roof"] and len(runs) == len(kernels)
    assert [rates[k] for k in kernels] == pytest.approx([flops / t for t in (4e-3, 1e-3, 2e-3, 3e-3)[:len(kernels)]])
    assert rates["roof"] == max(rates[k] for k in kernels)


def test_offline_lower_bound_adds_gemms_and_kv_reads(hf_models):
    """The offline bound, against a count request by request and step by step: prompts at the
    roof, then each decode step at the roof or at the weights' read time, whichever is longer,
    plus every stored token's K and V read once per decode step at the KV rate."""
    from loom.bench.latency import weight_bytes
    from loom.bench.throughput import Request, lower_bound

    model_dir, _ = hf_models("llama_gqa")
    c = ModelConfig.from_dir(model_dir)
    workload = [Request([5] * 6, 3), Request([5] * 2, 5)]
    per_layer = 2 * (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                     + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    head = 2 * c.hidden_size * c.vocab_size
    kv_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2  # K and V, bf16
    for roof, read in ((1e12, 1e6), (1e6, 1e15)):  # decode steps bound by the weights, then by the GEMMs
        prompt_time = sum(request_flops(c, len(r.prompt_token_ids), 1) for r in workload) / roof
        step_time = kv = 0.0
        for step in (1, 2, 3, 4):  # the first request decodes 2 tokens, the second 4
            running = [r for r in workload if r.output_len - 1 >= step]
            compute = sum(c.num_layers * per_layer + head for _ in running) / roof
            step_time += max(compute, weight_bytes(c, "bfloat16", None) / read)
            kv += sum((len(r.prompt_token_ids) + step) * kv_token for r in running)
        bound = lower_bound(c, "bfloat16", workload, roof, read, kv_read=2e9)
        assert bound["decode_kv_bytes"] == kv
        expected = prompt_time + step_time + kv / 2e9
        assert abs(bound["seconds"] - expected) <= 1e-9 * expected
        flops = workload_flops(c, [6, 2], [3, 5])
        assert abs(bound["mfu"] - flops / expected / roof) <= 1e-9 and bound["output_tok_per_s"] == 8 / bound["seconds"]
