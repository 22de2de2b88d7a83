"""`loom bench throughput | attention | parallel | prefill | latency | planner | quality | prefix | serve |
kv-quality | kv-speed`: each writes docs/benchmarks/<name>.json and .png."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.bench.serve import ServeRequest
    from loom.bench.servers import Launched

SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "corpora" / "tinyshakespeare.txt"


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (JSON + PNG under docs/benchmarks/)")
    sub = bench.add_subparsers(dest="bench", required=True)

    def common(p: argparse.ArgumentParser, default_model: str = "the 134M random reference Llama") -> None:
        p.add_argument("--model", default=None, help=f"model directory (default: {default_model})")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--out-dir", type=Path, default=None)

    def sizes(p: argparse.ArgumentParser, **defaults: int) -> None:
        """Integer options of one workload (--name-with-dashes N), with their defaults."""
        for name, default in defaults.items():
            p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)

    def decode_run(p: argparse.ArgumentParser, batches: list[int], max_tokens: int) -> None:
        """Options of the runs that time the engine's decode steps (latency, planner)."""
        p.add_argument("--batches", type=int, nargs="+", default=batches)
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--max-tokens", type=int, default=max_tokens)
        p.add_argument("--repeats", type=int, default=3)

    t = sub.add_parser("throughput", help="offline throughput vs transformers static batches")
    common(t)
    t.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    t.add_argument("--num-requests", type=int, default=64)
    t.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 8, 16])
    t.add_argument("--hf-batch1-requests", type=int, default=8,
                   help="requests the batch-1 peer runs (its rate is measured on this prefix of the workload)")
    t.add_argument("--peers", nargs="*", default=["hf", "openvino", "ctranslate2"],
                   choices=["hf", "openvino", "ctranslate2"],
                   help="peers run beside Loom (OpenVINO GenAI and CTranslate2 each install into a venv of their own)")
    t.add_argument("--ct2-batch-sizes", type=int, nargs="+", default=[8, 16])
    t.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="Loom's KV cache (int8: OpenVINO keeps its 8-bit cache too)")
    t.set_defaults(func=_throughput)

    a = sub.add_parser("attention", help="paged decode and prefill attention vs contiguous SDPA")
    common(a)
    a.add_argument("--batch", type=int, default=16)
    a.add_argument("--context", type=int, default=1024)
    a.add_argument("--prefill-tokens", type=int, default=512,
                   help="the prefill case's chunk: the last this many of --context tokens")
    a.set_defaults(func=_attention)

    pf = sub.add_parser("prefill", help="time to the first token of one prompt vs llama.cpp and OpenVINO GenAI, "
                                        "and with most of it cached")
    common(pf)
    pf.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    pf.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2047],
                    help="prompt lengths (the reference model's 2048 positions hold 2047 and the sampled token)")
    pf.add_argument("--cached", type=int, default=1536, help="tokens of the longest prompt already in the prefix cache")
    pf.add_argument("--repeats", type=int, default=3, help="prompts of each length (medians)")
    pf.add_argument("--peers", nargs="*", default=["llamacpp", "openvino"], choices=["llamacpp", "openvino"])
    pf.set_defaults(func=_prefill)

    n = sub.add_parser("parallel", help="n samples forked from one prefill vs n separate requests")
    common(n)
    n.add_argument("--dtype", default="float32")
    sizes(n, n=8, prompt_len=512, output_len=64)
    n.set_defaults(func=_parallel)

    tp = sub.add_parser("tp", help="tensor parallel: 2 ranks x 1 thread vs 1 process x 2 threads, and bytes "
                                   "communicated per step vs the planner")
    common(tp)
    tp.add_argument("--dtype", default="bfloat16")
    tp.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    sizes(tp, prompt_len=128, max_tokens=64)
    tp.set_defaults(func=_tp)

    lay = sub.add_parser("layouts", help="long-context decode on 2 ranks: tensor parallel by heads, Helix KV "
                                         "parallel, attention by batch (a multi-query model)")
    common(lay)
    lay.add_argument("--dtype", default="bfloat16")
    lay.add_argument("--batches", type=int, nargs="+", default=[4])
    lay.add_argument("--hardware", default=None,
                     help="the planner's hardware for its predicted step times (this-machine: `loom calibrate` "
                          "at one rank's threads)")
    sizes(lay, prompt_len=4096, max_tokens=32)
    lay.set_defaults(func=_layouts)

    lt = sub.add_parser("latency", help="small-batch decode speed and MBU vs transformers and llama.cpp")
    common(lt)
    decode_run(lt, batches=[1, 8], max_tokens=128)
    lt.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer (its venv build takes minutes)")
    lt.add_argument("--checkpoints", type=Path, nargs="*", default=[],
                    help="also time these checkpoints of the model, as they are (a quantized one, say)")
    lt.add_argument("--gguf", help="llama.cpp also runs this file (or pkg:NAME's), at batch 1: the GGUF the model "
                                   "was converted from, say; its ratio is taken against Loom's int4")
    lt.add_argument("--rounds", type=int, default=3, help="passes over all engines; results are medians over them")
    lt.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                    help="Loom's KV cache (int8: llama.cpp's is q8_0, and transformers, which has no such cache "
                         "of its own, is left out)")
    lt.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="Loom's decode steps run at once where every row takes its argmax (every timed row "
                         "here does): the engine's per-step Python is paid once for them")
    lt.set_defaults(func=_latency)

    pl = sub.add_parser("planner", help="the planner's predicted decode step times vs Loom's measured ones")
    common(pl)
    pl.add_argument("--weights", nargs="+", default=["bf16", "int8", "int4", "fp32"],
                    help="weight formats (bf16, int8, int4, fp32)")
    decode_run(pl, batches=[1, 8, 32], max_tokens=64)
    pl.add_argument("--hardware", type=Path,
                    help="hardware JSON written by `loom calibrate` under this run's conditions "
                         "(threads, step mode, linear dispatch plans; default: calibrate now)")
    pl.set_defaults(func=_planner)

    q = sub.add_parser("quality", help="held-out loss, needles and quantized agreement, through the engine")
    common(q, default_model="the house model")
    q.add_argument("--corpus", type=Path, default=SHAKESPEARE,
                   help="text whose last 10%% is scored (the house model trained on the rest)")
    q.add_argument("--needles", type=int, default=None,
                   help="fresh needles per context length (default: 200 for the house model, whose format they "
                        "are, else none)")
    q.add_argument("--window", type=int, default=1024, help="tokens per scored window of the held-out text")
    q.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024])
    q.add_argument("--quantization", nargs="*", default=["int8", "int4"],
                   help="also score these weight-only variants against bf16 (fp32 is scored too: the noise floor)")
    q.add_argument("--checkpoints", type=Path, nargs="*", default=[],
                   help="also score these checkpoints of the same model against bf16 (a quantized one, say)")
    q.set_defaults(func=_quality)

    sv = sub.add_parser("serve", help="an OpenAI-compatible server under load: TTFT, TPOT, ITL, throughput")
    sv.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000 (or --launch)")
    sv.add_argument("--model", help="the model name that server answers to")
    sv.add_argument("--launch", nargs="+", choices=LAUNCH_TARGETS, default=None,
                    help="start these on --launch-model, one run each per round: loom serve; offline (Loom's engine in "
                         "this process, no HTTP: the server's overhead); llama-server (built once from llama.cpp's "
                         "sources) and llama-cpp-python (its OpenAI server), on the same weights as GGUF")
    sv.add_argument("--launch-model", type=Path, default=None,
                    help="model directory for --launch (default: the 134M random reference Llama with the house "
                         "model's tokenizer)")
    sv.add_argument("--weights", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16", "int8", "int4"],
                    help="with --launch: a run per format (llama.cpp: f32, bf16, q8_0, q4_0)")
    sv.add_argument("--threads", type=int, default=2, help="with --launch: threads per server")
    sv.add_argument("--cold-start", action="store_true",
                    help="with --launch loom: first start it on an empty compile cache and time it to its first "
                         "answer, then start it again on that cache (warm) for the run")
    sv.add_argument("--label", default=None, help="names the report: serve-<label>.json (default: the model)")
    sv.add_argument("--num-requests", type=int, default=128)
    sv.add_argument("--rounds", type=int, default=1,
                    help="with --launch: run every target this many times, taking turns, each round on fresh "
                         "prompts (nothing cached from the round before); ratios are medians over rounds")
    load = sv.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="requests in flight at once (default: 16)")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests per second")
    sv.add_argument("--duration", type=float, default=None,
                    help="with --request-rate: send requests for this many seconds (a soak), sampling the launched "
                         "server's resident memory and KV usage as it runs")
    sv.add_argument("--prompt-len", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"))
    sv.add_argument("--output-len", type=int, nargs=2, default=[128, 256], metavar=("MIN", "MAX"))
    sv.add_argument("--tokenizer", type=Path, default=None,
                    help="send text prompts made with this model directory's tokenizer (default with --launch: the "
                         "launched model's, if it has one; else token ids)")
    sv.add_argument("--vocab-size", type=int, default=None,
                    help="prompt ids are drawn below it (default: the server's /tokenizer_info)")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--out-dir", type=Path, default=None)
    sv.set_defaults(func=_serve_bench)

    kv = sub.add_parser("kv-speed", help="KV compression: decode speed, KV memory per sequence, largest batch")
    common(kv, "the 134M random reference Llama, 4096 positions")
    kv.add_argument("--dtype", default="bfloat16")
    sizes(kv, batch=8, prompt_len=2048, output_len=256, capacity_requests=32, rounds=1)
    kv.set_defaults(func=_kv_speed)

    kq = sub.add_parser("kv-quality", help="KV compression: ROUGE against the full cache and needles, per budget")
    common(kq, default_model="the house model")
    kq.add_argument("--dtype", default="float32")
    kq.add_argument("--corpus", type=Path, default=SHAKESPEARE,
                    help="text whose last 10%% gives the prompts and the needles' haystacks")
    sizes(kq, prompts=32, prompt_len=512, max_tokens=64, needles=50, needle_context=1024)
    kq.add_argument("--kvpress", action="store_true",
                    help="also run kvpress's StreamingLLM and SnapKV presses on the same needles (a venv of its own)")
    kq.set_defaults(func=_kv_quality)

    p = sub.add_parser("prefix", help="prefix caching on vs off for requests sharing a prefix")
    common(p)
    p.add_argument("--dtype", default="float32")
    sizes(p, num_requests=32, prefix_len=768, tail_len=32, output_len=32)
    p.set_defaults(func=_prefix)


def _setup(args: argparse.Namespace) -> tuple[Path, int]:
    import torch

    from loom.models.reference import reference_model_dir
    from loom.models.config import ModelConfig

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else reference_model_dir()
    return model, ModelConfig.from_dir(model).vocab_size


_PEER_LABELS = {"hf": "HF b", "openvino": "OpenVINO", "ctranslate2": "CT2 b"}


def _throughput_peer_runs(args: argparse.Namespace, model: Path, dtype: str, workload: list) -> list:
    """(peer, the requests it runs, a call that runs them) for each peer run asked for."""
    from loom.bench import throughput as tp
    from loom.bench import throughput_peers

    def ids(requests: list) -> tuple[list[list[int]], list[int]]:
        return [r.prompt_token_ids for r in requests], [r.output_len for r in requests]

    runs = []
    if "hf" in args.peers:
        for bs in args.hf_batch_sizes:
            subset = workload[: args.hf_batch1_requests] if bs == 1 else workload
            runs.append(("hf", subset, lambda subset=subset, bs=bs: tp.run_hf(model, dtype, subset, bs)))
    if "openvino" in args.peers:
        runs.append(("openvino", workload,
                     lambda: throughput_peers.run_openvino(model, dtype, *ids(workload), args.threads,
                                                           args.kv_cache_dtype)))
    if "ctranslate2" in args.peers:
        for bs in args.ct2_batch_sizes:
            runs.append(("ctranslate2", workload, lambda bs=bs: throughput_peers.run_ctranslate2(
                model, dtype, *ids(workload), args.threads, bs)))
    return runs


def _throughput(args: argparse.Namespace) -> None:
    import torch

    from loom.bench import mfu
    from loom.bench import throughput as tp
    from loom.bench.calibrate import kv_bandwidth, memory_bandwidth, planner_dtype
    from loom.bench.report import bar_plot, write_report
    from loom.models.config import ModelConfig

    model, vocab = _setup(args)
    config = ModelConfig.from_dir(model)
    workload = tp.random_workload(args.num_requests, (32, 512), (32, 256), vocab)

    def model_flops(requests: list) -> float:
        return mfu.workload_flops(config, [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests])

    rows = []
    for dtype in args.dtypes:
        gemm = mfu.gemm_roof(config, getattr(torch, dtype))
        loom = tp.run_loom(model, dtype, workload, kv_cache_dtype=args.kv_cache_dtype)
        loom["mfu"] = model_flops(workload) / loom["seconds"] / gemm["roof"]
        print(f"[{dtype}] loom: {loom['output_tok_per_s']:.1f} tok/s, MFU {loom['mfu']:.2f} of "
              f"{gemm['roof'] / 1e9:.0f} GFLOP/s, busiest-step KV waste {loom['busiest_step']['kv_waste'] * 100:.2f}%",
              flush=True)
        bound = None
        if args.kv_cache_dtype == "auto":  # the bound models a cache of the model's dtype
            # Measured after Loom's run: nothing the rates allocate comes before the timed steps.
            read = memory_bandwidth()
            kv_read = kv_bandwidth((planner_dtype(dtype),))[planner_dtype(dtype)]
            bound = {**tp.lower_bound(config, dtype, workload, gemm["roof"], read, kv_read),
                     "read_bytes_per_s": read, "kv_read_bytes_per_s": kv_read}
            print(f"[{dtype}] bound: GEMMs at the roof, weights read at {read / 1e9:.1f} GB/s, decode attention's "
                  f"{bound['decode_kv_bytes'] / 1e9:.1f} GB of KV at {kv_read / 1e9:.1f} GB/s: "
                  f"{bound['output_tok_per_s']:.0f} tok/s (Loom {loom['output_tok_per_s'] / bound['output_tok_per_s']:.0%} "
                  f"of it), MFU {bound['mfu']:.2f}", flush=True)
        peers = []
        for peer, subset, run in _throughput_peer_runs(args, model, dtype, workload):
            try:
                result = run()
            except RuntimeError as e:  # a peer that cannot install or run is reported, not fatal
                result = {"dtype": dtype, "skipped": str(e)}
            result["peer"] = peer
            result.pop("first_request_ids", None)  # what the peers' tests compare, not a figure
            if "skipped" in result:
                print(f"[{dtype}] {peer} skipped: {result['skipped']}", flush=True)
            else:
                result["mfu"] = model_flops(subset) / result["seconds"] / gemm["roof"]
                print(f"[{dtype}] {result['engine']}: {result['output_tok_per_s']:.1f} tok/s, MFU {result['mfu']:.2f}",
                      flush=True)
            peers.append(result)
        row = {"dtype": dtype, "gemm_flops_per_s": gemm, "loom": loom, "peers": peers}
        if bound is not None:
            row["bound"] = bound
        for name, group in (("hf", ("hf",)), ("openvino_ctranslate2", ("openvino", "ctranslate2"))):
            ran = [r for r in peers if r["peer"] in group and "skipped" not in r]
            if ran:
                best = max(ran, key=lambda r: r["output_tok_per_s"])
                row[f"best_{name}"] = best["engine"]
                row[f"speedup_vs_best_{name}"] = loom["output_tok_per_s"] / best["output_tok_per_s"]
                print(f"[{dtype}] loom / {best['engine']} = {row[f'speedup_vs_best_{name}']:.2f}x", flush=True)
        rows.append(row)
    results = {"model": str(model), "kv_cache_dtype": args.kv_cache_dtype,
               "workload": {"num_requests": args.num_requests, "prompt_len": [32, 512],
                            "output_len": [32, 256], "ignore_eos": True, "greedy": True},
               "mfu": "model FLOPs of the requested tokens (linear layers, LM head, attention) / seconds / the "
                      "faster of torch's and Loom's GEMM over 512 rows of the model's layer shapes, same run",
               "bound": "the least time an engine doing nothing but the workload's GEMMs at the roof and decode "
                        "attention's KV reads at the rate Loom's decode kernel reached in this run, one after the "
                        "other, could take (decode steps no shorter than a read of the weights at the memory "
                        "probe's rate); caches of the model's dtype only",
               "results": rows}
    int8 = args.kv_cache_dtype == "int8"
    path = write_report("throughput-kv-int8" if int8 else "throughput", results, args.out_dir)
    labels, values = [], []
    for r in rows:
        labels.append(f"Loom\n{r['dtype']}\nMFU {r['loom']['mfu']:.2f}")
        values.append(r["loom"]["output_tok_per_s"])
        for p in r["peers"]:
            if "skipped" not in p:
                labels.append(f"{_PEER_LABELS[p['peer']]}{p.get('batch_size', '')}\n{r['dtype']}\nMFU {p['mfu']:.2f}")
                values.append(p["output_tok_per_s"])
    bar_plot(path.with_suffix(".png"), f"Output tokens/s, {args.num_requests} requests, {args.threads} threads"
             + (", int8 KV cache (OpenVINO: u8)" if int8 else ""),
             labels, values, "output tok/s")
    print(f"wrote {path}")


def _prefill(args: argparse.Namespace) -> None:
    import torch

    from loom.bench import llamacpp, mfu, prefill, throughput_peers
    from loom.bench.report import bar_plot, write_report
    from loom.models.config import ModelConfig

    model, vocab = _setup(args)
    config = ModelConfig.from_dir(model)
    if not 0 < args.cached < max(args.prompt_lens):
        raise ValueError(f"--cached: must be between 0 and the longest prompt, got {args.cached}")
    prompts = prefill.random_prompts(args.prompt_lens, args.repeats, vocab)
    gguf_types = {"float32": "f32", "bfloat16": "bf16"}
    rows = []
    for dtype in args.dtypes:
        roof = mfu.gemm_roof(config, getattr(torch, dtype))["roof"]
        engines = [prefill.run_loom(model, dtype, prompts, args.cached)]
        if "llamacpp" in args.peers:
            gguf = llamacpp.peer_gguf(model, gguf_types[dtype])
            engines.append({"engine": "llama.cpp", "dtype": gguf_types[dtype], "ttft_s": {
                n: llamacpp.run_llamacpp(gguf, ps[0], 2, args.threads, len(ps))["prefill_ms"] / 1e3
                for n, ps in prompts.items()}})
        if "openvino" in args.peers:
            try:
                engines.append(throughput_peers.run_openvino_prefill(model, dtype, prompts, args.threads))
            except RuntimeError as e:  # a peer that cannot install or run is reported, not fatal
                engines.append({"engine": "openvino-genai LLMPipeline", "dtype": dtype, "skipped": str(e)})
        for e in engines:
            if "skipped" in e:
                print(f"[{dtype}] {e['engine']} skipped: {e['skipped']}", flush=True)
                continue
            e["ttft_s"] = {int(n): s for n, s in e["ttft_s"].items()}
            e["prompt_tok_per_s"] = {n: n / s for n, s in e["ttft_s"].items()}
            e["mfu"] = {n: mfu.request_flops(config, n, 1) / s / roof for n, s in e["ttft_s"].items()}
            print(f"[{dtype}] {e['engine']}: " + ", ".join(
                f"{n} tokens {s * 1e3:.0f} ms ({e['prompt_tok_per_s'][n]:.0f} tok/s, MFU {e['mfu'][n]:.2f})"
                for n, s in e["ttft_s"].items()), flush=True)
        loom = engines[0]
        c = loom["cached"]
        print(f"[{dtype}] loom, {c['cached_tokens']} of {c['prompt_len']} tokens cached: {c['ttft_s'] * 1e3:.0f} ms, "
              f"{c['ratio_to_uncached']:.2f} of uncached", flush=True)
        ratios = {f"loom / {e['engine']}, {n} tokens": e["ttft_s"][n] / loom["ttft_s"][n]
                  for e in engines[1:] if "skipped" not in e for n in e["ttft_s"]}
        for name, r in ratios.items():
            print(f"[{dtype}] {name}: {r:.2f}x", flush=True)
        rows.append({"dtype": dtype, "gemm_roof_flops_per_s": roof, "engines": engines, "speedups": ratios})
    path = write_report("prefill", {"model": str(model), "prompt_lens": args.prompt_lens, "repeats": args.repeats,
                                    "mfu": "model FLOPs of the prompt (linear layers, attention, one LM head row) "
                                           "/ time to first token / the run's GEMM roof", "results": rows},
                        args.out_dir)
    labels, values = [], []
    for r in rows:
        for e in r["engines"]:
            for n, v in e.get("prompt_tok_per_s", {}).items():
                labels.append(f"{e['engine'].split()[0]}\n{r['dtype']}\n{n} tokens")
                values.append(v)
    bar_plot(path.with_suffix(".png"), "Prefill of one prompt: prompt tokens/s to the first token", labels, values,
             "prompt tok/s")
    print(f"wrote {path}")


def _attention(args: argparse.Namespace) -> None:
    import torch

    from loom.bench import attention
    from loom.bench.report import bar_plot, write_report
    from loom.models.config import ModelConfig

    model, _ = _setup(args)
    cfg = ModelConfig.from_dir(model)
    dtypes = (torch.float32, torch.bfloat16)
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16)
    decode = [attention.run(args.batch, args.context, *shape, dtype, layers=cfg.num_layers) for dtype in dtypes]
    prefill = [attention.run_prefill(args.prefill_tokens, args.context, *shape, dtype) for dtype in dtypes]
    for case, rows in (("decode", decode), ("prefill", prefill)):
        for r in rows:
            print(f"[{case} {r['dtype']}] paged {r['paged_ms']:.3f} ms, contiguous SDPA {r['contiguous_sdpa_ms']:.3f} ms, "
                  f"ratio {r['ratio_paged_over_contiguous']:.3f}; int8 pool {r['paged_int8_ms']:.3f} ms "
                  f"({r['speedup_int8']:.2f}x)")
    for r in decode:
        print(f"[decode {r['dtype']} mixed contexts] paged {r['paged_mixed_contexts_ms']:.3f} ms "
              f"({r['paged_mixed_contexts_GBps']:.1f} GB/s, against {r['paged_GBps']:.1f} over full contexts)")
        print(f"[decode {r['dtype']} scored] h2o {r['scored_h2o_ms']:.3f} ms "
              f"({r['scoring_overhead']['h2o']:+.1%}), keyformer {r['scored_keyformer_ms']:.3f} ms "
              f"({r['scoring_overhead']['keyformer']:+.1%})")
    path = write_report("paged_attention", {"batch": args.batch, "context": args.context, "decode_layers": cfg.num_layers,
                                            "prefill_tokens": args.prefill_tokens, "heads": cfg.num_heads,
                                            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                                            "block_size": 16, "results": decode, "prefill": prefill}, args.out_dir)
    common = (("paged int8", "paged_int8_ms"), ("SDPA", "contiguous_sdpa_ms"))
    bars = {"decode": (("Loom paged", "paged_ms"), ("Loom paged,\nmixed contexts", "paged_mixed_contexts_ms")) + common,
            "prefill": (("Loom paged", "paged_ms"),) + common}
    shown = [(f"{case}\n{name}\n{r['dtype']}", r[key]) for case, results in (("decode", decode), ("prefill", prefill))
             for r in results for name, key in bars[case]]
    bar_plot(path.with_suffix(".png"), f"Attention per layer: decode at batch {args.batch}, context "
             f"{args.context} (mixed: row b sees (b + 1) / {args.batch} of it), over {cfg.num_layers} layers' "
             f"caches; prefill of the last {args.prefill_tokens} tokens",
             [label for label, _ in shown], [ms for _, ms in shown], "ms per layer (median)")
    print(f"wrote {path}")


