"""Offline throughput: a batch of requests with random prompt and output lengths, Loom's
continuous batching against Hugging Face transformers' static padded batches, same run; and a
lower bound on the workload's time from the machine's measured rates."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from loom import LLM, SamplingParams
from loom.bench import clock
from loom.bench.latency import kv_bytes, weight_bytes
from loom.bench.mfu import layer_shapes, workload_flops
from loom.models.config import ModelConfig


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def random_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))],
                    rng.randint(*output_range)) for _ in range(num_requests)]


def lower_bound(cfg: ModelConfig, dtype: str, workload: list[Request], roof: float, read: float,
                kv_read: float) -> dict[str, float]:
    """A lower bound on the workload's time, for an engine that does nothing but its GEMMs at
    `roof` FLOP/s and decode attention's reads of a KV cache of the model's dtype at `kv_read`
    bytes/s, one after the other: every prompt first (linear layers, causal attention and one LM
    head row at the roof), then a decode step per output position for the requests still
    running, each taking at least the time to read the weights at `read` bytes/s. Returns that
    time, the MFU and output tokens/s it allows, and the KV bytes decode attention reads."""
    prompts = [len(r.prompt_token_ids) for r in workload]
    outputs = [r.output_len for r in workload]
    per_token = 2 * cfg.num_layers * sum(i * o for i, o in layer_shapes(cfg))
    head = 2 * cfg.hidden_size * cfg.vocab_size
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # per (query, key) pair
    seconds = sum(p * per_token + attention * p * (p + 1) // 2 + head for p in prompts) / roof
    weights, kv_token = weight_bytes(cfg, dtype, None), kv_bytes(cfg, dtype, 1, 1)
    decode_kv_bytes = 0.0
    for step in range(1, max(outputs)):
        # the requests computing their step-th output token, each over its prompt and step keys
        contexts = [p + step for p, o in zip(prompts, outputs) if o > step]
        seconds += max(len(contexts) * (per_token + head) / roof, weights / read)
        decode_kv_bytes += kv_token * sum(contexts)
    seconds += decode_kv_bytes / kv_read
    return {"seconds": seconds, "mfu": workload_flops(cfg, prompts, outputs) / seconds / roof,
            "output_tok_per_s": sum(outputs) / seconds, "decode_kv_bytes": decode_kv_bytes}


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
