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
    g = formats.add_parser("gguf", help="GGUF file (llama.cpp; Llama-family, byte-level BPE vocabulary)")
    g.add_argument("src", metavar="SRC.gguf", help="GGUF file, or pkg:NAME for the one an installed package ships")
    g.add_argument("dst", type=Path, metavar="DST_DIR", nargs="?",
                   help="output directory (default: Loom's cache, models/<file name up to its first dot>)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of the dequantized weights")
    g.add_argument("--int4", action="store_true",
                   help="write Loom's int4 checkpoint instead: Q4_0/Q4_1 weights keep their 4-bit codes, other "
                        "linear layers stay in --dtype; transformers cannot load it")
    g.set_defaults(func=_gguf)


def _llama2c(args: argparse.Namespace) -> None:
    from loom.models.llama2c import convert_llama2c

    convert_llama2c(args.src, args.dst)
    print(f"wrote {args.dst / 'config.json'} and {args.dst / 'model.safetensors'}")


def _gguf(args: argparse.Namespace) -> None:
    from loom.config import resolve_dtype
    from loom.models.gguf import convert_gguf, convert_gguf_int4, default_destination, gguf_source

    src = gguf_source(args.src)
    dst = args.dst or default_destination(src)
    if not args.int4:
        convert_gguf(src, dst, resolve_dtype(args.dtype))
        print(f"wrote {dst} from {src.name}")
        return
    kept = convert_gguf_int4(src, dst, resolve_dtype(args.dtype))
    print(f"wrote {dst} (int4) from {src.name}"
          + (f"; left in {args.dtype} (no 4-bit codes in the file): {', '.join(kept)}" if kept else ""))