def _kv_quality(args: argparse.Namespace) -> None:
    import torch

    from loom import LLM
    from loom.bench import kv_quality
    from loom.bench.quality import split_corpus
    from loom.bench.report import report_name, write_report
    from loom.cli.generate import DEFAULT_MODEL

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else DEFAULT_MODEL
    if not args.corpus.is_file():
        raise SystemExit(f"--corpus: {args.corpus} does not exist")
    train_text, heldout_text = split_corpus(args.corpus)
    llm = LLM(str(model), dtype=args.dtype)
    prompts = kv_quality.passages(llm, heldout_text, args.prompts, args.prompt_len, args.max_tokens)
    samples = kv_quality.needles(llm, train_text, heldout_text, args.needle_context, args.needles)
    result = kv_quality.evaluate(llm, prompts, samples, args.max_tokens)
    if args.kvpress:
        kv_quality.kvpress_needles(llm, model, samples, result["rows"], args.threads)
    for r in result["rows"]:
        needle = "" if r["needle_accuracy"] is None else f", needles {r['needle_accuracy']:.2f}"
        if "kvpress_needle_accuracy" in r:
            needle += f" (kvpress {r['kvpress_needle_accuracy']:.2f})"
        print(f"[{r['policy']} {r['budget']:.0%}] ROUGE-1 {r['rouge1']:.3f}, ROUGE-2 {r['rouge2']:.3f}, "
              f"ROUGE-L {r['rougeL']:.3f}, held-out loss {r['heldout_loss']:.3f}{needle}", flush=True)
    path = write_report(report_name("kv_quality", model, DEFAULT_MODEL),
                        {"model": str(model), "dtype": args.dtype, "prompts": args.prompts, "prompt_len": args.prompt_len,
                         "max_tokens": args.max_tokens, "needles": args.needles, "needle_context": args.needle_context,
                         **result}, args.out_dir)
    kv_quality.plot(path.with_suffix(".png"), f"{model.name}: {args.prompts} prompts of {args.prompt_len} tokens, "
                    f"{args.max_tokens} greedy (or teacher-forced) tokens; {args.needles} needles in "
                    f"{args.needle_context} tokens",
                    result["rows"])
    print(f"wrote {path}")


