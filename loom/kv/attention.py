"""Attention over the paged KV pool, for a packed batch of decodes and prefill chunks.

A step's tokens are packed as [decode tokens | prefill chunk 1 | prefill chunk 2 | ...]. Every
token's k/v is first written to its slot; then decode rows attend over their sequences' blocks
(one fused kernel for the whole group) and each prefill chunk attends causally over its cached
prefix plus itself, read from the blocks in place.

A KV policy that chooses tokens by attention (loom/kv/policy.py) asks some rows for their
scores: decode rows get them from the decode kernel itself (`DecodeScores`), prompt rows from
their logits, recomputed SCORE_ROWS queries at a time (`PromptScores`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loom.kv.cache import KVCache
from loom.kv.scores import HeadScores, lowest_unprotected, reference_row_scores

SCORE_ROWS = 256  # prompt queries whose logits are held at once while scoring


@dataclass
class PromptScores:
    """A prefill chunk's rows score their keys: row i with temperature temps[i] (0: not at all)
    and noise key row_keys[i] (-1: no noise); each layer adds its [KVH, context_len] scores to
    out[layer], the sequence's accumulated scores."""
    temps: torch.Tensor      # [num_tokens] float32
    row_keys: torch.Tensor   # [num_tokens] int64
    out: torch.Tensor        # [L, KVH, context_len] float32


@dataclass
class DecodeScores:
    """Decode rows score their keys, as PromptScores, adding to their sequences' accumulated
    scores in place: the kernel finds each scored row's state at its address (`rows`, from
    `HeadScores.address`; zeros for a row not scored), the reference path in `states`. Where
    newest[b] >= 0, the row's state also gets each head's lowest-scored entry at a position at
    most newest[b] (`HeadScores.lowest`: what a decode step's single drop takes)."""
    temps: torch.Tensor               # [num_decode] float32
    row_keys: torch.Tensor            # [num_decode] int64
    rows: torch.Tensor                # [num_decode, 5] int64
    newest: torch.Tensor              # [num_decode] int64
    states: list[HeadScores | None]   # never read by a compiled step


@dataclass
class PrefillSegment:
    start: int            # first row of this chunk in the packed batch
    num_tokens: int       # rows of this chunk (queries)
    context_len: int      # tokens it attends over: cached prefix + this chunk
    block_ids: torch.Tensor  # int32 block ids covering context_len tokens
    # Position of each of the context_len stored tokens, when they are not 0 .. context_len - 1
    # (tokens were dropped); the chunk's own tokens are the last num_tokens.
    key_positions: torch.Tensor | None = None
    scores: PromptScores | None = None
    # Set when the blocks hold only one shard of the sequence's keys (KV parallelism), which may
    # lack the chunk's own: each query's position [num_tokens] (then key_positions is set too).
    query_positions: torch.Tensor | None = None


@dataclass
class RowExchange:
    """When each rank attends for its own sequences only (attention sharded by batch): which of
    the step's rows go to each rank, and where each row's output comes back from."""
    send_index: torch.Tensor  # [ranks, rows per rank] int64: the step's rows for each rank (padded)
    back_index: torch.Tensor  # [T] int64: row t's place in the returned [ranks * rows per rank]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] int64, a slot for every packed token
    num_decode_tokens: int = 0            # the first rows are single-token decodes
    decode_block_tables: torch.Tensor | None = None   # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None   # [num_decode] int32
    prefills: list[PrefillSegment] = field(default_factory=list)
    decode_scores: DecodeScores | None = None
    row_exchange: RowExchange | None = None

    def decode_dims(self) -> tuple[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]]:
        """The (tensor, dim) pairs a decode-only step's size moves: those counting its rows, and
        those spanning its widest block table."""
        rows = [(self.slot_mapping, 0), (self.decode_block_tables, 0), (self.decode_context_lens, 0)]
        widths = [(self.decode_block_tables, 1)]
        if (s := self.decode_scores) is not None:
            rows += [(s.temps, 0), (s.row_keys, 0), (s.rows, 0), (s.newest, 0)]
        if (x := self.row_exchange) is not None:
            rows += [(x.send_index, 1), (x.back_index, 0)]
        return rows, widths


# An attention's output [T, H, D] and, from Loom's kernels, each row's log-sum-exp [T, H] (None
# from the reference paths).
Attended = tuple[torch.Tensor, torch.Tensor | None]


def paged_decode_attention(q: torch.Tensor, cache: KVCache, layer: int, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, backend: str,
                           scores: DecodeScores | None = None) -> Attended:
    """q [B, H, D] -> [B, H, D]: each row attends over its first context_lens[b] cached tokens."""
    if backend == "cpp" and scores is None:
        return torch.ops.loom.paged_decode_attention(q.contiguous(), cache.keys[layer], cache.values[layer],
                                                     block_tables, context_lens, scale, *cache.scales(layer))
    if backend == "cpp":
        return torch.ops.loom.paged_decode_attention_scored(
            q.contiguous(), cache.keys[layer], cache.values[layer], block_tables, context_lens, scale,
            scores.rows, scores.temps, scores.row_keys, scores.newest, layer, *cache.scales(layer))
    return _decode_reference(q, cache, layer, block_tables, context_lens, scale, scores), None


