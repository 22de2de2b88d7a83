"""`loom convert FORMAT SRC DST`: foreign checkpoints to Hugging Face directories."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    convert = subparsers.add_parser("convert", help="convert a foreign checkpoint to a Hugging Face directory")
    formats = convert.add_subparsers(dest="format", required=True)
    p = formats.add_parser("llama2c", help="llama2.c .bin checkpoint (legacy format)")
    p.add_argument("src", type=Path, metavar="SRC.bin", help="llama2.c checkpoint")
    p.add_argument("dst", type=Path, metavar="DST_DIR", help="output directory (created if missing)")
    p.set_defaults(func=_llama2c)


def _llama2c(args: argparse.Namespace) -> None:
    from loom.models.llama2c import convert_llama2c

    convert_llama2c(args.src, args.dst)
    print(f"wrote {args.dst / 'config.json'} and {args.dst / 'model.safetensors'}")
