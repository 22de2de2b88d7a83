"""Decode latency at small batch, with achieved memory bandwidth (MBU), against the peers.

Decode speed counts generated tokens after the first (which comes from the prefill), per
second of decode steps, as the llama.cpp peer does. MBU = bytes a decode step must read
(every weight once, plus the KV cache) / time per step / the machine's peak read bandwidth.
"""
from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from loom import LLM, SamplingParams
from loom.bench import clock
from loom.kv.cache import kv_bytes_per_block
from loom.models.config import ModelConfig


def weight_bytes(cfg: ModelConfig, dtype: str, quantization: str | None, group_size: int = 32,
                 symmetric: bool = False) -> float:
    """Bytes of weights a decode step reads: every linear layer (and the head) once; the
    embedding contributes one row per token, which is negligible."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    linear = cfg.num_layers * (h * (cfg.num_heads * cfg.head_dim) * 2 + 2 * h * kv + 3 * h * i) + h * v
    per_weight = {None: 4 if dtype == "float32" else 2, "int8": 1, "int4": 0.5}[quantization]
    # fp32 row scales; bf16 group scales and zeros (scales only if symmetric)
    extra = {None: 0, "int8": 4 / h, "int4": (2 if symmetric else 4) / group_size}[quantization]
    return linear * (per_weight + extra)


def kv_bytes(cfg: ModelConfig, dtype: str, context: int, batch: int, kv_cache_dtype: str = "auto") -> float:
    per_token = kv_bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, getattr(torch, dtype),
                                   kv_cache_dtype)
    return per_token * context * batch


def mbu(cfg: ModelConfig, dtype: str, quantization: str | None, batch: int, mean_context: int,
        steps_per_s: float, peak_bytes_per_s: float, kv_cache_dtype: str = "auto", symmetric: bool = False) -> float:
    """Achieved share of the peak: bytes one decode step reads x steps per second / peak."""
    step_bytes = (weight_bytes(cfg, dtype, quantization, symmetric=symmetric)
                  + kv_bytes(cfg, dtype, mean_context, batch, kv_cache_dtype))
    return step_bytes * steps_per_s / peak_bytes_per_s


def prompt_ids(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Deterministic, distinct prompts of ordinary token ids (ids 0-2 are often special)."""
    return [[(7 * k + 13 * b) % (vocab_size - 3) + 3 for k in range(prompt_len)] for b in range(batch)]


def latency_engine(model_dir: Path, dtype: str, quantization: str | None, batch: int, prompt_len: int,
                   kv_cache_dtype: str = "auto", symmetric: bool = False, num_scheduler_steps: int = 1) -> LLM:
    """The engine `run_loom` times: room for `batch` sequences, and a token budget that takes
    every prompt in one step, so that all the timed steps decode."""
    return LLM(str(model_dir), dtype=dtype, quantization=quantization, symmetric=symmetric,
               max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, batch * prompt_len),
               kv_cache_memory=1 << 30, kv_cache_dtype=kv_cache_dtype, num_scheduler_steps=num_scheduler_steps)


