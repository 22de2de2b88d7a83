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
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from loom.kv.attention import AttentionMetadata, PagedAttention, PrefillSegment, paged_attention
from loom.kv.cache import KVCache
from loom.parallel import comm
from loom.parallel.state import ParallelState


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
        out.decode_block_tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1])).contiguous()
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


class HelixAttention(nn.Module):
    """A layer's attention on one rank of a KVP group: partial attention over the keys this rank
    holds, one all-to-all, the merge. q [T, H/TPA, D] in, [T, H/N, D] out."""

    def __init__(self, attention: PagedAttention, state: ParallelState) -> None:
        super().__init__()
        self.layer_idx, self.scale, self.state = attention.layer_idx, attention.scale, state

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        out, lse = paged_attention(q, k, v, cache, self.layer_idx, meta, self.scale, "cpp")
        kvp, (tokens, heads, head_dim) = self.state.kvp_size, out.shape
        # One message, by head slice: the outputs as the kernel wrote them, then the bits of their
        # fp32 log-sum-exps in as many elements of the outputs' type (a bf16 lse would be too coarse).
        packed = torch.cat([out, lse.unsqueeze(-1).view(out.dtype)], dim=-1)
        packed = packed.view(tokens, kvp, heads // kvp, -1).transpose(0, 1).contiguous()
        parts = comm.all_to_all(packed, self.state.kvp.group, self.state.kvp.shm_group)
        lses = parts[..., head_dim:].contiguous().view(torch.float32).squeeze(-1)
        return merge_partials(parts[..., :head_dim].float(), lses).to(q.dtype)


def helix_attention_bytes(num_tokens: int, num_heads: int, head_dim: int, itemsize: int,
                          state: ParallelState) -> int:
    """Bytes each rank puts into one layer's all-to-all for `num_tokens` tokens: each head's output
    and its fp32 log-sum-exp."""
    return num_tokens * (num_heads // state.tpa_size) * (head_dim * itemsize + 4)
