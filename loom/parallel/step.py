"""A step's inputs from rank 0 to every rank. Each rank runs the same step on its shard; only
rank 0 samples, so nothing flows back but the logits gathered by the LM head."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from loom.parallel.state import ParallelState


def broadcast_step(inputs: Any, state: ParallelState) -> Any:
    """Rank 0 passes the step's inputs (None: no more steps) and gets them back; the other ranks
    pass None and receive them. Pickled: the control data of a step is small beside its
    activations (a few KB: token ids, positions, block tables)."""
    box = [inputs]
    dist.broadcast_object_list(box, src=0, group=state.group)
    return box[0]
