"""Pareto plots of a decode sweep (matplotlib is imported here only, with the Agg backend)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .cost import PhaseEstimate
from .search import interactivity_front, pareto_front, tokens_per_s_per_chip, ttl


def _family(e: PhaseEstimate) -> str:
    layout = e.layout
    if layout.kind == "helix":
        return "Helix" + (" HOP-B" if layout.hop_b else "")
    if layout.kind == "pipeline":
        return "pipeline"
    return f"{layout.kind} attn:{layout.attention}"


def plot_sweep(estimates: list[PhaseEstimate], path: str | Path, title: str) -> Path:
    """Left: latency per token vs chip-seconds per token, one frontier per layout family.
    Right: tokens/s/user vs tokens/s/chip, Helix against every other layout (Helix figure 4)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    families: dict[str, list[PhaseEstimate]] = defaultdict(list)
    for e in estimates:
        families[_family(e)].append(e)
    for name, items in sorted(families.items()):
        front = pareto_front(items, ttl, lambda e: e.chips * ttl(e) / e.batch)
        left.plot([ttl(e) * 1e3 for e in front], [e.chips * ttl(e) / e.batch for e in front],
                  marker="o", ms=3, label=name)
    left.set(xscale="log", yscale="log", xlabel="latency per token (ms)",
             ylabel="cost (chip-seconds per token)", title="decode: latency vs cost")
    left.legend(fontsize=7)
    for name, keep in (("Helix", lambda e: e.layout.kind == "helix"),
                       ("best non-Helix", lambda e: e.layout.kind != "helix")):
        front = interactivity_front([e for e in estimates if keep(e)])
        right.plot([1 / ttl(e) for e in front], [tokens_per_s_per_chip(e) for e in front],
                   marker="o", ms=3, label=name)
    right.set(xscale="log", yscale="log", xlabel="tokens/s/user (1 / TTL)", ylabel="tokens/s/chip",
              title="decode: interactivity vs throughput")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
