"""Block manager unit tests: allocation, ref counts, copy-on-write, fork, prefix reuse, LRU."""
from __future__ import annotations

from dataclasses import dataclass, field

from loom.kv.block_manager import BlockManager, SlotMap

BS = 4


@dataclass
class Seq:
    """A sequence as the block manager sees it: its tokens, how many are computed, its slot map."""
    tokens: list[int]
    kv: SlotMap = field(default_factory=lambda: SlotMap(BS))
    computed: int = 0

    @property
    def block_table(self) -> list[int]:
        return self.kv.block_ids


def seq(tokens) -> Seq:
    return Seq(list(tokens))


def compute(bm: BlockManager, s: Seq, n: int) -> None:
    """What the scheduler does around a step: allocate, (compute,) commit the stored tokens."""
    assert bm.allocate(s.kv, n)
    bm.commit(s.kv, n, s.computed, lambda: s.tokens)
    s.computed += n


def test_allocation_and_free():
    bm = BlockManager(8, BS)
    s = seq(range(10))
    compute(bm, s, 10)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    assert bm.num_free_blocks == 5
    s.tokens.extend([1, 2])  # tokens 10, 11 fit the third block
    compute(bm, s, 2)
    assert len(s.block_table) == 3
    s.tokens.append(3)
    compute(bm, s, 1)
    assert len(s.block_table) == 4
    bm.free(s.kv)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_allocation_refused_changes_nothing():
    bm = BlockManager(2, BS)
    s = seq(range(12))
    assert not bm.allocate(s.kv, 12)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_fork_shares_and_copy_on_write_only_partial_block():
    bm = BlockManager(8, BS)
    parent = seq(range(6))
    compute(bm, parent, 6)  # blocks: [full, partial(2 of 4)]
    child = Seq(list(range(6)), bm.fork(parent.kv), computed=6)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    child.tokens.append(42)
    compute(bm, child, 1)  # writes into the shared partial block -> copied first
    assert bm.take_copies() == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert child.block_table[1] != parent.block_table[1]
    assert bm.blocks[parent.block_table[1]].ref_count == 1
    assert bm.blocks[parent.block_table[0]].ref_count == 2
    parent.tokens.append(7)
    compute(bm, parent, 1)  # parent's partial block is no longer shared: no copy
    assert bm.take_copies() == []
    bm.free(parent.kv)
    bm.free(child.kv)
    assert bm.num_free_blocks == 8


def test_prefix_hash_reuse_across_requests():
    bm = BlockManager(16, BS)
    a = seq(list(range(100, 111)))  # 11 tokens: 2 full blocks + 3
    compute(bm, a, 11)
    assert bm.num_cached_blocks == 2
    b = seq(list(range(100, 108)) + [1, 2, 3, 4, 5])  # same first 2 blocks, then differs
    hits = bm.match_prefix(b.tokens)
    assert hits == a.block_table[:2]
    assert bm.allocate(b.kv, len(b.tokens) - 8, hits)
    assert b.kv.num_tokens == 8
    b.computed = 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[hits[0]].ref_count == 2
    # a different first block breaks the chain even if the second block's tokens match
    c = seq([0, 0, 0, 0] + list(range(104, 108)) + [9])
    assert bm.match_prefix(c.tokens) == []


def test_prefix_match_leaves_last_token_to_compute():
    bm = BlockManager(16, BS)
    a = seq(range(8))
    compute(bm, a, 8)
    same = seq(range(8))
    assert len(bm.match_prefix(same.tokens)) == 1  # not 2: the last token's logits are needed


def test_prefix_caching_off():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq(range(8))
    compute(bm, a, 8)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(list(range(9))) == []


def test_lru_eviction_of_unreferenced_cached_blocks():
    bm = BlockManager(4, BS)
    a = seq(range(8))
    compute(bm, a, 8)
    b = seq(range(50, 58))
    compute(bm, b, 8)
    b_blocks = list(b.block_table)
    bm.free(a.kv)  # a's blocks become evictable first (least recently used)
    bm.free(b.kv)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    c = seq(range(90, 98))
    compute(bm, c, 8)  # needs 2 blocks: evicts a's, keeps b's
    assert bm.num_cached_blocks == 4
    assert bm.match_prefix(list(range(50, 59))) == b_blocks
    assert bm.match_prefix(list(range(9))) == []
    bm.free(c.kv)
    # a hit on an evictable block takes it back out of the LRU
    d = seq(range(50, 59))
    hits = bm.match_prefix(d.tokens)
    assert bm.allocate(d.kv, 1, hits)
    assert all(bm.blocks[h].ref_count == 1 for h in hits) and bm.num_free_blocks == 1
    bm.free(d.kv)
    assert bm.num_free_blocks == 4


