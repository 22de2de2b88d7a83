"""Helix KV parallelism: each sequence's KV cache split by position over KVP ranks.

A sequence's blocks go round-robin over the KVP ranks (block j on rank j % KVP, so with blocks
of 16 tokens each rank takes 16 tokens in turn; the block manager allocates them so). Every
rank of a KVP group computes the same queries for its TPA share of the heads and attends over
the keys it holds, keeping each row's log-sum-exp. One all-to-all then hands rank k of the
group, from every rank of it, the partial outputs of the k-th slice of those heads, which it
merges exactly:

    out = sum_j exp(lse_j - L) out_j,   L = log sum_j exp(lse_j)

The output projection and the FFN then run tensor parallel over all ranks (tensor_parallel.py),
rank r owning heads [r H/N, (r+1) H/N), the slice the all-to-all left it.

Rank 0 schedules for the whole pool: a global block b lives on KVP rank b % KVP at local index
b // KVP. Each rank turns a step's global metadata into its own here: its blocks, its token
counts, and slots whose tokens live elsewhere pointed at a spare block no one reads.

HOP-B (`hop_b`) cuts the step into items, attends item by item and starts each item's
all-to-all as soon as its partial outputs exist, finishing the one before only after the next
item's attention: each exchange waits behind useful work instead of in front of it. The items
are the decode rows (in two halves from HOP_B_MIN_SPLIT decodes on) and each prefill chunk,
every one cut to what one message carries (`overlap_items`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from loom.kv.attention import AttentionMetadata, PagedAttention, PrefillSegment, attend, paged_attention
from loom.kv.cache import KVCache
from loom.parallel import comm
from loom.parallel.state import SHM_SLOT_BYTES, ParallelState


def local_token_counts(context_lens: torch.Tensor, rank: int, size: int, block_size: int) -> torch.Tensor:
    """How many of each sequence's first context_lens[b] tokens live on KVP rank `rank`."""
    full, rest = context_lens // block_size, context_lens % block_size
    local_full = (full - rank + size - 1) // size  # blocks j < full with j % size == rank
    return (local_full * block_size + torch.where(full % size == rank, rest, 0)).to(torch.int32)


