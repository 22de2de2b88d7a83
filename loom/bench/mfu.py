"""Model FLOPs utilization: the FLOPs a workload's tokens need, over the time they took, against
the best GEMM rate this CPU reaches at the model's own layer shapes, measured in the same run.

FLOPs count what a forward pass must do: the linear layers for every computed token (prompt and
decode), the LM head for every sampled row, and attention (q.k and p.v) over each token's
context. Embedding lookups, norms and the sampler count nothing."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loom.bench.calibrate import best_time
from loom.models.config import ModelConfig


def layer_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's merged projections: qkv, o, gate_up, down."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [(c.hidden_size, q + 2 * kv), (q, c.hidden_size), (c.hidden_size, 2 * c.intermediate_size),
            (c.intermediate_size, c.hidden_size)]


def request_flops(c: ModelConfig, prompt_len: int, output_len: int) -> float:
    """FLOPs of one request computed from scratch: its prompt, then output_len - 1 decode tokens
    (the last output token is sampled, never fed back), output_len sampled rows."""
    computed = prompt_len + output_len - 1
    linear = 2 * c.num_layers * sum(i * o for i, o in layer_shapes(c)) * computed
    head = 2 * c.hidden_size * c.vocab_size * output_len
    # the token at position p attends to p + 1 keys: sum over p < computed of (p + 1)
    contexts = computed * (computed + 1) // 2
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * contexts
    return linear + head + attention


def workload_flops(c: ModelConfig, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    return sum(request_flops(c, p, o) for p, o in zip(prompt_lens, output_lens))


def gemm_roof(c: ModelConfig, dtype: torch.dtype, tokens: int = 512, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of one decoder layer's four projections over `tokens` rows through each kernel a
    linear layer of `dtype` can dispatch to on this CPU (torch's F.linear, in the weights' dtype
    or in fp32, and Loom's panel kernels where this CPU has them; each with its weights in the
    form that kernel reads best); "roof" is the fastest. Random weights: the rate depends on the
    shapes only."""
    from loom.layers.dispatch import candidates, panels_available
    from loom.layers.linear import DenseLinear

    shapes = layer_shapes(c)
    flops = 2 * tokens * sum(i * o for i, o in shapes)
    linears = [nn.Linear(i, o, bias=False, dtype=dtype) for i, o in shapes]
    inputs = [torch.randn(tokens, i, dtype=dtype) for i, _ in shapes]
    rates = {}
    with torch.inference_mode():
        for kernel in candidates("fp32" if dtype == torch.float32 else "bf16", panels_available()):
            layers = [DenseLinear(linear, ((tokens, kernel),)) for linear in linears]
            rates[kernel] = flops / best_time(
                lambda: [getattr(layer, kernel)(x) for layer, x in zip(layers, inputs)], repeats)
    rates["roof"] = max(rates.values())
    return rates
