"""`loom generate` (one prompt, streamed) and `loom chat` (an interactive loop)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "house"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model and engine options shared by every command that builds an engine."""
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="local Hugging Face model directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="what the KV cache stores: the model's dtype (auto), or int8 with a scale per token and head")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is split over (start one process per rank with torchrun)")
    p.add_argument("--kv-parallel-size", type=int, default=1,
                   help="Helix: ranks each sequence's KV cache is split over, times the tensor-parallel ranks")
    p.add_argument("--attention-sharding", default="heads", choices=["heads", "batch"],
                   help="batch: each tensor-parallel rank keeps its own sequences' KV cache, every head of it")
    p.add_argument("--ffn-layout", default="1d", choices=["1d", "2d"],
                   help="2d: PaLM's 2D weight-stationary FFN over a grid of the ranks (4 or more)")
    p.add_argument("--hop-b", action="store_true",
                   help="Helix: overlap each item's all-to-all with the next item's attention (HOP-B)")


def _add_compile_arg(p: argparse.ArgumentParser) -> None:
    # One prompt at a time: compiling decode steps costs 10-30 s once and saves about 1 ms a
    # token, so it pays only for long sessions.
    p.add_argument("--compile", action="store_true", help="compile decode steps (torch.compile) before generating")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def register(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_engine_args(gen)
    _add_compile_arg(gen)
    add_sampling_args(gen)
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)

    chat = subparsers.add_parser("chat", help="chat interactively (the model's chat template)")
    add_engine_args(chat)
    _add_compile_arg(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=_chat)


def _build(args: argparse.Namespace):
    from loom import LLM, SamplingParams
    from loom.sampling_params import RequestOutputKind

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len,
              max_num_seqs=1, kv_cache_memory=256 << 20, enforce_eager=not args.compile,
              tensor_parallel_size=args.tensor_parallel_size, kv_parallel_size=args.kv_parallel_size,
              attention_sharding=args.attention_sharding, ffn_layout=args.ffn_layout, hop_b=args.hop_b,
              kv_cache_dtype=args.kv_cache_dtype)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            output_kind=RequestOutputKind.DELTA)
    return llm, params


def stream(llm, prompt: str | dict, params, out: TextIO | None = None) -> list[int]:
    """Runs one request (`params` asking for DELTA outputs), writing its text to `out` (default:
    the standard output of the moment) as it grows (the engine's detokenizer never emits half a
    character); returns the generated ids."""
    out = out or sys.stdout
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    ids: list[int] = []
    finished = False
    try:
        while not finished:
            for o in engine.step():
                if o.request_id != request_id:
                    continue
                delta = o.outputs[0]
                ids += delta.token_ids
                out.write(delta.text if engine.tokenizer is not None else "".join(f"{t} " for t in delta.token_ids))
                out.flush()
                finished = o.finished
    finally:
        if not finished:  # Ctrl-C or an error: free the request's blocks
            engine.abort_request(request_id)
            engine.step()
    return ids


def _generate(args: argparse.Namespace) -> None:
    llm, params = _build(args)
    sys.stdout.write(args.prompt)
    stream(llm, args.prompt, params)
    sys.stdout.write("\n")


def _chat(args: argparse.Namespace) -> None:
    llm, params = _build(args)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; chat needs one")
    messages: list[dict[str, str]] = []
    print("Type a message (empty line or Ctrl-D to quit).")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        ids = stream(llm, {"prompt_token_ids": tokenizer.encode_chat(messages)}, params)
        print()
        messages.append({"role": "assistant", "content": tokenizer.decode(ids)})
