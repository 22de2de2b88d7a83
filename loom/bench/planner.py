"""The planner against Loom: each decode step time `loom plan` predicts from the calibrated
components (loom/bench/calibrate.py) next to the one Loom measures on the same model, batch
size and context."""
from __future__ import annotations

from pathlib import Path

from loom.bench.latency import run_loom
from loom.planner.cost import decode_step_cost
from loom.planner.hardware import Hardware
from loom.planner.presets import ModelShape

# Planner weight dtype -> (Loom dtype, quantization, planner KV dtype): the KV cache is in the model dtype.
VARIANTS = {"bf16": ("bfloat16", None, "bf16"), "int8": ("bfloat16", "int8", "bf16"),
            "int4": ("bfloat16", "int4", "bf16"), "fp32": ("float32", None, "fp32")}


def compare(model_dir: Path, shape: ModelShape, hw: Hardware, weights: str, batch: int, prompt_len: int,
            max_tokens: int, repeats: int) -> dict:
    """One variant at one batch size: Loom's median step time and the prediction, in ms."""
    dtype, quantization, kv_dtype = VARIANTS[weights]
    measured = run_loom(model_dir, dtype, quantization, batch, prompt_len, max_tokens, repeats, breakdown=False)
    # The timed steps attend over prompt_len + 1 .. prompt_len + max_tokens - 1 cached tokens.
    cost = decode_step_cost(shape, hw, batch, weights, prompt_len + max_tokens // 2, kv_dtype)
    step_ms = 1e3 / measured["steps_per_s"]
    return {"weights": weights, "batch": batch, "measured_ms": step_ms,
            "measured_all_ms": [1e3 / r for r in measured["all_steps_per_s"]], "predicted_ms": cost.time_s * 1e3,
            "error": cost.time_s * 1e3 / step_ms - 1,
            "predicted_parts_ms": {"weights": cost.weight_s * 1e3, "kv": cost.kv_s * 1e3, "fixed": cost.fixed_s * 1e3}}


def plot(path: Path, rows: list[dict], title: str, band: float = 0.25) -> None:
    """Predicted against measured step time, log-log, with the y = x line and a +-band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured, predicted = [r["measured_ms"] for r in rows], [r["predicted_ms"] for r in rows]
    lo, hi = min(measured + predicted) / 1.5, max(measured + predicted) * 1.5
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.plot([lo, hi], [lo, hi], color="gray", linewidth=0.8)
    ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)],
                    color="gray", alpha=0.15, label=f"within {band:.0%}")
    for weights in dict.fromkeys(r["weights"] for r in rows):
        mine = [r for r in rows if r["weights"] == weights]
        ax.plot([r["measured_ms"] for r in mine], [r["predicted_ms"] for r in mine], "o", label=weights)
        for r in mine:
            ax.annotate(f"b{r['batch']} {r['error']:+.0%}", (r["measured_ms"], r["predicted_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms per decode step (median)",
           ylabel="predicted ms per decode step", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
