"""Search: evaluate every layout on every chip count, pick the best plan, trace Pareto frontiers."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, TypeVar

from .cost import PhaseEstimate, estimate
from .hardware import Hardware
from .layouts import candidate_layouts
from .presets import ModelShape
from .workload import Workload

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """Prefill and decode on the same chips; each phase uses its own best layout, as PaLM
    switches from weight-gathered prefill to weight-stationary decode on one weight layout."""
    prefill: PhaseEstimate
    decode: PhaseEstimate

    @property
    def chips(self) -> int:
        return self.prefill.chips

    @property
    def latency_s(self) -> float:
        return self.prefill.latency_s + self.decode.latency_s

    @property
    def chip_s_per_token(self) -> float:
        """Chip-seconds per generated token, prefill included."""
        return self.chips * self.latency_s / max(1, self.decode.tokens)

    def as_dict(self) -> dict:
        return {"chips": self.chips, "latency_s": self.latency_s, "chip_s_per_token": self.chip_s_per_token,
                "prefill": self.prefill.as_dict(), "decode": self.decode.as_dict()}


def chip_counts(hw: Hardware, limit: int | None = None) -> list[int]:
    """Powers of two up to the machine's size, plus the size itself (72 for an NVL72 rack)."""
    top = min(limit or hw.max_chips, hw.max_chips)
    counts = {1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top}
    return sorted(counts)


def evaluate(model: ModelShape, hw: Hardware, wl: Workload, chips: Iterable[int]) -> list[PhaseEstimate]:
    """Every (phase, chip count, layout) the hardware can run; layouts whose collectives would
    leave the interconnect domain without a scale-out network are skipped."""
    out = []
    for n in chips:
        for phase in ("prefill", "decode"):
            for layout in candidate_layouts(model, n, phase):
                try:
                    out.append(estimate(model, hw, wl, layout, phase))
                except ValueError:
                    continue
    return out


def best_plan(estimates: list[PhaseEstimate], wl: Workload) -> Plan | None:
    """Fastest fitting plan, or the cheapest one meeting `wl.latency_target_s` if set."""
    plans = []
    for n in sorted({e.chips for e in estimates}):
        fitting = [e for e in estimates if e.chips == n and e.fits]
        prefill = min((e for e in fitting if e.phase == "prefill"), key=lambda e: e.latency_s, default=None)
        decode = min((e for e in fitting if e.phase == "decode"), key=lambda e: e.latency_s, default=None)
        if prefill and decode:
            plans.append(Plan(prefill, decode))
    if wl.latency_target_s is not None:
        meeting = [p for p in plans if p.latency_s <= wl.latency_target_s]
        return min(meeting, key=lambda p: (p.chip_s_per_token, p.latency_s), default=None)
    return min(plans, key=lambda p: (p.latency_s, p.chip_s_per_token), default=None)


def pareto_front(items: Iterable[T], cost_x: Callable[[T], float], cost_y: Callable[[T], float]) -> list[T]:
    """Items no other item beats on both costs (both minimized), sorted by cost_x."""
    front: list[T] = []
    for item in sorted(items, key=lambda i: (cost_x(i), cost_y(i))):
        if not front or cost_y(item) < cost_y(front[-1]):
            front.append(item)
    return front


def decode_sweep(model: ModelShape, hw: Hardware, wl: Workload, batches: Iterable[int],
                 chips: Iterable[int]) -> list[PhaseEstimate]:
    """Fitting decode estimates over batch sizes and chip counts."""
    chips = list(chips)
    out = []
    for b in batches:
        out += [e for e in evaluate(model, hw, replace(wl, batch=b), chips) if e.phase == "decode" and e.fits]
    return out


def ttl(e: PhaseEstimate) -> float:
    """Token-to-token latency of a decode estimate."""
    return e.step.time_s


def tokens_per_s_per_chip(e: PhaseEstimate) -> float:
    return e.batch / (e.chips * e.step.time_s)


def interactivity_front(estimates: list[PhaseEstimate]) -> list[PhaseEstimate]:
    """Helix's frontier: tokens/s/user against tokens/s/chip (low TTL, high throughput)."""
    return pareto_front(estimates, ttl, lambda e: -tokens_per_s_per_chip(e))


@dataclass(frozen=True)
class FrontierGain:
    throughput_gain: float     # max over TTL of (Helix tokens/s/chip) / (baseline at that TTL)
    at_ttl_s: float            # the TTL where that gain occurs
    min_ttl_gain: float        # baseline's lowest TTL / Helix's lowest TTL
    # max over TTL of Helix's largest batch / the baseline's largest batch within that TTL, each
    # on as many chips as it uses: the paper's "concurrent users at fixed latency"
    batch_gain: float


def is_baseline(e: PhaseEstimate) -> bool:
    return e.layout.kind != "helix"


def helix_gain(estimates: list[PhaseEstimate],
               baseline: Callable[[PhaseEstimate], bool] = is_baseline) -> FrontierGain:
    """Compare Helix's frontier with the frontier of the `baseline` layouts at equal TTL."""
    helix = interactivity_front([e for e in estimates if e.layout.kind == "helix"])
    base = interactivity_front([e for e in estimates if baseline(e)])
    if not helix or not base:
        raise ValueError("need both Helix and non-Helix estimates that fit")
    best, batch_gain = (0.0, 0.0), 0.0
    for h in helix:
        reachable = [b for b in base if ttl(b) <= ttl(h)]
        if reachable:
            best = max(best, (tokens_per_s_per_chip(h) / max(map(tokens_per_s_per_chip, reachable)), ttl(h)))
            # Batches over every estimate, not the fronts: a larger batch on more chips has a lower
            # throughput per chip and so may sit off the front.
            batch = max(e.batch for e in estimates if e.layout.kind == "helix" and ttl(e) <= ttl(h))
            base_batch = max(e.batch for e in estimates if baseline(e) and ttl(e) <= ttl(h))
            batch_gain = max(batch_gain, batch / base_batch)
    return FrontierGain(throughput_gain=best[0], at_ttl_s=best[1], min_ttl_gain=ttl(base[0]) / ttl(helix[0]),
                        batch_gain=batch_gain)
