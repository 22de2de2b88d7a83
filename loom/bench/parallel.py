"""Parallel sampling: n samples forked from one prefill (blocks shared) against n separate
requests with prefix caching off (each prefills and stores the prompt itself), same run."""
from __future__ import annotations

import random
from pathlib import Path

from loom import LLM, SamplingParams
from loom.bench import clock


def run(model_dir: Path, dtype: str, n: int, prompt_len: int, output_len: int, vocab_size: int,
        forked: bool, seed: int = 0) -> dict:
    rng = random.Random(seed)
    prompt = {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(prompt_len)]}
    llm = LLM(str(model_dir), dtype=dtype, enable_prefix_caching=forked)
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    engine = llm.engine
    if forked:
        engine.add_request(prompt, SamplingParams(n=n, temperature=1.0, max_tokens=output_len, ignore_eos=True,
                                                  seed=seed))
    else:
        for k in range(n):
            engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True,
                                                      seed=seed + k))
    peak_blocks = 0
    start = clock.now()
    while engine.has_unfinished_requests():
        engine.step()
        stats = llm.stats()
        peak_blocks = max(peak_blocks, stats.num_blocks - stats.num_free_blocks)
    elapsed = clock.now() - start
    cache = engine.runner.cache
    block_bytes = cache.keys[0][0].nbytes * 2 * len(cache.keys)
    return {"mode": f"n={n} forked" if forked else f"{n} separate requests", "seconds": elapsed,
            "peak_kv_blocks": peak_blocks, "peak_kv_bytes": peak_blocks * block_bytes}
