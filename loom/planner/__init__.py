"""Analytical inference planner: predicts latency, MFU, memory and cost of each partitioning
layout (PaLM inference paper, Helix parallelism) and picks the best one for a workload.

Modules, one idea each:
  presets     model shapes (presets and Hugging Face config.json)
  hardware    chip and interconnect descriptions (presets, JSON files, `this-machine`)
  workload    what is being served (batch, lengths, dtypes, latency target)
  collectives alpha-beta cost of all-gather / reduce-scatter / all-reduce / all-to-all
  layouts     the partitioning layouts and the collectives each one issues per layer
  cost        per-layer and per-phase cost of a layout (the roofline model)
  search      enumerate layouts and chip counts, best plan, Pareto frontiers
  plots       Pareto plots (matplotlib, imported lazily)

Measuring this machine for it is `loom calibrate` (loom/bench/calibrate.py); the command line
is loom/cli/plan.py.
"""