def shard_metadata(meta: AttentionMetadata, rank: int, size: int, block_size: int,
                   spare_block: int) -> AttentionMetadata:
    """The step's attention metadata as KVP rank `rank` of `size` sees it (no KV policy scores:
    those are refused with KVP > 1)."""
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    local = torch.where(blocks % size == rank, blocks // size, spare_block) * block_size + offsets
    out = AttentionMetadata(slot_mapping=local, num_decode_tokens=meta.num_decode_tokens,
                            prefills=[_shard_segment(seg, rank, size, block_size) for seg in meta.prefills])
    if meta.num_decode_tokens:
        width = -(-meta.decode_block_tables.shape[1] // size)  # the same on every rank
        tables = meta.decode_block_tables[:, rank::size] // size
        # A fresh [rows, width] tensor: a view's strides can differ from a new one's in a dimension
        # of size 1, which a compiled graph's guards would then pin.
        out.decode_block_tables = tables.new_zeros(tables.shape[0], width)
        out.decode_block_tables[:, :tables.shape[1]] = tables
        out.decode_context_lens = local_token_counts(meta.decode_context_lens, rank, size, block_size)
    return out


def _shard_segment(seg: PrefillSegment, rank: int, size: int, block_size: int) -> PrefillSegment:
    stored = torch.arange(seg.context_len, device=seg.block_ids.device)
    positions = stored if seg.key_positions is None else seg.key_positions
    mine = (stored // block_size) % size == rank
    return dataclasses.replace(seg, context_len=int(mine.sum()), block_ids=(seg.block_ids[rank::size] // size),
                               key_positions=positions[mine], query_positions=positions[-seg.num_tokens:])


def shard_block_pairs(pairs: list[tuple[int, int]], rank: int, size: int) -> list[tuple[int, int]]:
    """The (src, dst) block copies that concern KVP rank `rank`, in its local ids (a copy never
    crosses ranks: both blocks serve the same index of a sequence)."""
    return [(src // size, dst // size) for src, dst in pairs if src % size == rank]


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The exact attention from partial ones over disjoint key sets: outs [S, ..., D] and their
    log-sum-exps lses [S, ...] (-inf where a part saw no key) -> [..., D]."""
    weights = torch.exp(lses - lses.amax(0))
    return (weights.unsqueeze(-1) * outs).sum(0) / weights.sum(0).unsqueeze(-1)


HOP_B_MIN_SPLIT = 4  # decodes in a step from which HOP-B splits them in two


def overlap_items(num_decode: int, prefill_rows: list[int], max_rows: int) -> list[tuple[int, int]]:
    """HOP-B's items as (first row, rows) of the packed step: the decode rows in two halves (one
    item for fewer than 4 decodes: a compiled graph would specialize on halves of one row),
    then each prefill chunk, every item at most `max_rows` rows. The halves are not cut further,
    so one compiled decode graph serves every batch size from 4 on; a step whose half would
    exceed `max_rows` is refused where the engine is configured."""
    half = num_decode // 2
    items = [(0, num_decode)] if num_decode < HOP_B_MIN_SPLIT else [(0, half), (half, num_decode - half)]
    start = num_decode
    for rows in prefill_rows:
        items += [(start + a, min(max_rows, rows - a)) for a in range(0, rows, max_rows)]
        start += rows
    return [item for item in items if item[1] > 0]


def max_item_rows(heads: int, head_dim: int, itemsize: int) -> int:
    """Rows of `heads` partial outputs (and their fp32 log-sum-exps) that one message carries."""
    return SHM_SLOT_BYTES // (heads * (head_dim * itemsize + 4))


def helix_items(meta: AttentionMetadata, heads: int, head_dim: int, itemsize: int) -> list[tuple[int, int]]:
    """The HOP-B items of a step (each with an all-to-all of its own) for a rank computing `heads`
    query heads."""
    return overlap_items(meta.num_decode_tokens, [seg.num_tokens for seg in meta.prefills],
                         max_item_rows(heads, head_dim, itemsize))


def item_metadata(meta: AttentionMetadata, first: int, rows: int) -> AttentionMetadata:
    """The metadata of rows [first, first + rows) of a step, an item that lies in its decode rows
    or in one prefill chunk, as attention over those rows alone sees it."""
    if first < meta.num_decode_tokens:
        last = first + rows
        return AttentionMetadata(slot_mapping=meta.slot_mapping, num_decode_tokens=rows,
                                 decode_block_tables=meta.decode_block_tables[first:last],
                                 decode_context_lens=meta.decode_context_lens[first:last])
    seg = next(seg for seg in meta.prefills if seg.start <= first < seg.start + seg.num_tokens)
    a = first - seg.start
    return AttentionMetadata(slot_mapping=meta.slot_mapping, prefills=[dataclasses.replace(
        seg, start=0, num_tokens=rows, query_positions=seg.query_positions[a:a + rows])])


class HelixAttention(nn.Module):
    """A layer's attention on one rank of a KVP group: partial attention over the keys this rank
    holds, one all-to-all, the merge (with HOP-B, item by item, overlapped). q [T, H/TPA, D] in,
    [T, H/N, D] out."""

    def __init__(self, attention: PagedAttention, state: ParallelState) -> None:
        super().__init__()
        self.layer_idx, self.scale, self.state = attention.layer_idx, attention.scale, state

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        group, shm = self.state.kvp.group, self.state.kvp.shm_group
        if not self.state.hop_b:
            out, lse = paged_attention(q, k, v, cache, self.layer_idx, meta, self.scale, "cpp")
            return self._merge(comm.all_to_all(self._pack(out, lse), group, shm), q.dtype)
        cache.write(self.layer_idx, k, v, meta.slot_mapping)
        merged, pending = [], None
        for first, rows in helix_items(meta, q.shape[1], q.shape[2], q.element_size()):
            out, lse = attend(q[first:first + rows], cache, self.layer_idx, item_metadata(meta, first, rows),
                              self.scale, "cpp")
            started = comm.all_to_all_start(self._pack(out, lse), group, shm)
            if pending is not None:  # the item before's exchange, finished after this item's attention
                merged.append(self._merge(comm.all_to_all_wait(pending, [out], shm), q.dtype))
            pending = started
        merged.append(self._merge(comm.all_to_all_wait(pending, [], shm), q.dtype))
        return torch.cat(merged) if len(merged) > 1 else merged[0]

    def _pack(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """One message, by head slice: the outputs as the kernel wrote them, then the bits of their
        fp32 log-sum-exps in as many elements of the outputs' type (a bf16 lse would be too coarse)."""
        tokens, heads, _ = out.shape
        packed = torch.cat([out, lse.unsqueeze(-1).view(out.dtype)], dim=-1)
        return packed.view(tokens, self.state.kvp_size, heads // self.state.kvp_size, -1).transpose(0, 1).contiguous()

    def _merge(self, parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        head_dim = parts.shape[-1] - 4 // parts.element_size()  # the lse's 4 bytes end each row
        lses = parts[..., head_dim:].contiguous().view(torch.float32).squeeze(-1)
        return merge_partials(parts[..., :head_dim].float(), lses).to(dtype)


def helix_attention_bytes(num_tokens: int, num_heads: int, head_dim: int, itemsize: int,
                          state: ParallelState) -> int:
    """Bytes each rank puts into one layer's all-to-all for `num_tokens` tokens: each head's output
    and its fp32 log-sum-exp."""
    return num_tokens * (num_heads // state.tpa_size) * (head_dim * itemsize + 4)
