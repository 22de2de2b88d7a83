"""The process group an engine runs on, and this rank's place in it."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.config import ParallelConfig

# A collective waits this long for a missing rank before failing (an idle engine's ranks wait in
# the step broadcast, so it is long; a rank that dies closes its sockets and fails the others at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    group: dist.ProcessGroup | None = None  # the tensor-parallel group; None in one process

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and answers users."""
        return self.rank == 0


def init_parallel(config: ParallelConfig, device: torch.device) -> ParallelState:
    """Joins (or, under torchrun, creates) the default process group for `config`; one process
    needs none. Gloo on CPU, NCCL on CUDA."""
    if config.world_size == 1:
        return ParallelState()
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} needs one process per rank; "
                             f"start them with `torchrun --nproc-per-node {config.world_size} ...`")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    world = dist.get_world_size()
    if world != config.world_size:
        raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} x kv_parallel_size "
                         f"{config.kv_parallel_size} must equal the world size, {world} processes")
    rank = dist.get_rank()
    return ParallelState(rank=rank, world_size=world, tp_rank=rank, tp_size=config.tensor_parallel_size,
                         group=dist.group.WORLD)
