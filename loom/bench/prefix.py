"""Prefix caching: requests sharing a long prefix, with and without the cache, same run."""
from __future__ import annotations

import random
from pathlib import Path

from loom import LLM, SamplingParams
from loom.bench import clock


def run(model_dir: Path, dtype: str, num_requests: int, prefix_len: int, tail_len: int, output_len: int,
        vocab_size: int, enable_prefix_caching: bool, seed: int = 0) -> dict:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(prefix_len)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(3, vocab_size) for _ in range(tail_len)]}
               for _ in range(num_requests)]
    llm = LLM(str(model_dir), dtype=dtype, enable_prefix_caching=enable_prefix_caching)
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = clock.now()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = clock.now() - start
    stats = llm.stats()
    return {"prefix_caching": enable_prefix_caching, "seconds": elapsed,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "token_ids": [o.outputs[0].token_ids for o in outs]}
