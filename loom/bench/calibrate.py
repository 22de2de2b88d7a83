"""`loom calibrate`: measure this machine so the planner can predict Loom's own runs.

The machine: memory read bandwidth (a large reduction), GEMM FLOP/s per dtype (through Loom's
linear layer) and gloo all-reduce bandwidth and latency between two local processes. Loom's
components, each timed on its own: the linear layers per weight format and tokens per step, the
paged decode attention, and the engine's fixed cost per step (tiny models whose weights cost
nothing). Everything runs at the current torch thread count and takes about half a minute on
one thread. The planner itself (loom/planner) stays free of torch: it only reads the result.
"""
from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from loom.bench import clock
from loom.planner.hardware import STEP_OVERHEAD_TERMS, Hardware, this_machine_path
from loom.planner.workload import dtype_bytes

if TYPE_CHECKING:
    from torch import nn

# One layer of the 134M reference Llama as Loom runs it (fused QKV, O, fused gate/up, down): out x in.
LAYER_SHAPES = ((2304, 768), (768, 768), (4096, 768), (768, 2048))
LINEAR_DTYPES = ("fp32", "bf16", "int8", "int4")
LINEAR_TOKENS = (1, 2, 4, 8, 16, 32, 64)
INT4_GROUP_SIZE = 32  # Loom's default
# Bytes each weight or KV probe streams per pass: several times a CPU's last-level cache (8x this
# machine's 32 MiB), so they come from memory as a real model's do.
STREAM_BYTES = 256 * 2**20
# A Llama whose weights and KV cache sit in L2: its decode steps cost only what does not scale
# with weights, measured at two depths and two batch sizes.
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=1024)
OVERHEAD_DEPTHS, OVERHEAD_BATCHES = (1, 4), (1, 32)


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` timed calls, after one warm-up: the least disturbed measurement."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock.now()
        fn()
        best = min(best, clock.now() - start)
    return best


def planner_dtype(dtype: str) -> str:
    """The planner's name of a Loom dtype (torch's name: "float32" or "bfloat16")."""
    return "bf16" if dtype == "bfloat16" else "fp32"


def _torch_dtype(dtype: str):
    """The torch dtype of a planner dtype that Loom computes in (fp32 or bf16)."""
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


def read_probe(nbytes: int = 512 * 2**20, repeats: int = 5) -> Callable[[], float]:
    """A probe of the peak read bandwidth: each call returns bytes/s summing a buffer much larger
    than the caches (allocated once, here), the best of `repeats`."""
    import torch
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return lambda: nbytes / best_time(lambda: x.sum(), repeats)


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Peak read bandwidth in bytes/s, one reading of `read_probe`."""
    return read_probe(nbytes, repeats)()


def _loom_linear(base: nn.Linear, dtype: str) -> nn.Module:
    """A fresh copy of nn.Linear `base` as Loom's engine runs it with `dtype` weights."""
    import torch
    from torch import nn

    from loom.layers.linear import DenseLinear
    from loom.quant.linear import WeightOnlyLinear

    if dtype in ("int8", "int4"):
        return WeightOnlyLinear.from_linear(base, dtype, INT4_GROUP_SIZE)
    linear = nn.Linear(base.in_features, base.out_features, bias=False, dtype=_torch_dtype(dtype))
    with torch.no_grad():
        linear.weight.copy_(base.weight)
    return DenseLinear(linear)


def gemm_flops(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of Loom's linear layer (panel-layout weights: 2-3x torch.mm in fp32 on some CPUs)
    over n tokens of an n x n weight."""
    import torch
    from torch import nn

    layer, x = _loom_linear(nn.Linear(n, n, bias=False), dtype), torch.randn(n, n, dtype=_torch_dtype(dtype))
    with torch.inference_mode():
        return 2 * n**3 / best_time(lambda: layer(x), repeats)


def linear_bandwidth(dtypes: tuple[str, ...] = LINEAR_DTYPES, tokens: tuple[int, ...] = LINEAR_TOKENS,
                     stream_bytes: int = STREAM_BYTES, repeats: int = 5) -> dict[str, list[float]]:
    """Weight bytes/s (parameters x the planner's bytes per weight / time) that Loom's linear
    layers reach in each format at each token count, on a stack of reference-model layers too
    large for the caches. The rates take in whatever bounds the kernels: memory at one token,
    their arithmetic (and each format's dispatch to other kernels, `loom calibrate --linears`) at
    more."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    bases = [nn.Linear(k, n, bias=False) for n, k in LAYER_SHAPES]
    params = sum(n * k for n, k in LAYER_SHAPES)
    rates: dict[str, list[float]] = {}
    for dtype in dtypes:
        layer_bytes = params * dtype_bytes(dtype)
        depth = math.ceil(stream_bytes / layer_bytes)
        layers = [_loom_linear(base, dtype) for _ in range(depth) for base in bases]
        act = _torch_dtype("fp32" if dtype == "fp32" else "bf16")  # quantized models run in bf16
        rates[dtype] = []
        with torch.inference_mode():
            for m in tokens:
                x = {k: torch.randn(m, k, dtype=act) for _, k in LAYER_SHAPES}
                t = best_time(lambda: [layer(x[layer.in_features]) for layer in layers], repeats)
                rates[dtype].append(depth * layer_bytes / t)
    return rates


def kv_bandwidth(dtypes: tuple[str, ...] = ("fp32", "bf16"), batch: int = 8, context: int = 512, kv_heads: int = 12,
                 head_dim: int = 64, stream_bytes: int = STREAM_BYTES, repeats: int = 3) -> dict[str, float]:
    """Bytes/s at which Loom's paged decode attention reads a KV cache of each dtype (the model's:
    fp32 or bf16) spread over enough layers not to fit the caches, blocks in allocation order."""
    import torch

    from loom.kernels import load_kernels
    from loom.kv.attention import paged_decode_attention
    from loom.kv.cache import KVCache

    load_kernels()
    block_size = 16
    blocks = -(-context // block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32)
    rates = {}
    for dtype in dtypes:
        layer_bytes = 2 * batch * context * kv_heads * head_dim * dtype_bytes(dtype)
        depth = math.ceil(stream_bytes / layer_bytes)
        cache = KVCache(depth, batch * blocks, kv_heads, head_dim, block_size, _torch_dtype(dtype), "cpu")
        for t in cache.keys + cache.values:
            t.normal_()
        q = torch.randn(batch, kv_heads, head_dim, dtype=_torch_dtype(dtype))
        t = best_time(lambda: [paged_decode_attention(q, cache, layer, tables, lens, head_dim**-0.5, "cpp")
                                for layer in range(depth)], repeats)
        rates[dtype] = depth * layer_bytes / t
    return rates


def step_overhead(prompt_len: int = 128, steps: int = 32, repeats: int = 3) -> dict[str, float]:
    """The engine's fixed cost per decode step, from tiny models' steps (the fastest of `repeats`
    runs of `steps` steps each, like every other calibration figure: on a shared machine the
    slower runs measure the neighbours) at two depths and two batch sizes, solved for
    base + per_seq x seqs + layers x (per_layer + per_layer_seq x seqs) (STEP_OVERHEAD_TERMS)."""
    from loom.bench.latency import run_loom
    from loom.models.reference import reference_model_dir

    t = {}
    for layers in OVERHEAD_DEPTHS:
        model = reference_model_dir(dict(TINY_LLAMA, num_hidden_layers=layers), name=f"calibrate-tiny-{layers}l")
        for batch in OVERHEAD_BATCHES:
            run = run_loom(model, "bfloat16", None, batch, prompt_len, steps + 1, repeats, breakdown=False)
            t[layers, batch] = 1 / max(run["all_steps_per_s"])
    (l0, l1), (b0, b1) = OVERHEAD_DEPTHS, OVERHEAD_BATCHES

    def intercept_slope(at: dict[int, float]) -> tuple[float, float]:
        slope = (at[b1] - at[b0]) / (b1 - b0)
        return at[b0] - b0 * slope, slope

    per_layer = {b: (t[l1, b] - t[l0, b]) / (l1 - l0) for b in OVERHEAD_BATCHES}
    base = {b: t[l0, b] - l0 * per_layer[b] for b in OVERHEAD_BATCHES}
    return dict(zip(STEP_OVERHEAD_TERMS, intercept_slope(base) + intercept_slope(per_layer)))


def _all_reduce_worker(rank: int, port: int, nbytes: int, repeats: int, out: dict) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        big, small = torch.ones(nbytes // 4), torch.ones(1)
        t_big = best_time(lambda: dist.all_reduce(big), repeats)
        t_small = best_time(lambda: dist.all_reduce(small), repeats * 4)
        if rank == 0:
            out["big"], out["small"] = t_big, t_small
    finally:
        dist.destroy_process_group()


def all_reduce_cost(nbytes: int = 16 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s per step) of gloo between two local ranks, expressed in the
    planner's alpha-beta model: all-reduce of D bytes over 2 ranks = 2 (alpha + D / 2 / bw)."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_all_reduce_worker, args=(port, nbytes, repeats, out), nprocs=2, join=True)
        t_big, t_small = out["big"], out["small"]
    latency = t_small / 2
    return nbytes / max(t_big - 2 * latency, 1e-9), latency


def conditions() -> dict:
    """What Loom's measured components depend on: a run under other conditions needs a new calibration."""
    import torch

    from loom.config import default_enforce_eager
    from loom.layers.dispatch import FORMATS, load_plan

    return {"threads": torch.get_num_threads(), "enforce_eager": default_enforce_eager(),
            "linear_dispatch": {fmt: [list(step) for step in load_plan(fmt)] for fmt in FORMATS}}


def measure(collectives: bool = True, dtypes: tuple[str, ...] = LINEAR_DTYPES,
            tokens: tuple[int, ...] = LINEAR_TOKENS) -> Hardware:
    """This machine and Loom's components on it, for weights in `dtypes` at `tokens` per step;
    without `collectives` (no second process started) it is described as one chip."""
    import torch

    bandwidth = memory_bandwidth()
    flops = {dtype: gemm_flops(dtype) for dtype in ("fp32", "bf16")}
    link_bw, link_latency = all_reduce_cost() if collectives else (0.0, 0.0)
    chips = 2 if collectives else 1
    return Hardware(
        name="this-machine", peak_flops=flops, memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        memory_bandwidth=bandwidth, link_bandwidth=link_bw, link_latency=link_latency, topology="switch",
        domain_size=chips, max_chips=chips,
        notes=f"measured by loom calibrate with {torch.get_num_threads()} torch threads; "
              "efficiencies are 1 because the figures are already achieved ones",
        extra={"torch": torch.__version__, **conditions()},
        linear_tokens=list(tokens), linear_bandwidth=linear_bandwidth(dtypes, tokens),
        # The KV cache is in the model's dtype: fp32 for fp32 weights, else bf16.
        kv_bandwidth=kv_bandwidth(tuple(sorted({"fp32" if d == "fp32" else "bf16" for d in dtypes}))),
        step_overhead=step_overhead())


def calibrate(out: Path | None = None) -> Hardware:
    """Measure, write the hardware JSON and return it."""
    hw = measure()
    path = out or this_machine_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hw.to_json() + "\n")
    return hw
