"""KV compression's speed and memory, same run: decode of a batch of long prompts under each
policy and budget against the full cache, and the largest batch that a fixed KV memory holds.

The model is the 134M reference Llama with a longer position range (its weights are the same
random draw), so that prompts of 2048 tokens and their outputs fit."""
from __future__ import annotations

import gc
import multiprocessing
import random
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from loom import LLM, SamplingParams
from loom.bench import clock
from loom.bench.report import cpu_label
from loom.kv.cache import kv_bytes_per_block
from loom.models.reference import REFERENCE_134M, reference_model_dir
from loom.sampling_params import RequestOutputKind

# (policy, budget as a fraction of the prompt); budget None for the full cache
SCORED = ("h2o", "keyformer")  # the policies that score every decode step
NEVER_REACHED = 10**9  # a token budget no run reaches: scores computed, nothing dropped
CASES = [("full", None)] + [(policy, budget) for policy in ("window", "streaming", "h2o", "keyformer", "snapkv")
                            for budget in (0.5, 0.25)]


def long_context_model() -> Path:
    return reference_model_dir(REFERENCE_134M | {"max_position_embeddings": 4096}, name="ref-134m-4k")


def _seconds(fn: Callable[[], object]) -> float:
    """How long one call of `fn` takes."""
    start = clock.now()
    fn()
    return clock.now() - start


def _prompts(count: int, length: int, vocab_size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(length)]} for _ in range(count)]


def _engine(model_dir: Path, dtype: str, policy: str, budget: float | None, max_num_seqs: int, max_model_len: int,
            kv_cache_memory: int | None = None) -> LLM:
    llm = LLM(str(model_dir), dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              kv_cache_memory=kv_cache_memory, kv_policy=policy, kv_budget=budget)
    # Warm-up, untimed, at shrinking batch sizes so that every decode graph the steps use has run
    # (the load prepared them, a scored policy's among them, or loaded them from disk).
    kv = {"kv_policy": policy, "kv_budget": 8} if policy != "full" else {"kv_policy": "full"}
    llm.generate([{"prompt_token_ids": [5] * 16}] * 3,
                 [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kv) for m in (4, 8, 12)],
                 use_tqdm=False)
    return llm


def bytes_per_slot(llm: LLM) -> int:
    config = llm.engine.config
    m, bs = config.model_config, config.cache.block_size
    return kv_bytes_per_block(m.num_layers, m.num_kv_heads, m.head_dim, bs, config.dtype) // bs


class DecodeRun:
    """One case's decode: `batch` prompts prefilled at construction, then decode steps taken one
    at a time (`step`), so that several cases' steps can take turns and the machine's drift
    hits them alike. What it measures (`result`): tok/s and time per step over the engine's
    steps alone, the KV memory each sequence holds between decode steps (the most over the
    steps; a step itself adds at most the block of its new token), and the bytes of K/V a step
    reads (the tokens stored and each new one, averaged over the steps)."""

    def __init__(self, model_dir: Path, dtype: str, policy: str, budget: float | None, batch: int, prompt_len: int,
                 output_len: int, vocab_size: int, seed: int = 0) -> None:
        self.policy, self.budget, self.batch, self.output_len = policy, budget, batch, output_len
        self.llm = _engine(model_dir, dtype, policy, budget, batch, prompt_len + output_len)
        engine, scheduler = self.llm.engine, self.llm.engine.scheduler
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for prompt in _prompts(batch, prompt_len, vocab_size, seed):
            engine.add_request(prompt, params)
        engine.step()  # the scheduler takes the requests in at a step
        while engine.has_unfinished_requests() and (scheduler.waiting or any(
                s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running)):
            engine.step()
        self.generated = sum(len(s.output_token_ids) for s in scheduler.running)
        self.slots_per_seq = self.elapsed = self.slots_read = 0.0
        self.steps = 0
        self._stats = self.llm.stats()  # the engine's state before the next step

    @property
    def finished(self) -> bool:
        return not self.llm.engine.has_unfinished_requests()

    def step(self) -> None:
        before = self._stats
        self.slots_read += before.kv_slots_used + before.num_running  # the tokens stored, and each new one
        self.elapsed += _seconds(self.llm.engine.step)  # the engine's step alone, not the memory counts
        self.steps += 1
        after = self._stats = self.llm.stats()
        if after.num_running:
            self.slots_per_seq = max(self.slots_per_seq, after.kv_slots_allocated / after.num_running)

    def result(self) -> dict:
        decoded = self.batch * self.output_len - self.generated
        per_slot = bytes_per_slot(self.llm)
        return {"policy": self.policy, "budget": self.budget, "batch": self.batch,
                "decode_tok_per_s": decoded / self.elapsed, "ms_per_step": 1000 * self.elapsed / self.steps,
                "kv_bytes_per_seq": self.slots_per_seq * per_slot,
                "kv_bytes_read_per_step": self.slots_read / self.steps * per_slot}


