"""The `loom` command line: one subcommand per capability, each in a module of this package.

Each module exposes `register(subparsers)`, which adds its subcommand and sets `func` on the
parsed namespace; this file wires them together. A failure prints one line naming the problem
(`loom: error: ...`) and exits with status 1; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in the order they appear in `loom --help`.
_COMMAND_MODULES = [
    "loom.cli.generate",   # generate, chat
    "loom.cli.serve",      # serve
    "loom.cli.convert",    # convert
    "loom.cli.quantize",   # quantize
    "loom.cli.bench",      # bench
    "loom.cli.plan",       # plan, calibrate
]


class _Parser(argparse.ArgumentParser):
    """Every command and subcommand takes --debug, wherever it is written."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the Python traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loom", description="Loom: a paged-KV LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # every failure a user can cause: bad paths, configs, options
        if getattr(args, "debug", False):
            raise
        parser.exit(1, f"loom: error: {_describe(e)}\n")


def _describe(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, (ValueError, OSError)):  # Loom's own errors name the field or file concerned
        return message
    return f"{type(e).__name__}: {message} (run with --debug for the traceback)"
