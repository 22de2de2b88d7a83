"""`loom quantize SRC DST --method int4 --group-size 32 [--symmetric]`."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="write a weight-only quantized checkpoint")
    p.add_argument("src", type=Path, help="Hugging Face model directory")
    p.add_argument("dst", type=Path, help="output directory")
    p.add_argument("--method", choices=["int8", "int4"], default="int8")
    add_int4_options(p)
    p.set_defaults(func=_run)


def add_int4_options(p: argparse.ArgumentParser) -> None:
    """int4's group size and form, for every command that quantizes."""
    p.add_argument("--group-size", type=int, default=32, help="int4 group size (32, 64 or 128)")
    p.add_argument("--symmetric", action="store_true",
                   help="int4 scales only, no zero points (llama.cpp's Q4_0 at group 32)")


def quantize_checkpoint(src: Path, dst: Path, method: str, group_size: int, symmetric: bool = False) -> None:
    """Loads `src`, quantizes every linear layer and writes the result to `dst`."""
    import torch

    from loom.models.config import ModelConfig
    from loom.models.loader import load_model
    from loom.quant.checkpoint import write_quantized_checkpoint
    from loom.quant.model import quantize_model
    from loom.quant.quantize import check_options, check_symmetric

    config = ModelConfig.from_dir(src)
    if config.quantization is not None:
        raise ValueError(f"{src}: already quantized ({config.quantization}); quantize the original")
    check_options(method, group_size)
    check_symmetric(method, symmetric, "--symmetric")
    model = load_model(src, torch.float32, cfg=config)
    quantize_model(model, method, group_size, symmetric=symmetric)
    write_quantized_checkpoint(model, src, dst)


def _run(args: argparse.Namespace) -> None:
    quantize_checkpoint(args.src, args.dst, args.method, args.group_size, args.symmetric)
    form = f", group {args.group_size}{', symmetric' if args.symmetric else ''}" if args.method == "int4" else ""
    print(f"wrote {args.dst} ({args.method}{form})")
