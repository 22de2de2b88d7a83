"""The collectives a partitioned forward calls, each through shared memory when the ranks have
a group there (every rank on one host, CPU), else through the process group. All are
operators, so compiled graphs call them too."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, shm_group: int | None) -> torch.Tensor:
    """The sum of `x` over the group's ranks."""
    if shm_group is not None:
        return torch.ops.loom.shm_all_reduce(x, shm_group)
    return funcol.all_reduce(x, "sum", group)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, shm_group: int | None) -> torch.Tensor:
    """x [ranks, ...]: piece j goes to the group's rank j; returns [ranks, ...], piece j from rank j."""
    if shm_group is not None:
        return torch.ops.loom.shm_all_to_all(x, shm_group)
    return funcol.all_to_all_single(x, None, None, group)


def all_to_all_start(x: torch.Tensor, group: dist.ProcessGroup, shm_group: int | None) -> tuple[torch.Tensor, ...]:
    """Starts `all_to_all(x, ...)` and returns at once, for `all_to_all_wait` to finish after other
    work. Shared memory holds at most two unfinished exchanges of a group: finish one before
    starting a third. x must fit one shared-memory slot."""
    if shm_group is not None:
        return torch.ops.loom.shm_all_to_all_start(x, shm_group), x
    splits = [x.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group)
    return (torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, group.group_name),)


def all_to_all_wait(started: tuple[torch.Tensor, ...], after: list[torch.Tensor],
                    shm_group: int | None) -> torch.Tensor:
    """The result of a started all-to-all, waited for after the tensors `after` (a compiled graph
    could otherwise move the wait before the work meant to hide it)."""
    if shm_group is not None:
        ticket, x = started
        return torch.ops.loom.shm_all_to_all_wait(ticket, x, shm_group, after)
    return torch.ops._c10d_functional.wait_tensor(started[0])


def gather_to_driver(x: torch.Tensor, group: dist.ProcessGroup, shm_group: int | None, rank: int,
                     world: int) -> list[torch.Tensor] | None:
    """Every rank's `x` (same shapes), in rank order, on rank 0; None on the others."""
    if shm_group is not None:  # every rank then holds them all
        parts = torch.ops.loom.shm_all_gather(x, shm_group, world)
        return list(parts.unbind(0)) if rank == 0 else None
    parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, parts, dst=0, group=group)
    return parts


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, shm_group: int | None, size: int) -> torch.Tensor:
    """Every rank's `x` (same shapes) stacked in the group's rank order: [size, *x.shape]."""
    if shm_group is not None:
        return torch.ops.loom.shm_all_gather(x, shm_group, size)
    return funcol.all_gather_tensor(x.unsqueeze(0).contiguous(), 0, group)


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, shm_group: int | None) -> torch.Tensor:
    """x [ranks, ...] holds a piece for each of the group's ranks: the sum over the ranks of
    their piece for this one, [...]."""
    if shm_group is not None:
        return torch.ops.loom.shm_reduce_scatter(x, shm_group)
    return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group).squeeze(0)
