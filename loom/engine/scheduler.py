"""Iteration-level scheduler: which sequences run this step and how many tokens each, and
what follows from a step's results.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first, in
arrival order, each asking for all its uncomputed tokens (1 for a decode, the rest of its prompt
for a prefill, cut to the budget when chunked prefill is on); then swapped-out sequences come
back, then waiting sequences are admitted FCFS while budget, `max_num_seqs` and free blocks
last. When the pool cannot hold a running sequence's next tokens, the latest arrival is
preempted (swapped out, or its blocks freed to be recomputed later from its tokens) and goes
back to the front of its queue, so the oldest requests always make progress: nothing starves.

With `num_scheduler_steps` > 1, a batch of greedy decode rows (their tokens their logits'
argmax as the model gives them) runs that many steps at once while nothing waits to be admitted:
the pool holds every step's token before it runs, and `postprocess` takes the steps' tokens in
order, a row's ending at its first stop.

The scheduler owns the block manager and every sequence's place in the queues; after the model
ran, `postprocess` records the computed tokens, drops what a request's KV policy no longer
keeps (by the scores the step added to its state), appends the sampled ones, forks n > 1
samples and beams, and finishes and frees what stops.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import torch

from loom.config import SchedulerConfig
from loom.engine.sequence import Request, Sequence, SequenceStatus
from loom.engine.stop_checker import StopChecker
from loom.kv.block_manager import BlockManager
from loom.kv.scores import HeadScores
from loom.layers.sampler import SampleResult, SeqStepOutput
from loom.outputs import EngineStats



@dataclass
class ScheduledBatch:
    seqs: list[Sequence]            # packed order: single-token rows (decodes) first
    num_new_tokens: list[int]       # tokens each sequence computes this step
    num_decodes: int                # leading sequences with exactly one new token
    moves: list[tuple[int, int]] = field(default_factory=list)   # (src, dst) slots, from dropped tokens
    head_moves: torch.Tensor | None = None  # [M, 4] (layer, kv head, src slot, dst slot), from per-head drops
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (pool block, swap slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (swap slot, pool block)
    num_steps: int = 1  # decode steps run at once, each row's token its argmax (slots allocated for all)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, stop_checker: StopChecker,
                 kv_heads: tuple[int, int], multi_step_rows: int = 0) -> None:
        self.config = config
        self.multi_step_rows = multi_step_rows  # the largest batch the runner decodes several steps at once
        self.kv_heads = kv_heads  # (layers, kv heads): the shape of a scored KV policy's state
        # Per-head moves of each sequence's last drop, due before the next step (moot once it is freed).
        self._head_moves: dict[Sequence, torch.Tensor] = {}
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self.swapped: list[Sequence] = []  # preempted by swap, sorted by arrival
        self.num_preemptions = 0
        self.num_swap_outs = 0

    def add(self, request: Request) -> None:
        self.waiting.extend(request.seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Takes every unfinished sequence of the request out of its queue, freeing its KV, and
        finishes them with `reason`."""
        queues = {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
                  SequenceStatus.SWAPPED: self.swapped}
        for seq in request.seqs:
            if seq.status in queues:
                queues[seq.status].remove(seq)
                self._free(seq)
        request.abort(reason)

    # ---- which sequences run ----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        bm = self.block_manager
        chosen: list[tuple[Sequence, int]] = []
        swap_out: list[tuple[int, int]] = []
        preempted = False

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
            while not bm.allocate(seq.kv, n):
                # The latest arrival goes, with its whole beam group (beams move in lock step).
                victims = self._group(self.running[-1])
                for victim in victims:
                    swap_out += self._preempt(victim)
                preempted = True
                if any(v is seq or any(v is c for c, _ in chosen) for v in victims):
                    restart = True  # allocations already made stay valid: allocate is idempotent
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
            if n == 0 or not bm.can_swap_in(seq.kv, n):
                break
            self.swapped.pop(0)
            swap_in += bm.swap_in(seq.kv)
            bm.allocate(seq.kv, n)  # cannot fail: can_swap_in counted these blocks
            self._run(seq)
            chosen.append((seq, n))
            budget -= n

        # No admissions in a step that had to preempt: the pool is full.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # Prompt logprobs need the logits of every prompt token, a scored KV policy every prompt
            # token's stored scores: compute them all.
            policy = seq.request.kv_policy
            computes_all = seq.params.prompt_logprobs is not None or (policy is not None and policy.scored)
            hits = [] if computes_all else bm.match_prefix(seq.token_ids())
            n = seq.num_tokens - len(hits) * bm.block_size
            if chunked:
                n = min(n, budget)
            elif n > budget:
                break
            if not bm.allocate(seq.kv, n, hits):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = seq.kv.num_tokens
            if not seq.was_admitted:  # a preempted sequence re-finding its own blocks is no hit
                seq.was_admitted = True
                bm.record_prefix_query(seq.num_tokens, seq.num_computed_tokens)
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            self._run(seq)
            chosen.append((seq, n))
            budget -= n

        chosen.sort(key=lambda sn: sn[1] != 1)  # stable: single-token rows first, order kept
        for seq, n in chosen:
            self._record_stored(seq, n)
        head_moves = torch.cat(list(self._head_moves.values())) if self._head_moves else None
        self._head_moves = {}
        num_steps = self._num_steps(chosen)  # before the copies are taken: its allocations may add some
        return ScheduledBatch(seqs=[s for s, _ in chosen], num_new_tokens=[n for _, n in chosen],
                              num_decodes=sum(1 for _, n in chosen if n == 1), moves=bm.take_moves(),
                              head_moves=head_moves, copies=bm.take_copies(), swap_out=swap_out, swap_in=swap_in,
                              num_steps=num_steps)

    def _num_steps(self, chosen: list[tuple[Sequence, int]]) -> int:
        """How many decode steps the batch runs at once: up to num_scheduler_steps where every row
        decodes by its logits' argmax (no penalty, masked id, processor, logprobs, beam or KV policy),
        nothing waits to be admitted, and the pool holds every step's token; no more than the
        nearest length limit leaves. A stop token or string found at one of them ends its row
        there: the row's later tokens are dropped."""
        steps = self.config.num_scheduler_steps
        if steps == 1 or self.waiting or self.swapped or not chosen or len(chosen) > self.multi_step_rows:
            return 1
        for seq, n in chosen:
            p = seq.params
            if (n != 1 or not p.takes_argmax or self.stop_checker.banned_token_ids(seq) or seq.is_beam
                    or seq.request.kv_policy is not None):
                return 1
            steps = min(steps, p.max_tokens - len(seq.output_token_ids),
                        self.stop_checker.max_model_len - seq.num_tokens)
        # Blocks taken for a larger count before one fails stay with their sequences, for their next tokens.
        if steps > 1 and all(self.block_manager.allocate(seq.kv, steps) for seq, _ in chosen):
            return steps
        return 1

    def _record_stored(self, seq: Sequence, n: int) -> None:
        """A scored KV policy's state gains the step's n tokens now, so that the step's
        attention adds their scores to it in place; a single-token row whose step ends one token
        over budget also has the kernel find its drop."""
        policy = seq.request.kv_policy
        if policy is None or not policy.scored:
            return
        if seq.kv_scores is None:
            seq.kv_scores = HeadScores(*self.kv_heads)
        state = seq.kv_scores
        state.append(seq.num_computed_tokens, n)
        if n == 1:
            state.lowest_newest = policy.single_drop_newest(state.num_tokens, seq.num_computed_tokens)

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.order)

    def _group(self, seq: Sequence) -> list[Sequence]:
        """The sequences that must be preempted together with `seq`: its running beam siblings."""
        if not seq.is_beam:
            return [seq]
        return [s for s in self.running if s.request is seq.request]

    def _preempt(self, seq: Sequence) -> list[tuple[int, int]]:
        """Swap: the sequence's blocks move to the second tier (the returned copies) and come
        back intact later. Recompute (also when the swap space is full): its KV is dropped; it
        keeps its tokens, re-queues first and is prefilled again."""
        self.running.remove(seq)
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq.kv):
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.order)
            self.num_swap_outs += 1
            return self.block_manager.swap_out(seq.kv)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.kv_scores = None  # its scores are recomputed with its tokens
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        return []

    # ---- what follows from a step -----------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, results: list[SeqStepOutput]) -> list[Request]:
        """Applies a step's results; returns the requests that have something new to report."""
        changed: dict[str, Request] = {}
        beam_requests: dict[str, Request] = {}
        for seq, n, result in zip(batch.seqs, batch.num_new_tokens, results):
            self.block_manager.commit(seq.kv, n, seq.num_computed_tokens, seq.token_ids)
            request = seq.request
            seq.num_computed_tokens += n
            if request.kv_policy is not None:
                self._compress(seq)
            for position, logprobs in result.prompt_logprobs or ():
                request.prompt_logprobs[position] = logprobs
            if result.sample is None:  # mid-prompt
                continue
            if seq.is_beam:  # beams advance together once every live beam has proposed
                seq.proposals = result.sample.proposals
                beam_requests[request.request_id] = request
                continue
            self._append_samples(seq, result.sample)
            for sample in result.later_samples:  # a batch of several steps: theirs, while the row runs
                if seq.is_finished:
                    break
                self.block_manager.commit(seq.kv, 1, seq.num_computed_tokens, seq.token_ids)
                seq.num_computed_tokens += 1
                self._append_samples(seq, sample)
            changed[request.request_id] = request
        for request in beam_requests.values():
            if all(s.proposals is not None for s in request.seqs):
                request.seqs = request.beam.advance(request.seqs, self._fork, self._release)
                if request.finished:
                    changed[request.request_id] = request
        return list(changed.values())

    def _compress(self, seq: Sequence) -> None:
        """Drops what the request's KV policy no longer keeps, once the whole prompt is stored
        (before n > 1 samples fork from it). Without a free block for a copy-on-write the drop
        waits for a later step."""
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            return
        kv, policy = seq.kv, seq.request.kv_policy
        if policy.scored:
            self._compress_per_head(seq)
            return
        drop = policy.tokens_to_drop(kv.positions if kv.positions is not None else range(kv.num_tokens))
        if drop:
            self.block_manager.drop(kv, drop)

    def _compress_per_head(self, seq: Sequence) -> None:
        """A scored policy's drop, different in each layer and kv head: the state records it,
        the block manager frees the blocks, and the moves of each head's kept tokens into its
        holes wait for the next step (read in the slots the tokens were in, written in the
        blocks the map holds now)."""
        state, kv, bs = seq.kv_scores, seq.kv, self.block_manager.block_size
        dropped = seq.request.kv_policy.heads_to_drop(state.positions, state.scores, seq.num_computed_tokens - 1,
                                                      seq.num_prompt_tokens, state.found)
        if dropped is None:
            return
        kept, old_ids = state.num_tokens - dropped.shape[-1], list(kv.block_ids)
        if self.block_manager.drop_per_head(kv, state.written_by(dropped), kept):
            self._head_moves[seq] = state.drop(dropped, old_ids, kv.block_ids, bs)

    def _append_samples(self, seq: Sequence, sample: SampleResult) -> None:
        """The first token continues `seq`; each further one (n > 1, at the end of the
        prompt) continues a fork of it."""
        tokens, logprobs = sample.token_ids, sample.logprobs or [None] * len(sample.token_ids)
        targets = [seq]
        if len(tokens) > 1:
            targets += [self._fork(seq) for _ in tokens[1:]]
            seq.generators = seq.generators[:1]
        for s, token, lp in zip(targets, tokens, logprobs):
            reason = self.stop_checker.finish_reason(s, s.append_token(token, lp))
            if reason is not None:
                s.finish(reason)
                self._release(s)

    def _fork(self, parent: Sequence) -> Sequence:
        child = parent.request.fork(parent, self.block_manager.fork(parent.kv))
        self._run(child)
        return child

    def _release(self, seq: Sequence) -> None:
        """Takes a running sequence out for good, freeing its blocks."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED

    def _free(self, seq: Sequence) -> None:
        """Frees the sequence's KV, with the moves still due into it."""
        self.block_manager.free(seq.kv)
        self._head_moves.pop(seq, None)

    def stats(self, kv_slots: bool = True) -> EngineStats:
        """Without `kv_slots`, the slot counts (a walk over every running sequence's blocks) are
        left at 0 and the rest costs a few attribute reads: what a per-step observer needs."""
        bm = self.block_manager
        allocated, used = bm.usage(s.kv for s in self.running) if kv_slots else (0, 0)
        return EngineStats(
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, num_cached_blocks=bm.num_cached_blocks,
            num_running=len(self.running), num_waiting=len(self.waiting), num_preemptions=self.num_preemptions,
            num_swapped=len(self.swapped), num_swap_outs=self.num_swap_outs,
            num_free_swap_blocks=bm.num_free_swap_blocks,
            prefix_cache_queries=bm.prefix_query_tokens, prefix_cache_hits=bm.prefix_hit_tokens,
            kv_slots_allocated=allocated, kv_slots_used=used)
