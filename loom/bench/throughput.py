"""Offline throughput: a batch of requests with random prompt and output lengths, Loom's
continuous batching against Hugging Face transformers' static padded batches, same run."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from loom import LLM, SamplingParams
from loom.bench import clock


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def random_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))],
                    rng.randint(*output_range)) for _ in range(num_requests)]


def run_loom(model_dir: Path, dtype: str, workload: list[Request], **engine_kw) -> dict:
    llm = LLM(str(model_dir), dtype=dtype, **engine_kw)
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    engine = llm.engine
    for r in workload:
        engine.add_request({"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    busiest = None
    steps = generated = 0
    elapsed = 0.0
    while engine.has_unfinished_requests():
        start = clock.now()
        generated += sum(1 for o in engine.step())
        elapsed += clock.now() - start  # the engine's steps alone, not the KV count below
        steps += 1
        s = engine.stats()
        if busiest is None or s.kv_slots_allocated > busiest.kv_slots_allocated:
            busiest = s
    assert generated == sum(r.output_len for r in workload), "every requested token must be generated"
    return {"engine": "loom", "dtype": dtype, "seconds": elapsed, "output_tokens": generated,
            "output_tok_per_s": generated / elapsed, "steps": steps,
            "busiest_step": {"kv_slots_allocated": busiest.kv_slots_allocated, "kv_slots_used": busiest.kv_slots_used,
                             "kv_waste": busiest.kv_waste, "running": busiest.num_running},
            "preemptions": engine.stats().num_preemptions}


def run_hf(model_dir: Path, dtype: str, workload: list[Request], batch_size: int) -> dict:
    """transformers `generate` on static batches in arrival order, each left-padded to its
    longest prompt and run for its longest output; only requested tokens count."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise SystemExit("the Hugging Face peer needs transformers (pip install transformers)") from e
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([[5] * 16]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = clock.now()
        for i in range(0, len(workload), batch_size):
            group = workload[i:i + batch_size]
            width = max(len(r.prompt_token_ids) for r in group)
            ids = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in group])
            mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in group])
            new = max(r.output_len for r in group)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
        elapsed = clock.now() - start
    useful = sum(r.output_len for r in workload)
    return {"engine": f"hf-transformers batch {batch_size}", "dtype": dtype, "batch_size": batch_size,
            "requests": len(workload), "seconds": elapsed, "output_tokens": useful, "output_tok_per_s": useful / elapsed}
