"""Block manager: the paged KV pool's bookkeeping (PagedAttention).

Each sequence's tokens live in slots of fixed-size blocks, listed by its `SlotMap`. Physical
blocks carry reference counts so sequences can share them: a fork shares a parent's whole map,
the prefix cache shares full blocks whose tokens (and everything before them) are identical. A
write into a shared, partially filled block first copies it (copy-on-write); the copy itself is
made by the model runner from the pairs `take_copies` hands out.

Prefix caching: a full block is identified by a hash chained over its parent's hash and its
own tokens, so equal hashes mean equal prefixes. Freed blocks that hold a hash stay reusable,
in LRU order, until a new allocation needs the space.

A partitioned run splits the pool over `num_shards` ranks, block b living on rank
b % num_shards. Placement "block" (Helix KV parallelism) sends a sequence's blocks round-robin
over them: its block j comes from shard j % num_shards, so each rank holds every
num_shards-th block of tokens. Placement "sequence" (attention sharded by batch) keeps all of a
sequence's blocks on one shard, the one with the most free blocks when it starts (or the one
its prefix hits live on). Every allocation, copy-on-write copy and prefix hit keeps the rule (a
block's hash fixes its index; a fork shares its parent's shard).

A second tier (swap) holds the blocks of sequences preempted by swapping: their slot maps keep
their tokens while the blocks sit in swap slots.

Any stored token can be dropped (`drop`, for a KV policy): the last stored tokens move into the
holes, so a sequence's stored tokens always fill its first slots and attention reads them as it
reads any other; blocks left empty go back to the pool. `drop_per_head` serves policies whose
drops differ per layer and kv head: it makes the written blocks the map's own and truncates,
and the policy moves tokens within each head's slice of the slots. A map that dropped tokens enters no
block into the prefix cache; its drops write into a block the cache lists only when the pool
has no block left to copy it to (the block then leaves the cache).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is registered in the prefix cache


@dataclass(eq=False)
class SlotMap:
    """Where one sequence's cached tokens are: stored token i sits in slot
    `block_ids[i // block_size] * block_size + i % block_size`.

    `num_tokens` counts the tokens stored (what attention reads), which the scheduler keeps
    apart from how far the sequence has been computed. `positions` is None while stored token i
    is the sequence's token i; once tokens were dropped it lists each stored token's position,
    unless the drops differed per layer and kv head (`heads_differ`: the KV policy's state
    knows the positions). Written only by the BlockManager; everyone else reads."""
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    positions: list[int] | None = None
    heads_differ: bool = False
    block_hashes: list[bytes] = field(default_factory=list)  # chained hash of each full block
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    swap_ids: list[int] = field(default_factory=list)  # second-tier slots while swapped out
    shard: int = 0  # with placement "sequence", where every block of the map lives

    def slots(self, start: int, stop: int) -> list[int]:
        """Slots of stored tokens start .. stop - 1."""
        bs, ids = self.block_size, self.block_ids
        return [ids[i // bs] * bs + i % bs for i in range(start, stop)]

    def blocks_for(self, num_tokens: int) -> list[int]:
        """The blocks holding the first `num_tokens` stored tokens."""
        return self.block_ids[: -(-num_tokens // self.block_size)]


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0, num_shards: int = 1, placement: str = "block") -> None:
        if num_blocks < num_shards:
            raise ValueError(f"the KV pool has no blocks (num_blocks={num_blocks}); raise kv_cache_memory")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_shards, self.by_sequence = num_shards, placement == "sequence"
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Per shard: unreferenced blocks without a hash, and unreferenced hashed ones (LRU first).
        self._free_ids: list[deque[int]] = [deque(range(s, num_blocks, num_shards)) for s in range(num_shards)]
        self._evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_shards)]
        self._cached: dict[bytes, int] = {}                           # hash -> block id
        self._pending_copies: list[tuple[int, int]] = []              # (src, dst) copy-on-write
        self._pending_moves: list[tuple[int, int]] = []               # (src, dst) slots, after drops
        self._free_swap_ids: deque[int] = deque(range(num_swap_blocks))
        self.num_swap_blocks = num_swap_blocks
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def new_slot_map(self) -> SlotMap:
        return SlotMap(self.block_size)

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-used ones plus cached ones it may evict."""
        return sum(self._num_free(s) for s in range(self.num_shards))

    def _num_free(self, shard: int) -> int:
        return len(self._free_ids[shard]) + len(self._evictable[shard])

    def _shard(self, slots: SlotMap, index: int) -> int:
        """The shard the map's block `index` comes from."""
        return slots.shard if self.by_sequence else index % self.num_shards

    def _fits(self, slots: SlotMap, indices: Iterable[int], taken: Iterable[int] = ()) -> bool:
        """Whether fresh blocks for the map's blocks `indices` can be had, once the free blocks
        `taken` (prefix hits about to be taken) are gone."""
        needed = [0] * self.num_shards
        for i in indices:
            needed[self._shard(slots, i)] += 1
        for block_id in taken:
            needed[block_id % self.num_shards] += 1
        return all(n <= self._num_free(s) for s, n in enumerate(needed))

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._free_swap_ids)

    def _blocks_needed(self, slots: SlotMap, num_new_tokens: int) -> list[int]:
        """The sequence-block indices that need a fresh block to take `num_new_tokens` more."""
        total = -(-(slots.num_tokens + num_new_tokens) // self.block_size)
        copy = [slots.num_tokens // self.block_size] if self._needs_copy_on_write(slots, num_new_tokens) else []
        return copy + list(range(len(slots.block_ids), total))

    def _needs_copy_on_write(self, slots: SlotMap, num_new_tokens: int) -> bool:
        partial = slots.num_tokens % self.block_size
        return (num_new_tokens > 0 and partial > 0
                and self.blocks[slots.block_ids[slots.num_tokens // self.block_size]].ref_count > 1)

    # ---- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks equal to the leading full blocks of `token_ids`. At least one token is
        always left to compute, since the step must produce the logits of the last one."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = block_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def commit(self, slots: SlotMap, num_new_tokens: int, first_position: int,
               token_ids: Callable[[], list[int]]) -> None:
        """Records that the tokens at positions first_position .. + num_new_tokens - 1 are
        stored, and enters newly filled blocks into the prefix cache (`token_ids` gives the
        sequence's tokens, asked for only then; a map with dropped tokens enters none)."""
        slots.num_tokens += num_new_tokens
        if slots.positions is not None or slots.heads_differ:
            if slots.positions is not None:
                slots.positions += range(first_position, first_position + num_new_tokens)
            return
        full = slots.num_tokens // self.block_size
        if not self.enable_prefix_caching or full <= slots.num_registered_blocks:
            return
        tokens = token_ids()
        for i in range(len(slots.block_hashes), full):  # a block's hash never changes: compute once
            parent = slots.block_hashes[-1] if slots.block_hashes else None
            slots.block_hashes.append(block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size]))
        for i in range(slots.num_registered_blocks, full):
            block, h = self.blocks[slots.block_ids[i]], slots.block_hashes[i]
            if block.hash is None and h not in self._cached:
                block.hash = h
                self._cached[h] = block.block_id
        slots.num_registered_blocks = full

    # ---- allocation -----------------------------------------------------------------------
    def allocate(self, slots: SlotMap, num_new_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        """Makes room for `num_new_tokens` more tokens (after taking `prefix_hits`, at
        admission, as already stored tokens). Returns False, changing nothing, if the pool
        cannot hold them. Calling it again for the same tokens changes nothing."""
        if (not prefix_hits and slots.num_tokens + num_new_tokens <= len(slots.block_ids) * self.block_size
                and not self._needs_copy_on_write(slots, num_new_tokens)):
            return True  # room in the blocks it holds: most decode steps
        hits = prefix_hits or []
        shard = slots.shard
        if self.by_sequence and not slots.block_ids:  # a new map: its prefix's shard, or the roomiest
            slots.shard = hits[0] % self.num_shards if hits else max(range(self.num_shards), key=self._num_free)
        if hits:  # the state after taking the hits, to count what else is needed
            needed = range(len(hits), -(-(len(hits) * self.block_size + num_new_tokens) // self.block_size))
        else:
            needed = self._blocks_needed(slots, num_new_tokens)
        if not self._fits(slots, needed, taken=[b for b in hits if self.blocks[b].ref_count == 0]):
            slots.shard = shard
            return False
        for block_id in hits:
            self._take(block_id)
        if hits:
            slots.block_ids = list(hits)
            slots.num_registered_blocks = len(hits)
            slots.num_tokens = len(hits) * self.block_size
        if self._needs_copy_on_write(slots, num_new_tokens):
            i = slots.num_tokens // self.block_size
            shared = self.blocks[slots.block_ids[i]]
            fresh = self._take_free(self._shard(slots, i))
            self._pending_copies.append((shared.block_id, fresh))
            shared.ref_count -= 1
            slots.block_ids[i] = fresh
        total = -(-(slots.num_tokens + num_new_tokens) // self.block_size)
        while len(slots.block_ids) < total:
            slots.block_ids.append(self._take_free(self._shard(slots, len(slots.block_ids))))
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) block pairs made since the last call, to copy before
        the next step writes."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_moves(self) -> list[tuple[int, int]]:
        """The (src, dst) slot moves of the drops since the last call, to make before the next
        step (before its swaps and copies: they concern blocks the dropping maps held)."""
        moves, self._pending_moves = self._pending_moves, []
        return moves

    def drop(self, slots: SlotMap, indices: Iterable[int]) -> bool:
        """Drops the stored tokens at `indices`. The last stored tokens that stay move into the
        holes that stay; a block receiving one that others share is copied first (the copy and
        the move become one set of slot moves), and so is one the prefix cache lists while there
        is room, so the cache keeps serving it; emptied blocks are freed. Returns False,
        changing nothing, if a copy of a shared block finds no free block."""
        bs, n = self.block_size, slots.num_tokens
        dropped = set(indices)
        if not dropped:
            return True
        if not all(0 <= i < n for i in dropped):
            raise ValueError(f"drop: indices must be stored tokens in [0, {n}), got {sorted(dropped)[:5]}")
        kept = n - len(dropped)
        holes = sorted(i for i in dropped if i < kept)
        fills = [i for i in range(kept, n) if i not in dropped]  # as many as holes
        source = self._make_writable(slots, {h // bs for h in holes})
        if source is None:
            return False
        old_slots = dict(source)
        for h, f in zip(holes, fills):
            f_slot = slots.block_ids[f // bs] * bs + f % bs
            source[slots.block_ids[h // bs] * bs + h % bs] = old_slots.get(f_slot, f_slot)
        self._pending_moves += [(src, dst) for dst, src in source.items() if src != dst]
        positions = slots.positions if slots.positions is not None else list(range(n))
        for h, f in zip(holes, fills):
            positions[h] = positions[f]
        slots.positions = positions[:kept]
        self._truncate(slots, kept)
        return True

    def drop_per_head(self, slots: SlotMap, written: set[int], kept: int) -> bool:
        """Makes room for a drop that differs per layer and kv head (a scored KV policy): the
        stored indices in `written` will be overwritten in some head, by moves the caller makes
        after this call's (`take_moves`), and the map then keeps its first `kept` tokens. Blocks
        written are copied first as `drop` does; returns False, changing nothing, when a copy
        finds no free block. The map's positions are then per head: the caller keeps them."""
        if not 0 <= kept <= slots.num_tokens or any(not 0 <= i < kept for i in written):
            raise ValueError(f"drop_per_head: written indices must be in [0, kept={kept}), kept in "
                             f"[0, {slots.num_tokens}]")
        source = self._make_writable(slots, {i // self.block_size for i in written})
        if source is None:
            return False
        self._pending_moves += [(src, dst) for dst, src in source.items()]
        slots.positions, slots.heads_differ = None, True
        self._truncate(slots, kept)
        return True

    def _make_writable(self, slots: SlotMap, written: set[int]) -> dict[int, int] | None:
        """Gives the map a block of its own for each of its blocks (indices into its table) about
        to be written: one others share is copied, and so is one the prefix cache lists while
        free blocks remain (without one it is written and leaves the cache). Returns each new
        slot's source slot, or None, changing nothing, when a needed copy finds no free block."""
        bs = self.block_size
        to_copy = [b for b in sorted(written) if self.blocks[slots.block_ids[b]].ref_count > 1]
        if not self._fits(slots, to_copy):
            return None
        for b in sorted(written):
            block = self.blocks[slots.block_ids[b]]
            if b in to_copy or block.hash is None:
                continue
            if self._fits(slots, to_copy + [b]):
                to_copy.append(b)
            else:
                del self._cached[block.hash]
                block.hash = None
        source = {}  # slot -> the slot whose content it takes
        copied = [(b, slots.block_ids[b], self._take_free(self._shard(slots, b))) for b in to_copy]
        for b, old, fresh in copied:
            # Released only now, so no copy of this drop lands in it; the moves read it before any step writes.
            self._release(old)
            slots.block_ids[b] = fresh
            source.update({fresh * bs + i: old * bs + i for i in range(bs)})
        return source

    def _truncate(self, slots: SlotMap, kept: int) -> None:
        """Keeps the map's first `kept` stored tokens, freeing the blocks left empty; a map that
        dropped tokens offers no block to the prefix cache."""
        slots.num_tokens = kept
        for block_id in reversed(slots.block_ids[-(-kept // self.block_size):]):
            self._release(block_id)
        del slots.block_ids[-(-kept // self.block_size):]
        slots.block_hashes, slots.num_registered_blocks = [], 0

    def fork(self, parent: SlotMap) -> SlotMap:
        """A map sharing every block of `parent` (written later only through copy-on-write)."""
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_count += 1
        return SlotMap(self.block_size, list(parent.block_ids), parent.num_tokens,
                       None if parent.positions is None else list(parent.positions), parent.heads_differ,
                       list(parent.block_hashes), parent.num_registered_blocks, shard=parent.shard)

    def free(self, slots: SlotMap, keep_moves: bool = False) -> None:
        """Releases everything the map holds, pool blocks or swap slots; it is empty after. The
        copies and moves still due into its blocks are moot and dropped (they could land in a
        block another map takes before they are made), unless `keep_moves` (a swap-out copies
        the blocks after they are made)."""
        # Tail first: the end of a prefix is the least likely part to be shared again, so it
        # should be evicted before the head.
        for block_id in reversed(slots.block_ids):
            self._release(block_id)
        held = set(slots.block_ids)
        self._pending_copies = [(src, dst) for src, dst in self._pending_copies if dst not in held]
        if not keep_moves:
            self._pending_moves = [(src, dst) for src, dst in self._pending_moves
                                   if dst // self.block_size not in held]
        self._free_swap_ids.extend(slots.swap_ids)
        slots.block_ids, slots.swap_ids, slots.positions, slots.heads_differ = [], [], None, False
        slots.num_tokens = slots.num_registered_blocks = 0

    def usage(self, maps: Iterable[SlotMap]) -> tuple[int, int]:
        """(slots in the blocks these maps hold, of those holding a stored token), shared
        blocks counted once."""
        bs, fill = self.block_size, {}
        for m in maps:
            full = min(len(m.block_ids), m.num_tokens // bs)
            fill.update(dict.fromkeys(m.block_ids[:full], bs))  # full blocks in one call: this runs every step
            for i in range(full, len(m.block_ids)):
                block_id = m.block_ids[i]
                fill[block_id] = max(fill.get(block_id, 0), min(bs, max(0, m.num_tokens - i * bs)))
        return len(fill) * bs, sum(fill.values())

    # ---- swapping to the second tier ------------------------------------------------------
    def can_swap_out(self, slots: SlotMap) -> bool:
        return len(slots.block_ids) <= len(self._free_swap_ids)

    def swap_out(self, slots: SlotMap) -> list[tuple[int, int]]:
        """Moves the map's blocks to swap slots (its stored tokens stay valid); returns the
        (pool block, swap slot) copies to make before the pool blocks are reused."""
        # A block still waiting for its copy-on-write copy holds nothing yet: save the source.
        pending = {dst: src for src, dst in self._pending_copies}
        pairs = [(pending.get(b, b), self._free_swap_ids.popleft()) for b in slots.block_ids]
        stored, positions, heads_differ, hashes = slots.num_tokens, slots.positions, slots.heads_differ, slots.block_hashes
        self.free(slots, keep_moves=True)
        slots.num_tokens, slots.positions, slots.heads_differ, slots.block_hashes = stored, positions, heads_differ, hashes
        slots.swap_ids = [slot for _, slot in pairs]
        return pairs

    def can_swap_in(self, slots: SlotMap, num_new_tokens: int) -> bool:
        total = -(-(slots.num_tokens + num_new_tokens) // self.block_size)
        return self._fits(slots, range(max(total, len(slots.swap_ids))))

    def swap_in(self, slots: SlotMap) -> list[tuple[int, int]]:
        """Brings the blocks back into fresh pool blocks; returns the (swap slot, pool block)
        copies to make before the step runs."""
        pairs = [(slot, self._take_free(self._shard(slots, i))) for i, slot in enumerate(slots.swap_ids)]
        self._free_swap_ids.extend(slots.swap_ids)
        slots.swap_ids = []
        slots.block_ids = [block for _, block in pairs]
        return pairs

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id % self.num_shards][block_id] = None
            else:
                self._free_ids[block_id % self.num_shards].append(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id % self.num_shards][block_id]
        block.ref_count += 1

    def _take_free(self, shard: int) -> int:
        """A free block of `shard`."""
        if self._free_ids[shard]:
            block_id = self._free_ids[shard].popleft()
        else:  # evict the least recently freed cached block
            block_id, _ = self._evictable[shard].popitem(last=False)
            block = self.blocks[block_id]
            del self._cached[block.hash]
            block.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id
