"""Which kernel a quantized layer uses, by tokens per step, and the calibration that measures
the crossover on this machine (stored as JSON, drawn as a plot of time against tokens)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from loom.config import cache_root

# Used until `loom quantize --calibrate` has measured this machine: torch's weight-only CPU
# kernels lose to a bf16 GEMM from about 16 tokens (reference figures of this project).
DEFAULT_CROSSOVER = {"int8": 8, "int4": 8}


def crossover_path() -> Path:
    return cache_root() / "quant-crossover.json"


def load_crossover(method: str) -> int:
    path = crossover_path()
    if path.is_file():
        return int(json.loads(path.read_text())["crossover"][method])
    return DEFAULT_CROSSOVER[method]


def calibrate(tokens: list[int], in_features: int = 4096, out_features: int = 4096, group_size: int = 32,
              repeats: int = 5) -> dict:
    """Times both kernels of each method at each token count (medians, interleaved); the
    crossover is the largest count up to which the weight-only kernel is always faster. The
    unquantized bf16 layer is timed too, as the reference both should approach."""
    from loom.layers.linear import PackedLinear, can_pack
    from loom.quant.linear import WeightOnlyLinear

    base = torch.nn.Linear(in_features, out_features, bias=False)
    result: dict = {"in_features": in_features, "out_features": out_features, "group_size": group_size,
                    "threads": torch.get_num_threads(), "tokens": tokens, "ms": {}, "crossover": {}}
    bf16 = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    reference = PackedLinear(bf16) if can_pack(torch.device("cpu")) else bf16
    result["ms"]["bf16"] = []
    for m in tokens:
        x = torch.randn(m, in_features, dtype=torch.bfloat16)
        reference(x)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            reference(x)
            samples.append(time.perf_counter() - start)
        result["ms"]["bf16"].append(statistics.median(samples) * 1e3)
    for method in ("int8", "int4"):
        layer = WeightOnlyLinear.from_linear(base, method, group_size, crossover=0)
        times: dict[str, list[float]] = {"weight_only": [], "dequantized_bf16": []}
        for m in tokens:
            x = torch.randn(m, in_features, dtype=torch.bfloat16)
            samples = {"weight_only": [], "dequantized_bf16": []}
            for _ in range(repeats):
                for name, fn in (("weight_only", layer.weight_only), ("dequantized_bf16", layer.dequantized_gemm)):
                    fn(x)
                    start = time.perf_counter()
                    fn(x)
                    samples[name].append(time.perf_counter() - start)
            for name in times:
                times[name].append(statistics.median(samples[name]) * 1e3)
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
