"""Run by the tensor-parallel tests under torchrun (or alone): greedy generations of batches of
prompts, one `generate` call per batch in turn, with the LLM options given; rank 0 writes the
tokens and the engine's stats as JSON. Usage: python tests/tp_run.py OPTIONS_JSON BATCHES_JSON OUT_JSON"""
import dataclasses
import json
import os
import sys
from pathlib import Path

from loom import LLM, SamplingParams


def generate(options: dict, batches: list[list[list[int]]], max_tokens: int) -> dict:
    """Tokens per batch and prompt, with each token's margin (logprob of the best token minus
    the second best's), and the engine's stats."""
    llm = LLM(**options)  # under torchrun, only rank 0 returns
    if "LOOM_TEST_READY_FILE" in os.environ:  # tells a test that every rank has loaded
        Path(os.environ["LOOM_TEST_READY_FILE"]).touch()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    tokens, margins = [], []
    for batch in batches:
        outputs = [r.outputs[0] for r in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
        tokens.append([o.token_ids for o in outputs])
        margins.append([[_margin(candidates) for candidates in o.logprobs] for o in outputs])
    return {"tokens": tokens, "margins": margins, "stats": dataclasses.asdict(llm.stats())}


def _margin(candidates: dict) -> float:
    best = sorted((lp.logprob for lp in candidates.values()), reverse=True)
    return best[0] - best[1]


def count_collectives() -> dict:
    """Counts the collectives this process really issues (eager steps only: a compiled graph
    calls them from C++), as {kind: [calls, bytes]}; the step's inputs' broadcast included.
    (The shared-memory group's set-up, before any step, uses none of these.)"""
    import torch.distributed as dist

    from loom.parallel import comm

    counts = {kind: [0, 0] for kind in ("all_reduce", "gather", "broadcast", "all_to_all", "reduce_scatter",
                                        "all_gather")}

    def counted(kind, f):
        def call(tensor, *args, **kwargs):
            counts[kind][0] += 1
            counts[kind][1] += tensor.numel() * tensor.element_size()
            return f(tensor, *args, **kwargs)
        return call

    comm.all_reduce = counted("all_reduce", comm.all_reduce)  # shared memory or gloo
    comm.gather_to_driver = counted("gather", comm.gather_to_driver)
    comm.all_to_all = counted("all_to_all", comm.all_to_all)
    comm.all_to_all_start = counted("all_to_all", comm.all_to_all_start)  # HOP-B's, finished by a wait
    comm.reduce_scatter = counted("reduce_scatter", comm.reduce_scatter)
    comm.all_gather = counted("all_gather", comm.all_gather)
    dist.broadcast = counted("broadcast", dist.broadcast)
    return counts


if __name__ == "__main__":
    options, batches, out = json.loads(sys.argv[1]), json.load(open(sys.argv[2])), sys.argv[3]
    counts = count_collectives() if os.environ.get("LOOM_TEST_COUNT_COLLECTIVES") else None
    result = generate(options, batches, options.pop("max_tokens"))
    if counts is not None:
        result["counted"] = counts
    with open(out, "w") as f:
        json.dump(result, f)
