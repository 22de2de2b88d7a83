"""Attention sharded by batch (the PaLM paper's layout for multi-query and grouped-query
decode): each tensor-parallel rank keeps the KV cache of its own sequences, every KV head of
them, instead of every sequence's cache for its share of the heads. With fewer KV heads than
ranks, head sharding replicates each KV head's whole cache on several ranks; by batch, nothing
is replicated and each rank holds 1/T of the cache.

The projections stay tensor parallel by heads. In each attention, one all-to-all moves the
step's q, k and v from head sharding to batch sharding (rank j receives, from every rank, that
rank's heads for the rows of j's sequences), each rank attends over its own blocks, and a
second all-to-all moves the outputs back to head sharding for the output projection.

Rank 0 schedules for the whole pool: the block manager keeps all of a sequence's blocks on one
rank (placement "sequence"), block b on rank b % T at local index b // T. Each rank turns a
step's global metadata into its own rows and blocks here.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from loom.kv.attention import AttentionMetadata, PagedAttention, RowExchange, paged_attention
from loom.kv.cache import KVCache
from loom.parallel import comm
from loom.parallel.state import ParallelState


def rows_by_rank(meta: AttentionMetadata, size: int) -> list[list[int]]:
    """The step's rows of each rank's sequences (a sequence lives where its first block does)."""
    owners = (meta.decode_block_tables[:, 0] % size).tolist() if meta.num_decode_tokens else []
    for seg in meta.prefills:
        owners += [int(seg.block_ids[0]) % size] * seg.num_tokens
    return [[t for t, owner in enumerate(owners) if owner == j] for j in range(size)]


def shard_batch_metadata(meta: AttentionMetadata, rank: int, size: int, block_size: int, spare_block: int,
                         decode_only: bool) -> AttentionMetadata:
    """The step's attention metadata for the rows of rank `rank`'s sequences, padded to the same
    count on every rank. Padding rows write to
    the spare block; in a decode-only step they are decodes of no key (so every rank runs the
    same compiled graph shape), else rows no segment covers."""
    nd = meta.num_decode_tokens
    rows_of = rows_by_rank(meta, size)
    width = max(1, max(map(len, rows_of)))
    send = torch.zeros(size, width, dtype=torch.long)
    back = torch.empty(meta.slot_mapping.numel(), dtype=torch.long)
    for j, rows in enumerate(rows_of):
        send[j, :len(rows)] = torch.tensor(rows, dtype=torch.long)
        back[rows] = j * width + torch.arange(len(rows))
    mine = rows_of[rank]
    slots = meta.slot_mapping[mine]
    slots = (slots // block_size // size) * block_size + slots % block_size
    padding = width - len(mine)
    local = AttentionMetadata(slot_mapping=torch.cat([slots, torch.full((padding,), spare_block * block_size)]),
                              row_exchange=RowExchange(send, back))
    decodes = [t for t in mine if t < nd]
    if decodes or decode_only:
        tables = meta.decode_block_tables[decodes] // size
        lens = meta.decode_context_lens[decodes]
        if decode_only:
            tables = torch.cat([tables, tables.new_zeros(padding, tables.shape[1])])
            lens = torch.cat([lens, lens.new_zeros(padding)])
        local.num_decode_tokens, local.decode_block_tables, local.decode_context_lens = len(lens), tables, lens
    place = {t: i for i, t in enumerate(mine)}
    local.prefills = [dataclasses.replace(seg, start=place[seg.start], block_ids=seg.block_ids // size)
                      for seg in meta.prefills if seg.start in place]
    return local


class BatchShardedAttention(nn.Module):
    """A layer's attention with its KV sharded by sequence: q [T, H/R, D] and k/v [T, KVH/R
    (or 1, replicated), D] for the step's rows in, head-sharded output [T, H/R, D] out."""

    def __init__(self, attention: PagedAttention, state: ParallelState, kv_heads: list[tuple[int, int]]) -> None:
        super().__init__()
        self.layer_idx, self.scale, self.backend = attention.layer_idx, attention.scale, attention.backend
        self.state = state
        # For each of the model's KV heads, the rank computing it and its index there (a replicated
        # head is taken from the first rank that has it). kv_heads: each rank's (first, count).
        self.kv_sources = [next((j, c - first) for j, (first, count) in enumerate(kv_heads)
                                if first <= c < first + count)
                           for c in range(max(first + count for first, count in kv_heads))]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        exchange, state = meta.row_exchange, self.state
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        packed = torch.cat([q, k, v], dim=1)[exchange.send_index]  # [R, rows, h + 2 kvh, D]
        got = comm.all_to_all(packed, state.group, state.shm_group)
        rows = got.shape[1]
        q_mine = got[:, :, :heads].transpose(0, 1).reshape(rows, -1, head_dim)
        k_mine = torch.stack([got[j, :, heads + i] for j, i in self.kv_sources], dim=1)
        v_mine = torch.stack([got[j, :, heads + kv_heads + i] for j, i in self.kv_sources], dim=1)
        out = paged_attention(q_mine, k_mine, v_mine, cache, self.layer_idx, meta, self.scale, self.backend)[0]
        out = out.view(rows, state.world_size, heads, head_dim).transpose(0, 1).contiguous()
        back = comm.all_to_all(out, state.group, state.shm_group)
        return back.view(-1, heads, head_dim)[exchange.back_index]


def batch_attention_bytes(rows_per_rank: int, q_heads: int, kv_heads: int, head_dim: int, itemsize: int,
                          world: int) -> int:
    """Bytes each rank puts into one layer's two all-to-alls: its q, k, v heads for every rank's
    padded rows, then its own rows' outputs for every rank's heads."""
    return world * rows_per_rank * (2 * q_heads + 2 * kv_heads) * head_dim * itemsize
