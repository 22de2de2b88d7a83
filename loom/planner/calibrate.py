"""`loom calibrate`: measure this machine so the planner can predict Loom's own runs.

Memory read bandwidth (a large reduction), GEMM FLOP/s per dtype and gloo all-reduce
bandwidth and latency between two local processes. Each probe runs for a fraction of a
second; the whole calibration takes a few seconds. torch is imported here only.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Callable

from .hardware import Hardware, this_machine_path


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` timed calls, after one warm-up: the least disturbed measurement."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    import torch
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_time(lambda: x.sum(), repeats)


def gemm_flops(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    import torch
    t = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(n, n, dtype=t), torch.randn(n, n, dtype=t)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), repeats)


def _all_reduce_worker(rank: int, port: int, nbytes: int, repeats: int, out: dict) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        big, small = torch.ones(nbytes // 4), torch.ones(1)
        t_big = _best_time(lambda: dist.all_reduce(big), repeats)
        t_small = _best_time(lambda: dist.all_reduce(small), repeats * 4)
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


def calibrate(out: Path | None = None) -> Hardware:
    """Measure, write the hardware JSON and return it."""
    import torch
    bandwidth = memory_bandwidth()
    flops = {dtype: gemm_flops(dtype) for dtype in ("fp32", "bf16")}
    link_bw, link_latency = all_reduce_cost()
    hw = Hardware(
        name="this-machine", peak_flops=flops, memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        memory_bandwidth=bandwidth, link_bandwidth=link_bw, link_latency=link_latency, topology="switch",
        domain_size=2, max_chips=2,
        notes=f"measured by loom calibrate with {torch.get_num_threads()} torch threads; "
              "efficiencies are 1 because the figures are already achieved ones",
        extra={"torch": torch.__version__, "threads": torch.get_num_threads()})
    path = out or this_machine_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hw.to_json() + "\n")
    return hw
