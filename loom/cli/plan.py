"""`loom plan` and `loom calibrate`. Heavy imports (torch, matplotlib) happen inside commands."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from loom.planner.cost import PhaseEstimate
from loom.planner.hardware import load_hardware, this_machine_path
from loom.planner.presets import PRESETS, load_model, with_block
from loom.planner.search import best_plan, chip_counts, decode_sweep, evaluate, helix_gain
from loom.planner.workload import DTYPE_BYTES, Workload

SWEEP_BATCHES = [2**k for k in range(11)]  # 1 .. 1024


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="predict latency, MFU, memory and cost of each partitioning layout")
    p.add_argument("--model", default="llama-134m",
                   help=f"preset ({', '.join(PRESETS)}, house) or a config.json / checkpoint directory")
    p.add_argument("--hardware", default="this-machine",
                   help="preset (tpu-v4, a100-80gb, h100, h200, gb200-nvl72), this-machine, or a JSON file")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output", type=int, default=128, help="generated tokens per sequence")
    p.add_argument("--latency-target", type=float, help="total latency budget in ms: pick the cheapest plan under it")
    p.add_argument("--chips", type=int, help="largest chip count to consider (default: the hardware's)")
    dtypes = sorted(DTYPE_BYTES)
    p.add_argument("--weight-dtype", default="bf16", choices=dtypes)
    p.add_argument("--kv-dtype", default="bf16", choices=dtypes)
    p.add_argument("--block", default="model", choices=["model", "serial", "parallel"],
                   help="evaluate the model with a serial or parallel attention/FFN block")
    p.add_argument("--overlap", action="store_true", help="hide activation collectives behind compute")
    p.add_argument("--top", type=int, default=8, help="layouts listed per phase")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--sweep", type=Path, metavar="OUT.png", help="also sweep batch and chips and draw Pareto frontiers")
    p.set_defaults(func=run_plan)

    c = subparsers.add_parser("calibrate", help="measure this machine for `loom plan --hardware this-machine`")
    c.add_argument("--out", type=Path, help=f"where to write the hardware JSON (default {this_machine_path()})")
    c.add_argument("--linears", action="store_true",
                   help="instead: time every linear kernel per weight format and tokens per step, and store "
                        "the fastest as each format's dispatch plan")
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    c.add_argument("--plot", type=Path, default=Path("docs/benchmarks/linear_dispatch.png"),
                   help="with --linears: where to draw every kernel's times (a .json beside it)")
    c.set_defaults(func=run_calibrate)


def _row(e: PhaseEstimate) -> str:
    return (f"  {e.chips:>4} {e.layout.name:<38} {e.latency_s * 1e3:>11.2f} {e.step.time_s * 1e3:>9.3f} "
            f"{e.mfu * 100:>5.1f}% {e.memory_per_chip / 2**30:>8.2f} {'yes' if e.fits else 'NO':>4} "
            f"{e.max_context:>10} {e.chip_s_per_token:>10.3g}")


def run_plan(args: argparse.Namespace) -> None:
    model = with_block(load_model(args.model), args.block)
    hw = load_hardware(args.hardware)
    target = args.latency_target / 1e3 if args.latency_target else None
    wl = Workload(batch=args.batch, input_len=args.input, output_len=args.output, weight_dtype=args.weight_dtype,
                  kv_dtype=args.kv_dtype, latency_target_s=target, overlap=args.overlap)
    chips = chip_counts(hw, args.chips)
    estimates = evaluate(model, hw, wl, chips)
    plan = best_plan(estimates, wl)
    result: dict = {"model": model.name, "hardware": hw.name, "workload": wl.__dict__,
                    "best": plan.as_dict() if plan else None}
    if args.sweep:
        from loom.planner.plots import plot_sweep
        sweep = decode_sweep(model, hw, replace(wl, batch=1), SWEEP_BATCHES, chips)
        plot_sweep(sweep, args.sweep, f"{model.name} on {hw.name}, context {wl.input_len}+{wl.output_len}")
        result["sweep_png"] = str(args.sweep)
        try:
            result["helix_gain"] = helix_gain(sweep).__dict__
        except ValueError:
            pass
    if args.json:
        result["estimates"] = [e.as_dict() for e in estimates]
        print(json.dumps(result, indent=2, default=str))
        return
    print(f"{model.name} ({model.n_params / 1e9:.2f}B params) on {hw.name}: batch {wl.batch}, "
          f"input {wl.input_len}, output {wl.output_len}, weights {wl.weight_dtype}, KV {wl.kv_dtype}")
    header = f"  {'chips':>4} {'layout':<38} {'latency ms':>11} {'step ms':>9} {'MFU':>6} {'GiB/chip':>8} {'fits':>4} {'max ctx':>10} {'chip-s/tok':>10}"
    for phase in ("prefill", "decode"):
        rows = sorted((e for e in estimates if e.phase == phase), key=lambda e: (not e.fits, e.latency_s))
        print(f"\n{phase} (fastest {args.top} of {len(rows)}):\n{header}")
        print("\n".join(_row(e) for e in rows[:args.top]))
    if plan is None:
        print("\nno plan fits" + (f" under {args.latency_target} ms" if target else ""))
    else:
        print(f"\nbest on {plan.chips} chips: prefill {plan.prefill.layout.name}, decode {plan.decode.layout.name}; "
              f"total {plan.latency_s * 1e3:.1f} ms, {plan.chip_s_per_token:.3g} chip-s per generated token")
    if "helix_gain" in result:
        g = result["helix_gain"]
        print(f"sweep: {args.sweep}; Helix vs best non-Helix: x{g['throughput_gain']:.2f} tokens/s/chip at equal TTL, "
              f"x{g['batch_gain']:.2f} concurrent requests at equal TTL, x{g['min_ttl_gain']:.2f} lower minimum TTL")


def run_calibrate(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.linears:
        _calibrate_linears(args.plot)
        return
    from loom.bench.calibrate import calibrate
    hw = calibrate(args.out)
    print(hw.to_json())
    print(f"written to {args.out or this_machine_path()}")


def _calibrate_linears(plot: Path) -> None:
    from loom.bench.report import command, environment
    from loom.layers.dispatch import calibrate, plot_calibration, save_plans

    result = calibrate()
    path = save_plans(result)
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot_calibration(result, plot)
    report = {"command": command(sys.argv[1:]), "environment": environment(), **result}
    plot.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    for fmt, plan in result["plans"].items():
        steps = ", ".join(f"{kernel} up to {bound}" for bound, kernel in plan[:-1])
        last = f"{plan[-1][1]} beyond" if len(plan) > 1 else f"{plan[-1][1]} always"
        print(f"{fmt}: {', '.join(filter(None, (steps, last)))}; the pick / the fastest <= "
              f"{max(result['check'][fmt]):.3f} (second pass)")
    print(f"wrote {path}, {plot} and {plot.with_suffix('.json')}")
