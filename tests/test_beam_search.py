"""Beam search: the same best beam as transformers' generate(num_beams=W), on shared blocks."""
from __future__ import annotations

import pytest
import torch

from conftest import build_hf_model
from loom import LLM

PROMPTS = [[5, 9, 33, 71, 2, 200, 14], [7, 8], list(range(10, 60))]
MAX_NEW = 12


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory):
    # A smaller init spread than the other fixtures: flatter distributions make beams that
    # end at EOS (id 2) at different lengths, so the length penalty decides between them.
    d = tmp_path_factory.mktemp("beam")
    return d, build_hf_model(d, "llama_gqa", std=0.05)


def hf_beam(hf, prompt, width, length_penalty):
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=width, do_sample=False,
                          max_new_tokens=MAX_NEW, length_penalty=length_penalty, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
def test_best_beam_matches_transformers(beam_model, width, length_penalty):
    model_dir, hf = beam_model
    llm = LLM(str(model_dir))
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], width, MAX_NEW, length_penalty,
                           use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_beam(hf, prompt, width, length_penalty)
        assert len(out.outputs) == width
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_some_beams_end_early_with_eos(beam_model):
    """The comparison above must cover hypotheses finishing at EOS, not only at max length."""
    model_dir, _ = beam_model
    outs = LLM(str(model_dir)).beam_search([{"prompt_token_ids": p} for p in PROMPTS], 4, MAX_NEW, 0.5, use_tqdm=False)
    assert any(o.finish_reason == "stop" and len(o.token_ids) < MAX_NEW for out in outs for o in out.outputs)


def test_beams_share_blocks(beam_model):
    model_dir, _ = beam_model
    llm = LLM(str(model_dir))
    engine = llm.engine
    prompt = list(range(3, 200))  # 13 blocks: every beam would need its own 13 without sharing
    engine.add_beam_request({"prompt_token_ids": prompt}, 4, MAX_NEW, ignore_eos=True)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, llm.stats().num_blocks - llm.stats().num_free_blocks)
    assert most <= 13 + 4 * 2  # the shared prompt, plus each beam's own tail (and one CoW copy)


def test_beam_search_under_preemption(beam_model):
    model_dir, hf = beam_model
    # 2 layers x 2 kv heads x 8 dims x 2 x 4 bytes = 256 B per token, 4 KiB per block
    small = LLM(str(model_dir), kv_cache_memory=24 * 4096, max_model_len=128, max_num_batched_tokens=64)
    prompts = [{"prompt_token_ids": list(range(3 + i, 60 + i))} for i in range(4)]
    outs = small.beam_search(prompts, 4, MAX_NEW, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    ref = LLM(str(model_dir)).beam_search(prompts, 4, MAX_NEW, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert small.stats().num_free_blocks == small.stats().num_blocks


def test_bad_beam_width(beam_model):
    llm = LLM(str(beam_model[0]))
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search({"prompt_token_ids": [4, 5]}, 0, 4)
