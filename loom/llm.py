"""The offline API, in vLLM's conventions: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Sequence as SequenceABC

from tqdm import tqdm

from loom.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, resolve_dtype
from loom.engine.input_processor import Prompt
from loom.engine.llm_engine import LLMEngine
from loom.outputs import EngineStats, RequestOutput
from loom.sampling_params import RequestOutputKind, SamplingParams
from loom.tokenizer import Tokenizer


class InvalidRequestsError(ValueError):
    """Some prompts of a `generate` call were invalid. The valid ones still ran: `outputs` holds
    their results in the order given, with None where a prompt was rejected."""

    def __init__(self, errors: dict[int, ValueError], outputs: list[RequestOutput | None]) -> None:
        self.errors, self.outputs = errors, outputs
        lines = "; ".join(f"prompt {i}: {e}" for i, e in errors.items())
        super().__init__(f"{len(errors)} of {len(outputs)} prompts rejected ({lines})")


class LLM:
    def __init__(self, model: str, dtype: str = "float32", kv_cache_memory: int | float | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 max_model_len: int | None = None, preemption_mode: str = "recompute",
                 swap_space: int = 1 << 30, seed: int = 0, device: str = "cpu",
                 num_threads: int | None = None, attention_backend: str | None = None,
                 quantization: str | None = None, group_size: int = 32, symmetric: bool = False,
                 enforce_eager: bool | None = None,
                 kv_policy: str = "full", kv_budget: int | float | None = None,
                 kv_recent_ratio: float = 0.3, tensor_parallel_size: int = 1, kv_parallel_size: int = 1,
                 attention_sharding: str = "heads", all_reduce: str = "auto", ffn_layout: str = "1d",
                 hop_b: bool = False, kv_cache_dtype: str = "auto", num_scheduler_steps: int = 1) -> None:
        """On several ranks (tensor_parallel_size x kv_parallel_size > 1, under torchrun), only
        rank 0 returns: the other ranks run the steps rank 0 sends them, then exit the process
        (status 0) when rank 0 finishes."""
        config = EngineConfig(
            model=str(model), dtype=resolve_dtype(dtype), device=device, seed=seed, num_threads=num_threads,
            quantization=quantization, group_size=group_size, symmetric=symmetric, enforce_eager=enforce_eager,
            attention_backend=attention_backend,
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching, swap_space=swap_space,
                              kv_policy=kv_policy, kv_budget=kv_budget, kv_recent_ratio=kv_recent_ratio,
                              kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      max_model_len=max_model_len or 0, preemption_mode=preemption_mode,
                                      num_scheduler_steps=num_scheduler_steps),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, kv_parallel_size=kv_parallel_size,
                                    attention_sharding=attention_sharding, all_reduce=all_reduce,
                                    ffn_layout=ffn_layout, hop_b=hop_b),
        )
        self.engine = LLMEngine(config)
        runner = self.engine.runner
        if not runner.parallel.is_driver:
            runner.follow()
            raise SystemExit(0)
        if runner.parallel.world_size > 1:
            atexit.register(runner.shutdown)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in the order given.

        A prompt that fails validation does not stop the others: they all run, then an
        InvalidRequestsError (a ValueError naming the field) reports the rejected ones and
        carries the completed outputs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        # Only the final outputs are kept: the engine need not build the others.
        final_only = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final_only[id(p)] for p in params]

        order: dict[str, int] = {}
        errors: dict[int, ValueError] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                order[self.engine.add_request(prompt, p)] = i
            except ValueError as e:
                errors[i] = e
        results = self._run(order, len(prompts), use_tqdm)
        if errors:
            raise InvalidRequestsError(errors, results)
        return results  # type: ignore[return-value]

    def _run(self, order: dict[str, int], size: int, use_tqdm: bool) -> list[RequestOutput | None]:
        """Steps the engine until the queued requests finish; their results in `order`'s
        positions (None where nothing was queued). On any exception, aborts them first."""
        results: list[RequestOutput | None] = [None] * size
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm or len(order) < 2)
        try:
            with bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            for request_id in order:  # leave the engine clean for the next call
                self.engine.abort_request(request_id)
            self.engine.step()  # takes the aborts in; runs nothing of theirs
            raise
        return results

    def beam_search(self, prompts: Prompt | SequenceABC[Prompt], beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, ignore_eos: bool = False,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """Beam search, step for step as Hugging Face `generate(num_beams=beam_width)`; each
        result's `outputs` are the best `beam_width` hypotheses, best first. Beams share KV
        blocks (fork, copy-on-write)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        order = {self.engine.add_beam_request(p, beam_width, max_tokens, length_penalty, ignore_eos): i
                 for i, p in enumerate(prompts)}
        return self._run(order, len(prompts), use_tqdm)  # type: ignore[return-value]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation or a list of them, each rendered with the model's chat template."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"messages: {self.engine.config.model} has no tokenizer for a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(conv)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