class LoomDecodeRun:
    """An engine with `batch` requests of `prompt_len` tokens to decode `max_tokens` each, timed a
    run at a time: `time_decode()` adds the requests, computes their prompts (one step), then times
    the decode steps to the end and returns steps/s.

    Where the C++ decode step ran every timed step, the run's split of a step's time comes from
    those same steps (`splits`): the C++ step adds up its linear layers' (the LM head's too) and
    attention's time. Elsewhere (compiled decode graphs) `breakdown` profiles one more run."""

    def __init__(self, model_dir: Path, dtype: str, quantization: str | None, batch: int, prompt_len: int,
                 max_tokens: int, kv_cache_dtype: str = "auto", symmetric: bool = False,
                 num_scheduler_steps: int = 1) -> None:
        # Engines of earlier runs are garbage held by reference cycles: collect them now, or a full
        # collection during the timed steps walks them all (measured: int8 batch 1 ran ~30% slower
        # after four earlier engines in the same process).
        gc.collect()
        self.dtype, self.quantization, self.batch = dtype, quantization, batch
        self.kv_cache_dtype, self.symmetric, self.num_scheduler_steps = kv_cache_dtype, symmetric, num_scheduler_steps
        llm = latency_engine(model_dir, dtype, quantization, batch, prompt_len, kv_cache_dtype, symmetric,
                             num_scheduler_steps)
        vocab_size = llm.engine.config.model_config.vocab_size
        self.prompts = [{"prompt_token_ids": p} for p in prompt_ids(batch, prompt_len, vocab_size)]
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(self.prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        self.engine = llm.engine
        self.splits: list[dict[str, float] | None] = []  # each timed run's, or None where it has none

    def prefill(self) -> None:
        """The requests in and their prompts computed: every later step decodes."""
        self.request_ids = [self.engine.add_request(p, self.params) for p in self.prompts]
        self.engine.step()

    def decode_steps(self) -> int:
        """Runs the engine's steps to the end (every one decodes after `prefill`); returns how many
        decode steps the model ran: a row's tokens after its first (an engine step may run several)."""
        tokens = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id == self.request_ids[0]:
                    tokens = len(out.outputs[0].token_ids)
        return tokens - 1

    def time_decode(self) -> float:
        self.prefill()
        decode_step = self.engine.runner.decode_step
        if decode_step is not None:  # else no split of the run's own: its steps run untouched
            decode_step.time_kernels(True)
        try:
            start = clock.now()
            steps = self.decode_steps()
            elapsed = clock.now() - start
            linear_s, attention_s, served = decode_step.kernel_seconds() if decode_step is not None else (0, 0, 0)
        finally:
            if decode_step is not None:
                decode_step.time_kernels(False)
        self.splits.append(step_split(steps, elapsed, linear_s, attention_s) if served == steps > 0 else None)
        return steps / elapsed

    def breakdown(self, steps_per_s: float) -> dict[str, float]:
        """Where a step's time goes, the linear layers' and attention's share from one more run
        under the profiler (`decode_breakdown`), the step's from `steps_per_s`. (The profiler's own
        cost would land outside the operators; the two runs apart carry their spread instead.)"""
        self.prefill()
        steps, linear_s, attention_s = decode_breakdown(self.engine)
        return step_split(steps, steps / steps_per_s, linear_s, attention_s)


def loom_result(run: LoomDecodeRun, rates: list[float], breakdown: bool = True) -> dict:
    """Loom's row of latency.json from the decode rates of `run`'s timed runs (medians), with
    `run.breakdown` unless told not to."""
    steps_per_s = statistics.median(rates)
    result = {"engine": "loom", "dtype": run.dtype, "quantization": run.quantization, "symmetric": run.symmetric,
              "kv_cache_dtype": run.kv_cache_dtype, "num_scheduler_steps": run.num_scheduler_steps,
              "batch": run.batch, "steps_per_s": steps_per_s,
              "tok_per_s": steps_per_s * run.batch, "all_steps_per_s": rates}
    if breakdown:
        splits = run.splits[-len(rates):]  # the rates' own runs (an untimed first call may precede them)
        if len(splits) == len(rates) and None not in splits:
            result["step_ms"] = {k: statistics.median(split[k] for split in splits) for k in splits[0]}
            result["step_split"] = "timed"
        else:
            result["step_ms"] = run.breakdown(steps_per_s)
            result["step_split"] = "profiled"
    return result


def run_loom(model_dir: Path, dtype: str, quantization: str | None, batch: int, prompt_len: int, max_tokens: int,
             repeats: int, kv_cache_dtype: str = "auto", breakdown: bool = True, symmetric: bool = False,
             num_scheduler_steps: int = 1) -> dict:
    """Decode rates of `repeats` timed runs and, with `breakdown`, one more run under the profiler
    for where a step's time goes (`step_ms`)."""
    run = LoomDecodeRun(model_dir, dtype, quantization, batch, prompt_len, max_tokens, kv_cache_dtype, symmetric,
                        num_scheduler_steps)
    rates = [run.time_decode() for _ in range(repeats)]
    return loom_result(run, rates, breakdown)


def interleaved(runs: list[Callable[[], float]], repeats: int, settle: Callable[[], None]) -> list[list[float]]:
    """Calls each of `runs` `repeats` times, taking turns, after one untimed call each; returns
    each one's results. On a shared machine whose memory bandwidth moves by the minute, engines
    timed a minute apart compare the machine's moods as much as the engines: taking turns puts
    each pair seconds apart, and the order reverses every turn so that a drift weighs on all
    alike. `settle()` runs before each call (a pause, so that the last engine's spinning threads
    are idle before the next one starts)."""
    for run in runs:
        settle()
        run()
    results: list[list[float]] = [[] for _ in runs]
    for turn in range(repeats):
        order = range(len(runs)) if turn % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            settle()
            results[i].append(runs[i]())
    return results


# Operators by where a decode step's time goes: the linear layers (every kernel their dispatch can
# pick) and attention; everything else (the engine loop, sampling, the compiled graph's own
# work and its small fused kernels) is the step's fixed cost.
LINEAR_OPS = frozenset({"loom::dense_linear", "loom::amx_linear", "loom::int8_linear", "loom::int4_linear",
                        "loom::int8_dequantize", "loom::int4_dequantize", "aten::mm", "aten::addmm", "aten::linear"})
ATTENTION_OPS = frozenset({"loom::paged_decode_attention", "loom::paged_decode_attention_scored",
                           "loom::paged_prefill_attention", "aten::scaled_dot_product_attention"})


def decode_breakdown(engine) -> tuple[int, float, float]:
    """Runs `engine`'s requests (their prefill done) to the end under torch's profiler: the steps,
    and the seconds in the linear layers' and in attention's operators (their own time, children
    excluded)."""
    from torch.profiler import ProfilerActivity, profile

    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    if steps == 0:
        raise ValueError("decode_breakdown: the engine had no decode steps to run")
    return steps, *operator_seconds({e.key: e.self_cpu_time_total for e in prof.key_averages()})


def operator_seconds(self_us: dict[str, float]) -> tuple[float, float]:
    """Seconds in the linear layers' and in attention's operators, given each operator's own time (us)."""
    return (sum(t for op, t in self_us.items() if op in LINEAR_OPS) / 1e6,
            sum(t for op, t in self_us.items() if op in ATTENTION_OPS) / 1e6)


def step_split(steps: int, elapsed_s: float, linear_s: float, attention_s: float) -> dict[str, float]:
    """ms per step of `steps` steps that took `elapsed_s`, `linear_s` of it in the linear layers
    and `attention_s` in attention: in all ("step"), in each, and the rest ("other")."""
    if steps == 0:
        raise ValueError("step_split: no steps")
    step, linear, attention = (1e3 * s / steps for s in (elapsed_s, linear_s, attention_s))
    return {"step": step, "linear": linear, "attention": attention, "other": step - linear - attention}


def run_hf(model_dir: Path, dtype: str, batch: int, prompt_len: int, max_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    gc.collect()  # as LoomDecodeRun does
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompt_ids(batch, prompt_len, model.config.vocab_size))
    mask = torch.ones_like(ids)
    rates = []
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
        for _ in range(repeats):
            t = clock.now()
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
            prefill = clock.now() - t
            t = clock.now()
            model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
            # decode time: the whole call less a prefill measured on its own
            decode = clock.now() - t - prefill
            if decode <= 0:
                raise RuntimeError(f"transformers' decode time is lost in its prefill's noise at max_tokens "
                                   f"{max_tokens}: raise --max-tokens")
            rates.append((max_tokens - 1) / decode)
    return {"engine": "hf-transformers", "dtype": dtype, "batch": batch, "steps_per_s": statistics.median(rates),
            "tok_per_s": statistics.median(rates) * batch, "all_steps_per_s": rates}
