"""A step's inputs from rank 0 to every rank, and the tally of what a step communicates. Each
rank runs the same step on its shard; only rank 0 samples, so nothing flows back but the logits
gathered by the LM head."""
from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loom.parallel.state import ParallelState

logger = logging.getLogger(__name__)


def broadcast_step(inputs: Any, state: ParallelState) -> tuple[Any, int]:
    """Rank 0 passes the step's inputs (None: no more steps) and gets them back; the other ranks
    pass None and receive them. Also returns the pickled size in bytes. Two broadcasts: the size,
    then the bytes (what torch's broadcast_object_list does, with the size kept for the stats).
    The control data of a step is small beside its activations: token ids, positions, block tables."""
    if state.is_driver:
        payload = torch.frombuffer(bytearray(pickle.dumps(inputs)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()])
    else:
        size = torch.zeros(1, dtype=torch.long)
    dist.broadcast(size, src=0, group=state.group)
    if not state.is_driver:
        payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=state.group)
    received = inputs if state.is_driver else pickle.loads(payload.numpy().tobytes())
    if received is None:  # the run's last collective
        await_release([size, payload])
    return received, int(size)


def await_release(tensors: list[torch.Tensor], timeout: float = 5.0) -> bool:
    """Waits until nothing but Python holds `tensors` (a finished collective's), at most
    `timeout` seconds; whether it did. Gloo's worker thread drops its references to a collective's
    tensors just after the collective returns, and needs the GIL for it: after a run's last
    collective, the interpreter's exit can come first, and the worker, unable to take the GIL,
    aborts the process ("terminate called without an active exception")."""
    deadline = time.monotonic() + timeout
    while any(t._use_count() > 1 for t in tensors):
        if time.monotonic() > deadline:
            logger.warning("a collective's tensors are still held after %.0f s; leaving anyway", timeout)
            return False
        time.sleep(0.001)
    return True


class LockStepError(RuntimeError):
    """A step failed with the ranks in it (a rank gone, a collective or kernel failed): the
    ranks can no longer run in lock step, so none goes on."""

    def __init__(self, state: ParallelState, error: BaseException) -> None:
        super().__init__(f"rank {state.rank} of {state.world_size}: a step failed, and the ranks cannot go on in "
                         f"lock step (a rank lost or failing): {type(error).__name__}: {error}")


@dataclass
class CollectiveStats:
    """Collectives issued so far, by kind: calls, and bytes each rank put in (a gather's
    contribution, an all-reduce's input, a broadcast's payload)."""
    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, calls: int, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + calls
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
