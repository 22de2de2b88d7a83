"""`loom bench latency`'s breakdown of a decode step (where its time goes, by operator) and its
engine, checked without timing anything."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import random_prompts
from loom import LLM, SamplingParams
from loom.bench.latency import (ATTENTION_OPS, LINEAR_OPS, LoomDecodeRun, interleaved, kv_bytes, latency_engine,
                                loom_result, operator_seconds, step_split, weight_bytes)
from loom.kernels import load_kernels
from loom.kv.cache import KVCache
from loom.models.config import ModelConfig
from loom.quant.linear import WeightOnlyLinear


def test_breakdown_names_real_operators():
    load_kernels()
    for op in LINEAR_OPS | ATTENTION_OPS:
        namespace, name = op.split("::")
        assert hasattr(getattr(torch.ops, namespace), name), op


class _CalledOperators(TorchDispatchMode):
    """Records the name of every operator called under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_breakdown_classifies_the_operators_a_decode_step_calls(gqa, quantization):
    """Every decode step calls operators of both kinds the breakdown sums (by name)."""
    llm = LLM(str(gqa[0]), enforce_eager=True, quantization=quantization, max_num_seqs=2)
    engine = llm.engine
    for prompt in random_prompts(2, 16):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the prefill
    with _CalledOperators() as called:
        engine.step()
    assert called.names & LINEAR_OPS and called.names & ATTENTION_OPS


def test_step_splits_by_operator_kind():
    """Each operator's own time lands in its kind (others in neither); a step's time less both
    kinds is "other"."""
    self_us = {"loom::int8_linear": 3000.0, "aten::mm": 1000.0, "loom::paged_decode_attention": 600.0,
               "aten::add": 50.0}
    assert operator_seconds(self_us) == pytest.approx((0.004, 0.0006))
    ms = step_split(steps=2, elapsed_s=0.006, linear_s=0.004, attention_s=0.0006)
    assert ms == pytest.approx({"step": 3.0, "linear": 2.0, "attention": 0.3, "other": 0.7})
    with pytest.raises(ValueError, match="no steps"):
        step_split(steps=0, elapsed_s=0.0, linear_s=0.0, attention_s=0.0)


def test_a_row_splits_its_step_by_its_own_runs_only_when_each_has_a_split():
    """loom_result: where each of the rates' runs carries its own split, the row's is their median
    (an untimed first run before them does not count); where one has none, a profiled run's."""
    splits = [{"step": 1, "linear": 1, "attention": 1, "other": 1}, {"step": 2, "linear": 2, "attention": 2, "other": 2},
              {"step": 3, "linear": 3, "attention": 3, "other": 3}]
    profiled = {"step": 9, "linear": 9, "attention": 9, "other": 9}
    run = SimpleNamespace(dtype="bfloat16", quantization=None, symmetric=False, kv_cache_dtype="auto", batch=1,
                          num_scheduler_steps=1,
                          splits=[None, *splits], breakdown=lambda steps_per_s: profiled)
    row = loom_result(run, [1.0, 1.0, 1.0])
    assert (row["step_split"], row["step_ms"]) == ("timed", splits[1])
    run.splits = [splits[0], None, splits[2]]
    row = loom_result(run, [1.0, 1.0, 1.0])
    assert (row["step_split"], row["step_ms"]) == ("profiled", profiled)


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
def test_mbu_counts_the_kv_pool_as_stored(gqa, dtype, kv_cache_dtype):
    """The KV bytes MBU counts per token are what the engine's pool holds per slot (int8: with scales)."""
    cfg = ModelConfig.from_dir(gqa[0])
    cache = KVCache(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, 16, getattr(torch, dtype), "cpu",
                    kernels=kv_cache_dtype == "int8", kv_cache_dtype=kv_cache_dtype)
    pool_bytes = sum(t.nbytes for keys, values in cache.pools() for t in keys + values)
    assert kv_bytes(cfg, dtype, context=16, batch=4, kv_cache_dtype=kv_cache_dtype) == pool_bytes


