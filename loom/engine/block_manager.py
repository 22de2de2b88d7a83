"""Block manager: the paged KV pool's bookkeeping (PagedAttention).

Every sequence owns a block table (logical block i -> physical block id). Physical blocks carry
reference counts so sequences can share them: fork shares a parent's whole table, the prefix
cache shares full blocks whose tokens (and everything before them) are identical. A write into
a shared, partially filled block first copies it (copy-on-write); the copy itself is done by
the model runner from `pending_copies`.

Prefix caching: a full block is identified by a hash chained over its parent's hash and its
own tokens, so equal hashes mean equal prefixes. Freed blocks that hold a hash stay reusable,
in LRU order, until a new allocation needs the space.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from loom.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is registered in the prefix cache


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool has no blocks (num_blocks={num_blocks}); raise kv_cache_memory")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))        # unreferenced, no hash
        self.evictable: OrderedDict[int, None] = OrderedDict()       # unreferenced, hashed; LRU first
        self.cached: dict[bytes, int] = {}                           # hash -> block id
        self.pending_copies: list[tuple[int, int]] = []              # (src, dst) copy-on-write
        self.free_swap_ids: deque[int] = deque(range(num_swap_blocks))  # slots of the second tier
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-used ones plus cached ones it may evict."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        extra = max(0, total - len(seq.block_table))
        return extra + int(self._needs_copy_on_write(seq, num_new_tokens))

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        partial = seq.num_computed_tokens % self.block_size
        return (num_new_tokens > 0 and partial > 0
                and self.blocks[seq.block_table[seq.num_computed_tokens // self.block_size]].ref_count > 1)

    # ---- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks equal to the sequence's leading full blocks. At least one token is
        always left to compute, since the step must produce the logits of the last one."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need the logits of every prompt token: compute them all
        hits: list[int] = []
        parent = None
        tokens = seq.token_ids()
        for i in range((len(tokens) - 1) // self.block_size):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enters the sequence's newly filled blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        tokens = seq.token_ids()
        for i in range(len(seq.block_hashes), full):  # a block's hash never changes: compute once
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size]))
        for i in range(seq.num_registered_blocks, full):
            block, h = self.blocks[seq.block_table[i]], seq.block_hashes[i]
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block.block_id
        seq.num_registered_blocks = full

    # ---- allocation -----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        """Makes room for `num_new_tokens` more tokens of `seq` (taking `prefix_hits` first, at
        admission). Returns False, changing nothing, if the pool cannot hold them."""
        hits = prefix_hits or []
        hit_evictable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if hits:
            # hypothetical state after taking the hits, to count what else is needed
            needed = -(-(len(hits) * self.block_size + num_new_tokens) // self.block_size) - len(hits)
        else:
            needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks - hit_evictable:
            return False
        for block_id in hits:
            self._take(block_id)
        if hits:
            seq.block_table = list(hits)
            seq.num_registered_blocks = len(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
        if self._needs_copy_on_write(seq, num_new_tokens):
            i = seq.num_computed_tokens // self.block_size
            shared = self.blocks[seq.block_table[i]]
            fresh = self._take_free()
            self.pending_copies.append((shared.block_id, fresh))
            shared.ref_count -= 1
            seq.block_table[i] = fresh
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (written later only through CoW)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        # Tail first: the end of a prefix is the least likely part to be shared again, so it
        # should be evicted before the head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)
        if self.pending_copies:  # a copy into a block this sequence no longer holds is moot
            held = set(seq.block_table)
            self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in held]
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # ---- swapping to the second tier ------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_swap_ids)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Moves the sequence's blocks to swap slots (its computed tokens stay valid); returns
        the (pool block, swap slot) copies to make before the pool blocks are reused."""
        # A block still waiting for its copy-on-write copy holds nothing yet: save the source.
        pending = {dst: src for src, dst in self.pending_copies}
        pairs = [(pending.get(b, b), self.free_swap_ids.popleft()) for b in seq.block_table]
        computed = seq.num_computed_tokens
        self.free(seq)
        seq.num_computed_tokens = computed
        seq.swap_table = [slot for _, slot in pairs]
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(total, len(seq.swap_table)) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Brings the blocks back into fresh pool blocks; returns the (swap slot, pool block)
        copies to make before the step runs."""
        pairs = [(slot, self._take_free()) for slot in seq.swap_table]
        self.free_swap_ids.extend(seq.swap_table)
        seq.swap_table = []
        seq.block_table = [block for _, block in pairs]
        return pairs

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:  # evict the least recently freed cached block
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_hit_tokens
