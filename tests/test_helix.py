"""Helix's pieces in one process: the block manager's round-robin placement over KV shards, and
partial attention over each shard's blocks merged by log-sum-exp against plain dense attention
(the multi-process runs are in test_tensor_parallel.py)."""
from __future__ import annotations

import pytest
import torch

from loom.kernels import load_kernels
from loom.kv.attention import AttentionMetadata, PrefillSegment, attend, paged_attention
from loom.kv.block_manager import BlockManager
from loom.kv.cache import KVCache
from loom.parallel.helix import (item_metadata, local_token_counts, merge_partials, overlap_items, shard_block_pairs,
                                 shard_metadata)
from tests.test_attention import dense_attention


@pytest.fixture(autouse=True, scope="module")
def kernels():
    load_kernels()


def test_blocks_go_round_robin_over_the_shards():
    bm = BlockManager(num_blocks=12, block_size=4, num_shards=3)
    seq = bm.new_slot_map()
    assert bm.allocate(seq, 30)  # 8 blocks: 3 + 3 + 2 over the shards
    assert [b % 3 for b in seq.block_ids] == [j % 3 for j in range(8)]
    assert bm.num_free_blocks == 4
    other = bm.new_slot_map()
    assert bm.allocate(other, 4) and other.block_ids[0] % 3 == 0  # shard 0's last block
    # Shard 0 is full, shards 1 and 2 hold a block each: a sequence's first block cannot be had.
    third = bm.new_slot_map()
    assert not bm.allocate(third, 1)
    assert third.block_ids == [] and bm.num_free_blocks == 3