def test_hit_blocks_are_not_counted_as_free_space():
    bm = BlockManager(3, BS)
    a = seq(range(8))
    compute(bm, a, 8)
    bm.free(a.kv)  # 2 evictable cached blocks + 1 free
    b = seq(list(range(8)) + list(range(20, 29)))  # hits 2 blocks, needs 3 more for 9 tokens
    hits = bm.match_prefix(b.tokens)
    assert len(hits) == 2
    assert not bm.allocate(b.kv, 9, hits)
    assert bm.num_free_blocks == 3 and all(bm.blocks[h].ref_count == 0 for h in hits)


def test_fork_copies_the_map_not_the_list():
    bm = BlockManager(8, BS)
    parent = seq(range(5))
    compute(bm, parent, 5)
    child = Seq(list(range(5)), bm.fork(parent.kv), computed=5)
    child.tokens += [9, 9, 9, 9]
    compute(bm, child, 4)  # copy-on-write of block 1, then a new block 2
    assert len(parent.block_table) == 2 and len(child.block_table) == 3
    assert parent.kv.num_tokens == 5 and child.kv.num_tokens == 9


def test_stored_tokens_map_to_slots_in_table_order():
    bm = BlockManager(8, BS)
    s = seq(range(6))
    compute(bm, s, 6)
    b0, b1 = s.block_table
    assert s.kv.slots(0, 6) == [b0 * BS, b0 * BS + 1, b0 * BS + 2, b0 * BS + 3, b1 * BS, b1 * BS + 1]
    assert s.kv.blocks_for(4) == [b0] and s.kv.blocks_for(5) == [b0, b1]


def test_swap_out_and_in_keep_the_stored_tokens():
    bm = BlockManager(4, BS, num_swap_blocks=3)
    s = seq(range(6))
    compute(bm, s, 6)
    assert bm.can_swap_out(s.kv)
    out = bm.swap_out(s.kv)
    assert [pool for pool, _ in out] == [0, 1] and bm.num_free_blocks == 4 and bm.num_free_swap_blocks == 1
    assert s.kv.num_tokens == 6 and s.block_table == []
    assert bm.can_swap_in(s.kv, 1)
    back = bm.swap_in(s.kv)
    assert [slot for slot, _ in back] == [slot for _, slot in out] and bm.num_free_swap_blocks == 3
    bm.free(s.kv)
    assert bm.num_free_blocks == 4


def test_free_returns_swap_slots():
    bm = BlockManager(4, BS, num_swap_blocks=3)
    s = seq(range(6))
    compute(bm, s, 6)
    bm.swap_out(s.kv)
    bm.free(s.kv)  # an aborted sequence that was swapped out
    assert bm.num_free_swap_blocks == 3 and s.kv.swap_ids == []


def test_usage_counts_shared_blocks_once():
    bm = BlockManager(8, BS)
    a = seq(range(6))
    compute(bm, a, 6)
    b = Seq(list(range(6)), bm.fork(a.kv))
    assert bm.usage([a.kv, b.kv]) == (2 * BS, 6)
    # A fork that grew past the shared partial block, and one block allocated ahead of its tokens:
    # every block counted once at its fullest.
    b.tokens += [6, 7, 8]
    compute(bm, b, 3)
    c = seq(range(20, 25))
    assert bm.allocate(c.kv, 9)
    bm.commit(c.kv, 5, 0, lambda: c.tokens)
    held = {i: 0 for m in (a.kv, b.kv, c.kv) for i in m.block_ids}
    for m in (a.kv, b.kv, c.kv):
        for i, block_id in enumerate(m.block_ids):
            held[block_id] = max(held[block_id], min(BS, max(0, m.num_tokens - i * BS)))
    assert bm.usage([a.kv, b.kv, c.kv]) == (len(held) * BS, sum(held.values())) == (7 * BS, 6 + 3 + 2 + 5)


