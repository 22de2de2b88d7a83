"""Which kernel a quantized layer uses, by tokens per step, and the calibration that measures
the crossover on this machine (stored as JSON, drawn as a plot of time against tokens)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import logging

import torch

from loom.config import cache_root
from loom.kernels import load_kernels

logger = logging.getLogger(__name__)

# Used until `loom quantize --calibrate` has measured this machine: on the CPU this project
# measured (AVX512-BF16), Loom's weight-only kernels beat dequantize-then-GEMM up to 1024 tokens
# on 4096 x 4096 layers and up to ~256 on the 134M reference model's smaller ones.
DEFAULT_CROSSOVER = {"int8": 256, "int4": 256}


def crossover_path() -> Path:
    return cache_root() / "quant-crossover.json"


def load_crossover(method: str) -> int:
    path = crossover_path()
    if path.is_file():
        return int(json.loads(path.read_text())["crossover"][method])
    load_kernels()
    if not torch.ops.loom.linear_vectorized():
        # Without AVX512-BF16 the weight-only kernels are plain loops, far slower than any GEMM.
        logger.warning("this CPU lacks AVX512-BF16: quantized layers dequantize at every step (run `loom "
                       "quantize --calibrate` to measure instead)")
        return 0
    return DEFAULT_CROSSOVER[method]


def _median_ms(fns: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, repeats: int) -> float:
    """Median time of one call, each sample a pass over every layer in `fns` (after a warm pass)."""
    for fn in fns:
        fn(x)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for fn in fns:
            fn(x)
        samples.append((time.perf_counter() - start) / len(fns))
    return statistics.median(samples) * 1e3


def calibrate(tokens: list[int], in_features: int = 4096, out_features: int = 4096, group_size: int = 32,
              copies: int = 8, repeats: int = 5) -> dict:
    """Times both kernels of each method at each token count; the crossover is the largest
    count up to which the weight-only kernel is always faster. The unquantized bf16 layer is
    timed too, as the reference both should approach. Each timing cycles through `copies`
    different matrices, more than the caches hold, so weights come from memory as in a model."""
    from loom.layers.linear import DenseLinear, panel_kernels_available
    from loom.quant.linear import WeightOnlyLinear

    bases = [torch.nn.Linear(in_features, out_features, bias=False) for _ in range(copies)]
    result: dict = {"in_features": in_features, "out_features": out_features, "group_size": group_size,
                    "copies": copies, "threads": torch.get_num_threads(), "tokens": tokens, "ms": {},
                    "crossover": {}}
    panels = panel_kernels_available(torch.device("cpu"))
    reference = [DenseLinear(b.to(torch.bfloat16)) if panels else b.to(torch.bfloat16) for b in bases]
    inputs = {m: torch.randn(m, in_features, dtype=torch.bfloat16) for m in tokens}
    result["ms"]["bf16"] = [_median_ms(reference, inputs[m], repeats) for m in tokens]
    del reference
    for method in ("int8", "int4"):
        layers = [WeightOnlyLinear.from_linear(b, method, group_size, crossover=0) for b in bases]
        times = {"weight_only": [_median_ms([l.weight_only for l in layers], inputs[m], repeats) for m in tokens],
                 "dequantized_bf16": [_median_ms([l.dequantized_gemm for l in layers], inputs[m], repeats)
                                      for m in tokens]}
        result["ms"][method] = times
        crossover = 0
        for m, wo, dq in zip(tokens, times["weight_only"], times["dequantized_bf16"]):
            if wo >= dq:
                break
            crossover = m
        result["crossover"][method] = crossover
    return result


def save_calibration(result: dict, plot_path: Path | None = None) -> Path:
    path = crossover_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if plot_path is not None:
        plot_calibration(result, plot_path)
    return path


def plot_calibration(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method, style in (("int8", "-"), ("int4", "--")):
        for kernel, color in (("weight_only", "#4C72B0"), ("dequantized_bf16", "#DD8452")):
            ax.plot(result["tokens"], result["ms"][method][kernel], style, color=color, marker="o",
                    label=f"{method} {kernel.replace('_', ' ')}")
        ax.axvline(result["crossover"][method] + 0.5, linestyle=style, color="gray", linewidth=0.8)
    ax.plot(result["tokens"], result["ms"]["bf16"], ":", color="black", marker=".", label="bf16 weights (reference)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the step (M)")
    ax.set_ylabel("ms per matmul (median)")
    ax.set_title(f"Weight-only kernels vs dequantized bf16 GEMM, K = N = {result['in_features']}, "
                 f"{result['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
