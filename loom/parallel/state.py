"""The process group an engine runs on, and this rank's place in it."""
from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.config import ParallelConfig

logger = logging.getLogger(__name__)

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
    shm_group: int | None = None  # a shared-memory all-reduce group (loom::shm_all_reduce), if in use

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
                         group=dist.group.WORLD, shm_group=_shared_memory_group(config.all_reduce, device))


# Bytes of one rank's slot; a larger tensor goes through in pieces (a 2048-token fp32 prefill
# chunk of a 768-wide model is 6 MiB).
SHM_SLOT_BYTES = 4 << 20


def _shared_memory_group(choice: str, device: torch.device) -> int | None:
    """A shared-memory all-reduce group of every rank, when `choice` and the ranks allow one:
    all on one host, on CPU. "shared_memory" where they cannot is an error."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    possible = device.type == "cpu" and len(set(hosts)) == 1
    if choice == "process_group" or (choice == "auto" and not possible):
        logger.info("all-reduce through the process group (%s)", dist.get_backend())
        return None
    if not possible:
        raise ValueError(f"all_reduce: shared memory needs every rank on one host and on CPU; the ranks run on "
                         f"{sorted(set(hosts))} ({device.type})")
    from loom.kernels import load_kernels

    load_kernels()
    name = [f"/loom-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    handle = torch.ops.loom.shm_open_group(name[0], dist.get_rank(), dist.get_world_size(), SHM_SLOT_BYTES)
    dist.barrier()  # every rank has it mapped: the name can go (the memory stays until the last one exits)
    if dist.get_rank() == 0:
        torch.ops.loom.shm_unlink_group(name[0])
    logger.info("all-reduce through shared memory (every rank on %s)", hosts[0])
    return handle
