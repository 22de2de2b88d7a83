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
    """This rank's place. The ranks form a grid of TPA x KVP (Helix; KVP = 1 is plain tensor
    parallel): rank = tpa_rank * kvp_size + kvp_rank. Attention splits heads over the TPA
    ranks and each sequence's KV over the KVP ranks; the output projection, the FFN and the
    vocabulary are split over all ranks (tp_rank of tp_size, the world)."""
    rank: int = 0
    world_size: int = 1
    kvp_size: int = 1
    batch_sharded: bool = False  # attention sharded by batch: each rank keeps its own sequences' KV
    group: dist.ProcessGroup | None = None  # every rank; None in one process
    shm_group: int | None = None  # a shared-memory group of every rank (loom::shm_*), if in use
    kvp_group: dist.ProcessGroup | None = None  # the ranks holding this one's heads (KVP > 1)
    kvp_shm_group: int | None = None  # the same ranks' shared-memory group, if in use

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and answers users."""
        return self.rank == 0

    @property
    def tp_rank(self) -> int:
        return self.rank

    @property
    def tp_size(self) -> int:
        return self.world_size

    @property
    def kvp_rank(self) -> int:
        return self.rank % self.kvp_size

    @property
    def tpa_rank(self) -> int:
        """Which share of the attention heads this rank's QKV projection computes."""
        return self.rank // self.kvp_size

    @property
    def tpa_size(self) -> int:
        return self.world_size // self.kvp_size

    @property
    def kv_shards(self) -> tuple[int, str]:
        """Over how many ranks the scheduler's KV pool is split, and how a sequence's blocks are
        placed on them (loom/kv/block_manager.py)."""
        if self.kvp_size > 1:
            return self.kvp_size, "block"
        if self.batch_sharded:
            return self.world_size, "sequence"
        return 1, "block"


def init_parallel(config: ParallelConfig, device: torch.device) -> ParallelState:
    """Joins (or, under torchrun, creates) the default process group for `config`; one process
    needs none. Gloo on CPU, NCCL on CUDA."""
    if config.world_size == 1:
        return ParallelState()
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} x kv_parallel_size "
                             f"{config.kv_parallel_size} needs one process per rank; start them with "
                             f"`torchrun --nproc-per-node {config.world_size} ...`")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    world = dist.get_world_size()
    if world != config.world_size:
        raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} x kv_parallel_size "
                         f"{config.kv_parallel_size} must equal the world size, {world} processes")
    rank, kvp = dist.get_rank(), config.kv_parallel_size
    # Every rank creates every KVP group, in the same order (torch.distributed's rule).
    kvp_groups = [dist.new_group(list(range(t * kvp, (t + 1) * kvp))) for t in range(world // kvp)] if kvp > 1 else []
    shm = _shared_memory_groups(config.all_reduce, device, kvp)
    return ParallelState(rank=rank, world_size=world, kvp_size=kvp, batch_sharded=config.attention_sharding == "batch",
                         group=dist.group.WORLD,
                         shm_group=shm[0] if shm else None,
                         kvp_group=kvp_groups[rank // kvp] if kvp_groups else None,
                         kvp_shm_group=shm[1] if shm and kvp > 1 else None)


# Bytes of one rank's slot; a larger tensor goes through in pieces (a 2048-token fp32 prefill
# chunk of a 768-wide model is 6 MiB).
SHM_SLOT_BYTES = 4 << 20


def _shared_memory_groups(choice: str, device: torch.device, kvp: int) -> tuple[int, int] | None:
    """Shared-memory groups of every rank and of this rank's KVP ranks (the same as the first
    when KVP is 1), when `choice` and the ranks allow them: all on one host, on CPU.
    "shared_memory" where they cannot is an error."""
    world, rank = dist.get_world_size(), dist.get_rank()
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    possible = device.type == "cpu" and len(set(hosts)) == 1
    if choice == "process_group" or (choice == "auto" and not possible):
        logger.info("collectives through the process group (%s)", dist.get_backend())
        return None
    if not possible:
        raise ValueError(f"all_reduce: shared memory needs every rank on one host and on CPU; the ranks run on "
                         f"{sorted(set(hosts))} ({device.type})")
    from loom.kernels import load_kernels

    load_kernels()
    # Names for the world's group and each KVP group.
    names = [f"/loom-{uuid.uuid4().hex}-{i}" for i in range(1 + world // kvp)] if rank == 0 else None
    holder = [names]
    dist.broadcast_object_list(holder, src=0)
    names = holder[0]
    everyone = torch.ops.loom.shm_open_group(names[0], rank, world, SHM_SLOT_BYTES)
    mine = everyone if kvp == 1 else torch.ops.loom.shm_open_group(names[1 + rank // kvp], rank % kvp, kvp,
                                                                   SHM_SLOT_BYTES)
    dist.barrier()  # every rank has them mapped: the names can go (the memory stays until the last one exits)
    if rank == 0:
        for name in names:
            torch.ops.loom.shm_unlink_group(name)
    logger.info("collectives through shared memory (every rank on %s)", hosts[0])
    return everyone, mine
