"""Which kernel each linear layer runs, by tokens in the step.

Every linear layer, dense (fp32, bf16) or weight-only quantized (int8, int4), has a few kernels
that compute the same product (`candidates`), and a plan that names one per range of token
counts. Few tokens are bound by reading the weights, many by arithmetic, and which kernel wins
where depends on the CPU: Loom's panel kernels (loom/kernels/linear.cpp; AVX-512 BF16 or AVX2)
read the weights at the memory's bandwidth; on AMX machines oneDNN's bf16 GEMM overtakes them
past a few dozen tokens; on CPUs without native bf16 torch's bf16 GEMM is emulated, and from
about 16 tokens an fp32 GEMM over weights widened at each call is several times faster.

`calibrate` times every candidate of every format on this machine, keeps the fastest at each
token count as the plan, and times the dispatching layers again in the same run to check the
choice; `load_plan` reads that result, or a default for the CPU's family until it exists.
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Callable

import torch

from loom.bench import clock
from loom.config import cache_root
from loom.kernels import load_kernels

# A plan: ((up to this many tokens, kernel), ...) with ascending bounds; the last entry covers
# every larger count too.
Plan = tuple[tuple[int, str], ...]

FORMATS = ("fp32", "bf16", "int8", "int4")
# What each format can run, Loom's own kernels first (they need AVX-512 BF16 or AVX2; "amx", the
# bf16 panels through AMX tiles, needs AMX too). A kernel named *_fp32 runs its GEMM in fp32
# whatever the activations' dtype.
_OWN = {"fp32": ("panel",), "bf16": ("panel", "amx"), "int8": ("weight_only",), "int4": ("weight_only",)}
OWN_KERNELS = frozenset(k for own in _OWN.values() for k in own)  # every other candidate is a torch GEMM
_GEMMS = {"fp32": ("gemm",), "bf16": ("gemm", "gemm_fp32"), "int8": ("dequantized", "dequantized_fp32"),
          "int4": ("dequantized", "dequantized_fp32")}
# The activations each format is calibrated with: the dtype its models run in.
CALIBRATION_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16}
# One decoder layer of the 134M reference Llama as Loom runs it (fused QKV, O, fused gate/up,
# down), out x in: the shapes the project's benchmarks run.
REFERENCE_SHAPES = ((2304, 768), (768, 768), (4096, 768), (768, 2048))
# Up to the scheduler's default tokens per step (a whole 2048-token prompt is one step).
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

# Until `loom calibrate --linears` has measured the machine. Measured on the reference model's layers:
# - AVX-512 BF16 without AMX (AMD Zen 4): Loom's kernels lead every torch GEMM at every count up to
#   512 in every format. At 512 tokens the int8 kernel takes half the time of dequantize-then-GEMM,
#   and the panel kernel 0.74x of oneDNN's bf16 GEMM.
# - AMX (an Intel Xeon, family 6 model 167): Loom's AMX tiles are level with the panel kernel up to
#   4 tokens and 3x / 7x as fast at 32 / 512. They lead oneDNN's bf16 GEMM (which unpacks the panels
#   at each call) up to 1024 tokens, and take 1.3x its time at 2048. The integer kernels lead
#   dequantize-then-GEMM up to 128 (int8) and 64 (int4) tokens.
# - AVX2 (AMD Zen 3): the panel kernels (bf16 widening in registers) lead torch's fp32 GEMM at
#   every count up to 512 (1.2x and 1.75x there), and the integer kernels every dequantizing GEMM
#   up to 512.
# - Without either build: torch's bf16 GEMM costs each row as one more matrix-vector product, and
#   falls behind a widening fp32 GEMM from 16 tokens.
DEFAULT_PLANS: dict[str, dict[str, Plan]] = {
    "avx512_bf16": {"fp32": ((1, "panel"),), "bf16": ((1, "panel"),), "int8": ((1, "weight_only"),),
                    "int4": ((1, "weight_only"),)},
    "amx": {"fp32": ((1, "panel"),), "bf16": ((4, "panel"), (1024, "amx"), (1025, "gemm")),
            "int8": ((128, "weight_only"), (129, "dequantized")), "int4": ((64, "weight_only"), (65, "dequantized"))},
    "avx2": {"fp32": ((1, "panel"),), "bf16": ((1, "panel"),), "int8": ((1, "weight_only"),),
             "int4": ((1, "weight_only"),)},
    "other": {"fp32": ((1, "gemm"),), "bf16": ((8, "gemm"), (9, "gemm_fp32")),
              "int8": ((8, "dequantized"), (9, "dequantized_fp32")),
              "int4": ((8, "dequantized"), (9, "dequantized_fp32"))},
}


@cache
def linear_isa() -> str:
    """The vector path Loom's linear kernels were built with here: "avx512_bf16", "avx2" or ""."""
    load_kernels()
    return torch.ops.loom.linear_isa()


