"""Prefill: the time to the first token of one prompt on an idle engine, Loom beside llama.cpp
and OpenVINO GenAI on the same prompts, and Loom's with most of the prompt already cached."""
from __future__ import annotations

import random
import statistics
from pathlib import Path

from loom import LLM, SamplingParams
from loom.bench import clock


def random_prompts(lens: list[int], repeats: int, vocab_size: int, seed: int = 0) -> dict[int, list[list[int]]]:
    """`repeats` random prompts of each length, all different (no engine can reuse one's prefix)."""
    rng = random.Random(seed)
    return {n: [[rng.randrange(3, vocab_size) for _ in range(n)] for _ in range(repeats)] for n in lens}


def run_loom(model_dir: Path, dtype: str, prompts: dict[int, list[list[int]]], cached: int) -> dict:
    """Median seconds to the first token of each length's prompts (none of them cached), and of
    the longest prompts again with a new tail after their first `cached` tokens, which the first
    pass left in the prefix cache."""
    llm = LLM(str(model_dir), dtype=dtype, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        start = clock.now()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return clock.now() - start

    ttft([5] * 64)  # warm-up
    uncached = {n: statistics.median(ttft(p) for p in ps) for n, ps in prompts.items()}
    longest = max(prompts)
    # a new tail: the whole prompt differs from anything cached but its first `cached` tokens
    hit = statistics.median(ttft(p[:cached] + [3 + (t + 1) % 1000 for t in p[cached:]]) for p in prompts[longest])
    return {"engine": "loom", "dtype": dtype, "ttft_s": uncached,
            "cached": {"prompt_len": longest, "cached_tokens": cached, "ttft_s": hit,
                       "ratio_to_uncached": hit / uncached[longest]}}