def test_prefix_hits_and_copy_on_write_keep_each_block_on_its_shard():
    bm = BlockManager(num_blocks=16, block_size=4, num_shards=2)
    tokens = list(range(13))
    first = bm.new_slot_map()
    assert bm.allocate(first, 13)
    bm.commit(first, 13, 0, lambda: tokens)
    bm.free(first)  # its 3 full blocks stay cached
    second = bm.new_slot_map()
    hits = bm.match_prefix(tokens)
    assert len(hits) == 3 and bm.allocate(second, 1, hits)
    assert [b % 2 for b in second.block_ids] == [0, 1, 0, 1]
    # A fork writing into the shared partial block gets a copy on the same shard.
    bm.commit(second, 1, 12, lambda: tokens)
    child = bm.fork(second)
    assert bm.allocate(child, 1)
    (src, dst), = bm.take_copies()
    assert src == second.block_ids[3] and dst == child.block_ids[3] and src % 2 == dst % 2 == 1
    assert shard_block_pairs([(src, dst)], 1, 2) == [(src // 2, dst // 2)]
    assert shard_block_pairs([(src, dst)], 0, 2) == []


def test_local_token_counts():
    lens = torch.tensor([1, 5, 16, 17, 40, 70], dtype=torch.int32)
    for size in (2, 3):
        counts = torch.stack([local_token_counts(lens, r, size, 16) for r in range(size)])
        expected = [[sum(1 for t in range(int(n)) if (t // 16) % size == r) for n in lens] for r in range(size)]
        assert counts.tolist() == expected


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_attention_over_shards_merges_to_the_full_one(size, dtype):
    """A packed step (two decodes, one of them shorter than a block, a prefill chunk on top of a
    cached prefix and a short prompt) run on each KV shard's blocks, then merged, equals dense
    attention over all the keys; rows that see no key on a shard contribute nothing there."""
    g = torch.Generator().manual_seed(size)
    heads, kv_heads, head_dim, bs, per_shard = 8, 2, 64, 16, 12
    # Each sequence: (tokens cached before the step, tokens this step computes)
    plan = [(5, 1), (70, 1), (40, 24), (0, 5)]
    free = [list(range(s, size * per_shard, size)) for s in range(size)]
    tables = []
    for cached, new in plan:
        tables.append([free[j % size].pop() for j in range(-(-(cached + new) // bs))])
    ks = [torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype) for c, n in plan]
    vs = [torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype) for c, n in plan]
    slot = [lambda t, table=table: table[t // bs] * bs + t % bs for table in tables]
    caches = [KVCache(1, per_shard + 1, kv_heads, head_dim, bs, dtype, "cpu") for _ in range(size)]
    for rank, cache in enumerate(caches):  # the cached tokens, each written on its shard only
        for i, (cached, _) in enumerate(plan):
            prefix = AttentionMetadata(slot_mapping=torch.tensor([slot[i](t) for t in range(cached)], dtype=torch.long))
            local = shard_metadata(prefix, rank, size, bs, per_shard)
            cache.write(0, ks[i][:cached], vs[i][:cached], local.slot_mapping)

    rows = [(i, t) for i, (cached, new) in enumerate(plan) for t in range(cached, cached + new)]
    q = torch.randn(len(rows), heads, head_dim, generator=g).to(dtype)
    k_new = torch.stack([ks[i][t] for i, t in rows])
    v_new = torch.stack([vs[i][t] for i, t in rows])
    width = max(len(t) for t in tables[:2])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot[i](t) for i, t in rows]), num_decode_tokens=2,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]], dtype=torch.int32),
        decode_context_lens=torch.tensor([c + n for c, n in plan[:2]], dtype=torch.int32),
        prefills=[PrefillSegment(start=2, num_tokens=24, context_len=64,
                                 block_ids=torch.tensor(tables[2], dtype=torch.int32)),
                  PrefillSegment(start=26, num_tokens=5, context_len=5,
                                 block_ids=torch.tensor(tables[3], dtype=torch.int32))])
    parts = [paged_attention(q, k_new, v_new, cache, 0, shard_metadata(meta, rank, size, bs, per_shard),
                             head_dim ** -0.5, "cpp") for rank, cache in enumerate(caches)]
    for row in (0, *range(26, 31)):  # sequences of 6 and 5 tokens: none on shard 1
        assert torch.isinf(parts[1][1][row]).all() and (parts[1][0][row] == 0).all()
    merged = merge_partials(torch.stack([p[0].float() for p in parts]), torch.stack([p[1] for p in parts]))

    expected = torch.cat([dense_attention(q[:1], ks[0], vs[0]), dense_attention(q[1:2], ks[1], vs[1]),
                          dense_attention(q[2:26], ks[2], vs[2], causal_offset=40),
                          dense_attention(q[26:], ks[3], vs[3], causal_offset=0)])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(merged, expected, atol=tol, rtol=tol)

    # HOP-B attends item by item (here each decode alone, the prefill chunk cut to 10 rows): the
    # same partial outputs and log-sum-exps, row for row.
    items = [(0, 1), (1, 1), (2, 10), (12, 10), (22, 4), (26, 5)]
    assert overlap_items(2, [24, 5], 10) == [(0, 2)] + items[2:]
    for rank, cache in enumerate(caches):
        local = shard_metadata(meta, rank, size, bs, per_shard)
        pieces = [attend(q[first:first + rows], cache, 0, item_metadata(local, first, rows), head_dim ** -0.5, "cpp")
                  for first, rows in items]
        torch.testing.assert_close(torch.cat([out for out, _ in pieces]), parts[rank][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.cat([lse for _, lse in pieces]), parts[rank][1], atol=1e-6, rtol=0)


def test_overlap_items():
    """HOP-B's items: fewer than 4 decodes together, or in two halves, then each prefill chunk in
    pieces of at most max_rows rows."""
    assert overlap_items(1, [], 8) == [(0, 1)]
    assert overlap_items(3, [], 8) == [(0, 3)]
    assert overlap_items(7, [], 2) == [(0, 3), (3, 4)]  # the halves are not cut (compiled graphs)
    assert overlap_items(0, [3, 17], 8) == [(0, 3), (3, 8), (11, 8), (19, 1)]