def panels_available() -> bool:
    """Whether Loom's panel kernels run on this CPU (AVX-512 BF16, or AVX2 with FMA)."""
    return linear_isa() != ""


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16); elsewhere torch emulates it."""
    return linear_isa() == "avx512_bf16"


@cache
def amx_tiles() -> bool:
    """Whether Loom's AMX kernel runs here: built on a CPU with AMX, which the OS lends this process."""
    load_kernels()
    return torch.ops.loom.amx_tiles()


def candidates(fmt: str, panels: bool) -> tuple[str, ...]:
    """The kernels a layer of format `fmt` can run here."""
    own = tuple(k for k in _OWN[fmt] if k != "amx" or amx_tiles()) if panels else ()
    return own + _GEMMS[fmt]


@cache
def cpu_family() -> str:
    """"amx" (Loom's AMX kernel runs), "avx512_bf16", "avx2" (the panel kernels run, in that
    build) or "other"."""
    isa = linear_isa()
    if isa != "avx512_bf16":
        return isa or "other"
    return "amx" if amx_tiles() else "avx512_bf16"


def plan_path() -> Path:
    return cache_root() / "linear-dispatch.json"


def load_plan(fmt: str) -> Plan:
    """This machine's calibrated plan for `fmt`, or its CPU family's default."""
    path = plan_path()
    if not path.is_file():
        return DEFAULT_PLANS[cpu_family()][fmt]
    plan = _stored_plans(path, path.stat().st_mtime_ns)[fmt]
    unknown = {kernel for _, kernel in plan} - set(candidates(fmt, panels_available()))
    if unknown:
        raise ValueError(f"{path}: the {fmt} plan names kernels this CPU does not run ({sorted(unknown)}): "
                         f"measured on another machine? Run `loom calibrate --linears` here, or delete it")
    return plan


@cache
def _stored_plans(path: Path, mtime_ns: int) -> dict[str, Plan]:
    """The plans in `path` (read once per version of the file, not once per layer)."""
    return {fmt: tuple((int(bound), kernel) for bound, kernel in plan)
            for fmt, plan in json.loads(path.read_text())["plans"].items()}


def choose(plan: Plan, tokens: int) -> str:
    """The plan's kernel for a step of `tokens` tokens. The last entry serves every count past
    the one before it, unbounded: a graph traced there is not guarded on its bound."""
    for bound, kernel in plan[:-1]:
        if tokens <= bound:
            return kernel
    return plan[-1][1]


def planned_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's forward: x [..., in_features] through the kernel (a method of the layer)
    its plan names for x's token count, plus the bias."""
    x2 = x.reshape(-1, layer.in_features)
    out = getattr(layer, choose(layer.plan, x2.shape[0]))(x2)
    if layer.bias is not None:
        out = out + layer.bias.to(out.dtype)
    return out.view(*x.shape[:-1], layer.out_features)


def plan_from_times(tokens: list[int], ms: dict[str, list[float]], stickiness: float = 0.05) -> Plan:
    """The plan that runs, at each of `tokens`, the kernel with the least time in `ms` (kernel ->
    times per count); the kernel of the count before is kept while it is within `stickiness` of the
    fastest, so that noise between near-equal kernels does not cut the plan into many pieces (each
    switch costs a compiled decode graph more)."""
    plan: list[tuple[int, str]] = []
    for i, m in enumerate(tokens):
        fastest = min(ms, key=lambda kernel: ms[kernel][i])
        if plan and ms[plan[-1][1]][i] <= (1 + stickiness) * ms[fastest][i]:
            plan[-1] = (m, plan[-1][1])
        else:
            plan.append((m, fastest))
    return tuple(plan)


def _fastest_ms(kernels: dict[str, list[Callable[[], object]]], repeats: int) -> dict[str, float]:
    """Each kernel's fastest time of one call, a sample being a pass over its functions; the
    kernels take turns, so a slower spell of the machine falls on all of them alike, and each
    round starts with the next one, so that none always runs first, after the others have
    filled the caches with their own data."""
    for fns in kernels.values():  # a warm pass
        for fn in fns:
            fn()
    best = dict.fromkeys(kernels, float("inf"))
    names = list(kernels)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fns = kernels[name]
            start = clock.now()
            for fn in fns:
                fn()
            best[name] = min(best[name], (clock.now() - start) / len(fns) * 1e3)
    return best


