"""The throughput and prefill peers (each in a venv of its own, built on first use) compute the
same model: greedy, their tokens are Loom's, with prompts of several lengths in flight."""
from __future__ import annotations

import os

import pytest
from conftest import random_prompts

from loom import LLM, SamplingParams

peers = pytest.mark.skipif(os.environ.get("LOOM_TEST_PEERS") != "1",
                           reason="set LOOM_TEST_PEERS=1: OpenVINO GenAI and CTranslate2 install venvs of their own "
                                  "(minutes), so they are not in the default suite")


@peers
@pytest.mark.parametrize("peer", ["openvino", "ctranslate2"])
def test_peer_generates_what_loom_generates(gqa, peer):
    from loom.bench import throughput_peers

    model_dir, _ = gqa
    prompts = [p[:n] for p, n in zip(random_prompts(3, 40, seed=1), (40, 17, 29))]
    lens = [4, 6, 5]
    if peer == "openvino":
        out = throughput_peers.run_openvino(model_dir, "float32", prompts, lens, threads=2)
    else:
        out = throughput_peers.run_ctranslate2(model_dir, "float32", prompts, lens, threads=2, batch_size=3)
    assert out["output_tokens"] == sum(lens) and "seconds" in out
    want = LLM(str(model_dir)).generate({"prompt_token_ids": prompts[0]},
                                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out["first_request_ids"] == want[0].outputs[0].token_ids


@peers
def test_openvino_keeps_an_8_bit_cache_beside_looms_int8_one(gqa):
    """With Loom's int8 KV cache, OpenVINO runs its own 8-bit one (its rounding differs from
    Loom's, so the tokens are not compared)."""
    from loom.bench import throughput_peers

    model_dir, _ = gqa
    prompts, lens = random_prompts(2, 30, seed=4), [5, 3]
    out = throughput_peers.run_openvino(model_dir, "float32", prompts, lens, threads=2, kv_cache_dtype="int8")
    assert out["kv_cache_precision"] == "u8" and out["output_tokens"] == 8


@peers
def test_openvino_prefill_samples_what_loom_samples(gqa):
    from loom.bench import throughput_peers

    model_dir, _ = gqa
    prompts = {17: random_prompts(2, 17, seed=2), 40: random_prompts(2, 40, seed=3)}
    out = throughput_peers.run_openvino_prefill(model_dir, "float32", prompts, threads=2)
    assert set(out["ttft_s"]) == {"17", "40"} and all(s > 0 for s in out["ttft_s"].values())
    llm = LLM(str(model_dir))
    for n, ps in prompts.items():
        want = [o.outputs[0].token_ids[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)]
        assert out["first_tokens"][str(n)] == want