def test_drop_fills_holes_from_the_tail_and_frees_blocks():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    s = seq(range(11))  # blocks [0..3] [4..7] [8..10]
    compute(bm, s, 11)
    b0, b1, b2 = s.block_table
    assert bm.drop(s.kv, [1, 5, 6])  # 8 stay: holes 1, 5, 6 take tokens 8, 9, 10
    assert s.kv.num_tokens == 8 and s.block_table == [b0, b1] and bm.num_free_blocks == 6
    assert s.kv.positions == [0, 8, 2, 3, 4, 9, 10, 7]
    assert sorted(bm.take_moves()) == sorted([(b2 * BS, b0 * BS + 1), (b2 * BS + 1, b1 * BS + 1),
                                              (b2 * BS + 2, b1 * BS + 2)])
    s.tokens.append(99)
    compute(bm, s, 1)  # a new token goes to stored index 8, keeping its own position
    assert s.kv.positions[-1] == 11 and s.kv.num_tokens == 9 and len(s.block_table) == 3


def test_drop_never_writes_into_a_cached_block():
    """A block the prefix cache lists keeps its content for later requests: the dropping
    sequence moves to a copy, and the cached prefix still matches in full."""
    bm = BlockManager(8, BS)
    s = seq(range(11))
    compute(bm, s, 11)
    b0, b1, b2 = s.block_table
    assert bm.num_cached_blocks == 2
    assert bm.drop(s.kv, [1, 5, 6])
    c0, c1 = s.block_table
    assert {c0, c1}.isdisjoint({b0, b1, b2})
    moves = dict((dst, src) for src, dst in bm.take_moves())
    assert moves[c0 * BS] == b0 * BS and moves[c0 * BS + 1] == b2 * BS and moves[c1 * BS + 2] == b2 * BS + 2
    assert bm.match_prefix(list(range(9))) == [b0, b1]
    assert bm.num_free_blocks == 6  # the cached blocks are evictable again: reusable space
    s.tokens.append(99)
    compute(bm, s, 1)  # a dropping map enters nothing into the cache
    assert bm.num_cached_blocks == 2

    # With no block to copy to, a cached block is written in place and leaves the cache.
    bm = BlockManager(3, BS)
    s = seq(range(11))
    compute(bm, s, 11)
    b0, b1, _ = s.block_table
    assert bm.num_free_blocks == 0 and bm.drop(s.kv, [1, 5, 6])
    assert s.block_table == [b0, b1] and bm.num_cached_blocks == 0 and bm.match_prefix(list(range(9))) == []


def test_drop_into_a_shared_block_copies_it_first():
    bm = BlockManager(8, BS)
    parent = seq(range(8))
    compute(bm, parent, 8)
    child = Seq(list(range(8)), bm.fork(parent.kv), computed=8)
    p0, p1 = parent.block_table
    assert bm.drop(child.kv, [2])  # token 7 moves into index 2, inside the shared block p0
    fresh = child.block_table[0]
    assert fresh not in (p0, p1) and child.block_table[1] == p1 and parent.block_table == [p0, p1]
    moves = dict((dst, src) for src, dst in bm.take_moves())
    # The fresh block takes p0's slots, except slot 2, which takes token 7 from p1.
    assert moves == {fresh * BS: p0 * BS, fresh * BS + 1: p0 * BS + 1, fresh * BS + 2: p1 * BS + 3,
                     fresh * BS + 3: p0 * BS + 3}
    assert bm.blocks[p0].ref_count == 1 and bm.blocks[p1].ref_count == 2
    assert parent.kv.positions is None and child.kv.positions == [0, 1, 7, 3, 4, 5, 6]


def test_drop_refused_without_room_for_the_copy():
    bm = BlockManager(2, BS)
    parent = seq(range(8))
    compute(bm, parent, 8)
    child = Seq(list(range(8)), bm.fork(parent.kv), computed=8)
    assert not bm.drop(child.kv, [0])
    assert child.kv.num_tokens == 8 and child.kv.positions is None and bm.take_moves() == []


def test_drop_checks_indices():
    import pytest

    bm = BlockManager(4, BS)
    s = seq(range(5))
    compute(bm, s, 5)
    with pytest.raises(ValueError, match="drop"):
        bm.drop(s.kv, [5])
