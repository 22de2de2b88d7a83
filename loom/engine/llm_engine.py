"""The engine loop: add requests, step (schedule -> run -> append tokens -> stop checks), abort.

`step()` is synchronous and returns what changed, so both the offline `LLM` and an async
server can drive it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from loom.config import EngineConfig
from loom.detokenizer import IncrementalDetokenizer, find_stop
from loom.engine.beam_search import BeamState
from loom.engine.block_manager import BlockManager
from loom.engine.model_runner import ModelRunner
from loom.engine.scheduler import Scheduler
from loom.engine.sequence import Request, Sequence, SequenceStatus
from loom.kernels import load_kernels
from loom.kv.attention import ATTENTION_BACKENDS
from loom.kv.cache import KVCache, kv_bytes_per_block
from loom.kv.swap import SwapSpace
from loom.layers.linear import panel_kernels_available, use_panel_linears
from loom.layers.sampler import Sampler
from loom.models.config import ModelConfig
from loom.models.llama import LlamaForCausalLM
from loom.models.loader import load_model
from loom.outputs import CompletionOutput, Logprob, RequestOutput
from loom.quant.model import quantize_model
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer


@dataclass
class EngineStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_swapped: int            # sequences whose blocks are in the second tier now
    num_swap_outs: int          # preemptions that swapped (the rest recomputed)
    prefix_cache_queries: int   # prompt tokens looked up
    prefix_cache_hits: int      # of those, found in the cache
    kv_slots_allocated: int     # token slots in blocks held by running sequences
    kv_slots_used: int          # of those, holding a computed token

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_waste(self) -> float:
        return 1 - self.kv_slots_used / self.kv_slots_allocated if self.kv_slots_allocated else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, attention_backend: str | None = None) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.model = self._load_model(attention_backend)
        self.model_config = self.model.config
        self.cache, self.swap_space, self.block_manager = self._allocate_kv()
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        # Compiling needs every op of a decode step to be traceable: the C++ attention is, the
        # reference attention (a Python loop over sequences) is not.
        compile_decode = not config.enforce_eager and self.attention_backend == "cpp"
        self.runner = ModelRunner(self.model, self.cache, Sampler(config.seed, self.device), self.device,
                                  self.eos_token_ids, self.swap_space, compile_decode)
        self._request_counter = itertools.count()
        self._requests: dict[str, Request] = {}

    def _load_model(self, attention_backend: str | None) -> LlamaForCausalLM:
        backend = attention_backend or ("cpp" if self.device.type == "cpu" else "torch")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: {backend!r}, choose from {ATTENTION_BACKENDS}")
        self.attention_backend = backend
        if backend == "cpp":
            load_kernels()  # build or load now, so a missing compiler fails here and not mid-run
        sched, max_positions = self.config.scheduler, ModelConfig.from_dir(self.config.model).max_position_embeddings
        if sched.max_model_len <= 0:
            sched.max_model_len = max_positions
        elif sched.max_model_len > max_positions:
            raise ValueError(f"max_model_len: {sched.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_positions}")
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < sched.max_model_len:
            raise ValueError(f"max_num_batched_tokens: {sched.max_num_batched_tokens} < max_model_len "
                             f"{sched.max_model_len}; without chunked prefill a whole prompt must fit one step")
        model = load_model(self.config.model, self.config.dtype, self.device, sched.max_model_len)
        model.set_attention_backend(backend)
        if self.config.quantization is not None:
            if model.config.quantization is not None:
                raise ValueError(f"quantization: {self.config.model} is already quantized "
                                 f"({model.config.quantization['method']}); load it without quantization=")
            quantize_model(model, self.config.quantization, self.config.group_size)
        if self.config.pack_linear_weights and panel_kernels_available(self.device):
            use_panel_linears(model)
        return model

    def _allocate_kv(self) -> tuple[KVCache, SwapSpace | None, BlockManager]:
        """Sizes the block pool from the memory budget (and the swap tier, in swap mode)."""
        cfg, sched, m = self.config.cache, self.config.scheduler, self.model_config
        bs = cfg.block_size
        per_block = kv_bytes_per_block(m.num_layers, m.num_kv_heads, m.head_dim, bs, self.config.dtype)
        blocks_per_seq = -(-sched.max_model_len // bs)
        # No point in more blocks than max_num_seqs full-length sequences could ever hold.
        num_blocks = min(cfg.budget_bytes() // per_block, sched.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"kv_cache_memory: {cfg.budget_bytes()} bytes hold {num_blocks} blocks of {bs} tokens, but one "
                f"sequence of max_model_len {sched.max_model_len} needs {blocks_per_seq}; raise kv_cache_memory "
                "or lower max_model_len")
        cache = KVCache(m.num_layers, num_blocks, m.num_kv_heads, m.head_dim, bs, self.config.dtype, self.device)
        num_swap_blocks = cfg.swap_space // per_block if sched.preemption_mode == "swap" else 0
        if sched.preemption_mode == "swap" and num_swap_blocks < 1:
            raise ValueError(f"swap_space: {cfg.swap_space} bytes hold no block of {per_block} bytes")
        swap = SwapSpace(cache, num_swap_blocks) if num_swap_blocks else None
        return cache, swap, BlockManager(num_blocks, bs, cfg.enable_prefix_caching, num_swap_blocks)

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids'")
            return None, list(prompt["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError(f"prompt: {self.config.model} has no tokenizer.json; pass {{'prompt_token_ids': [...]}}")
        if not prompt:
            raise ValueError("prompt: empty prompt")
        return prompt, self.tokenizer.encode(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.scheduler.max_model_len
        if not token_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                             f"max_model_len {max_len}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids: ids {bad_stop} are outside the vocabulary [0, {vocab})")

    def add_request(self, prompt: str | dict, params: SamplingParams, request_id: str | None = None) -> str:
        """Validates and queues a request; a bad one raises ValueError and changes nothing."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop: stop strings need a tokenizer; {self.config.model} has none (use stop_token_ids)")
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request = Request(request_id, text, token_ids, params)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        seq = self._new_sequence(request)
        # One generator per output sequence, so each sample's tokens depend only on the seed
        # and its index, never on batch mates or preemptions; sample 0 equals the n = 1 sample.
        seq.sibling_generators = [None if params.seed is None else
                                  torch.Generator(device=self.device).manual_seed(params.seed + 7919 * k)
                                  for k in range(params.n)]
        seq.generator = seq.sibling_generators[0]
        self._requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def add_beam_request(self, prompt: str | dict, beam_width: int, max_tokens: int, length_penalty: float = 1.0,
                         ignore_eos: bool = False, request_id: str | None = None) -> str:
        """Queues a beam search (see loom/engine/beam_search.py); its output lists the best
        `beam_width` hypotheses, best first."""
        if beam_width < 1:
            raise ValueError(f"beam_width: must be >= 1, got {beam_width}")
        if 2 * beam_width > self.model_config.vocab_size:
            raise ValueError(f"beam_width: {beam_width} needs 2 x {beam_width} candidate tokens, more than the vocabulary")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        request_id = self.add_request(prompt, params, request_id)  # validates the prompt
        request = self._requests[request_id]
        eos = set() if ignore_eos else set(self.eos_token_ids)
        request.beam = BeamState(beam_width, max_tokens, length_penalty, eos)
        request.seqs[0].beam_width = beam_width
        return request_id

    def _new_sequence(self, request: Request, parent: Sequence | None = None) -> Sequence:
        """A new sequence of the request; with a parent, a copy of its tokens and text so far
        (the caller shares the parent's blocks with it through the block manager's fork)."""
        seq = Sequence(request.request_id, request.prompt_token_ids, request.params, index=request.num_created)
        request.num_created += 1
        if request.params.logprobs is not None:
            seq.logprobs = []
        if parent is not None:  # siblings share the request's arrival (they are scheduled together)
            seq.arrival, seq.beam_width = parent.arrival, parent.beam_width
            if seq.index < len(parent.sibling_generators):  # an n > 1 sample, not a beam
                seq.generator = parent.sibling_generators[seq.index]
            seq.output_token_ids = list(parent.output_token_ids)
            seq.cumulative_logprob, seq.text = parent.cumulative_logprob, parent.text
            if parent.logprobs is not None:
                seq.logprobs = list(parent.logprobs)
            if parent.detokenizer is not None:
                seq.detokenizer = parent.detokenizer.fork()
        elif self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     request.params.skip_special_tokens)
        request.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        for seq in self.scheduler.abort(request_id):
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for every request that got a token this step."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.has_unfinished():  # would loop forever: a bookkeeping bug, not user input
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        # n > 1: the prompt's last step draws n tokens; the first goes to this sequence, the
        # others to children forked from it (sharing all its blocks).
        num_samples = {id(s): s.params.n for s in batch.seqs
                       if s.params.n > 1 and len(self._requests[s.request_id].seqs) == 1}
        results = self.runner.execute(batch, num_samples)
        touched: dict[str, Request] = {}
        beam_requests: dict[str, Request] = {}
        for seq, n, result in zip(batch.seqs, batch.num_new_tokens, results):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
            request = self._requests[seq.request_id]
            if result.prompt_logprobs:
                for position, logprobs in result.prompt_logprobs:
                    request.prompt_logprobs[position] = logprobs
            if result.sample is None:
                continue
            if seq.is_beam:  # beams advance together once every live beam has proposed
                seq.proposals = result.sample.proposals
                beam_requests[request.request_id] = request
                continue
            tokens = result.sample.token_ids
            for k in range(1, len(tokens)):
                child = self._new_sequence(request, parent=seq)
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
                self._append_token(child, tokens[k], result.sample.logprobs[k] if result.sample.logprobs else None)
            self._append_token(seq, tokens[0], result.sample.logprobs[0] if result.sample.logprobs else None)
            touched[request.request_id] = request
        for request in beam_requests.values():
            if all(s.proposals is not None for s in request.seqs):
                self._advance_beams(request)
                if request.finished:
                    touched[request.request_id] = request
        return [self._output(r) for r in touched.values()]

    def _advance_beams(self, request: Request) -> None:
        live = list(request.seqs)  # forks below append to request.seqs
        chosen = request.beam.step([s.cumulative_logprob for s in live], [s.output_token_ids for s in live],
                                   [s.proposals for s in live])
        for s in live:
            s.proposals = None
        next_beams: list[Sequence] = []
        used: set[int] = set()
        for c in chosen if not request.beam.done else []:
            parent = live[c.beam]
            if c.beam in used:  # a second continuation of one beam: fork it (blocks shared, CoW)
                beam = self._new_sequence(request, parent=parent)
                self.block_manager.fork(parent, beam)
                self.scheduler.add_running(beam)
            else:
                beam = parent
                used.add(c.beam)
            next_beams.append(beam)
        for b, s in enumerate(live):
            if b not in used:  # pruned (or the search is over)
                s.status = SequenceStatus.FINISHED
                self.scheduler.finish(s)
        for beam, c in zip(next_beams, chosen):
            beam.output_token_ids.append(c.token)
            beam.cumulative_logprob += c.logprob
        request.seqs = next_beams

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None) -> None:
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        new_chars = 0
        if seq.detokenizer is not None:
            delta = seq.detokenizer.append(token)
            seq.text += delta
            new_chars = len(delta)
        reason = self._finish_reason(seq, token, new_chars)
        if reason is not None:
            if reason != "stop" and seq.detokenizer is not None:
                seq.text += seq.detokenizer.finish()
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            self.scheduler.finish(seq)

    def _finish_reason(self, seq: Sequence, token: int, new_chars: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            seq.stop_reason = token if token in p.stop_token_ids else None
            return "stop"
        if p.stop and new_chars and len(seq.output_token_ids) >= p.min_tokens:
            hit = find_stop(seq.text, new_chars, p.stop)
            if hit is not None:
                at, stop = hit
                seq.text = seq.text[: at + len(stop)] if p.include_stop_str_in_output else seq.text[:at]
                seq.stop_reason = stop
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.scheduler.max_model_len:
            return "length"
        return None

    def _output(self, request: Request) -> RequestOutput:
        finished = request.finished
        if finished:
            del self._requests[request.request_id]
        if request.beam is not None:
            outputs = [CompletionOutput(
                index=i, text=self.tokenizer.decode(h.token_ids) if self.tokenizer else "", token_ids=h.token_ids,
                finish_reason="stop" if h.token_ids[-1] in request.beam.eos_token_ids else "length",
                cumulative_logprob=h.cumulative_logprob) for i, h in enumerate(request.beam.finished)]
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished)
        outputs = [CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.output_token_ids), finish_reason=s.finish_reason,
            stop_reason=s.stop_reason, logprobs=s.logprobs,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None) for s in request.seqs]
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=outputs, finished=finished, num_cached_tokens=request.seqs[0].num_cached_prompt_tokens,
            prompt_logprobs=request.prompt_logprobs,
        )

    def stats(self) -> EngineStats:
        bm, bs = self.block_manager, self.block_manager.block_size
        fill: dict[int, int] = {}
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                used = min(bs, max(0, seq.num_computed_tokens - i * bs))
                fill[block_id] = max(fill.get(block_id, 0), used)
        return EngineStats(
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, num_cached_blocks=bm.num_cached_blocks,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_swapped=len(self.scheduler.swapped), num_swap_outs=self.scheduler.num_swap_outs,
            prefix_cache_queries=bm.prefix_query_tokens, prefix_cache_hits=bm.prefix_hit_tokens,
            kv_slots_allocated=len(fill) * bs, kv_slots_used=sum(fill.values()),
        )
