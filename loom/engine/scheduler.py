"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first, in
arrival order, each asking for all its uncomputed tokens (1 for a decode, the rest of its prompt
for a prefill, cut to the budget when chunked prefill is on); then waiting sequences are
admitted FCFS while budget, `max_num_seqs` and free blocks last. When the pool cannot hold a
running sequence's next tokens, the latest arrival is preempted (its blocks freed, recomputed
later from its tokens) and goes back to the front of the queue, so the oldest requests always
make progress: nothing starves.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from loom.config import SchedulerConfig
from loom.engine.block_manager import BlockManager
from loom.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]            # packed order: single-token rows (decodes) first
    num_new_tokens: list[int]       # tokens each sequence computes this step
    num_decodes: int                # leading sequences with exactly one new token
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (pool block, swap slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (swap slot, pool block)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self.swapped: deque[Sequence] = deque()  # preempted by swap, oldest first
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.last_copies: list[tuple[int, int]] = []  # the last step's copy-on-write pairs

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> list[Sequence]:
        """Removes every sequence of the request, freeing its blocks; returns them."""
        removed = [s for s in self.running if s.request_id == request_id]
        for seq in removed:
            self.running.remove(seq)
            self.block_manager.free(seq)
        queued = [s for s in self.waiting if s.request_id == request_id]
        for seq in queued:
            self.waiting.remove(seq)
        swapped = [s for s in self.swapped if s.request_id == request_id]
        for seq in swapped:
            self.swapped.remove(seq)
            self.block_manager.free_swap_ids.extend(seq.swap_table)
            seq.swap_table = []
        return removed + queued + swapped

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins the batch directly."""
        seq.status = SequenceStatus.RUNNING
        seq.was_admitted = True
        bisect.insort(self.running, seq, key=lambda s: s.order)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        bm = self.block_manager
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        self._swap_out: list[tuple[int, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed_tokens  # 0: a beam waiting for its siblings
            if chunked:
                n = min(n, budget)
            if n == 0 or n > budget:
                i += 1
                continue
            restart = False
            while not bm.allocate_slots(seq, n):
                # The latest arrival goes, with its whole beam group (beams move in lock step).
                victims = self._group(self.running[-1])
                for victim in victims:
                    self._preempt(victim)
                preempted = True
                if any(v is seq or any(v is c for c, _ in chosen) for v in victims):
                    restart = True  # allocations already made stay valid: allocate_slots is idempotent
                    break
            if restart:
                chosen, budget, i = [], self.config.max_num_batched_tokens, 0
                continue
            chosen.append((seq, n))
            budget -= n
            i += 1

        # Swapped sequences come back before new ones are admitted (they arrived earlier).
        swap_in: list[tuple[int, int]] = []
        while self.swapped and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0 or not bm.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            swap_in += bm.swap_in(seq)
            bm.allocate_slots(seq, n)  # cannot fail: can_swap_in counted these blocks
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order)
            chosen.append((seq, n))
            budget -= n

        # No admissions in a step that had to preempt: the pool is full.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hits = bm.match_prefix(seq)
            n = seq.num_tokens - len(hits) * bm.block_size
            if chunked:
                n = min(n, budget)
            elif n > budget:
                break
            if not bm.allocate_slots(seq, n, hits):
                break
            self.waiting.popleft()
            if not seq.was_admitted:  # a preempted sequence re-finding its own blocks is no hit
                seq.was_admitted = True
                bm.record_prefix_query(seq.num_tokens, len(hits) * bm.block_size)
                seq.num_cached_prompt_tokens = len(hits) * bm.block_size
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order)
            chosen.append((seq, n))
            budget -= n

        chosen.sort(key=lambda sn: sn[1] != 1)  # stable: single-token rows first, order kept
        copies, bm.pending_copies = bm.pending_copies, []
        self.last_copies = copies
        return ScheduledBatch(
            seqs=[s for s, _ in chosen],
            num_new_tokens=[n for _, n in chosen],
            num_decodes=sum(1 for _, n in chosen if n == 1),
            copies=copies,
            swap_out=self._swap_out,
            swap_in=swap_in,
        )

    def _group(self, seq: Sequence) -> list[Sequence]:
        """The sequences that must be preempted together with `seq`: its running beam siblings."""
        if not seq.is_beam:
            return [seq]
        return [s for s in self.running if s.request_id == seq.request_id]

    def _preempt(self, seq: Sequence) -> None:
        """Swap: the sequence's blocks move to the second tier and come back intact later.
        Recompute (also when the swap space is full): its KV is dropped; it keeps its tokens,
        re-queues first and is prefilled again."""
        self.running.remove(seq)
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            self._swap_out += self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.order)
            self.num_swap_outs += 1
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
