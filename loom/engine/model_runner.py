"""Model runner: builds the model and its KV cache, turns a scheduled batch into tensors,
runs the model, samples.

For each scheduled sequence it packs the tokens it computes this step (ids, positions, the
slot each token's K/V goes to, from the sequence's slot map) and describes its attention:
decode rows by padded block tables and stored-token counts, prefill chunks as segments. Rows
whose sequence reaches its last token this step are sampled; a request asking for prompt
logprobs also gets the logits of its prompt rows.
"""
from __future__ import annotations

import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from loom.config import EngineConfig
from loom.engine.decode_graphs import DecodeGraphs
from loom.engine.decode_step import DecodeStep
from loom.engine.sequence import Sequence
from loom.engine.stop_checker import StopChecker
from loom.kv.attention import AttentionMetadata, DecodeScores, PrefillSegment, PromptScores
from loom.kv.cache import KVCache, kv_cache_blocks
from loom.kv.policy import DECODE_SCORED_POLICIES
from loom.kv.scores import HeadScores, row_key
from loom.kv.swap import SwapSpace
from loom.layers.dispatch import OWN_KERNELS, plan_switches, planned_kernels
from loom.layers.sampler import SampleResult, Sampler, SampleRow, SeqStepOutput, top_logprobs
from loom.models.loader import build_model
from loom.outputs import Logprob
from loom.parallel.batch_attention import rows_by_rank, shard_batch_metadata
from loom.parallel.helix import HOP_B_MIN_SPLIT, helix_items, shard_block_pairs, shard_metadata
from loom.parallel.state import ParallelState, init_parallel
from loom.parallel.step import CollectiveStats, LockStepError, broadcast_step
from loom.parallel.tensor_parallel import local_kv_heads, model_collectives

if TYPE_CHECKING:
    from loom.engine.scheduler import ScheduledBatch


# Decode batch sizes compiled at load: 1 has a graph of its own, 2 makes the one for all larger.
DECODE_GRAPH_BATCHES = (1, 2)


