"""`loom bench latency`'s breakdown of a decode step: where its time goes, by operator."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from loom import LLM, SamplingParams
from loom.bench import latency
from loom.bench.latency import ATTENTION_OPS, LINEAR_OPS, decode_breakdown, kv_bytes
from loom.kernels import load_kernels
from loom.kv.cache import KVCache
from loom.models.config import ModelConfig


def test_breakdown_names_real_operators():
    load_kernels()
    for op in LINEAR_OPS | ATTENTION_OPS:
        namespace, name = op.split("::")
        assert hasattr(getattr(torch.ops, namespace), name), op


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_breakdown_classifies_the_operators_a_decode_step_calls(gqa, quantization):
    """Every decode step calls operators of both kinds the breakdown sums (checked by name, not time)."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(str(gqa[0]), enforce_eager=True, quantization=quantization, max_num_seqs=2)
    engine = llm.engine
    for prompt in random_prompts(2, 16):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    called = {e.key for e in prof.key_averages()}
    assert called & LINEAR_OPS and called & ATTENTION_OPS
    ms = decode_breakdown(engine)
    assert not engine.has_unfinished_requests()
    assert set(ms) == {"profiled_step", "linear", "attention", "other"}
    with pytest.raises(ValueError, match="no decode steps"):
        decode_breakdown(engine)


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
def test_mbu_counts_the_kv_pool_as_stored(gqa, dtype, kv_cache_dtype):
    """The KV bytes MBU counts per token are what the engine's pool holds per slot (int8: with scales)."""
    cfg = ModelConfig.from_dir(gqa[0])
    cache = KVCache(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, 16, getattr(torch, dtype), "cpu",
                    kernels=kv_cache_dtype == "int8", kv_cache_dtype=kv_cache_dtype)
    pool_bytes = sum(t.nbytes for keys, values in cache.pools() for t in keys + values)
    assert kv_bytes(cfg, dtype, context=16, batch=4, kv_cache_dtype=kv_cache_dtype) == pool_bytes


def test_run_loom_builds_the_engine_with_the_cache_asked_for(gqa, monkeypatch):
    """The engine run_loom times holds the KV cache it was given (stopped before any timing)."""
    built = []

    class Built(Exception):
        pass

    class Recorded(LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)
            raise Built

    monkeypatch.setattr(latency, "LLM", Recorded)
    with pytest.raises(Built):
        latency.run_loom(gqa[0], "bfloat16", None, batch=2, prompt_len=8, max_tokens=6, repeats=1,
                         kv_cache_dtype="int8")
    assert built[0].engine.runner.cache.quantized
