"""Writing a benchmark's JSON and PNG, with the command that produced them."""
from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def model_label(path: str | Path) -> str:
    """A model's (or any file's) name for reports: relative to the repository or to Loom's cache,
    never an absolute path of the machine that ran the benchmark."""
    from loom.config import cache_root

    path = Path(path).resolve()
    for root, prefix in ((BENCH_DIR.parents[1], ""), (cache_root(), "<loom cache>/")):
        if path.is_relative_to(root.resolve()):
            return prefix + str(path.relative_to(root.resolve()))
    return path.name


def report_name(kind: str, model: str | Path, default_model: str | Path) -> str:
    """`kind` for the command's default model; `kind-<model directory>` for any other, so that
    runs on other models sit beside the default's report instead of replacing it."""
    return kind if Path(model).resolve() == Path(default_model).resolve() else f"{kind}-{Path(model).name}"


def cpu() -> dict[str, Any]:
    """The CPU the figures were measured on: its model name, its family and model numbers (a
    virtual machine's model name may not tell one generation from the next: "AMD EPYC" is Zen 3,
    4 or 5) and the features Loom's kernels and torch's GEMMs choose paths by."""
    name, flags, numbers = platform.processor() or platform.machine(), set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() in ("cpu family", "model") and value.strip().isdigit():
                    numbers[{"cpu family": "family", "model": "model_number"}[key.strip()]] = int(value)
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    features = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return {"model": name, **numbers, "features": [f for f in features if f in flags]}


def cpu_label() -> str:
    """The CPU's name for a plot's title: "AMD EPYC (family 26, model 2)"."""
    c = cpu()
    return f"{c['model']} (family {c['family']}, model {c['model_number']})" if "family" in c else c["model"]


def environment() -> dict[str, Any]:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "machine": platform.machine(), "cpu": cpu(), "cpu_count": torch.multiprocessing.cpu_count(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def command(argv: list[str]) -> str:
    """The loom command that made a report, less where it was written, and with the paths it
    names inside the repository or Loom's cache relative to them (not paths of that machine)."""
    kept = [a for i, a in enumerate(argv) if a != "--out-dir" and (i == 0 or argv[i - 1] != "--out-dir")]
    return "loom " + " ".join(model_label(a) if a.startswith("/") else a for a in kept
                              if not a.startswith("--out-dir="))


def write_report(name: str, results: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = out_dir or BENCH_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    if "model" in results:
        results = {**results, "model": model_label(results["model"])}
    payload = {"benchmark": name, "command": command(sys.argv[1:]), "environment": environment(), **results}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def bar_plot(path: Path, title: str, labels: list[str], values: list[float], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Each bar as wide as its label's longest line at the ticks' font size, so that labels never overlap.
    longest = max((len(line) for label in labels for line in label.splitlines()), default=0)
    fig, ax = plt.subplots(figsize=(max(7, len(labels) * max(0.8, 0.075 * longest)), 4))
    bars = ax.bar(labels, values, color=["#4C72B0" if "loom" in l.lower() else "#999999" for l in labels])
    ax.tick_params(axis="x", labelsize=8)
    ax.bar_label(bars, fmt="%.1f")
    ax.margins(y=0.1)  # room above the tallest bar for its label
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{cpu_label()}, torch {torch.__version__}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
