"""The `loom` command line: one subcommand per capability.

Each capability module exposes `register(subparsers)`, which adds its subcommand and sets
`func` on the parsed namespace; this file only wires them together.
"""
from __future__ import annotations

import argparse
import importlib

# Modules that contribute subcommands, in the order they appear in `loom --help`.
_COMMAND_MODULES = [
    "loom.commands.generate",   # generate, chat
    "loom.models.llama2c",      # convert
    "loom.quant.cli",           # quantize
    "loom.bench.cli",           # bench
    "loom.planner.cli",         # plan
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom: a paged-KV LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
