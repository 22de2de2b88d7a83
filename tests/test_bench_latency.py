"""`loom bench latency`'s breakdown of a decode step: where its time goes, by operator."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from loom import LLM, SamplingParams
from loom.bench.latency import ATTENTION_OPS, LINEAR_OPS, decode_breakdown
from loom.kernels import load_kernels


def test_breakdown_names_real_operators():
    load_kernels()
    for op in LINEAR_OPS | ATTENTION_OPS:
        namespace, name = op.split("::")
        assert hasattr(getattr(torch.ops, namespace), name), op


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_breakdown_splits_a_decode_step(gqa, quantization):
    llm = LLM(str(gqa[0]), enforce_eager=True, quantization=quantization, max_num_seqs=2)
    engine = llm.engine
    for prompt in random_prompts(2, 16):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the prefill
    ms = decode_breakdown(engine)
    assert not engine.has_unfinished_requests()
    assert ms["linear"] > 0 and ms["attention"] > 0 and ms["other"] > 0
    assert ms["linear"] + ms["attention"] + ms["other"] == pytest.approx(ms["profiled_step"])
    with pytest.raises(ValueError, match="no decode steps"):
        decode_breakdown(engine)
