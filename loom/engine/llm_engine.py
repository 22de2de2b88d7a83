"""The engine loop: requests in, one step at a time (schedule -> execute -> postprocess), outputs
out.

`step()` is synchronous and returns what changed, so both the offline `LLM` and an async
server can drive it. `add_request` and `abort_request` may be called from any thread, also
while a step runs: they only queue, and the next step takes the queue in.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

from loom.config import EngineConfig
from loom.engine.input_processor import InputProcessor, Prompt
from loom.engine.model_runner import ModelRunner
from loom.engine.scheduler import ScheduledBatch, Scheduler
from loom.engine.sequence import Request
from loom.engine.stop_checker import StopChecker
from loom.kv.block_manager import BlockManager
from loom.outputs import EngineStats, FinishedRequestStats, IterationStats, RequestOutput
from loom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.processor = InputProcessor(config)
        self.tokenizer = self.processor.tokenizer
        stop_checker = StopChecker(self.processor.eos_token_ids, config.max_model_len)
        self.runner = ModelRunner(config, stop_checker)
        block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                     config.cache.enable_prefix_caching, self.runner.num_swap_blocks,
                                     num_shards=self.runner.kv_shards, placement=self.runner.kv_placement)
        m = config.model_config
        multi_step_rows = self.runner.decode_step.max_batch if self.runner.decode_step is not None else 0
        if config.scheduler.num_scheduler_steps > 1 and not multi_step_rows:
            logger.warning("num_scheduler_steps=%d: decode steps run one at a time (several at once need the "
                           "C++ decode step)", config.scheduler.num_scheduler_steps)
        self.scheduler = Scheduler(config.scheduler, block_manager, stop_checker, (m.num_layers, m.num_kv_heads),
                                   multi_step_rows)
        self._request_counter = itertools.count()
        self._lock = threading.Lock()  # guards the three below
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._added: list[Request] = []          # since the last step
        self._aborted: list[str] = []            # since the last step
        self.last_iteration = IterationStats()   # what the last step did (the step's thread writes it)

    # ---- requests (any thread) ------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Validates and queues a request; a bad one raises ValueError and changes nothing."""
        request_id = request_id if request_id is not None else f"{next(self._request_counter)}"
        return self._add(self.processor.request(request_id, prompt, params))

    def add_beam_request(self, prompt: Prompt, beam_width: int, max_tokens: int, length_penalty: float = 1.0,
                         ignore_eos: bool = False, request_id: str | None = None) -> str:
        """Queues a beam search; its output lists the best `beam_width` hypotheses, best first."""
        request_id = request_id if request_id is not None else f"{next(self._request_counter)}"
        return self._add(self.processor.beam_request(request_id, prompt, beam_width, max_tokens, length_penalty,
                                                     ignore_eos))

    def _add(self, request: Request) -> str:
        with self._lock:
            if request.request_id in self._requests:
                raise ValueError(f"request_id: {request.request_id!r} is already in use")
            self._requests[request.request_id] = request
            self._added.append(request)
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        """Stops the request at the next step, which frees its blocks and reports it finished
        with finish_reason "abort". Unknown or finished ids are ignored."""
        with self._lock:
            self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests or self._aborted)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for every request with news (by its output kind)."""
        changed = self._take_queued()
        batch = self.scheduler.schedule()
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        if batch.seqs:
            try:
                results = self.runner.execute(batch)
                changed += self.scheduler.postprocess(batch, results)
            except Exception:
                if self.runner.parallel.world_size > 1:
                    raise  # a LockStepError: no later step can run on every rank
                changed += self._fail(batch)
        outputs = self._outputs(changed)
        self.last_iteration = _iteration_stats(changed, time.monotonic())
        if not batch.seqs and (self.scheduler.has_unfinished() or self._lost_requests()):
            raise RuntimeError("scheduler made no progress with requests pending")  # a bookkeeping bug
        return outputs

    def _fail(self, batch: ScheduledBatch) -> list[Request]:
        """A step raised (a kernel fault, a bug): its requests end with finish_reason "error"
        and free their blocks; the others, and later steps, go on. (On several ranks a failed
        step is fatal instead: `step` raises.)"""
        logger.exception("engine step failed; its requests end with finish_reason 'error'")
        failed = list({id(seq.request): seq.request for seq in batch.seqs}.values())
        for request in failed:
            self.scheduler.abort(request, reason="error")
        return failed

    def _lost_requests(self) -> bool:
        """Whether a request the scheduler was given is unfinished yet no longer scheduled."""
        with self._lock:
            return len(self._requests) > len(self._added)

    def _take_queued(self) -> list[Request]:
        """Hands the added requests to the scheduler and aborts the aborted ones (returned)."""
        with self._lock:
            added, self._added = self._added, []
            aborted_ids, self._aborted = self._aborted, []
            aborted = [self._requests[i] for i in dict.fromkeys(aborted_ids) if i in self._requests]
        for request in added:
            self.scheduler.add(request)
        for request in aborted:
            self.scheduler.abort(request)
        return aborted

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = [out for r in requests if (out := r.output()) is not None]
        finished = [out.request_id for out in outputs if out.finished]  # a finished request always reports
        if finished:
            with self._lock:
                for request_id in finished:
                    self._requests.pop(request_id, None)
        return outputs

    def stats(self, kv_slots: bool = True) -> EngineStats:
        stats, collectives = self.scheduler.stats(kv_slots), self.runner.collectives
        stats.collective_calls, stats.collective_bytes = dict(collectives.calls), dict(collectives.bytes)
        return stats


def _iteration_stats(requests: list[Request], now: float) -> IterationStats:
    """Tokens and latencies of the requests a step changed; updates their metrics."""
    stats = IterationStats()
    for request in requests:
        m = request.metrics
        generated = sum(len(seq.output_token_ids) for seq in request.seqs)
        if generated > m.num_generation_tokens:
            if m.first_token_time is None:
                m.first_token_time = now
                stats.time_to_first_token.append(now - m.arrival_time)
                stats.num_prompt_tokens += len(request.prompt_token_ids)
            else:
                stats.inter_token_latency.append(now - m.last_token_time)
            stats.num_generation_tokens += generated - m.num_generation_tokens
            m.last_token_time, m.num_generation_tokens = now, generated
        if request.finished:
            reason = next((s.finish_reason for s in request.seqs if s.finish_reason), "abort")
            scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else now
            stats.finished.append(FinishedRequestStats(reason, now - m.arrival_time, scheduled - m.arrival_time,
                                                       len(request.prompt_token_ids), m.num_generation_tokens))
    return stats
