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
class Subgroup:
    """Some of the ranks, this one among them, and how to reach them."""
    group: dist.ProcessGroup
    shm_group: int | None  # their shared-memory group (loom::shm_*), if in use
    rank: int  # this rank's index among them
    size: int


@dataclass(frozen=True)
class ParallelState:
    """This rank's place. The ranks form a grid of TPA x KVP (Helix; KVP = 1 is plain tensor
    parallel): rank = tpa_rank * kvp_size + kvp_rank. Attention splits heads over the TPA
    ranks and each sequence's KV over the KVP ranks; the output projection, the FFN and the
    vocabulary are split over all ranks (tp_rank of tp_size, the world). A 2D weight-stationary
    FFN sees them as a grid of X x YZ instead: rank = yz * X + x."""
    rank: int = 0
    world_size: int = 1
    kvp_size: int = 1
    batch_sharded: bool = False  # attention sharded by batch: each rank keeps its own sequences' KV
    hop_b: bool = False  # Helix: each item's all-to-all overlapped with the next item's attention
    group: dist.ProcessGroup | None = None  # every rank; None in one process
    shm_group: int | None = None  # a shared-memory group of every rank (loom::shm_*), if in use
    kvp: Subgroup | None = None  # the KVP ranks holding this one's heads (KVP > 1)
    ffn_x: Subgroup | None = None  # 2D FFN: the ranks of this one's YZ index, along X
    ffn_yz: Subgroup | None = None  # 2D FFN: the ranks of this one's X index, along YZ

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
    rank, kvp, x = dist.get_rank(), config.kv_parallel_size, config.ffn_grid[0]
    partitions = {}  # name -> the rank lists it splits the world into
    if kvp > 1:
        partitions["kvp"] = [list(range(t * kvp, (t + 1) * kvp)) for t in range(world // kvp)]
    if x > 1:
        partitions["ffn_x"] = [list(range(yz * x, (yz + 1) * x)) for yz in range(world // x)]
        partitions["ffn_yz"] = [list(range(i, world, x)) for i in range(x)]
    # Every rank creates every group, in the same order (torch.distributed's rule).
    groups = {name: [dist.new_group(ranks) for ranks in partition] for name, partition in partitions.items()}
    shm = _shared_memory_groups(config.all_reduce, device, list(partitions.values()))
    subgroups = {}
    for i, (name, partition) in enumerate(partitions.items()):
        mine = next(j for j, ranks in enumerate(partition) if rank in ranks)
        subgroups[name] = Subgroup(groups[name][mine], shm[1][i] if shm else None, partition[mine].index(rank),
                                   len(partition[mine]))
    return ParallelState(rank=rank, world_size=world, kvp_size=kvp, batch_sharded=config.attention_sharding == "batch",
                         hop_b=config.hop_b,
                         group=dist.group.WORLD, shm_group=shm[0] if shm else None, **subgroups)


# Bytes of one rank's slot; a larger tensor goes through in pieces (a 2048-token fp32 prefill
# chunk of a 768-wide model is 6 MiB).
SHM_SLOT_BYTES = 4 << 20


def _shared_memory_groups(choice: str, device: torch.device,
                          partitions: list[list[list[int]]]) -> tuple[int, list[int]] | None:
    """Shared-memory groups of every rank and, for each partition of the ranks, of the ranks in
    this one's part, when `choice` and the ranks allow them: all on one host, on CPU.
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
    # One name for the world's group, suffixed for each part of each partition.
    holder = [f"/loom-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    base = holder[0]
    everyone = torch.ops.loom.shm_open_group(base, rank, world, SHM_SLOT_BYTES)
    names, mine = [base], []
    for i, partition in enumerate(partitions):
        names += [f"{base}-{i}-{j}" for j in range(len(partition))]
        j, ranks = next((j, ranks) for j, ranks in enumerate(partition) if rank in ranks)
        mine.append(torch.ops.loom.shm_open_group(f"{base}-{i}-{j}", ranks.index(rank), len(ranks), SHM_SLOT_BYTES))
    dist.barrier()  # every rank has them mapped: the names can go (the memory stays until the last one exits)
    if rank == 0:
        for name in names:
            torch.ops.loom.shm_unlink_group(name)
    logger.info("collectives through shared memory (every rank on %s)", hosts[0])
    return everyone, mine