def reference_layers(fmt: str, shapes: tuple[tuple[int, int], ...], copies: int, plan: Plan | None = None):
    """`copies` stacks of layers of `shapes` (out, in) in format `fmt`, as a model loads them."""
    from torch import nn

    from loom.layers.linear import DenseLinear
    from loom.quant.linear import WeightOnlyLinear

    layers = []
    for _ in range(copies):
        for out_features, in_features in shapes:
            base = nn.Linear(in_features, out_features, bias=False)
            if fmt in ("int8", "int4"):
                layers.append(WeightOnlyLinear.from_linear(base, fmt, 32, plan))
            else:
                layers.append(DenseLinear(base.to(CALIBRATION_DTYPE[fmt]), plan))
    return layers


def calibrate(tokens: tuple[int, ...] = TOKENS, shapes: tuple[tuple[int, int], ...] = REFERENCE_SHAPES,
              copies: int = 4, repeats: int = 7, formats: tuple[str, ...] = FORMATS) -> dict:
    """Times every candidate of each format at each token count over `copies` stacks of `shapes`
    (cycled, so weights come from memory as in a model; fastest of `repeats` passes), keeps the
    fastest as the plan, then times every candidate and the dispatching layers again, in turns:
    "check" holds, per token count, the time of the kernel the plan picks over the fastest
    candidate's in that second pass; "dispatched", the layers' own forward (the plan's pick plus
    the dispatch)."""
    panels = panels_available()
    result: dict = {"family": cpu_family(), "threads": torch.get_num_threads(), "shapes": [list(s) for s in shapes],
                    "copies": copies, "repeats": repeats, "tokens": list(tokens), "ms": {}, "plans": {}, "check": {}}
    with torch.inference_mode():
        for fmt in formats:
            kernels = candidates(fmt, panels)
            # One stack per format holds the weights in the form a loaded model would: panels if
            # the plan may use them.
            layers = reference_layers(fmt, shapes, copies, plan=((1, kernels[0]),))
            inputs = {m: {k: torch.randn(m, k, dtype=CALIBRATION_DTYPE[fmt]) for _, k in shapes} for m in tokens}

            def timed(names: list[str], m: int) -> dict[str, float]:
                return _fastest_ms({name: [lambda layer=layer, name=name: getattr(layer, name)(
                    inputs[m][layer.in_features]) for layer in layers] for name in names}, repeats)

            first = [timed(list(kernels), m) for m in tokens]
            ms = {kernel: [t[kernel] for t in first] for kernel in kernels}
            plan = plan_from_times(list(tokens), ms)
            for layer in layers:
                layer.plan = plan
            again = [timed([*kernels, "forward"], m) for m in tokens]
            dispatched = [t.pop("forward") for t in again]
            result["ms"][fmt] = {**ms, "dispatched": dispatched}
            result["plans"][fmt] = [list(step) for step in plan]
            result["check"][fmt] = [t[choose(plan, m)] / min(t.values()) for m, t in zip(tokens, again)]
    return result


def save_plans(result: dict) -> Path:
    """Stores a calibration's plans where `load_plan` reads them."""
    path = plan_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def plot_calibration(result: dict, path: Path) -> None:
    """One panel per format: every candidate's time against tokens, the dispatched layer's as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(result["plans"])
    fig, axes = plt.subplots(1, len(formats), figsize=(4 * len(formats), 3.8), squeeze=False)
    for ax, fmt in zip(axes[0], formats):
        for kernel, times in result["ms"][fmt].items():
            if kernel == "dispatched":
                ax.plot(result["tokens"], times, "o", color="black", markersize=4, label="dispatched (2nd pass)")
            else:
                ax.plot(result["tokens"], times, "-", marker=".", label=kernel)
        worst = max(result["check"][fmt])
        ax.set_title(f"{fmt}: the plan's pick <= {worst:.2f}x the fastest", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens in the step")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("ms per matmul (fastest pass)")
    fig.suptitle(f"Linear kernels per format: CPU family {result['family']}, {result['threads']} threads, "
                 f"layer shapes {result['shapes']} (out x in)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plans(model: torch.nn.Module) -> list[Plan]:
    return [m.plan for m in model.modules() if isinstance(getattr(m, "plan", None), tuple)]


def planned_kernels(model: torch.nn.Module, max_tokens: int) -> set[str]:
    """Every kernel some linear layer of `model` runs at 1 .. max_tokens tokens per step."""
    return {kernel for plan in _plans(model) for bound, kernel in _reached(plan, max_tokens)}


def plan_switches(model: torch.nn.Module, max_tokens: int) -> set[int]:
    """The token counts up to max_tokens at which some layer of `model` changes kernel: a
    compiled graph dynamic in the batch size is guarded on each side of them."""
    return {bound + 1 for plan in _plans(model) for bound, _ in _reached(plan, max_tokens)[:-1]}


def _reached(plan: Plan, max_tokens: int) -> Plan:
    """The plan's entries that serve some count in 1 .. max_tokens."""
    reached = []
    for bound, kernel in plan:
        reached.append((bound, kernel))
        if bound >= max_tokens:
            break
    return tuple(reached)
