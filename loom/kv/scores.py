"""Scores of the KV policies that choose tokens by attention (H2O, Keyformer, SnapKV).

`HeadScores` is one sequence's record, per layer and kv head, of each stored token's position
and accumulated score: those policies drop different tokens in each head, so stored index i
holds a different token in each. The kernels add each step's scores (loom/kernels); this module
also holds their plain-PyTorch definition, which the reference attention backend runs and the
tests check the kernels against.

Keyformer's noise g is Gumbel(0, 1) by inverse CDF on a grid of 2^GUMBEL_BITS quantiles, indexed
by a counter-based hash of (row key, layer, kv head, key position): a query's noise depends on
what it is, never on its batch or chunk. A row key is hashed from (seed, sample, position).
"""
from __future__ import annotations

import torch

GUMBEL_BITS = 12
MASK32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash with good avalanche, for Python ints and int64 tensors alike."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def row_key(seed: int, sample: int, position: int) -> int:
    return mix32(mix32(mix32(seed & MASK32) ^ (sample & MASK32)) ^ (position & MASK32))


def gumbel_reference(row_keys: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """The noise of rows [r] over key positions [KVH, n] -> [r, KVH, n] (what the kernels add)."""
    num_kv_heads, device = positions.shape[0], positions.device
    grid = (torch.arange(1 << GUMBEL_BITS, dtype=torch.float64, device=device) + 0.5) / (1 << GUMBEL_BITS)
    table = (-torch.log(-torch.log(grid))).float()
    keys = mix32(mix32(row_keys.long().to(device) & MASK32 ^ mix32(layer + 1))[:, None]
                 ^ ((torch.arange(num_kv_heads, device=device) + 1) * 0x9E3779B9 & MASK32))  # [r, KVH]
    h = mix32(keys[:, :, None] ^ ((positions.long() & MASK32) * 0x85EBCA6B & MASK32)[None])
    return table[h >> (32 - GUMBEL_BITS)]


def reference_row_scores(logits: torch.Tensor, num_kv_heads: int, visible: torch.Tensor, temps: torch.Tensor,
                         row_keys: torch.Tensor, layer: int, key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rows' scores, the definition: logits [H, r, ctx] (scaled q.k), each row seeing its first
    visible[r] keys; row r scores with temperature temps[r] (0: not at all), with Gumbel noise
    keyed by row_keys[r] (-1: none) and the keys' positions ([KVH, ctx]; None: key t is at
    position t). Returns [KVH, ctx]: softmax((x + g) / tau) summed over rows and each kv head's
    query heads."""
    num_heads, rows, ctx = logits.shape
    x = logits.float().view(num_kv_heads, num_heads // num_kv_heads, rows, ctx)
    if key_positions is None:
        key_positions = torch.arange(ctx, device=logits.device).expand(num_kv_heads, ctx)
    noise = gumbel_reference(row_keys, layer, key_positions).permute(1, 0, 2)  # [KVH, r, ctx]
    noise = noise * (row_keys >= 0)[None, :, None]
    y = (x + noise[:, None]) / temps.clamp(min=1e-30)[None, None, :, None]
    y = y.masked_fill(torch.arange(ctx, device=logits.device)[None, :] >= visible[:, None], float("-inf"))
    p = torch.softmax(y, dim=-1) * (temps > 0)[None, None, :, None]
    return p.sum(dim=(1, 2))


def lowest_unprotected(scores: torch.Tensor, positions: torch.Tensor, newest: int) -> torch.Tensor:
    """[..., 1] index of the lowest score among the entries at positions <= newest ([..., n]
    float32 scores, int32 positions): Loom's C++ op when the kernels are built (one pass,
    without the temporaries below), else the same in PyTorch."""
    if hasattr(torch.ops.loom, "lowest_unprotected"):
        return torch.ops.loom.lowest_unprotected(scores, positions, newest)
    return torch.where(positions <= newest, scores, torch.inf).argmin(-1, keepdim=True)


class HeadScores:
    """Per layer and kv head, the position and accumulated score of each stored token of one
    sequence. The scheduler appends a step's tokens when it schedules them; the step's attention
    adds their scores in place (decode rows in the kernel, through `address`; prompt rows into
    `scores`); the scheduler then drops from it."""

    def __init__(self, num_layers: int, num_kv_heads: int, capacity: int = 64) -> None:
        self._positions = torch.zeros(num_layers, num_kv_heads, capacity, dtype=torch.int32)
        self._scores = torch.zeros(num_layers, num_kv_heads, capacity)
        self.num_tokens = 0
        # Each head's lowest-scored entry at a position <= lowest_newest ([L, KVH, 1]), which the
        # next decode step's attention finds with its scores; lowest_newest None: none asked.
        self.lowest = torch.zeros(num_layers, num_kv_heads, 1, dtype=torch.long)
        self.lowest_newest: int | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[:, :, :self.num_tokens]

    @property
    def scores(self) -> torch.Tensor:
        return self._scores[:, :, :self.num_tokens]

    def append(self, first_position: int, count: int) -> None:
        """Records `count` new stored tokens at consecutive positions, with no score yet."""
        n = self.num_tokens + count
        if n > self._positions.shape[-1]:
            grow = max(n, 2 * self._positions.shape[-1]) - self._positions.shape[-1]
            self._positions = torch.cat([self._positions, self._positions.new_zeros(*self._positions.shape[:2], grow)], -1)
            self._scores = torch.cat([self._scores, self._scores.new_zeros(*self._scores.shape[:2], grow)], -1)
        self._positions[:, :, self.num_tokens:n] = torch.arange(first_position, first_position + count,
                                                                dtype=torch.int32)
        self._scores[:, :, self.num_tokens:n] = 0
        self.num_tokens = n
        self.lowest_newest = None

    @property
    def found(self) -> tuple[int, torch.Tensor] | None:
        """(newest, lowest) once a decode step was asked for its single drop, else None."""
        return None if self.lowest_newest is None else (self.lowest_newest, self.lowest)

    def address(self) -> list[int]:
        """Where the decode kernel finds and adds to this state: (scores address, positions
        address, lowest address, capacity, layers), the first two buffers [layers, KVH, capacity],
        all contiguous. Valid until the next `append` (which may grow them)."""
        return [self._scores.data_ptr(), self._positions.data_ptr(), self.lowest.data_ptr(), self._scores.shape[-1],
                self._scores.shape[0]]

    def clone(self) -> HeadScores:
        other = HeadScores.__new__(HeadScores)
        other._positions, other._scores, other.num_tokens = self._positions.clone(), self._scores.clone(), self.num_tokens
        other.lowest, other.lowest_newest = self.lowest.clone(), self.lowest_newest
        return other

    def written_by(self, dropped: torch.Tensor) -> set[int]:
        """The stored indices that a drop of `dropped` [L, KVH, k] overwrites in some head: its
        holes below the new count (`drop` fills them)."""
        kept = self.num_tokens - dropped.shape[-1]
        return {i for i in dropped.flatten().tolist() if i < kept}

    def drop(self, dropped: torch.Tensor, old_block_ids: list[int], new_block_ids: list[int],
             block_size: int) -> torch.Tensor:
        """Drops the stored indices `dropped` [L, KVH, k] (the same count in each head): in each
        head the entries kept beyond the new count fill its holes below it, both in ascending
        order. Returns the same moves for the KV pool, [M, 4] rows of (layer, kv head, source
        slot through `old_block_ids`, destination slot through `new_block_ids`): Loom's C++ op
        when the kernels are built (one call), else the same in PyTorch."""
        op = torch.ops.loom.drop_head_entries if hasattr(torch.ops.loom, "drop_head_entries") else drop_head_entries
        moves = op(self._positions, self._scores, dropped, self.num_tokens,
                   torch.tensor(old_block_ids, dtype=torch.long), torch.tensor(new_block_ids, dtype=torch.long),
                   block_size)
        self.num_tokens -= dropped.shape[-1]
        self.lowest_newest = None
        return moves


def drop_head_entries(positions: torch.Tensor, scores: torch.Tensor, dropped: torch.Tensor, num_tokens: int,
                      old_block_ids: torch.Tensor, new_block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """`HeadScores.drop` in PyTorch, as Loom's op of the same name does it: positions and scores
    [L, KVH, capacity] with `num_tokens` stored, `dropped` [L, KVH, k]; in each head its holes
    below the new count, ascending, each filled in place by the next kept entry beyond it.
    Returns [M, 4] rows of (layer, kv head, source slot, destination slot), head by head."""
    kept = num_tokens - dropped.shape[-1]
    gone = torch.zeros(dropped.shape[:2] + (num_tokens,), dtype=torch.bool)
    gone.scatter_(-1, dropped.long(), True)
    holes = gone[:, :, :kept].nonzero()        # (layer, head, index), row-major: per head ascending
    fills = (~gone[:, :, kept:]).nonzero()     # as many per head as that head has holes
    layer, head, src, dst = holes[:, 0], holes[:, 1], fills[:, 2] + kept, holes[:, 2]
    positions[layer, head, dst] = positions[layer, head, src]
    scores[layer, head, dst] = scores[layer, head, src]
    return torch.stack([layer, head, old_block_ids[src // block_size] * block_size + src % block_size,
                        new_block_ids[dst // block_size] * block_size + dst % block_size], dim=1)
