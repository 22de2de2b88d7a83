"""Partitioned decode on this machine: 2 ranks x 1 thread (one torchrun launch) against 1
process x 2 threads, at each batch size, with the bytes the ranks communicate per step and the
KV cache rank 0 holds. `loom bench tp` runs tensor parallel (activations all-reduced through
shared memory, and through gloo) beside the planner's prediction of its bytes; `loom bench
layouts` runs the layouts that split the KV cache (heads, Helix, batch) at a long context.

Each configuration runs in processes of its own (`python -m loom.bench.tp ...`, under torchrun
for 2 ranks); rank 0 writes its figures as JSON. Decode is timed from the step after every
prompt has its first token to the end, compiled graphs warmed up first.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loom.bench import clock
from loom.bench.calibrate import planner_dtype
from loom.planner.collectives import Collective
from loom.planner.hardware import Hardware
from loom.planner.layouts import Layout


def _decode(llm, batch: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    """Decode figures of `batch` requests of `prompt_len` random tokens, `max_tokens` each."""
    import random

    from loom import SamplingParams

    engine, rng = llm.engine, random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending = {engine.add_request({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}, params)
               for _ in range(batch)}
    while pending:  # prefill, until every request has its first token
        pending -= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    before, steps = llm.stats(), 0
    kv_bytes = _rank0_kv_bytes(llm)
    start = clock.now()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = clock.now() - start
    after = llm.stats()
    per_step = {kind: (after.collective_bytes[kind] - before.collective_bytes.get(kind, 0)) / steps
                for kind in after.collective_bytes}
    calls = {kind: (after.collective_calls[kind] - before.collective_calls.get(kind, 0)) / steps
             for kind in after.collective_calls}
    return {"batch": batch, "steps": steps, "ms_per_step": 1000 * seconds / steps,
            "tok_per_s": batch * steps / seconds, "bytes_per_step": per_step, "calls_per_step": calls,
            "rank0_kv_bytes": kv_bytes}


def _rank0_kv_bytes(llm) -> int:
    """Bytes of the KV blocks rank 0 holds now (a pool split over ranks keeps block b on rank b % shards)."""
    runner, blocks = llm.engine.runner, llm.engine.scheduler.block_manager.blocks
    used = sum(1 for b in blocks if b.ref_count > 0 and b.block_id % runner.kv_shards == 0)
    cache = runner.cache
    return used * 2 * len(cache.keys) * cache.keys[0][0].nbytes


def worker(args: argparse.Namespace) -> None:
    """One configuration, in this process (and, under torchrun, its sibling ranks)."""
    from loom import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, tensor_parallel_size=args.tp,
              kv_parallel_size=args.kvp, attention_sharding=args.attention_sharding, all_reduce=args.all_reduce,
              hop_b=args.hop_b,
              max_num_seqs=max(args.batches), max_model_len=args.prompt_len + args.max_tokens + 16,
              kv_cache_memory=args.kv_cache_memory)
    vocab = llm.engine.config.model_config.vocab_size
    llm.generate([{"prompt_token_ids": [5] * 16}] * 2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    rows = [_decode(llm, b, args.prompt_len, args.max_tokens, vocab) for b in args.batches]
    Path(args.out).write_text(json.dumps(rows))


def run(model: Path, dtype: str, tp: int, threads: int, batches: list[int], prompt_len: int,
        max_tokens: int, all_reduce: str = "auto", kvp: int = 1, attention_sharding: str = "heads",
        hop_b: bool = False, kv_cache_memory: int | None = None) -> list[dict]:
    """The decode rows of one configuration (tp x kvp ranks), each rank on `threads` threads."""
    from loom.bench.servers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        args = ["--model", str(model), "--dtype", dtype, "--tp", str(tp), "--kvp", str(kvp), "--attention-sharding",
                attention_sharding, "--threads", str(threads), "--batches", *map(str, batches), "--prompt-len",
                str(prompt_len), "--max-tokens", str(max_tokens), "--all-reduce", all_reduce, "--out", str(out)]
        if kv_cache_memory is not None:
            args += ["--kv-cache-memory", str(kv_cache_memory)]
        if hop_b:
            args.append("--hop-b")
        launcher = [sys.executable]
        if tp * kvp > 1:
            launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(tp * kvp), "--master-addr",
                         "127.0.0.1", "--master-port", str(free_port())]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        subprocess.run([*launcher, "-m", "loom.bench.tp", *args], check=True, env=env)
        return json.loads(out.read_text())


def long_context_mqa_model() -> Path:
    """The 134M reference Llama with one KV head (multi-query) and 8192 positions."""
    from loom.models.reference import REFERENCE_134M, reference_model_dir

    return reference_model_dir(REFERENCE_134M | {"num_key_value_heads": 1, "max_position_embeddings": 8192},
                               name="ref-134m-mqa-8k")


def planner_layout_figures(model: Path, dtype: str, layout: Layout, batch: int, context: float,
                           hardware: Hardware | None) -> dict[str, float]:
    """The planner's figures for one decode step of `layout` at `context` cached tokens per
    sequence, per rank: KV bytes read, Helix's all-to-all bytes and, on calibrated hardware (one
    rank's threads as one chip), the step time."""
    from loom.planner.cost import kv_per_token_per_chip, step_cost
    from loom.planner.layouts import helix_all_to_all
    from loom.planner.presets import from_hf_config
    from loom.planner.workload import Workload, dtype_bytes

    shape = from_hf_config(model)
    kind = planner_dtype(dtype)
    wl = Workload(batch=batch, input_len=int(context), output_len=0, weight_dtype=kind, kv_dtype=kind, act_dtype=kind)
    out = {"kv_bytes_per_step": kv_per_token_per_chip(shape, wl, layout, batch) * context}
    if layout.kind == "helix":
        act = dtype_bytes(kind)
        out["all_to_all_bytes_per_step"] = shape.n_layers * helix_all_to_all(layout, shape, batch, act).nbytes
    if hardware is not None:
        out["ms_per_step"] = 1e3 * step_cost(shape, hardware, wl, layout, batch, 1, context, context)[1].time_s
    return out


def planner_bytes(model: Path, dtype: str, tp: int, batch: int) -> dict[str, float]:
    """The planner's activation collectives of a 1D tensor-parallel decode step, per rank: an
    all-gather and a reduce-scatter per projection pair, which an all-reduce of the same bytes
    is (Loom issues the all-reduce)."""
    from loom.planner.layouts import Layout, layer_collectives
    from loom.planner.presets import from_hf_config
    from loom.planner.workload import dtype_bytes

    shape = from_hf_config(model)
    act = dtype_bytes(planner_dtype(dtype))
    per_layer: list[Collective] = layer_collectives(Layout("1d", tp), shape, batch, 1, 0.0, act)
    reduce_scatter = sum(c.nbytes for c in per_layer if c.kind == "reduce-scatter")
    return {"all_reduce": shape.n_layers * reduce_scatter}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--kvp", type=int, default=1)
    p.add_argument("--attention-sharding", default="heads")
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--batches", type=int, nargs="+", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--all-reduce", default="auto")
    p.add_argument("--hop-b", action="store_true")
    p.add_argument("--out", required=True)
    worker(p.parse_args())