_TYPECODES = {torch.long: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` (int64 or int32) on `device`. Built over an array's
    buffer: a third of what `torch.tensor` costs on a list (1.0 against 3.2 us warm), and a
    step builds five."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    t = torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)
    return t if device.type == "cpu" else t.to(device)


@dataclass
class StepInputs:
    """Everything a rank needs to run one step, built by rank 0 from the scheduled batch: the
    cache's block operations, the packed tokens and their attention, and which rows get logits
    (each sampled row, then each prompt-logprob chunk as (first row, rows))."""
    moves: list[tuple[int, int]]
    head_moves: torch.Tensor | None
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    prompt_logit_rows: list[tuple[int, int]]
    num_steps: int = 1  # decode steps at once: the slot map holds every step's slots


class ModelRunner:
    def __init__(self, config: EngineConfig, stop_checker: StopChecker) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.parallel: ParallelState = init_parallel(config.parallel, self.device)  # before any weight loads
        self._out_of_step = False  # a step failed here after the other ranks had begun it
        self.collectives = CollectiveStats()  # what rank 0's steps communicated (several ranks)
        self.dtype = config.dtype
        self.model = build_model(config, self.parallel)
        m, (shards, self.kv_placement) = config.model_config, self.parallel.kv_shards
        num_kv_heads = m.num_kv_heads if self.parallel.batch_sharded else \
            local_kv_heads(m.num_heads, m.num_kv_heads, self.parallel.tpa_size, self.parallel.tpa_rank)[1]
        blocks_shards = shards if self.kv_placement == "block" else 1  # how many ranks hold one sequence
        num_blocks, num_swap_blocks = self._agreed(*kv_cache_blocks(config, num_kv_heads, blocks_shards))
        self.kv_shards = shards
        self.num_blocks = num_blocks * shards  # the scheduler's pool: every rank's blocks
        # With the pool split over ranks, one spare block more takes the writes of tokens other ranks hold.
        self.cache = KVCache(m.num_layers, num_blocks + (shards > 1), num_kv_heads, m.head_dim,
                             config.cache.block_size, config.dtype, self.device,
                             kernels=config.attention_backend == "cpp", kv_cache_dtype=config.cache.kv_cache_dtype)
        self.swap_space = SwapSpace(self.cache, num_swap_blocks) if num_swap_blocks else None
        self.sampler = Sampler(config.seed, self.device)
        # One instance entered at every step: as a decorator it would build a new one at every call
        # (three Python calls more, in the step's Python that runs cold after the weights' stream).
        self._inference_mode = torch.inference_mode()
        self.seed = config.seed
        self.kv_heads = (m.num_layers, m.num_kv_heads)
        self.stop_checker = stop_checker
        # Decode-only steps run through compiled graphs (loom/engine/decode_graphs.py). Rounding as
        # eager does keeps bf16 outputs identical; the guards already check every input's shape, so
        # the graph skips re-checking each intermediate's; a C++ wrapper calls the kernels (about
        # 7% of an int8 batch-1 step saved against inductor's Python wrapper). Compiling needs
        # every op of a decode step to be traceable: the C++ attention is, the reference attention
        # (a Python loop over sequences) is not. Where a decode step's linear layers may run
        # torch's GEMMs (their dispatch plans), inductor's pattern passes would fold a residual add
        # into the GEMM before its output is rounded (addmm): they stay off, so bf16 steps round as
        # eager's. The C++ wrapper cannot call the process group's functional all-to-all ("arg
        # type Any"), so collectives through gloo or NCCL keep the Python wrapper.
        self.decode_graphs = None
        if not config.enforce_eager and config.attention_backend == "cpp":
            cpp_wrapper = self.parallel.world_size == 1 or self.parallel.shm_group is not None
            self.max_decode_batch = config.scheduler.max_num_seqs
            torch_gemms = planned_kernels(self.model, self.max_decode_batch) - OWN_KERNELS
            options = {"emulate_precision_casts": True, "size_asserts": False, "cpp_wrapper": cpp_wrapper,
                       "pattern_matcher": not torch_gemms}
            # Parallel options take effect from two ranks on: one process builds the same model
            # whatever they say, so it keeps one set of graphs for all of them.
            layout = repr((config.parallel, self.parallel.rank)) if self.parallel.world_size > 1 else "one process"
            self.decode_graphs = DecodeGraphs(self.model, self.cache, options, layout)
        # Decode steps it serves run as one C++ call instead (loom/engine/decode_step.py).
        self.decode_step = None
        if self.decode_graphs is not None and self.parallel.world_size == 1:
            self.decode_step = DecodeStep.build(self.model, self.cache, config.scheduler.max_num_seqs)
        if self.decode_graphs is not None:
            self._prepare_decode_graphs(scored=config.cache.kv_policy in DECODE_SCORED_POLICIES)

    def _agreed(self, *counts: int) -> tuple[int, ...]:
        """The smallest of each count over the ranks (each rank sizes its pool from its own
        memory; one scheduler hands out blocks for all of them)."""
        if self.parallel.world_size == 1:
            return counts
        t = torch.tensor(counts)
        torch.distributed.all_reduce(t, torch.distributed.ReduceOp.MIN)
        return tuple(t.tolist())

    @torch.inference_mode()
    def _prepare_decode_graphs(self, scored: bool) -> None:
        """Loads or compiles the decode graphs now, at load, so that no request waits for the
        compiler: one for a step of batch 1 and one for batch 2 (which serves every larger batch,
        up to the next batch at which a linear layer switches kernel or, with HOP-B, from which it
        splits the decodes: each takes one more). A graph whose batches the C++ step all serves
        is not needed. Steps whose attention scores keys for a KV policy have graphs of their own,
        which the C++ step never serves: prepared too where the engine's default policy scores
        decode steps (`scored`), else compiled at such a step's first use."""
        switches = plan_switches(self.model, self.max_decode_batch)
        if self.parallel.hop_b:
            switches.add(HOP_B_MIN_SPLIT)
        # No step has more rows than max_decode_batch.
        batches = sorted(b for b in set(DECODE_GRAPH_BATCHES) | switches if b <= self.max_decode_batch)
        served = self.decode_step.max_batch if self.decode_step is not None else 0
        lasts = [end - 1 for end in batches[1:]] + [self.max_decode_batch]  # the largest batch each graph serves
        steps = [(batch, False) for batch, last in zip(batches, lasts) if last > served]
        steps += [(batch, True) for batch in batches] if scored else []
        for batch, scores in tqdm(steps, desc="Decode graphs", unit="graph", disable=not self.parallel.is_driver):
            ids, positions, slots = (torch.zeros(batch, dtype=torch.long, device=self.device) for _ in range(3))
            meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch,
                                     decode_block_tables=torch.zeros(batch, 1, dtype=torch.int32, device=self.device),
                                     decode_context_lens=torch.ones(batch, dtype=torch.int32, device=self.device))
            if scores:  # rows of temperature 0: traced as a scored step, none of them scoring
                meta.decode_scores = DecodeScores(
                    temps=torch.zeros(batch, device=self.device),
                    row_keys=torch.full((batch,), -1, dtype=torch.long, device=self.device),
                    rows=torch.zeros(batch, 5, dtype=torch.long, device=self.device),
                    newest=torch.full((batch,), -1, dtype=torch.long, device=self.device), states=[None] * batch)
            self.decode_graphs.prepare(ids, positions, self._local(meta, [], decode_only=True)[0])

    def _local(self, meta: AttentionMetadata, copies: list[tuple[int, int]],
               decode_only: bool) -> tuple[AttentionMetadata, list[tuple[int, int]]]:
        """A step's metadata and block copies as this rank sees them: with the pool split over
        ranks, its own blocks and rows only (moves and swaps are refused then)."""
        if self.kv_shards == 1:
            return meta, copies
        rank, spare, bs = self.parallel.rank % self.kv_shards, self.cache.num_blocks - 1, self.cache.block_size
        copies = shard_block_pairs(copies, rank, self.kv_shards)
        if self.kv_placement == "block":
            return shard_metadata(meta, rank, self.kv_shards, bs, spare), copies
        return shard_batch_metadata(meta, rank, self.kv_shards, bs, spare, decode_only), copies

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 decode_only: bool) -> torch.Tensor:
        if self.decode_graphs is not None and decode_only:
            return self.decode_graphs(ids, positions, meta)
        return self.model(ids, positions, self.cache, meta)

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_space.num_blocks if self.swap_space is not None else 0

    def _sample_row(self, seq: Sequence) -> SampleRow:
        proposals = 2 * seq.request.beam.width if seq.is_beam else 0
        return SampleRow(seq.params, seq.generators, seq.prompt_token_ids, seq.output_token_ids,
                         self.stop_checker.banned_token_ids(seq), proposals)

    def _score_rows(self, seq: Sequence, start: int, n: int) -> tuple[list[float], list[int]] | None:
        """Temperatures and noise keys of a scored KV policy's rows at positions start ..
        start + n - 1; None when none of them scores."""
        policy = seq.request.kv_policy
        if policy is None or not policy.scored:
            return None
        temps = [policy.score_temperature(p, seq.num_prompt_tokens) for p in range(start, start + n)]
        if not any(temps):
            return None
        seed = self.seed if seq.params.seed is None else seq.params.seed
        keys = [row_key(seed, seq.index, p) if policy.noisy else -1 for p in range(start, start + n)]
        return temps, keys

    def _decode_scores(self, decodes: list[Sequence]) -> DecodeScores | None:
        """The decode rows' score inputs; None when no row scores."""
        rows = [(b, self._score_rows(s, s.num_computed_tokens, 1)) for b, s in enumerate(decodes)]
        rows = [(b, r) for b, r in rows if r is not None]
        if not rows:
            return None
        n = len(decodes)
        temps, keys, newest, addresses = [0.0] * n, [-1] * n, [-1] * n, [[0] * 5] * n
        states: list[HeadScores | None] = [None] * n
        for b, (row_temps, row_keys) in rows:
            state = states[b] = decodes[b].kv_scores
            temps[b], keys[b], addresses[b] = row_temps[0], row_keys[0], state.address()
            if state.lowest_newest is not None:  # a drop of one token per head follows this step
                newest[b] = state.lowest_newest
        return DecodeScores(temps=torch.tensor(temps, device=self.device),
                            row_keys=torch.tensor(keys, device=self.device),
                            rows=torch.tensor(addresses, device=self.device),
                            newest=torch.tensor(newest, device=self.device), states=states)

    def execute(self, batch: ScheduledBatch) -> list[SeqStepOutput]:
        """Runs one step (on rank 0, the driver): a result per scheduled sequence."""
        with self._inference_mode:
            return self._execute(batch)

    def _execute(self, batch: ScheduledBatch) -> list[SeqStepOutput]:
        inputs, sampled_seqs, prompt_seqs = self._prepare(batch)
        try:
            if self.parallel.world_size > 1:
                self._count_collectives(inputs, broadcast_step(inputs, self.parallel)[1])
            logits, argmax = self._run(inputs)
        except Exception as error:
            if self.parallel.world_size == 1:
                raise
            self._out_of_step = True  # the other ranks may wait in any collective of this step
            raise LockStepError(self.parallel, error) from error
        outputs = [SeqStepOutput() for _ in batch.seqs]
        if inputs.num_steps > 1:  # every row takes its argmax: a step's rows after another
            n = len(batch.seqs)
            for i, output in enumerate(outputs):
                samples = [SampleResult(token_ids=[t]) for t in argmax[i::n]]
                output.sample, output.later_samples = samples[0], samples[1:]
            return outputs
        if sampled_seqs:
            rows = [self._sample_row(batch.seqs[i]) for i in sampled_seqs]
            for i, result in zip(sampled_seqs, self.sampler(logits[0], rows, argmax)):
                outputs[i].sample = result
        for i, chunk_logits in zip(prompt_seqs, logits[1 if sampled_seqs else 0:]):
            outputs[i].prompt_logprobs = self._prompt_logprobs(batch.seqs[i], chunk_logits)
        return outputs

    def follow(self) -> None:
        """On a rank other than 0: runs every step rank 0 sends, until it sends the end (then
        leaves the process group). A rank gone (its connections closed) fails the collective
        waiting for it, and so this rank."""
        try:
            # Received under inference mode too: tensors unpickled outside it would not match the
            # compiled graphs' guards (one recompile per graph, seconds each, mid-run).
            with torch.inference_mode():
                while (inputs := broadcast_step(None, self.parallel)[0]) is not None:
                    self._run(inputs)
        except Exception as error:
            raise LockStepError(self.parallel, error) from error
        self.shutdown()

    def shutdown(self) -> None:
        """Ends a run over several ranks: rank 0 ends the other ranks' `follow`, then each rank
        leaves the process group (left to the interpreter's exit, gloo's worker threads can abort
        the process: SIGABRT, "terminate called without an active exception"). After a failed
        step the other ranks are not waiting for the end: this process's exit closes its
        connections, which fails their collective."""
        if self.parallel.world_size == 1 or self._out_of_step or not torch.distributed.is_initialized():
            return
        if self.parallel.is_driver:
            broadcast_step(None, self.parallel)
        torch.distributed.destroy_process_group()

    def _count_collectives(self, inputs: StepInputs, broadcast_bytes: int) -> None:
        self.collectives.add("broadcast", 2, 8 + broadcast_bytes)  # the size, then the pickled inputs
        logit_rows = ([len(inputs.sample_rows)] if inputs.sample_rows else []) + [n for _, n in inputs.prompt_logit_rows]
        rows_per_rank, items = 0, 1
        if self.parallel.batch_sharded:
            rows_per_rank = max(1, max(map(len, rows_by_rank(inputs.meta, self.kv_shards))))
        if self.parallel.hop_b:
            cfg = self.model.config
            items = len(helix_items(inputs.meta, cfg.num_heads // self.parallel.tpa_size, cfg.head_dim,
                                    self.dtype.itemsize))
        for kind, calls, nbytes in model_collectives(self.model.config, self.dtype, self.parallel,
                                                     inputs.input_ids.numel(), logit_rows, rows_per_rank, items):
            self.collectives.add(kind, calls, nbytes)

    def _run(self, inputs: StepInputs) -> tuple[list[torch.Tensor], list[int] | None]:
        """The step's model work, the same on every rank: the cache's block operations, the
        forward, and the logits of the sampled rows and of each prompt-logprob chunk; where the
        C++ decode step ran it, each sampled row's argmax too (else None)."""
        # Order matters: moves concern blocks their sequences held when the moves were planned
        # (the swap-out copies what they leave); blocks freed by a swap-out may be refilled by a
        # swap-in or a copy.
        self.cache.move(inputs.moves, inputs.head_moves)
        if inputs.swap_out:
            self.swap_space.swap_out(inputs.swap_out)
        if inputs.swap_in:
            self.swap_space.swap_in(inputs.swap_in)
        decode_only = not inputs.meta.prefills
        meta, copies = self._local(inputs.meta, inputs.copies, decode_only)
        self.cache.copy_blocks(copies)
        if decode_only and self.decode_step is not None and self.decode_step.serves(meta):
            logits, argmax = self.decode_step(inputs.input_ids, inputs.positions, meta, inputs.num_steps)
            return [logits], argmax  # a decode-only step samples every row
        if inputs.num_steps > 1:
            raise RuntimeError(f"a batch of {inputs.num_steps} decode steps at once that the C++ decode step "
                               f"does not serve")  # the scheduler asks for them only where it does
        hidden = self._forward(inputs.input_ids, inputs.positions, meta, decode_only)
        logits = []
        if inputs.sample_rows:
            sampled = hidden  # decode-only steps sample every row: no gather
            if len(inputs.sample_rows) < hidden.shape[0]:
                sampled = hidden[torch.tensor(inputs.sample_rows, device=self.device)]
            logits.append(self.model.compute_logits(sampled))
        logits += [self.model.compute_logits(hidden[first:first + n]) for first, n in inputs.prompt_logit_rows]
        return logits, None

    def _prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[int], list[int]]:
        """The step's inputs, and (as batch indices) the sequences sampled and those whose prompt
        logprobs this step computes."""
        input_ids, positions, slots = [], [], []
        sample_rows: list[int] = []
        sampled_seqs: list[int] = []
        prompt_logit_rows: list[tuple[int, int]] = []
        prompt_seqs: list[int] = []
        prefills: list[PrefillSegment] = []
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, stored = seq.num_computed_tokens, seq.kv.num_tokens
            input_ids += seq.token_ids_between(start, start + n)
            positions += range(start, start + n)
            slots += seq.kv.slots(stored, stored + n)
            if i >= batch.num_decodes:
                block_ids = torch.tensor(seq.kv.blocks_for(stored + n), dtype=torch.int32, device=self.device)
                key_positions = None if seq.kv.positions is None else torch.tensor(
                    seq.kv.positions + list(range(start, start + n)), device=self.device)
                score_rows = self._score_rows(seq, start, n)
                prompt_scores = None if score_rows is None else PromptScores(
                    torch.tensor(score_rows[0], device=self.device), torch.tensor(score_rows[1], device=self.device),
                    seq.kv_scores.scores)
                prefills.append(PrefillSegment(start=row, num_tokens=n, context_len=stored + n, block_ids=block_ids,
                                               key_positions=key_positions, scores=prompt_scores))
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                # row p predicts prompt token p + 1: the rows whose next token is in the prompt
                prompt_logit_rows.append((row, min(start + n, seq.num_prompt_tokens - 1) - start))
                prompt_seqs.append(i)
            row += n
            if start + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sampled_seqs.append(i)

        if batch.num_steps > 1:  # single-token rows only: every step's slots, a step's rows after another
            rows = [s.kv.slots(s.kv.num_tokens, s.kv.num_tokens + batch.num_steps) for s in batch.seqs]
            slots = [row[j] for j in range(batch.num_steps) for row in rows]
        meta = AttentionMetadata(slot_mapping=int_tensor(slots, torch.long, self.device),
                                 num_decode_tokens=batch.num_decodes, prefills=prefills)
        if batch.num_decodes:
            decodes = batch.seqs[: batch.num_decodes]
            width = max(len(s.kv.block_ids) for s in decodes)
            padded = [b for s in decodes for b in s.kv.block_ids + [0] * (width - len(s.kv.block_ids))]
            meta.decode_block_tables = int_tensor(padded, torch.int32, self.device).view(len(decodes), width)
            meta.decode_context_lens = int_tensor([s.kv.num_tokens + 1 for s in decodes], torch.int32, self.device)
            meta.decode_scores = self._decode_scores(decodes)
        inputs = StepInputs(batch.moves, batch.head_moves, batch.swap_out, batch.swap_in, batch.copies,
                            int_tensor(input_ids, torch.long, self.device),
                            int_tensor(positions, torch.long, self.device), meta, sample_rows,
                            prompt_logit_rows, batch.num_steps)
        return inputs, sampled_seqs, prompt_seqs

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> list[tuple[int, dict[int, Logprob]]]:
        """Row p of the chunk predicts prompt token p + 1: the logprobs of each prompt token it sees."""
        start = seq.num_computed_tokens
        logprobs = logits.log_softmax(dim=-1)
        return [(p + 1, top_logprobs(logprobs[p - start], seq.prompt_token_ids[p + 1], seq.params.prompt_logprobs))
                for p in range(start, start + logits.shape[0])]
