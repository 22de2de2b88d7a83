"""The kvpress peer (its own venv, built on first use): with no compression it is transformers'
greedy generation, and its StreamingLLM press keeps what Loom's `streaming` policy keeps, so the
first tokens after the compressed prompt are Loom's."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import hf_greedy

from loom import LLM, SamplingParams

peers = pytest.mark.skipif(os.environ.get("LOOM_TEST_PEERS") != "1",
                           reason="set LOOM_TEST_PEERS=1: the kvpress peer installs a venv of its own (minutes), so "
                                  "it is not in the default suite")


@peers
def test_kvpress_streaming_keeps_what_loom_keeps(hf_models):
    from loom.bench.kvpress_peer import run_kvpress

    model_dir, model = hf_models("llama_gqa")
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 256, (40,), generator=g).tolist() for _ in range(3)]
    # The prompt's last row attends before compression, the next one over the 20 kept tokens
    # and itself in both; Loom's window slides from the step after (kvpress's never does).
    out = run_kvpress(model_dir, batch, 2, [1.0, 0.5], threads=2)
    assert out["streaming"]["1.0"] == [hf_greedy(model, p, 2) for p in batch]
    llm = LLM(str(model_dir), block_size=8)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, kv_policy="streaming", kv_budget=20)
    loom = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                                          use_tqdm=False)]
    assert out["streaming"]["0.5"] == loom
    assert len(out["snapkv"]["0.5"]) == 3
