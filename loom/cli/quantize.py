"""`loom quantize SRC DST --method int4 --group-size 32` and `loom quantize --calibrate`."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="write a weight-only quantized checkpoint, or calibrate the kernels")
    p.add_argument("src", nargs="?", type=Path, help="Hugging Face model directory")
    p.add_argument("dst", nargs="?", type=Path, help="output directory")
    p.add_argument("--method", choices=["int8", "int4"], default="int8")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size (32, 64 or 128)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the weight-only vs dequantized-GEMM crossover on this machine and store it")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--plot", type=Path, default=Path("docs/benchmarks/quant_dispatch.png"))
    p.set_defaults(func=_run)


def quantize_checkpoint(src: Path, dst: Path, method: str, group_size: int) -> None:
    """Loads `src`, quantizes every linear layer and writes the result to `dst`."""
    import torch

    from loom.models.config import ModelConfig
    from loom.models.loader import load_model
    from loom.quant.checkpoint import write_quantized_checkpoint
    from loom.quant.model import quantize_model
    from loom.quant.quantize import check_options

    config = ModelConfig.from_dir(src)
    if config.quantization is not None:
        raise ValueError(f"{src}: already quantized ({config.quantization}); quantize the original")
    check_options(method, group_size)
    model = load_model(src, torch.float32, cfg=config)
    quantize_model(model, method, group_size)
    write_quantized_checkpoint(model, src, dst)


def _run(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.calibrate:
        from loom.quant.dispatch import calibrate, save_calibration

        result = calibrate([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
        path = save_calibration(result, args.plot)
        print(f"crossover (largest tokens per step where the weight-only kernel wins): {result['crossover']}")
        print(f"wrote {path} and {args.plot}")
        return
    if args.src is None or args.dst is None:
        raise ValueError("give SRC and DST directories (or --calibrate)")
    quantize_checkpoint(args.src, args.dst, args.method, args.group_size)
    print(f"wrote {args.dst} ({args.method}{f', group {args.group_size}' if args.method == 'int4' else ''})")
