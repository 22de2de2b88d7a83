"""Block manager unit tests: allocation, ref counts, copy-on-write, fork, prefix reuse, LRU."""
from __future__ import annotations

from loom.engine.block_manager import BlockManager
from loom.engine.sequence import Sequence
from loom.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """What the engine does around a step: allocate, 'compute', register full blocks."""
    assert bm.allocate_slots(s, n)
    s.num_computed_tokens += n
    bm.register_full_blocks(s)


def test_allocation_and_free():
    bm = BlockManager(8, BS)
    s = seq(range(10))
    compute(bm, s, 10)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    assert bm.num_free_blocks == 5
    s.output_token_ids.extend([1, 2])  # tokens 10, 11 fit the third block
    compute(bm, s, 2)
    assert len(s.block_table) == 3
    s.output_token_ids.append(3)
    compute(bm, s, 1)
    assert len(s.block_table) == 4
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_allocation_refused_changes_nothing():
    bm = BlockManager(2, BS)
    s = seq(range(12))
    assert not bm.allocate_slots(s, 12)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_fork_shares_and_copy_on_write_only_partial_block():
    bm = BlockManager(8, BS)
    parent = seq(range(6))
    compute(bm, parent, 6)  # blocks: [full, partial(2 of 4)]
    child = seq(range(6), "child")
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    child.output_token_ids.append(42)
    compute(bm, child, 1)  # writes into the shared partial block -> copied first
    assert bm.pending_copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert child.block_table[1] != parent.block_table[1]
    assert bm.blocks[parent.block_table[1]].ref_count == 1
    assert bm.blocks[parent.block_table[0]].ref_count == 2
    bm.pending_copies.clear()
    parent.output_token_ids.append(7)
    compute(bm, parent, 1)  # parent's partial block is no longer shared: no copy
    assert bm.pending_copies == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_prefix_hash_reuse_across_requests():
    bm = BlockManager(16, BS)
    a = seq(list(range(100, 111)))  # 11 tokens: 2 full blocks + 3
    compute(bm, a, 11)
    assert bm.num_cached_blocks == 2
    b = seq(list(range(100, 108)) + [1, 2, 3, 4, 5])  # same first 2 blocks, then differs
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[hits[0]].ref_count == 2
    # a different first block breaks the chain even if the second block's tokens match
    c = seq([0, 0, 0, 0] + list(range(104, 108)) + [9])
    assert bm.match_prefix(c) == []


def test_prefix_match_leaves_last_token_to_compute():
    bm = BlockManager(16, BS)
    a = seq(range(8))
    compute(bm, a, 8)
    same = seq(range(8))
    assert len(bm.match_prefix(same)) == 1  # not 2: the last token's logits are needed


def test_prefix_caching_off():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq(range(8))
    compute(bm, a, 8)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(seq(range(9))) == []


def test_lru_eviction_of_unreferenced_cached_blocks():
    bm = BlockManager(4, BS)
    a = seq(range(8))
    compute(bm, a, 8)
    b = seq(range(50, 58))
    compute(bm, b, 8)
    b_blocks = list(b.block_table)
    bm.free(a)  # a's blocks become evictable first (least recently used)
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    c = seq(range(90, 98))
    compute(bm, c, 8)  # needs 2 blocks: evicts a's, keeps b's
    assert bm.num_cached_blocks == 4
    assert bm.match_prefix(seq(range(50, 59))) == b_blocks
    assert bm.match_prefix(seq(range(9))) == []
    bm.free(c)
    # a hit on an evictable block takes it back out of the LRU
    d = seq(range(50, 59))
    hits = bm.match_prefix(d)
    assert bm.allocate_slots(d, 1, hits)
    assert all(bm.blocks[h].ref_count == 1 for h in hits) and bm.num_free_blocks == 1
    bm.free(d)
    assert bm.num_free_blocks == 4


def test_hit_blocks_are_not_counted_as_free_space():
    bm = BlockManager(3, BS)
    a = seq(range(8))
    compute(bm, a, 8)
    bm.free(a)  # 2 evictable cached blocks + 1 free
    b = seq(list(range(8)) + list(range(20, 29)))  # hits 2 blocks, needs 3 more for 9 tokens
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert not bm.allocate_slots(b, 9, hits)
    assert bm.num_free_blocks == 3 and all(bm.blocks[h].ref_count == 0 for h in hits)
