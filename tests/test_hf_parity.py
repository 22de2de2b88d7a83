"""Greedy outputs are token-identical to Hugging Face transformers (fp32), batched."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_tracks, hf_greedy
from loom import LLM, SamplingParams

PROMPT_LENGTHS = (1, 7, 16, 29, 64)
MAX_NEW = 24


def _prompts(seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa", "llama_mqa", "llama_tied", "qwen2_bias", "mistral",
                                  "llama3_scaled"])
def test_greedy_matches_transformers(hf_models, name):
    model_dir, hf = hf_models(name)
    prompts = _prompts(seed=len(name))
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_NEW), f"{name}, prompt of {len(prompt)}"
        assert out.outputs[0].finish_reason == "length"


def test_long_context_beyond_llama3_original_length(hf_models):
    """llama3 rope scaling matters past original_max_position_embeddings (64 here)."""
    model_dir, hf = hf_models("llama3_scaled")
    prompt = _prompts(seed=3)[-1] * 3  # 192 tokens
    out = LLM(str(model_dir)).generate({"prompt_token_ids": prompt},
                                       SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 16)


def test_bfloat16_tracks_fp32(hf_models):
    """bf16 is not bit-identical, but over a whole generated sequence (prompt and 40 tokens,
    teacher-forced) its logprobs stay close to transformers' fp32 ones and it ranks the same
    token first almost everywhere."""
    model_dir, hf = hf_models("llama_gqa")
    prompt = _prompts(seed=5)[3]
    llm = LLM(str(model_dir), dtype="bfloat16")
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    # Measured here: at most 0.21 nats off, 0.03 on average, the same first token at 91-100% of
    # positions over five prompts (the random model has near-ties); fp32 itself is within 1e-4.
    assert_tracks(llm, hf, prompt + out, max_error=0.5, mean_error=0.06, agreement=0.9)
