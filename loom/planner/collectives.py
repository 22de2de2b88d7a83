"""Alpha-beta cost of the collectives the layouts issue (PaLM appendix A.1).

A collective over k chips moving D bytes per chip costs D (k-1)/k / bandwidth plus a latency
per step: one ring per axis of the group's torus slice (4x4x4: 3+3+3 steps), or log2 k
tree steps on a switch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Hardware

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "send")


@dataclass(frozen=True)
class Collective:
    kind: str
    nbytes: float  # per chip: the output of an all-gather, the input of the others
    group: int     # chips taking part
    prefetch: bool = False  # moves weights, not activations: can run ahead of the compute

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective {self.kind!r}")


def _bandwidth(hw: Hardware, group: int) -> float:
    bw = hw.link_bandwidth if group <= hw.domain_size else hw.scale_out_bandwidth
    if bw <= 0:
        raise ValueError(f"{hw.name}: a group of {group} chips exceeds its domain of {hw.domain_size}")
    return bw * hw.link_efficiency


def torus_axes(chips: int) -> tuple[int, int, int]:
    """The most cubic X x Y x Z slice of `chips` chips (64 -> 4x4x4), largest axis first."""
    axes = [1, 1, 1]
    factors, rest, p = [], chips, 2
    while rest > 1:
        while rest % p == 0:
            factors.append(p)
            rest //= p
        p += 1
    for f in sorted(factors, reverse=True):
        axes[axes.index(min(axes))] *= f
    x, y, z = sorted(axes, reverse=True)
    return x, y, z


def _steps(hw: Hardware, group: int) -> int:
    # A torus runs one ring per axis of the group's slice; a switch runs a tree.
    if hw.topology == "torus":
        return sum(a - 1 for a in torus_axes(group))
    return math.ceil(math.log2(group))


def collective_time(hw: Hardware, c: Collective) -> float:
    """Seconds one collective takes on `hw`."""
    if c.group <= 1:
        return 0.0
    if c.kind == "send":  # point-to-point, e.g. between pipeline stages
        return hw.link_latency + c.nbytes / _bandwidth(hw, c.group)
    passes = 2 if c.kind == "all-reduce" else 1  # reduce-scatter then all-gather
    share = (c.group - 1) / c.group
    return passes * (_steps(hw, c.group) * hw.link_latency + c.nbytes * share / _bandwidth(hw, c.group))


def paper_time(collectives: list[Collective], bandwidth: float) -> float:
    """The PaLM paper's approximation: (k-1)/k taken as 1 and no latency, so each collective
    costs its per-chip bytes over the network bandwidth (all-reduce twice)."""
    return sum((2 if c.kind == "all-reduce" else 1) * c.nbytes / bandwidth for c in collectives)
