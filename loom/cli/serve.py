"""`loom serve`: the OpenAI-compatible HTTP server (loom/server/app.py) on uvicorn.

The port opens at once and `/health` answers "starting" while the model loads and its decode
steps compile; then "ok". SIGTERM or Ctrl-C stops accepting, lets in-flight requests finish
for up to --shutdown-timeout seconds, then aborts the rest. An engine that stops on an error
(a rank of a parallel engine lost, say) stops the server, which exits with that error.
"""
from __future__ import annotations

import argparse
import os
import threading

from loom.cli.generate import add_engine_args
from loom.cli.quantize import add_int4_options
from loom.kv.policy import KV_POLICIES


def _kv_budget(text: str) -> int | float:
    return int(text) if text.isdigit() else float(text)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--served-model-name", help="the name clients ask for (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("LOOM_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $LOOM_API_KEY, else none)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoding at once")
    p.add_argument("--max-num-queued-requests", type=int, default=256,
                   help="requests waiting beyond those; more get 429 with Retry-After")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (default: sized by Loom)")
    p.add_argument("--quantization", choices=["int8", "int4"], default=None)
    add_int4_options(p)
    p.add_argument("--enforce-eager", action="store_true", help="never compile decode steps")
    p.add_argument("--kv-policy", choices=KV_POLICIES, default="full",
                   help="KV-cache compression for requests that do not choose their own (kv_policy)")
    p.add_argument("--kv-budget", type=_kv_budget, default=None,
                   help="tokens a compressed sequence keeps: a fraction of its prompt (0.5) or a count (512)")
    p.add_argument("--kv-recent-ratio", type=float, default=0.3,
                   help="of the budget, the most recent tokens h2o and keyformer always keep")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps run at once while every running request is greedy (as it comes: no "
                        "penalties, logprobs or KV policy) and none waits: their tokens stream together, and a "
                        "new request waits for the batch's last step")
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.set_defaults(func=_serve)


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
                group_size=args.group_size, symmetric=args.symmetric,
                enforce_eager=True if args.enforce_eager else None, kv_policy=args.kv_policy, kv_budget=args.kv_budget,
                kv_recent_ratio=args.kv_recent_ratio, tensor_parallel_size=args.tensor_parallel_size,
                kv_parallel_size=args.kv_parallel_size, attention_sharding=args.attention_sharding,
                ffn_layout=args.ffn_layout, hop_b=args.hop_b, kv_cache_dtype=args.kv_cache_dtype,
                num_scheduler_steps=args.num_scheduler_steps)


def _serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    import uvicorn

    from loom import LLM
    from loom.engine.async_llm_engine import AsyncLLMEngine
    from loom.server.app import ServerConfig, build_app
    from loom.server.metrics import Metrics

    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: a rank that only runs rank 0's steps
        LLM(**_engine_options(args))  # never returns here: it runs rank 0's steps, then exits
    loaded: dict[str, object] = {}
    config = ServerConfig(model_name=args.served_model_name or Path(args.model).resolve().name,
                          api_key=args.api_key, max_queued_requests=args.max_num_queued_requests)
    metrics = Metrics(config.model_name)
    server = uvicorn.Server(uvicorn.Config(build_app(config, lambda: loaded.get("engine"), metrics), host=args.host,
                                           port=args.port, timeout_graceful_shutdown=args.shutdown_timeout,
                                           log_level="info"))

    def stop(error: BaseException) -> None:
        """Loading failed, or the engine stopped on an error: the server stops too, reporting it."""
        loaded["error"] = error
        server.should_exit = True

    def load() -> None:
        try:
            llm = LLM(**_engine_options(args))
            loaded["engine"] = AsyncLLMEngine(llm.engine, on_step=metrics.record, on_failure=stop)
            print(f"loom: serving {config.model_name} on http://{args.host}:{args.port}", flush=True)
        except BaseException as error:  # reported by the main thread once the server stops
            stop(error)

    threading.Thread(target=load, name="loom-load", daemon=True).start()
    try:
        server.run()
    finally:
        engine = loaded.get("engine")
        if isinstance(engine, AsyncLLMEngine):
            engine.shutdown(timeout=5)
    if "error" in loaded:
        raise loaded["error"]  # type: ignore[misc]