def run_decodes(model_dir: Path, dtype: str, cases: list[tuple[str, float | None]], batch: int, prompt_len: int,
                output_len: int, vocab_size: int, threads: int) -> list[dict]:
    """Every case's engine prefilled, then one decode step of each in turn until all are done:
    a step of one case is never more than a round of steps away from a step of every other.
    Run in a process of its own: the engines' memory (about 11 GiB at 2048-token prompts, all
    cases alive at once) goes back to the system with it, where a process that went on would
    keep much of it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_decodes, model_dir, dtype, cases, batch, prompt_len, output_len, vocab_size,
                           threads).result()


def _run_decodes(model_dir: Path, dtype: str, cases: list[tuple[str, float | None]], batch: int, prompt_len: int,
                 output_len: int, vocab_size: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    runs = [DecodeRun(model_dir, dtype, policy, budget, batch, prompt_len, output_len, vocab_size)
            for policy, budget in cases]
    while not all(run.finished for run in runs):
        for run in runs:
            if not run.finished:
                run.step()
    return [run.result() for run in runs]


def add_memory_bound(decode: list[dict], weight_bytes: float) -> None:
    """Each case's bytes a step reads (the weights once, the K/V its sequences store), the rate
    its steps read them at, and its speed-up over full (the first case) if both steps did
    nothing but read their bytes at one rate: what a smaller cache buys a decode bound by memory,
    before any cost of its own."""
    for d in decode:
        d["bytes_per_step"] = weight_bytes + d["kv_bytes_read_per_step"]
        d["GBps"] = d["bytes_per_step"] / d["ms_per_step"] / 1e6
        d["memory_bound_vs_full"] = decode[0]["bytes_per_step"] / d["bytes_per_step"]


def median_run(runs: list[dict]) -> dict:
    """One case's runs as one: the median step time (and its throughput), every round's kept."""
    return {**runs[0], "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
            "decode_tok_per_s": statistics.median(r["decode_tok_per_s"] for r in runs),
            "rounds_ms_per_step": [r["ms_per_step"] for r in runs],
            "kv_bytes_per_seq": max(r["kv_bytes_per_seq"] for r in runs),
            "kv_bytes_read_per_step": statistics.median(r["kv_bytes_read_per_step"] for r in runs)}


def run_capacity(model_dir: Path, dtype: str, policy: str, budget: float | None, kv_cache_memory: int,
                 num_requests: int, prompt_len: int, output_len: int, vocab_size: int, seed: int = 1) -> dict:
    """`num_requests` long requests at once through a pool of `kv_cache_memory` bytes: the most
    sequences that ran together, and how often the pool forced a preemption."""
    gc.collect()  # the engines of earlier runs, held by reference cycles
    llm = _engine(model_dir, dtype, policy, budget, num_requests, prompt_len + output_len, kv_cache_memory)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for prompt in _prompts(num_requests, prompt_len, vocab_size, seed):
        llm.engine.add_request(prompt, params)
    most = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        most = max(most, llm.stats().num_running)
    return {"policy": policy, "budget": budget, "kv_cache_memory": kv_cache_memory, "num_requests": num_requests,
            "largest_batch": most, "preemptions": llm.stats().num_preemptions}


def label(case: dict) -> str:
    if case["budget"] is None:
        return "full"
    if case["budget"] == NEVER_REACHED:
        return f"{case['policy']} scoring only"
    return f"{case['policy']} {case['budget']:.0%}"


def plot(path: Path, title: str, decode: list[dict], capacity: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, rows, key, ylabel in ((left, decode, "decode_tok_per_s", "decode tok/s"),
                                  (right, capacity, "largest_batch", "largest batch in the same KV memory")):
        names = [label(r) for r in rows]
        bars = ax.bar(names, [r[key] for r in rows], color=["#888888"] + ["#4C72B0"] * (len(rows) - 1))
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    bound = [decode[0]["decode_tok_per_s"] * r["memory_bound_vs_full"] for r in decode]
    left.scatter(range(len(decode)), bound, marker="_", s=300, color="#C44E52", zorder=3,
                 label="memory bound (full's rate x its bytes per step / the case's)")
    left.set_ylim(top=1.2 * max(bound))
    left.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{title}\n{cpu_label()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