def _kv_speed(args: argparse.Namespace) -> None:
    import torch

    from loom.bench import kv_speed
    from loom.bench.latency import weight_bytes
    from loom.bench.report import write_report
    from loom.models.config import ModelConfig

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else kv_speed.long_context_model()
    model_config = ModelConfig.from_dir(model)
    shape = dict(prompt_len=args.prompt_len, output_len=args.output_len, vocab_size=model_config.vocab_size)
    # Every decode case's steps in turn within a round, so that the machine's drift hits all
    # alike; the scored policies with a budget nothing reaches (every step scored, nothing
    # dropped) give what scoring alone costs against the full cache.
    cases = [*kv_speed.CASES, *((policy, kv_speed.NEVER_REACHED) for policy in kv_speed.SCORED)]
    rounds: list[list[dict]] = [[] for _ in cases]
    for _ in range(args.rounds):
        decoded = kv_speed.run_decodes(model, args.dtype, cases, args.batch, **shape, threads=args.threads)
        for d, runs in zip(decoded, rounds):
            runs.append(d)
            print(f"[{kv_speed.label(d)}] batch {args.batch}: {d['decode_tok_per_s']:.1f} tok/s, "
                  f"{d['ms_per_step']:.1f} ms/step, {d['kv_bytes_per_seq'] / 2**20:.1f} MiB KV per sequence",
                  flush=True)
    medians = [kv_speed.median_run(runs) for runs in rounds]
    decode, scoring = medians[:len(kv_speed.CASES)], medians[len(kv_speed.CASES):]
    for s in scoring:
        s["overhead_vs_full"] = s["ms_per_step"] / decode[0]["ms_per_step"] - 1
        print(f"[{kv_speed.label(s)}] {s['ms_per_step']:.1f} ms/step, {s['overhead_vs_full']:+.1%} against full",
              flush=True)
    # The fixed memory: what the full cache needs for the decode run's batch.
    memory = round(decode[0]["kv_bytes_per_seq"] * args.batch)
    capacity = []
    for policy, budget in kv_speed.CASES:
        capacity.append(kv_speed.run_capacity(model, args.dtype, policy, budget, memory, args.capacity_requests,
                                              **shape))
        c = capacity[-1]
        print(f"[{kv_speed.label(c)}] {memory / 2**20:.0f} MiB of KV: {c['largest_batch']} sequences at once, "
              f"{c['preemptions']} preemptions", flush=True)
    full = decode[0]
    kv_speed.add_memory_bound(decode, weight_bytes(model_config, args.dtype, None))
    for d, c in zip(decode, capacity):
        d["decode_vs_full"] = d["decode_tok_per_s"] / full["decode_tok_per_s"]
        c["batch_vs_full"] = c["largest_batch"] / capacity[0]["largest_batch"]
        print(f"[{kv_speed.label(d)}] {d['decode_vs_full']:.2f}x full's decode; reading "
              f"{d['bytes_per_step'] / 2**20:.0f} MiB a step at {d['GBps']:.1f} GB/s, memory bound "
              f"{d['memory_bound_vs_full']:.2f}x", flush=True)
    path = write_report("kv_speed", {"model": str(model), "dtype": args.dtype, **shape, "batch": args.batch,
                                     "decode": decode, "scoring_only": scoring, "capacity": capacity}, args.out_dir)
    kv_speed.plot(path.with_suffix(".png"), f"{args.batch} prompts of {args.prompt_len} tokens, {args.output_len} "
                  f"output tokens, {args.dtype}, {args.threads} threads; right: {args.capacity_requests} requests "
                  f"in {memory / 2**20:.0f} MiB of KV", decode, capacity)
    print(f"wrote {path}")


