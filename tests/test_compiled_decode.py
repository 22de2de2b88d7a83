"""The compiled decode path (torch.compile of decode-only steps) against eager execution.

One engine per case, each generating for prompts of different lengths and budgets, so the
compiled graph sees batch sizes shrink and contexts cross block boundaries (dynamic shapes).
The C++ decode step, which would serve most of these steps, is off here (test_decode_step.py)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model

from loom import LLM, SamplingParams
from loom.engine import decode_graphs
from loom.engine.decode_step import DecodeStep

PROMPTS = [{"prompt_token_ids": [5, 9, 33, 71, 2, 200, 14]}, {"prompt_token_ids": list(range(20, 60))},
           {"prompt_token_ids": [7] * 3}]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 9, 21)]


@pytest.fixture(autouse=True)
def graphs_only(monkeypatch):
    monkeypatch.setattr(DecodeStep, "build", staticmethod(lambda *args: None))


def run(model_dir, enforce_eager: bool, **kwargs) -> tuple[list[list[int]], LLM]:
    # Batches of at most the 3 prompts: no decode graph for batches past a kernel switch
    # (compiling one at load is the subject of its own test below).
    llm = LLM(str(model_dir), enforce_eager=enforce_eager, max_num_seqs=4, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kwargs", [dict(dtype="float32"), dict(dtype="bfloat16", quantization="int4"),
                                    dict(dtype="bfloat16", quantization="int4", symmetric=True)],
                         ids=["fp32", "bf16-int4", "bf16-int4-symmetric"])
def test_compiled_decode_matches_eager(hf_models, kwargs):
    model_dir, _ = hf_models("llama_gqa")
    eager, _ = run(model_dir, True, **kwargs)
    compiled, llm = run(model_dir, False, **kwargs)
    assert llm.engine.runner.decode_graphs is not None
    assert compiled == eager
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_reference_attention_runs_eagerly(hf_models):
    model_dir, _ = hf_models("llama_gqa")
    llm = LLM(str(model_dir), enforce_eager=False, attention_backend="torch")
    assert llm.engine.runner.decode_graphs is None


def test_saved_graphs_serve_engines_of_the_same_model_only(tmp_path, monkeypatch):
    """A load saves the graphs it compiles; a later engine of a model of the same shapes and
    dtype loads them (whatever its weights, its KV pool's size and its parallel options, which
    one process ignores), while another quantization compiles graphs of its own. The graphs skip
    guards on modules and parameters, so each engine must run its own model through them: with
    all three alive and called in turn, each still generates what its eager run does."""
    monkeypatch.setattr(decode_graphs, "graphs_root", lambda: tmp_path / "graphs")
    dirs = [tmp_path / f"seed{seed}" for seed in (1, 2)]
    for seed, d in enumerate(dirs, 1):
        build_hf_model(d, "llama_gqa", seed=seed)
    cases = [(dirs[0], dict()), (dirs[1], dict(kv_cache_memory=1 << 20, all_reduce="process_group")),
             (dirs[1], dict(quantization="int8"))]
    eager = [run(d, True, dtype="bfloat16", **kwargs)[0] for d, kwargs in cases]
    assert eager[0] != eager[1]
    compiled = [run(d, False, dtype="bfloat16", **kwargs) for d, kwargs in cases]
    graphs = [llm.engine.runner.decode_graphs for _, llm in compiled]
    assert [(len(g.graphs), g.num_compiled) for g in graphs] == [(2, 2), (2, 0), (2, 2)]
    assert len(list((tmp_path / "graphs").glob("*/*.graph"))) == 4
    assert [outs for outs, _ in compiled] == eager
    for (_, llm), expected in zip(compiled, eager):
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected


def test_saved_graphs_of_a_shorter_context_do_not_serve_a_longer_one(hf_models, tmp_path, monkeypatch):
    """The rotary tables' length follows max_model_len and is part of a saved graph's key: an
    engine of a longer context compiles its own graphs rather than loading ones that index
    shorter tables (positions past their end would abort the process), and matches eager."""
    monkeypatch.setattr(decode_graphs, "graphs_root", lambda: tmp_path / "graphs")
    model_dir, _ = hf_models("llama_gqa")
    run(model_dir, False, dtype="float32", max_model_len=64)
    prompts, params = PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)  # to position 99
    llm = LLM(str(model_dir), enforce_eager=False, max_num_seqs=4, dtype="float32", max_model_len=128)
    assert llm.engine.runner.decode_graphs.num_compiled == 2
    eager = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=128)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] ==
            [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)])


def test_decode_graphs_compile_at_load_not_at_the_first_request(hf_models, tmp_path, monkeypatch):
    """Loading compiles the batch-1 graph and the one for larger batches, and one more from each
    batch at which a linear layer's plan switches kernel (here at 3); requests of any batch size
    after that compile nothing (no request waits for the compiler), and match eager ones."""
    from loom.layers.dispatch import FORMATS, candidates, panels_available, plan_path

    kernels = candidates("bf16", panels_available())
    plans = {fmt: [[1, candidates(fmt, panels_available())[0]]] for fmt in FORMATS}
    plans["bf16"] = [[2, kernels[0]], [3, kernels[1]]]
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    monkeypatch.setattr(decode_graphs, "graphs_root", lambda: tmp_path / "graphs")  # none saved by earlier runs
    plan_path().write_text(json.dumps({"plans": plans}))
    model_dir, _ = hf_models("llama_mha")
    llm = LLM(str(model_dir), enforce_eager=False, dtype="bfloat16")
    graphs = llm.engine.runner.decode_graphs
    assert (len(graphs.graphs), graphs.num_compiled) == (3, 3)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # batches of 3, 2 and 1, contexts crossing blocks
    one = llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
    assert (len(graphs.graphs), graphs.num_compiled) == (3, 3)
    eager = LLM(str(model_dir), enforce_eager=True, dtype="bfloat16").generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    assert one[0].outputs[0].token_ids == eager[0].outputs[0].token_ids


@pytest.mark.parametrize("policy", ["h2o", "keyformer"])
def test_scored_decode_is_compiled_and_matches_eager(hf_models, policy):
    """Scored decode steps (the kernel adds each row's attention scores) run in a compiled
    graph of their own, beside the unscored ones (loaded, if an earlier test saved them), with
    the same tokens as eager."""
    model_dir, _ = hf_models("llama_gqa")
    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True, kv_policy=policy,
                             kv_budget=0.5) for p in PARAMS]
    outs, scores = {}, {}
    for eager in (True, False):
        # At most 4 sequences: the load compiles the graphs of batch 1 and of 2 on, and no third
        # for a kernel switch (which would satisfy the count of graphs below without a scored one).
        llm = LLM(str(model_dir), enforce_eager=eager, dtype="float32", max_num_seqs=4)
        scheduler, seen = llm.engine.scheduler, []
        postprocess = scheduler.postprocess

        def record(batch, results, postprocess=postprocess, seen=seen):
            seen += [(s.request.request_id, s.num_computed_tokens, s.kv_scores.scores.clone())
                     for s in batch.seqs if s.kv_scores is not None]
            return postprocess(batch, results)

        scheduler.postprocess = record
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        scores[eager] = seen
        assert llm.stats().num_free_blocks == llm.stats().num_blocks
    assert outs[False] == outs[True]
    # The scores accumulated after each step, layer by layer, are the eager ones.
    assert [s[:2] for s in scores[False]] == [s[:2] for s in scores[True]]
    assert all(torch.allclose(c[2], e[2], atol=1e-5) for c, e in zip(scores[False], scores[True]))
    assert len(llm.engine.runner.decode_graphs.graphs) > 2  # the load's two unscored graphs, and the scored


@pytest.mark.parametrize("keep_inputs", [True, False], ids=["inputs-kept", "prologue"])
def test_guards_are_checked_only_when_a_step_is_shaped_unlike_the_last(hf_models, monkeypatch, keep_inputs):
    """Consecutive decode steps alike in shape reuse the last step's graph without its guards and
    (its inputs kept) without its prologue, the step's own tensors put where the last step's
    were; a new batch size or block-table width checks the guards again. Where an input is
    neither the model's, the cache's nor the step's (here: no tensor counted as persistent),
    every step runs the prologue. Both match eager."""
    model_dir, _ = hf_models("llama_gqa")
    eager, _ = run(model_dir, True, dtype="float32")
    llm = LLM(str(model_dir), enforce_eager=False, max_num_seqs=4, dtype="float32")
    graphs = llm.engine.runner.decode_graphs
    if not keep_inputs:
        monkeypatch.setattr(graphs, "_persistent", {})
    checks, shape_changes, kept_runs = [], [], []
    for graph in graphs.graphs:
        monkeypatch.setattr(graph, "guard_check", lambda *a, g=graph.guard_check: checks.append(1) or g(*a))
    record, run_kept = graphs._record, decode_graphs._ShapedStep.run
    monkeypatch.setattr(graphs, "_record", lambda step, *a: shape_changes.append(step.shapes) or record(step, *a))
    monkeypatch.setattr(decode_graphs._ShapedStep, "run", lambda step, *a: kept_runs.append(1) or run_kept(step, *a))
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == eager
    assert all(a != b for a, b in zip(shape_changes, shape_changes[1:]))
    assert len(shape_changes) <= len(checks) <= 2 * len(shape_changes)  # each change checks at most both graphs
    if keep_inputs:
        assert len(kept_runs) > 2 * len(shape_changes)  # most steps are shaped like the one before
    else:
        assert kept_runs == []
