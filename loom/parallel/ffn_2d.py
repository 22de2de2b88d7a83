"""PaLM's 2D weight-stationary FFN: each weight split along both the model dimension E and the
FFN dimension F over a grid of X x YZ ranks (rank = yz * X + x), so each rank keeps an
[E/X, F/YZ] block of every FFN weight; activations move along the two axes in turn.

Per FFN (SwiGLU), on rank (x, yz), with the layer's input replicated on every rank as Loom's
residual stream is:
  input     its E/X columns                                  [T, E/X]
  gate/up   its block: partial sums over X                   [T, 2F/YZ]
            reduce-scatter along X                           [T, 2F/(YZ X)]   (gate and up pieces)
            silu(gate) * up, all-gather along X              [T, F/YZ]
  down      its block: partial sums over YZ                  [T, E/X]
            reduce-scatter along YZ                          [T, E/(X YZ)]
            all-gather over all ranks, to the replicated     [T, E]
The paper keeps the residual stream itself sharded E_xyz (its first collective is an
all-gather along YZ, its last the reduce-scatter along YZ); Loom's attention is 1D tensor
parallel over a replicated residual, so the input's E/X slice is taken locally and the last
all-gather restores the replication. Communication per rank falls as the grid grows in both
axes, where the 1D layout's all-reduce stays at the full [T, E].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.parallel import comm
from loom.parallel.state import ParallelState


class WeightStationary2DMLP(nn.Module):
    """A Llama MLP's rank (x, yz) share in the 2D layout. gate_up holds, for each x' of the grid,
    the gate rows and then the up rows of the x'-th piece of this rank's F/YZ features (so the
    reduce-scatter along X hands rank x matching gate and up pieces), input columns E_x; down
    holds rows E_x, input columns F_yz."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, columns: slice, state: ParallelState) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.state = gate_up, down, state
        self.columns = columns  # this rank's E/X of the model dimension
        x, yz = state.ffn_x.size, state.ffn_yz.size
        # Rank (x', yz') ends with chunk x' * YZ + yz' of the model dimension: where each chunk is.
        self.chunk_ranks = [(k % yz) * x + k // yz for k in range(x * yz)]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s, tokens = self.state, h.shape[0]
        x, yz = s.ffn_x.size, s.ffn_yz.size
        partial = self.gate_up_proj(h[:, self.columns].contiguous())
        pieces = comm.reduce_scatter(partial.view(tokens, x, -1).transpose(0, 1), s.ffn_x.group, s.ffn_x.shm_group)
        gate, up = pieces.chunk(2, dim=-1)
        act = comm.all_gather(F.silu(gate) * up, s.ffn_x.group, s.ffn_x.shm_group, x)
        partial = self.down_proj(act.transpose(0, 1).reshape(tokens, -1))
        mine = comm.reduce_scatter(partial.view(tokens, yz, -1).transpose(0, 1), s.ffn_yz.group, s.ffn_yz.shm_group)
        chunks = comm.all_gather(mine, s.group, s.shm_group, s.world_size)
        return chunks[self.chunk_ranks].transpose(0, 1).reshape(tokens, -1)


def ffn_2d_cuts(hidden_size: int, intermediate_size: int, state: ParallelState) -> tuple[torch.Tensor, slice, slice]:
    """What rank (x, yz) keeps: the rows of the merged gate_up weight, in the order
    WeightStationary2DMLP wants; its slice of the model dimension (gate_up's input columns,
    down's rows); its slice of the FFN dimension (down's input columns)."""
    x, yz = state.ffn_x.size, state.ffn_yz.size
    width, per_yz = hidden_size // x, intermediate_size // yz
    piece, first = per_yz // x, state.ffn_yz.rank * per_yz
    rows = []
    for i in range(x):
        start = first + i * piece
        rows += [torch.arange(start, start + piece), intermediate_size + torch.arange(start, start + piece)]
    model_dim = slice(state.ffn_x.rank * width, (state.ffn_x.rank + 1) * width)
    return torch.cat(rows), model_dim, slice(first, first + per_yz)


def ffn_2d_collectives(num_tokens: int, hidden_size: int, intermediate_size: int, itemsize: int,
                       state: ParallelState) -> list[tuple[str, int, int]]:
    """(kind, calls, bytes each rank puts in) of one 2D FFN over `num_tokens` tokens."""
    x, yz = state.ffn_x.size, state.ffn_yz.size
    gate_up = num_tokens * 2 * intermediate_size // yz * itemsize
    act = num_tokens * intermediate_size // (yz * x) * itemsize
    down = num_tokens * hidden_size // x * itemsize
    return [("reduce_scatter", 2, gate_up + down), ("all_gather", 2, act + down // yz)]