def _prefix(args: argparse.Namespace) -> None:
    from loom.bench import prefix
    from loom.bench.report import bar_plot, write_report

    model, vocab = _setup(args)
    kw = dict(model_dir=model, dtype=args.dtype, num_requests=args.num_requests, prefix_len=args.prefix_len,
              tail_len=args.tail_len, output_len=args.output_len, vocab_size=vocab)
    on = prefix.run(enable_prefix_caching=True, **kw)
    off = prefix.run(enable_prefix_caching=False, **kw)
    same = on.pop("token_ids") == off.pop("token_ids")
    speedup = off["seconds"] / on["seconds"]
    print(f"caching on {on['seconds']:.2f} s, off {off['seconds']:.2f} s: {speedup:.2f}x; same outputs: {same}")
    path = write_report("prefix_caching", {"model": str(model), "dtype": args.dtype,
                                           "workload": {k: v for k, v in kw.items() if k not in ("model_dir",)},
                                           "on": on, "off": off, "speedup": speedup, "same_outputs": same},
                        args.out_dir)
    bar_plot(path.with_suffix(".png"), f"{args.num_requests} requests sharing a {args.prefix_len}-token prefix",
             ["Loom, prefix caching", "Loom, no caching"], [on["seconds"], off["seconds"]], "total seconds")
    print(f"wrote {path}")


def _parallel(args: argparse.Namespace) -> None:
    from loom.bench import parallel
    from loom.bench.report import bar_plot, write_report

    model, vocab = _setup(args)
    kw = dict(model_dir=model, dtype=args.dtype, n=args.n, prompt_len=args.prompt_len, output_len=args.output_len,
              vocab_size=vocab)
    forked = parallel.run(forked=True, **kw)
    separate = parallel.run(forked=False, **kw)
    speedup = separate["seconds"] / forked["seconds"]
    for r in (forked, separate):
        print(f"{r['mode']}: {r['seconds']:.2f} s, peak KV {r['peak_kv_bytes'] / 2**20:.1f} MiB "
              f"({r['peak_kv_blocks']} blocks)")
    print(f"forked is {speedup:.2f}x faster")
    path = write_report("parallel_sampling", {"model": str(model), "dtype": args.dtype,
                                              "workload": {k: v for k, v in kw.items() if k != "model_dir"},
                                              "forked": forked, "separate": separate, "speedup": speedup},
                        args.out_dir)
    bar_plot(path.with_suffix(".png"), f"n={args.n} samples of a {args.prompt_len}-token prompt",
             [f"Loom n={args.n} (forked)", f"Loom {args.n} requests"], [forked["seconds"], separate["seconds"]],
             "total seconds")
    print(f"wrote {path}")


