"""Chips and their interconnect: presets, user JSON files, and the calibrated `this-machine`.

Peak figures are datasheet values. The three efficiencies scale them to what real kernels
reach; docs/planner.md says where each preset's efficiencies come from. `loom calibrate` also
measures Loom's own components on this machine (linear layers per weight format and tokens per
step, decode attention, the engine's fixed cost per step); the presets leave those empty and
fall back to the roofline.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 2**30
STEP_OVERHEAD_TERMS = ("base_s", "per_seq_s", "per_layer_s", "per_layer_seq_s")


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]   # per chip, by matmul dtype (bf16, fp8, fp4, int8, fp32)
    memory_bytes: float            # per chip
    memory_bandwidth: float        # bytes/s per chip
    link_bandwidth: float          # bytes/s one chip sends into a collective, one direction
    link_latency: float = 0.0      # seconds per step of a collective
    topology: str = "switch"       # "torus": ring steps (k-1); "switch": tree steps (log2 k)
    domain_size: int = 1           # chips joined by link_bandwidth
    scale_out_bandwidth: float = 0.0  # bytes/s per chip between domains (0: cannot span)
    max_chips: int = 1
    flops_efficiency: float = 1.0  # achieved / peak matmul FLOP/s
    memory_efficiency: float = 1.0  # achieved / peak memory bandwidth
    link_efficiency: float = 1.0   # achieved / peak link bandwidth
    notes: str = ""
    extra: dict = field(default_factory=dict)  # anything else a calibration recorded
    # Loom's own components as measured by `loom calibrate`; where empty, the roofline applies.
    linear_tokens: list[int] = field(default_factory=list)  # tokens per step of each linear_bandwidth entry
    linear_bandwidth: dict[str, list[float]] = field(default_factory=dict)  # weight dtype -> weight bytes/s
    kv_bandwidth: dict[str, float] = field(default_factory=dict)  # KV dtype -> bytes/s decode attention reads
    step_overhead: dict[str, float] = field(default_factory=dict)  # see STEP_OVERHEAD_TERMS

    def __post_init__(self) -> None:
        if "bf16" not in self.peak_flops:
            raise ValueError(f"{self.name}: peak_flops needs at least a bf16 entry")
        if self.topology not in ("torus", "switch"):
            raise ValueError(f"{self.name}: topology must be 'torus' or 'switch'")
        if self.linear_tokens != sorted(set(self.linear_tokens)):
            raise ValueError(f"{self.name}: linear_tokens must be increasing")
        for dtype, rates in self.linear_bandwidth.items():
            if len(rates) != len(self.linear_tokens):
                raise ValueError(f"{self.name}: linear_bandwidth[{dtype!r}] needs one rate per linear_tokens entry")
        if self.step_overhead and set(self.step_overhead) != set(STEP_OVERHEAD_TERMS):
            raise ValueError(f"{self.name}: step_overhead needs exactly {', '.join(STEP_OVERHEAD_TERMS)}")

    def matmul_dtype(self, weight_dtype: str) -> str:
        """Dtype the matmuls run in: low-precision formats the chip computes natively run as
        such; weight-only formats (int8/int4 without native support, PaLM's AQT) in bf16."""
        if weight_dtype in ("fp8", "fp4", "fp32") and weight_dtype in self.peak_flops:
            return weight_dtype
        return "bf16"

    def flops(self, dtype: str) -> float:
        """Achievable matmul FLOP/s per chip."""
        return self.peak_flops[dtype] * self.flops_efficiency

    @property
    def bandwidth(self) -> float:
        return self.memory_bandwidth * self.memory_efficiency

    def weight_bandwidth(self, dtype: str, tokens: float) -> float:
        """Weight bytes/s of a step's matmuls over `tokens` tokens: the measured rate of `dtype`
        (time per byte interpolated linearly in tokens, held beyond the measured range, where
        the FLOP/s roofline takes over), else the memory bandwidth."""
        rates = self.linear_bandwidth.get(dtype)
        if not rates:
            return self.bandwidth
        xs = self.linear_tokens
        t = min(max(tokens, xs[0]), xs[-1])
        i = bisect.bisect_left(xs, t)
        if xs[i] == t:
            return rates[i]
        w = (t - xs[i - 1]) / (xs[i] - xs[i - 1])
        return 1 / ((1 - w) / rates[i - 1] + w / rates[i])

    def kv_read_bandwidth(self, dtype: str) -> float:
        """Bytes/s of KV-cache traffic: the measured decode-attention rate, else the memory bandwidth."""
        return self.kv_bandwidth.get(dtype, self.bandwidth)

    def step_overhead_s(self, seqs: float, layers: int) -> float:
        """Seconds a step costs besides weight and KV reads (engine loop, sampler, small ops):
        base + per_seq x seqs + layers x (per_layer + per_layer_seq x seqs)."""
        o = self.step_overhead
        if not o:
            return 0.0
        return o["base_s"] + o["per_seq_s"] * seqs + layers * (o["per_layer_s"] + o["per_layer_seq_s"] * seqs)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


PRESETS: dict[str, Hardware] = {h.name: h for h in [
    # TPU v4: 275 TFLOP/s bf16 (int8 runs weight-only here, as in the paper), 32 GiB HBM at
    # 1200 GB/s, 3D torus ICI. The efficiencies and latency are fitted to the PaLM paper's
    # appendix D (see docs/planner.md); they are what its published runs achieved.
    Hardware(name="tpu-v4", peak_flops={"bf16": 275e12, "int8": 275e12}, memory_bytes=32 * GiB,
             memory_bandwidth=1200e9, link_bandwidth=270e9, link_latency=5e-6, topology="torus",
             domain_size=4096, max_chips=256, flops_efficiency=0.75, memory_efficiency=1.0,
             link_efficiency=0.3, notes="calibrated to PaLM 540B appendix D"),
    Hardware(name="a100-80gb", peak_flops={"bf16": 312e12, "int8": 624e12, "fp32": 19.5e12},
             memory_bytes=80 * GiB, memory_bandwidth=2039e9, link_bandwidth=300e9, link_latency=3e-6,
             domain_size=8, scale_out_bandwidth=25e9, max_chips=256, flops_efficiency=0.7,
             memory_efficiency=0.85, link_efficiency=0.8, notes="datasheet x typical efficiencies"),
    Hardware(name="h100", peak_flops={"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12, "fp32": 67e12},
             memory_bytes=80 * GiB, memory_bandwidth=3350e9, link_bandwidth=450e9, link_latency=2e-6,
             domain_size=8, scale_out_bandwidth=50e9, max_chips=256, flops_efficiency=0.7,
             memory_efficiency=0.85, link_efficiency=0.8, notes="datasheet x typical efficiencies"),
    Hardware(name="h200", peak_flops={"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12, "fp32": 67e12},
             memory_bytes=141e9, memory_bandwidth=4800e9, link_bandwidth=450e9, link_latency=2e-6,
             domain_size=8, scale_out_bandwidth=50e9, max_chips=256, flops_efficiency=0.7,
             memory_efficiency=0.85, link_efficiency=0.8, notes="datasheet x typical efficiencies"),
    # One Blackwell GPU of a GB200 NVL72 rack: 72 GPUs on one NVLink switch domain.
    Hardware(name="gb200-nvl72", peak_flops={"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15, "int8": 5e15},
             memory_bytes=186e9, memory_bandwidth=8000e9, link_bandwidth=900e9, link_latency=1.5e-6,
             domain_size=72, max_chips=72, flops_efficiency=0.7, memory_efficiency=0.85,
             link_efficiency=0.8, notes="datasheet x typical efficiencies"),
]}


def this_machine_path() -> Path:
    """Where `loom calibrate` writes this machine's description by default."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "loom" / "this-machine.json"


def load_hardware_file(path: str | Path) -> Hardware:
    data = json.loads(Path(path).read_text())
    known = set(Hardware.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown hardware fields {sorted(unknown)}")
    return Hardware(**data)


def load_hardware(spec: str) -> Hardware:
    """A preset name, `this-machine` (written by `loom calibrate`), or a JSON file."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "this-machine":
        path = this_machine_path()
        if not path.exists():
            raise ValueError(f"no calibration at {path}: run `loom calibrate` first")
        return load_hardware_file(path)
    if Path(spec).exists():
        return load_hardware_file(spec)
    raise ValueError(f"unknown hardware {spec!r}: a preset ({', '.join(PRESETS)}), this-machine, or a JSON file")