def test_latency_engine_holds_the_cache_asked_for(gqa):
    """The engine run_loom times holds the KV cache it was given."""
    llm = latency_engine(gqa[0], "bfloat16", None, batch=2, prompt_len=8, kv_cache_dtype="int8")
    assert llm.engine.runner.cache.quantized


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_weight_bytes_are_what_the_layers_hold(gqa, symmetric):
    """MBU's int4 bytes per step: half a byte a weight, and a bf16 scale (and zero, unless
    symmetric) per group of 32, over every linear layer the engine quantized."""
    llm = latency_engine(gqa[0], "bfloat16", "int4", batch=1, prompt_len=8, symmetric=symmetric)
    held = 0
    for m in llm.engine.runner.model.modules():
        if isinstance(m, WeightOnlyLinear):
            q, scales, zeros = m.portable()
            held += q.numel() / 2 + 2 * scales.numel() + (0 if zeros is None else 2 * zeros.numel())
    assert (zeros is None) == symmetric
    assert weight_bytes(ModelConfig.from_dir(gqa[0]), "bfloat16", "int4", symmetric=symmetric) == held


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_decode_run_decodes_afresh_after_one_prompt_step(gqa, monkeypatch, num_scheduler_steps):
    """Each run starts afresh: its prompts in one step, then max_tokens - 1 decode steps to the end
    (the steps a run's rate counts), also where the engine runs 4 of them at once (2 engine steps)."""
    if num_scheduler_steps > 1:
        monkeypatch.setenv("LOOM_ENFORCE_EAGER", "0")  # several steps at once run in the C++ decode step
    run = LoomDecodeRun(gqa[0], "bfloat16", None, batch=2, prompt_len=8, max_tokens=6,
                        num_scheduler_steps=num_scheduler_steps)
    step, engine_steps = run.engine.step, []
    monkeypatch.setattr(run.engine, "step", lambda: engine_steps.append(1) or step())
    for _ in range(2):
        run.prefill()
        assert all(seq.num_computed_tokens == 8 for seq in run.engine.scheduler.running)
        del engine_steps[:]
        assert run.decode_steps() == 5
        assert len(engine_steps) == (5 if num_scheduler_steps == 1 else 2)
        assert not run.engine.has_unfinished_requests()


def test_interleaved_runs_take_turns_in_alternating_order():
    """One warm-up call each, then turns whose order reverses every time; a settle before every call."""
    calls: list[str] = []
    settled: list[int] = []

    def run(name: str):
        def call() -> float:
            calls.append(name)
            return float(len(calls))
        return call

    results = interleaved([run("a"), run("b")], repeats=3, settle=lambda: settled.append(len(calls)))
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert results == [[3.0, 6.0, 7.0], [4.0, 5.0, 8.0]]
    assert settled == list(range(8))


def test_latency_report_keeps_every_turn(gqa, tmp_path, monkeypatch):
    """`loom bench latency`'s report from its rounds (given here): where Loom and llama.cpp took
    turns, Loom's MBU is the median of every turn's (each against its own probe), and the ratio
    to llama.cpp keeps every turn's beside the median over rounds."""
    from loom.bench import calibrate
    from loom.cli import bench
    from loom.models import reference

    def round_rows(loom_rate: float, peer_rate: float, mbus: list[float], paired: list[float]) -> list[dict]:
        step_ms = {"step": 2.0, "linear": 1.0, "attention": 0.5, "other": 0.5}
        return [{"engine": "loom", "dtype": "bfloat16", "quantization": None, "batch": 1, "tok_per_s": loom_rate,
                 "steps_per_s": loom_rate, "all_steps_per_s": [loom_rate], "step_ms": step_ms, "step_split": "timed",
                 "mbu_turns": mbus,
                 "read_GBps_turns": [50.0] * len(mbus)},
                {"engine": "llama.cpp", "dtype": "bf16", "batch": 1, "tok_per_s": peer_rate, "steps_per_s": peer_rate,
                 "all_steps_per_s": [peer_rate], "paired_ratios": paired}]

    rounds = iter([round_rows(120.0, 100.0, [0.7, 0.9], [1.1, 1.3]), round_rows(150.0, 100.0, [0.8, 0.6], [1.5, 1.6])])
    monkeypatch.setattr(bench, "_latency_round", lambda args, model, cfg: next(rounds))
    monkeypatch.setattr(calibrate, "memory_bandwidth", lambda: 50e9)
    monkeypatch.setattr(reference, "reference_model_dir", lambda: tmp_path / "reference")
    args = argparse.Namespace(model=str(gqa[0]), threads=2, out_dir=tmp_path, rounds=2, prompt_len=8, max_tokens=4,
                              repeats=2, kv_cache_dtype="auto")
    bench._latency(args)
    report = json.loads((tmp_path / f"latency-{gqa[0].name}.json").read_text())
    loom_row, peer_row = report["results"]
    assert loom_row["mbu_turns"] == [0.7, 0.9, 0.8, 0.6] and loom_row["mbu"] == pytest.approx(0.75)
    assert loom_row["tok_per_s"] == pytest.approx(135.0) and peer_row["paired_ratios"] == [1.1, 1.3, 1.5, 1.6]
    ratio = report["ratios"]["batch 1: bfloat16 / llama.cpp bf16"]
    assert ratio["rounds"] == pytest.approx([1.2, 1.5]) and ratio["median"] == pytest.approx(1.35)
    assert ratio["turns"] == [1.1, 1.3, 1.5, 1.6] and ratio["turns_median"] == pytest.approx(1.4)