def _tp(args: argparse.Namespace) -> None:
    from loom.bench import tp
    from loom.bench.report import write_report

    model, _ = _setup(args)
    if args.threads % 2:
        raise ValueError(f"--threads: {args.threads} cores cannot be split over 2 ranks")
    per_rank = args.threads // 2
    ranks_label = f"2 ranks x {per_rank} thread{'s' if per_rank > 1 else ''}"
    configs = {f"1 process x {args.threads} threads": (1, args.threads, "auto"),
               f"{ranks_label}, shared memory": (2, per_rank, "shared_memory"),
               f"{ranks_label}, gloo": (2, per_rank, "process_group")}
    results = {}
    for label, (ranks, threads, all_reduce) in configs.items():
        results[label] = tp.run(model, args.dtype, ranks, threads, args.batches, args.prompt_len, args.max_tokens,
                                all_reduce)
        for row in results[label]:
            print(f"{label}, batch {row['batch']}: {row['ms_per_step']:.2f} ms/step, {row['tok_per_s']:.1f} tok/s, "
                  f"bytes/step {row['bytes_per_step'] or '-'}", flush=True)
    single, shared, gloo = results.values()
    comparison = []
    for one, two, three in zip(single, shared, gloo):
        predicted = tp.planner_bytes(model, args.dtype, 2, two["batch"])
        measured = two["bytes_per_step"]["all_reduce"]
        comparison.append({"batch": two["batch"], "shared_memory_step_time_ratio": two["ms_per_step"] / one["ms_per_step"],
                           "gloo_step_time_ratio": three["ms_per_step"] / one["ms_per_step"],
                           "all_reduce_bytes": measured, "planner_all_reduce_bytes": predicted["all_reduce"],
                           "bytes_error": measured / predicted["all_reduce"] - 1})
        c = comparison[-1]
        print(f"batch {two['batch']}: 2 ranks / 1 process step time {c['shared_memory_step_time_ratio']:.2f}x "
              f"(shared memory), {c['gloo_step_time_ratio']:.2f}x (gloo); all-reduce bytes/step {measured:.0f} vs "
              f"planner {predicted['all_reduce']:.0f} ({c['bytes_error']:+.1%})")
    path = write_report("tensor_parallel", {"model": str(model), "dtype": args.dtype, "prompt_len": args.prompt_len,
                                            "max_tokens": args.max_tokens, "results": results,
                                            "comparison": comparison}, args.out_dir)
    short = {label: label.replace(" x ", "\nx ").replace(", ", "\n").replace("shared memory", "shared\nmemory")
             for label in results}
    _plot_step_times(path, f"decode, {args.dtype}, prompt {args.prompt_len}: one process vs 2 tensor-parallel "
                     "ranks", short, results)


def _plot_step_times(path: Path, title: str, short: dict[str, str], results: dict[str, list[dict]]) -> None:
    """A bar per configuration (`short` names it on the plot) and batch: ms per decode step."""
    from loom.bench.report import bar_plot

    labels = [f"{short[label]}\nbatch {row['batch']}" for label, rows in results.items() for row in rows]
    bar_plot(path.with_suffix(".png"), title, labels, [row["ms_per_step"] for rows in results.values() for row in rows],
             "ms per decode step")
    print(f"wrote {path}")


def _layouts(args: argparse.Namespace) -> None:
    from loom.bench import tp
    from loom.bench.report import write_report
    from loom.planner.hardware import load_hardware
    from loom.planner.layouts import Layout

    if args.threads % 2:
        raise ValueError(f"--threads: {args.threads} cores cannot be split over 2 ranks")
    model = Path(args.model) if args.model else tp.long_context_mqa_model()
    hardware = load_hardware(args.hardware) if args.hardware else None
    per_rank = args.threads // 2
    helix = dict(tp=1, kvp=2, threads=per_rank)
    # label -> (plot label, how Loom runs it, the planner's layout)
    configs = {
        f"1 process x {args.threads} threads": ("1 process", dict(tp=1, threads=args.threads), Layout("1d", 1)),
        "tensor parallel 2 by heads (the KV head replicated)": ("TP 2\nby heads", dict(tp=2, threads=per_rank),
                                                                Layout("1d", 2)),
        "Helix KVP 2 (KV split by position)": ("Helix\nKVP 2", helix, Layout("helix", 2, "kvp", kvp=2)),
        "Helix KVP 2, HOP-B": ("Helix\nHOP-B", helix | dict(hop_b=True), Layout("helix", 2, "kvp", kvp=2, hop_b=True)),
        "Helix KVP 2 through gloo": ("Helix\ngloo", helix | dict(all_reduce="process_group"),
                                     Layout("helix", 2, "kvp", kvp=2)),
        "Helix KVP 2, HOP-B, through gloo": ("Helix\nHOP-B\ngloo", helix | dict(all_reduce="process_group", hop_b=True),
                                             Layout("helix", 2, "kvp", kvp=2, hop_b=True)),
        "tensor parallel 2, attention by batch": ("TP 2\nby batch", dict(tp=2, attention_sharding="batch",
                                                                          threads=per_rank),
                                                  Layout("1d", 2, attention="batch")),
    }
    # The timed steps attend over prompt_len + 1 .. prompt_len + max_tokens - 1 cached tokens.
    context = args.prompt_len + args.max_tokens / 2
    results = {}
    for label, (_, options, layout) in configs.items():
        results[label] = tp.run(model, args.dtype, batches=args.batches, prompt_len=args.prompt_len,
                                max_tokens=args.max_tokens, **options)
        for row in results[label]:
            row["planner"] = tp.planner_layout_figures(model, args.dtype, layout, row["batch"], context, hardware)
            planned = row["planner"]
            print(f"{label}, batch {row['batch']}: {row['ms_per_step']:.2f} ms/step (planner "
                  f"{planned.get('ms_per_step', float('nan')):.2f}), rank 0 KV {row['rank0_kv_bytes'] / 2**20:.1f} "
                  f"MiB (planner {planned['kv_bytes_per_step'] / 2**20:.1f}), "
                  f"bytes/step {row['bytes_per_step'] or '-'}",
                  flush=True)
    path = write_report("layouts", {"model": str(model), "dtype": args.dtype, "prompt_len": args.prompt_len,
                                    "max_tokens": args.max_tokens, "hardware": args.hardware,
                                    "results": results}, args.out_dir)
    _plot_step_times(path, f"decode at context {args.prompt_len}, {args.dtype}, multi-query model: layouts on 2 "
                     "ranks", {label: short for label, (short, _, _) in configs.items()}, results)


def _quality(args: argparse.Namespace) -> None:
    import random

    import torch

    from loom import LLM, SamplingParams
    from loom.bench import quality
    from loom.bench.report import bar_plot, report_name, write_report
    from loom.cli.generate import DEFAULT_MODEL

    torch.set_num_threads(args.threads)
    model = args.model or str(DEFAULT_MODEL)
    if not args.corpus.is_file():
        raise FileNotFoundError(f"{args.corpus}: corpus not found (pass --corpus)")
    is_house = Path(model).resolve() == DEFAULT_MODEL.resolve()
    needles = args.needles if args.needles is not None else (200 if is_house else 0)
    train_text, heldout = quality.split_corpus(args.corpus)
    unigram = _unigram_nats_per_char(LLM(model, enforce_eager=True).get_tokenizer(), train_text, heldout)
    rng = random.Random(0)
    lines = [line for line in heldout.split("\n") if len(line) > 20]
    prompts = [rng.choice(lines) for _ in range(64)]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # (label, checkpoint, dtype, quantization, int4 symmetric, KV cache dtype); the first is the
    # reference of the others.
    variants = [("bfloat16", model, "bfloat16", None, False, "auto"), ("float32", model, "float32", None, False, "auto"),
                ("bfloat16, int8 KV cache", model, "bfloat16", None, False, "int8"),
                *((method, model, "bfloat16", method, False, "auto") for method in args.quantization),
                *([("int4, symmetric", model, "bfloat16", "int4", True, "auto")] if "int4" in args.quantization else []),
                *((path.name, str(path), "bfloat16", None, False, "auto") for path in args.checkpoints)]
    rows: dict[str, dict] = {}
    reference: list[list[int]] = []
    for label, checkpoint, dtype, method, symmetric, kv_cache_dtype in variants:
        llm = LLM(checkpoint, dtype=dtype, quantization=method, group_size=32, symmetric=symmetric,
                  kv_cache_dtype=kv_cache_dtype)
        row = rows[label] = quality.heldout_loss(llm, heldout, args.window)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if not reference:
            reference = tokens
            if needles:
                row["needle_accuracy"] = quality.needle_accuracy(llm, train_text, heldout, args.contexts, needles)
        else:
            row["greedy_agreement_64_prompts"] = quality.greedy_agreement(reference, tokens)
            row["loss_increase_vs_bf16"] = row["nats_per_token"] / rows["bfloat16"]["nats_per_token"] - 1
        if llm.get_tokenizer().chat_templates and not is_house:
            row["chat_answers"] = quality.chat_answers(llm)
        print(f"{label}: {row['nats_per_char']:.4f} nats/char, perplexity {row['perplexity']:.3f}"
              + "".join(f", {k} {row[k]}" for k in ("loss_increase_vs_bf16", "greedy_agreement_64_prompts",
                                                     "needle_accuracy") if k in row)
              + (f", chat answers {row['chat_answers']['accuracy']:.0%}" if "chat_answers" in row else ""), flush=True)
        del llm
    path = write_report(report_name("quality", model, DEFAULT_MODEL),
                        {"model": model, "corpus_heldout_chars": len(heldout), "window": args.window,
                         "unigram_nats_per_char": unigram, "results": rows}, args.out_dir)
    bar_plot(path.with_suffix(".png"), f"{Path(model).name}: held-out loss through the engine (lower is better)",
             ["unigram"] + [f"Loom {k}" for k in rows], [unigram] + [r["nats_per_char"] for r in rows.values()],
             "nats per character")
    print(f"wrote {path}")