def _decode_reference(q: torch.Tensor, cache: KVCache, layer: int, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, scores: DecodeScores | None) -> torch.Tensor:
    """Plain PyTorch: gather each sequence's blocks and run SDPA. Obviously right, not fast."""
    out = torch.empty_like(q)
    bs = cache.block_size
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k, v = cache.gather(layer, block_tables[b, : (n + bs - 1) // bs].long(), n)
        out[b] = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale,
                                                enable_gqa=k.shape[0] != q.shape[1]).squeeze(1)
        if scores is not None and scores.temps[b] > 0:
            state = scores.states[b]
            state.scores[layer, :, :n] += reference_row_scores(
                _logits(q[b:b + 1], k, scale), k.shape[0], torch.tensor([n], device=q.device), scores.temps[b:b + 1],
                scores.row_keys[b:b + 1], layer, state.positions[layer, :, :n])
            if (newest := int(scores.newest[b])) >= 0:
                state.lowest[layer] = lowest_unprotected(state.scores[layer], state.positions[layer], newest)
    return out


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [r, H, D] against k [KVH, ctx, D] -> scaled logits [H, r, ctx] float32."""
    group = q.shape[1] // k.shape[0]
    return torch.matmul(q.float().transpose(0, 1), k.float().repeat_interleave(group, 0).transpose(1, 2)) * scale


def prompt_row_scores(q: torch.Tensor, cache: KVCache, layer: int, seg: PrefillSegment, scale: float,
                      backend: str) -> torch.Tensor:
    """The chunk's scored rows' scores over its context: [KVH, context_len]. The chunk's stored
    order is position order (prompts are compressed only once computed)."""
    scored = (seg.scores.temps > 0).nonzero().squeeze(1)
    k, _ = cache.gather(layer, seg.block_ids, seg.context_len)
    out = torch.zeros(k.shape[0], seg.context_len, device=q.device)
    first = seg.context_len - seg.num_tokens  # stored index of the chunk's first token
    for rows in scored.split(SCORE_ROWS):
        visible = first + rows + 1
        width = int(visible[-1])  # rows ascend: no row of this group sees a key past its last's
        logits, temps, keys = _logits(q[rows], k[:, :width], scale), seg.scores.temps[rows], seg.scores.row_keys[rows]
        if backend == "cpp":
            out[:, :width] += torch.ops.loom.attention_row_scores(logits, k.shape[0], visible, temps, keys, layer)
        else:
            out[:, :width] += reference_row_scores(logits, k.shape[0], visible, temps, keys, layer)
    return out


def prefill_attention(q: torch.Tensor, cache: KVCache, layer: int, seg: PrefillSegment, scale: float,
                      backend: str) -> Attended:
    """One chunk's causal attention over its sequence's blocks (the chunk's own k/v included).
    q [n, H, D] -> [n, H, D]."""
    if backend == "cpp":
        return torch.ops.loom.paged_prefill_attention(q.contiguous(), cache.keys[layer], cache.values[layer],
                                                      seg.block_ids, seg.context_len, seg.key_positions, scale,
                                                      seg.query_positions, *cache.scales(layer))
    return _prefill_reference(q, cache, layer, seg, scale), None


def _prefill_reference(q: torch.Tensor, cache: KVCache, layer: int, seg: PrefillSegment,
                       scale: float) -> torch.Tensor:
    """Plain PyTorch: gather the sequence's tokens and run SDPA with the causal mask spelled out."""
    n = seg.num_tokens
    k, v = cache.gather(layer, seg.block_ids, seg.context_len)
    keys = seg.key_positions
    if keys is None:  # stored token i is at position i
        keys = torch.arange(seg.context_len, device=q.device)
    visible = keys.unsqueeze(0) <= keys[-n:].unsqueeze(1)  # each query sees keys up to its position
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible, scale=scale,
                                          enable_gqa=k.shape[0] != q.shape[1]).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                    meta: AttentionMetadata, scale: float, backend: str) -> Attended:
    """q [T, H, D], k/v [T, KVH, D] for the packed step -> attention output [T, H, D], and its
    log-sum-exp [T, H] from the C++ backend."""
    cache.write(layer, k, v, meta.slot_mapping)
    return attend(q, cache, layer, meta, scale, backend)


def attend(q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata, scale: float,
           backend: str) -> Attended:
    """The attention of the packed rows q [T, H, D] whose k/v are already in the cache."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32) if backend == "cpp" else None
    nd = meta.num_decode_tokens
    parts = []
    if nd:
        parts.append((slice(0, nd), paged_decode_attention(q[:nd], cache, layer, meta.decode_block_tables,
                                                           meta.decode_context_lens, scale, backend,
                                                           meta.decode_scores)))
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_tokens)
        parts.append((rows, prefill_attention(q[rows], cache, layer, seg, scale, backend)))
        if seg.scores is not None:
            seg.scores.out[layer] += prompt_row_scores(q[rows], cache, layer, seg, scale, backend)
    for rows, (part, part_lse) in parts:
        out[rows] = part
        if lse is not None:
            lse[rows] = part_lse
    return out, lse


class PagedAttention(nn.Module):
    """One layer's attention over the paged pool: the step's packed q [T, H, D] and new k/v
    [T, KVH, D] in, [T, H, D] out. A module of its own, so a partitioned run can swap in its
    variant (loom/parallel/helix.py)."""

    def __init__(self, layer_idx: int, scale: float, backend: str = "cpp") -> None:
        super().__init__()
        self.layer_idx, self.scale, self.backend = layer_idx, scale, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return paged_attention(q, k, v, cache, self.layer_idx, meta, self.scale, self.backend)[0]