LAUNCH_TARGETS = ("loom", "offline", "llama-server", "llama-cpp-python")


def _serve_bench(args: argparse.Namespace) -> None:
    import math

    from loom.bench import serve
    from loom.bench.report import bar_plot, write_report
    from loom.tokenizer import Tokenizer

    launch = args.launch or []
    if not launch and not (args.base_url and args.model):
        raise ValueError("--base-url and --model: name a running server, or --launch one")
    if args.duration is not None and not args.request_rate:
        raise ValueError("--duration: a soak sends requests at a --request-rate")
    if "offline" in launch and args.request_rate:
        raise ValueError("--launch offline: the in-process engine is driven at a --concurrency, not a request rate")
    if args.rounds < 1 or (args.rounds > 1 and (not launch or args.duration)):
        raise ValueError(f"--rounds: {args.rounds}; more than one round takes --launch and no --duration")
    model_dir = None
    if launch:
        from loom.cli.generate import DEFAULT_MODEL
        from loom.models.reference import reference_model_dir, with_tokenizer

        model_dir = args.launch_model or with_tokenizer(reference_model_dir(), DEFAULT_MODEL)
    tokenizer = Tokenizer.from_dir(args.tokenizer or model_dir) if (args.tokenizer or model_dir) else None
    if args.tokenizer and tokenizer is None:
        raise ValueError(f"--tokenizer: {args.tokenizer} has no tokenizer.json")
    if tokenizer is None and "llama-cpp-python" in launch:
        raise ValueError("--launch llama-cpp-python: its server takes text prompts only, and --launch-model has no "
                         "tokenizer to make them with")
    vocab = 0
    if tokenizer is None:
        from loom.models.config import ModelConfig

        vocab = args.vocab_size or (ModelConfig.from_dir(model_dir).vocab_size if model_dir
                                    else _server_vocab(args.base_url))
    num_requests = args.num_requests
    if args.duration:  # enough arrivals to outlast the duration at the rate
        num_requests = max(num_requests, math.ceil(1.5 * args.request_rate * args.duration) + 16)
    workloads = [serve.make_workload(num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed + r,
                                     vocab, tokenizer) for r in range(args.rounds)]
    concurrency = None if args.request_rate else (args.concurrency or 16)
    runs = []
    for weights in args.weights if launch else [None]:
        with contextlib.ExitStack() as stack:  # a format's targets stay up through its rounds
            targets = [(name, stack.enter_context(_serve_target(args, name, weights, model_dir, workloads[0][0],
                                                                concurrency)))
                       for name in launch or [None]]
            for r, workload in enumerate(workloads):
                for name, run in targets:
                    runs.append(_report_run({**run(workload), "server": name or args.base_url, "weights": weights,
                                             "round": r}))
    ratios, ratios_by_round = serve.ratios_over_rounds(runs)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x" + (f" (rounds: {', '.join(f'{rr[k]:.2f}' for rr in ratios_by_round)})"
                                  if args.rounds > 1 else ""))
    label = args.label or (Path(model_dir).resolve().name if model_dir else args.model)
    path = write_report(f"serve-{label}", {"model": str(model_dir) if model_dir else args.model,
                                            "workload": {"num_requests": num_requests, "prompt_len": args.prompt_len,
                                                         "output_len": args.output_len,
                                                         "prompts": "text" if tokenizer else "token ids",
                                                         "concurrency": concurrency,
                                                         "request_rate": args.request_rate,
                                                         "duration_s": args.duration, "rounds": args.rounds},
                                            "runs": runs, "ratios": ratios, "ratios_by_round": ratios_by_round},
                        args.out_dir)
    title = f"Serving {label}: " + (f"{args.request_rate} req/s for {args.duration:.0f} s" if args.duration else
                                    f"{num_requests} requests, " + (f"concurrency {concurrency}" if concurrency
                                                                    else f"{args.request_rate} req/s"))
    if args.duration:
        serve.soak_plot(path.with_suffix(".png"), title, runs)
    else:
        if args.rounds > 1:
            title += f", median of {args.rounds} rounds"
        bars = {}
        for r in runs:
            bars.setdefault(f"{r['server']}\n{r['weights'] or ''}", []).append(r["output_tok_per_s"])
        bar_plot(path.with_suffix(".png"), title, list(bars), [statistics.median(v) for v in bars.values()],
                 "output tokens/s")
    print(f"wrote {path}")


@contextlib.contextmanager
def _serve_target(args: argparse.Namespace, name: str | None, weights: str | None, model_dir: Path | None,
                  probe: ServeRequest, concurrency: int | None) -> Iterator[Callable[[list], dict]]:
    """A target made ready (a server started, or the engine loaded in-process for offline; the
    running server when name is None) as a function that runs a workload on it; stopped after."""
    import shutil
    import tempfile

    from loom.bench import serve, servers

    slots, context = concurrency or 16, args.prompt_len[1] + args.output_len[1] + 16
    if name == "offline":
        llm = serve.offline_llm(model_dir, weights, slots, args.threads)
        yield lambda workload: serve.run_offline(llm, workload, slots)
        return
    cold, cache, server = {}, None, None
    try:
        if name == "loom" and args.cold_start:
            cache = Path(tempfile.mkdtemp(prefix="loom-compile-cache-"))
            server = servers.launch_loom(model_dir, weights, slots, args.threads, probe, cache)
            server.stop()
            cold = {"cold_startup_s": server.startup_s, "cold_first_answer_s": server.first_answer_s}
        server = servers.launch(name, model_dir, weights, slots, context, args.threads, probe, cache) \
            if name else None
        started = {"startup_s": server.startup_s, "first_answer_s": server.first_answer_s, **cold} if server else {}
        yield lambda workload: {**_serve_http(args, server, workload, concurrency), **started}
    finally:
        if server:
            server.stop()
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def _serve_http(args: argparse.Namespace, server: Launched | None, workload: list, concurrency: int | None) -> dict:
    """One run of the workload against a launched server (or --base-url's when None); a soak
    (--duration) also samples its memory and KV use."""
    from loom.bench import serve, servers

    url, model = (server.url, server.model) if server else (args.base_url, args.model)

    def probe() -> dict[str, float]:  # the process's own count where it was launched here
        return {**servers.loom_gauges(url), **({"rss_bytes": server.rss_bytes()} if server else {})}

    idle = servers.loom_gauges(url)
    result = serve.benchmark(url, model, workload, concurrency, args.request_rate, args.seed, args.api_key,
                             args.duration, probe if args.duration else None,
                             probe_every=min(10.0, (args.duration or 0) / 20))
    if args.duration:
        result["kv_usage_idle"] = idle.get("kv_cache_usage_perc")
        result["kv_usage_after"] = servers.settled_kv_usage(url, idle.get("kv_cache_usage_perc"))
        # Samples come every probe_every seconds: the first tenth of them is the run's first tenth.
        samples = result["samples"]
        warm = [s for s in samples[len(samples) // 10:] if "rss_bytes" in s]
        after = probe().get("rss_bytes")
        if warm and after:  # growth from the first sample after a tenth of the run to its end
            result["rss_after_bytes"] = after
            result["rss_growth_after_warmup"] = after / warm[0]["rss_bytes"] - 1
    return result


def _report_run(result: dict) -> dict:
    print(f"[{result['server']} {result['weights'] or ''}] {result['completed']} of {result['num_requests']} requests "
          f"in {result['duration_s']:.1f} s: {result['output_tok_per_s']:.1f} output tok/s, "
          f"{result['num_errors']} errors; " + ", ".join(
              f"{k.upper()} p50 {result[k].get('median_ms', 0):.1f} / p99 {result[k].get('p99_ms', 0):.1f} ms"
              for k in ("ttft", "tpot", "itl")), flush=True)
    return result


def _server_vocab(base_url: str) -> int:
    import httpx

    try:
        return httpx.get(f"{base_url.rstrip('/')}/tokenizer_info", timeout=10).json()["vocab_size"]
    except (httpx.HTTPError, KeyError, ValueError):
        raise ValueError("--vocab-size: the server has no /tokenizer_info to read it from; pass it") from None


def _unigram_nats_per_char(tokenizer, train_text: str, heldout: str) -> float:
    """Baseline: add-one-smoothed token frequencies of the training split, scored on held-out text."""
    import math
    from collections import Counter

    counts = Counter(tokenizer.encode(train_text, add_special_tokens=False))
    total = sum(counts.values()) + tokenizer.vocab_size
    return -sum(math.log((counts[t] + 1) / total) for t in tokenizer.encode(heldout, add_special_tokens=False)) \
        / len(heldout)


# Loom variants of `loom bench latency` (dtype, quantization, int4 symmetric) and the llama.cpp type
# each is compared with. int4 as Q4_0 holds it: symmetric, group 32, the same bytes per weight.
LATENCY_VARIANTS = [("float32", None, False, "f32"), ("bfloat16", None, False, "bf16"),
                    ("bfloat16", "int8", False, "q8_0"), ("bfloat16", "int4", True, "q4_0")]


def _latency_round(args: argparse.Namespace, model: Path, cfg) -> list[dict]:
    """One pass over every engine and variant (Loom, then its peers for the same weights). At
    batch 1 Loom and llama.cpp take turns run by run (`latency.interleaved`)."""
    from loom.bench import latency, llamacpp

    rows = []
    for dtype, quant, symmetric, gguf_type in LATENCY_VARIANTS:
        peer = None
        for batch in args.batches:
            if batch == 1 and not args.no_llamacpp:
                r, peer = _latency_pair(args, model, cfg, dtype, quant, symmetric, gguf_type)
            else:
                r = latency.run_loom(model, dtype, quant, batch, args.prompt_len, args.max_tokens, args.repeats,
                                     args.kv_cache_dtype, symmetric=symmetric,
                                     num_scheduler_steps=args.num_scheduler_steps)
            rows.append(r)
            print(f"loom {quant or dtype} batch {batch}: {r['tok_per_s']:.1f} tok/s; a step, ms: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["step_ms"].items()), flush=True)
        if quant is None and args.kv_cache_dtype == "auto":
            for batch in args.batches:
                r = latency.run_hf(model, dtype, batch, args.prompt_len, args.max_tokens, args.repeats)
                rows.append(r)
                print(f"hf {dtype} batch {batch}: {r['tok_per_s']:.1f} tok/s", flush=True)
        if not args.no_llamacpp:
            rows.append(peer or _llamacpp_row(args, llamacpp.peer_gguf(model, gguf_type), gguf_type, cfg))
    for checkpoint in args.checkpoints:
        for batch in args.batches:
            r = latency.run_loom(checkpoint, "bfloat16", None, batch, args.prompt_len, args.max_tokens, args.repeats,
                                 args.kv_cache_dtype)
            rows.append(dict(r, checkpoint=checkpoint.name))
            print(f"loom {checkpoint.name} batch {batch}: {r['tok_per_s']:.1f} tok/s", flush=True)
    if args.gguf and not args.no_llamacpp:
        from loom.models.gguf import gguf_file_type, gguf_source

        source = gguf_source(args.gguf)
        rows.append(_llamacpp_row(args, source, gguf_file_type(source), cfg, source=True))
    return rows


# Before each timed run of a pair: the other engine's threads spin a little after their last
# work (OpenMP's and ggml's) before they sleep.
_SETTLE_S = 0.05


def _latency_pair(args: argparse.Namespace, model: Path, cfg, dtype: str, quant: str | None, symmetric: bool,
                  gguf_type: str) -> tuple[dict, dict]:
    """Loom's and llama.cpp's batch-1 rows of one variant, their runs taking turns with a probe of
    the read bandwidth beside Loom's (`latency.interleaved`): Loom's row has the MBU of each turn
    against its own probe ("mbu_turns"), llama.cpp's each turn's Loom / llama.cpp ratio
    ("paired_ratios")."""
    from loom.bench import latency, llamacpp
    from loom.bench.calibrate import read_probe

    prompt = latency.prompt_ids(1, args.prompt_len, cfg.vocab_size)[0]
    run = latency.LoomDecodeRun(model, dtype, quant, 1, args.prompt_len, args.max_tokens, args.kv_cache_dtype,
                                symmetric, args.num_scheduler_steps)
    with llamacpp.LlamaCppDecodeRun(llamacpp.peer_gguf(model, gguf_type), prompt, args.max_tokens, args.threads,
                                    kv_cache_q8_0=args.kv_cache_dtype == "int8") as peer:
        reads, mine, theirs = latency.interleaved([read_probe(), run.time_decode, peer.time_decode], args.repeats,
                                                  lambda: time.sleep(_SETTLE_S))
    row = latency.loom_result(run, mine)
    row["read_GBps_turns"] = [r / 1e9 for r in reads]
    row["mbu_turns"] = [latency.mbu(cfg, dtype, quant, 1, args.prompt_len + args.max_tokens // 2, rate, read,
                                    args.kv_cache_dtype, symmetric) for rate, read in zip(mine, reads)]
    paired = [a / b for a, b in zip(mine, theirs)]
    peer_row = dict(_llamacpp_result(gguf_type, statistics.median(theirs), theirs), paired_ratios=paired)
    print(f"llama.cpp {gguf_type} batch 1: {peer_row['tok_per_s']:.1f} tok/s; Loom / llama.cpp by turn: "
          + ", ".join(f"{x:.2f}" for x in paired) + "; Loom's MBU by turn: "
          + ", ".join(f"{x:.2f}" for x in row["mbu_turns"]), flush=True)
    return row, peer_row


def _llamacpp_result(gguf_type: str, tok_per_s: float, all_tok_per_s: list[float]) -> dict:
    """llama.cpp's row of latency.json (batch 1: a token a step)."""
    return {"engine": "llama.cpp", "dtype": gguf_type, "batch": 1, "tok_per_s": tok_per_s, "steps_per_s": tok_per_s,
            "all_steps_per_s": all_tok_per_s}


def _llamacpp_row(args: argparse.Namespace, gguf: Path, gguf_type: str, cfg, source: bool = False) -> dict:
    """llama.cpp's batch-1 decode of `gguf`, as a row of latency.json."""
    from loom.bench import latency, llamacpp

    prompt = latency.prompt_ids(1, args.prompt_len, cfg.vocab_size)[0]
    r = llamacpp.run_llamacpp(gguf, prompt, args.max_tokens, args.threads, args.repeats,
                              kv_cache_q8_0=args.kv_cache_dtype == "int8")
    row = _llamacpp_result(gguf_type, r["decode_tok_per_s"], r["decode_tok_per_s_all"])
    if source:
        row["source_file"] = gguf.name
    print(f"llama.cpp {gguf_type}{' (' + gguf.name + ')' if source else ''} batch 1: {row['tok_per_s']:.1f} tok/s",
          flush=True)
    return row


ENGINE_LABELS = {"loom": "Loom", "hf-transformers": "HF", "llama.cpp": "llama.cpp"}


def _latency_ratios(rows: list[dict]) -> dict[str, float]:
    """The ratios the latency figures are quoted by, within one round: Loom over each peer,
    quantized over bf16."""
    def rate(engine: str, dtype: str, batch: int, quant: str | None = None) -> float | None:
        for r in rows:
            if (r["engine"], r["dtype"], r["batch"], r.get("quantization")) == (engine, dtype, batch, quant) \
                    and not {"checkpoint", "source_file"} & r.keys():
                return r["tok_per_s"]
        return None

    ratios = {}
    for dtype, quant, _, gguf_type in LATENCY_VARIANTS:
        name = quant or dtype
        loom1 = rate("loom", dtype, 1, quant)
        peers = {f"{name} / llama.cpp {gguf_type}": rate("llama.cpp", gguf_type, 1),
                 f"{name} / hf bfloat16" if quant else f"{name} / hf {dtype}": rate("hf-transformers", dtype, 1)}
        for label, peer in peers.items():
            if loom1 and peer:
                ratios[f"batch 1: {label}"] = loom1 / peer
        if quant:
            for batch in sorted({r["batch"] for r in rows if r["batch"] > 1}):
                q, bf16 = rate("loom", dtype, batch, quant), rate("loom", "bfloat16", batch)
                if q and bf16:
                    ratios[f"batch {batch}: {quant} / bf16"] = q / bf16
    source = next((r for r in rows if "source_file" in r), None)
    if source:  # the file the model came from: against Loom's int4 and each checkpoint given
        theirs = f"llama.cpp {source['dtype']} ({source['source_file']})"
        mine = [("int4", rate("loom", "bfloat16", 1, "int4"))] + [
            (r["checkpoint"], r["tok_per_s"]) for r in rows if "checkpoint" in r and r["batch"] == 1]
        for name, loom1 in mine:
            if loom1:
                ratios[f"batch 1: {name} / {theirs}"] = loom1 / source["tok_per_s"]
    return ratios


def _latency(args: argparse.Namespace) -> None:
    from loom.bench import latency
    from loom.bench.calibrate import memory_bandwidth
    from loom.bench.report import report_name, write_report
    from loom.models.config import ModelConfig
    from loom.models.reference import reference_model_dir

    model, _ = _setup(args)
    cfg = ModelConfig.from_dir(model)
    # Whole rounds, each running every engine, so that each ratio compares runs minutes apart
    # rather than a round apart on a shared machine; medians over rounds. Within a round, Loom and
    # llama.cpp take turns at batch 1, seconds apart. The machine's read bandwidth itself moves
    # between phases (here: ~40 and ~70 GB/s), so it is probed before every round, and MBU is
    # taken against the highest probe (what the machine showed it can do), or at batch 1 beside
    # llama.cpp against the probe read beside each of Loom's runs.
    rounds, peaks = [], []
    for i in range(args.rounds):
        peaks.append(memory_bandwidth())
        print(f"round {i + 1} of {args.rounds}: peak read bandwidth {peaks[-1] / 1e9:.1f} GB/s "
              f"({args.threads} threads)", flush=True)
        rounds.append(_latency_round(args, model, cfg))
    peak = max(peaks)
    rows = []
    for i, first in enumerate(rounds[0]):
        samples = [rnd[i] for rnd in rounds]
        row = dict(first, tok_per_s=statistics.median(r["tok_per_s"] for r in samples),
                   steps_per_s=statistics.median(r["steps_per_s"] for r in samples),
                   all_steps_per_s=[x for r in samples for x in r["all_steps_per_s"]],
                   tok_per_s_rounds=[r["tok_per_s"] for r in samples])
        if "step_ms" in first:  # Loom's: where a step's time goes, medians over rounds
            row["step_ms"] = {k: statistics.median(r["step_ms"][k] for r in samples) for k in first["step_ms"]}
        for turns in ("paired_ratios", "mbu_turns", "read_GBps_turns"):
            if turns in first:
                row[turns] = [x for r in samples for x in r[turns]]
        if "mbu_turns" in row:  # each turn against the probe read beside it
            row["mbu"] = statistics.median(row["mbu_turns"])
        # llama.cpp's weights' bytes per step are not Loom's; a checkpoint's format is its own
        elif first["engine"] != "llama.cpp" and "checkpoint" not in first:
            row["mbu"] = latency.mbu(cfg, row["dtype"], row.get("quantization"), row["batch"],
                                     args.prompt_len + args.max_tokens // 2, row["steps_per_s"], peak,
                                     args.kv_cache_dtype, row.get("symmetric", False))
        rows.append(row)
    per_round = [_latency_ratios(rnd) for rnd in rounds]
    ratios = {k: {"median": statistics.median(rr[k] for rr in per_round), "rounds": [rr[k] for rr in per_round]}
              for k in per_round[0]}
    for dtype, quant, _, gguf_type in LATENCY_VARIANTS:  # llama.cpp's turns, where they took turns
        peer = next((r for r in rows if r["engine"] == "llama.cpp" and r["dtype"] == gguf_type
                     and "paired_ratios" in r), None)
        if peer:
            turns = ratios[f"batch 1: {quant or dtype} / llama.cpp {gguf_type}"]
            turns["turns"] = peer["paired_ratios"]
            turns["turns_median"] = statistics.median(peer["paired_ratios"])
    for r in rows:
        print(f"{r['engine']} {_variant(r)} batch {r['batch']}: {r['tok_per_s']:.1f} tok/s"
              + (f", MBU {r['mbu']:.2f}" if "mbu" in r else "")
              + (f"; a step {r['step_ms']['step']:.2f} ms: linear {r['step_ms']['linear']:.2f}, "
                 f"attention {r['step_ms']['attention']:.2f}, other {r['step_ms']['other']:.2f} "
                 f"(split: {r['step_split']})" if "step_ms" in r else ""))
    for k, v in ratios.items():
        print(f"{k}: {v['median']:.2f}x (rounds: {', '.join(f'{x:.2f}' for x in v['rounds'])})"
              + (f"; by turn {v['turns_median']:.2f}x ({min(v['turns']):.2f}-{max(v['turns']):.2f})"
                 if "turns" in v else ""))
    kind = "latency-kv-int8" if args.kv_cache_dtype == "int8" else "latency"
    path = write_report(report_name(kind, model, reference_model_dir()), {"model": str(model), "prompt_len": args.prompt_len,
                                    "max_tokens": args.max_tokens, "repeats": args.repeats, "rounds": args.rounds,
                                    "kv_cache_dtype": args.kv_cache_dtype,
                                    "peak_read_GBps": peak / 1e9, "peak_read_GBps_rounds": [p / 1e9 for p in peaks],
                                    "results": rows, "ratios": ratios}, args.out_dir)
    latency_plot(path.with_suffix(".png"), rows, args.prompt_len, args.threads, args.kv_cache_dtype)
    print(f"wrote {path}")


def _variant(row: dict) -> str:
    """What a latency row ran: a checkpoint's name, the quantization, or the dtype (and file)."""
    if "source_file" in row:
        return f"{row['dtype']} ({row['source_file']})"
    if row.get("quantization") == "int4" and row.get("symmetric"):
        return "int4 symmetric"
    return row.get("checkpoint") or row.get("quantization") or row["dtype"]


def latency_plot(path: Path, rows: list[dict], prompt_len: int, threads: int, kv_cache_dtype: str = "auto") -> None:
    """Batch-1 tokens/s of every engine and variant (the `results` of latency.json)."""
    from loom.bench.report import bar_plot

    batch1 = [r for r in rows if r["batch"] == 1]
    cache = ", 8-bit KV caches" if kv_cache_dtype == "int8" else ""
    steps = max(r.get("num_scheduler_steps", 1) for r in batch1)
    cache += f", Loom {steps} steps at once" if steps > 1 else ""
    bar_plot(path, f"Batch-1 decode, prompt {prompt_len}, {threads} threads{cache}",
             [ENGINE_LABELS[r["engine"]] + "\n" + _variant(r).replace(" ", "\n") for r in batch1],
             [r["tok_per_s"] for r in batch1], "tokens/s (median over rounds)")


def _planner(args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from loom.bench import planner
    from loom.bench.report import write_report
    from loom.bench.calibrate import conditions, measure
    from loom.planner.hardware import load_hardware_file
    from loom.planner.presets import from_hf_config

    model, _ = _setup(args)
    unknown = set(args.weights) - set(planner.VARIANTS)
    if unknown:
        raise ValueError(f"--weights: unknown {sorted(unknown)}; choose from {', '.join(planner.VARIANTS)}")
    if args.hardware:
        hw = load_hardware_file(args.hardware)
        differ = {k: v for k, v in conditions().items() if hw.extra.get(k) != v}
        if differ:
            raise ValueError(f"{args.hardware} was calibrated with {hw.extra}, this run has {differ}: recalibrate")
    else:
        print(f"calibrating at {args.threads} threads", flush=True)
        hw = measure(collectives=False)
    shape = from_hf_config(model)
    rows = []
    for weights in args.weights:
        for batch in args.batches:
            r = planner.compare(model, shape, hw, weights, batch, args.prompt_len, args.max_tokens, args.repeats)
            rows.append(r)
            print(f"{weights} batch {batch}: measured {r['measured_ms']:.2f} ms, predicted {r['predicted_ms']:.2f} ms "
                  f"({r['error']:+.1%})", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    path = write_report("planner", {"model": str(model), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                                    "repeats": args.repeats, "worst_abs_error": worst, "hardware": asdict(hw),
                                    "results": rows}, args.out_dir)
    planner.plot(path.with_suffix(".png"), rows, f"{shape.name} decode step, prompt {args.prompt_len}, "
                 f"{args.threads} threads: planner vs Loom")
    print(f"worst error {worst:.1%}; wrote {path}")
