"""The C++ decode step (loom/engine/decode_step.py) against the compiled decode graphs and the
model's LM head, bit for bit, its argmax against the sampler's, and against eager execution by
the tokens it decodes; which models and steps it serves."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_hf_model

from loom import LLM, SamplingParams
from loom.engine import decode_graphs, model_runner
from loom.engine.decode_step import DecodeStep
from loom.kv.attention import DecodeScores
from loom.layers import dispatch, linear
from loom.layers.sampler import first_argmax

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"
PROMPTS = [{"prompt_token_ids": [5, 9, 33, 71, 2, 200, 14]}, {"prompt_token_ids": list(range(20, 60))},
           {"prompt_token_ids": [7] * 3}]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 9, 21)]


def generate(model_dir, enforce_eager: bool, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), enforce_eager=enforce_eager, max_num_seqs=4, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture
def both_paths(monkeypatch):
    """Runs every decode step the C++ step serves through the compiled graph and the model's LM
    head too, the graph's logits kept (so the C++ step's KV writes are written again by the
    graph's, and the sampler scans the graph's logits); returns the pairs of logits, after
    checking that the C++ step's logits are in the model's dtype and its argmax of each row is the
    sampler's scan of its logits (widened, as the sampler widens them)."""
    pairs = []
    run = model_runner.ModelRunner._run

    def run_both(self, inputs):
        logits, argmax = run(self, inputs)
        if argmax is None:  # not a step the C++ step ran
            return logits, argmax
        assert logits[0].dtype == self.dtype
        ours = logits[0].to(torch.float32, copy=True)
        assert argmax == first_argmax(ours)
        graphs = self.model.compute_logits(self.decode_graphs(inputs.input_ids, inputs.positions, inputs.meta))
        pairs.append((ours, graphs))
        return [graphs], None

    monkeypatch.setattr(model_runner.ModelRunner, "_run", run_both)
    return pairs


FORMATS = [dict(dtype="float32"), dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="int8"),
           dict(dtype="bfloat16", quantization="int4"), dict(dtype="bfloat16", quantization="int4", symmetric=True),
           dict(dtype="bfloat16", kv_cache_dtype="int8")]
FORMAT_IDS = ["fp32", "bf16", "bf16-int8", "bf16-int4", "bf16-int4-symmetric", "bf16-kv-int8"]


@pytest.mark.parametrize("kwargs", FORMATS, ids=FORMAT_IDS)
def test_decode_step_equals_the_compiled_graph_bit_for_bit(hf_models, both_paths, kwargs):
    model_dir, _ = hf_models("llama_gqa")
    generate(model_dir, False, **kwargs)
    assert len(both_paths) > 20  # every decode step of the three prompts, batches 3, 2 and 1
    for ours, graphs in both_paths:
        assert ours.dtype == graphs.dtype and torch.equal(ours, graphs)


@pytest.mark.parametrize("name", ["llama_mha", "llama_mqa", "qwen2_bias", "llama3_scaled", "llama_tied"])
def test_decode_step_serves_the_llama_family(hf_models, both_paths, name):
    """MHA, MQA, a QKV bias, llama3 rotary scaling and tied embeddings, in bf16."""
    model_dir, _ = hf_models(name)
    generate(model_dir, False, dtype="bfloat16")
    assert both_paths and all(torch.equal(ours, graphs) for ours, graphs in both_paths)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_computes_partial_vectors_as_the_graph_does(tmp_path, both_paths, dtype):
    """A hidden size of 80 (a norm's sum: two full vectors of 32 bf16 lanes and 16 lanes more) and
    an intermediate size of 168 (SwiGLU: ten vectors of 16 and 8 lanes more)."""
    build_hf_model(tmp_path, "llama_gqa", hidden_size=80, intermediate_size=168)
    generate(tmp_path, False, dtype=dtype)
    assert both_paths and all(torch.equal(ours, graphs) for ours, graphs in both_paths)


@pytest.mark.parametrize("kwargs", FORMATS[:4], ids=FORMAT_IDS[:4])
def test_decode_step_decodes_as_eager(hf_models, monkeypatch, kwargs):
    model_dir, _ = hf_models("llama_gqa")
    eager, _ = generate(model_dir, True, **kwargs)
    calls = []
    run = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a: calls.append(1) or run(self, *a))
    ours, llm = generate(model_dir, False, **kwargs)
    assert ours == eager
    assert len(calls) > 20  # it ran the decode steps
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_decode_step_leaves_scored_steps_to_the_graphs(gqa):
    """It serves every unscored batch here, so the load compiles no graph."""
    llm = LLM(str(gqa[0]), enforce_eager=False, max_num_seqs=4)
    assert llm.engine.runner.decode_graphs.num_compiled == 0
    step, meta = llm.engine.runner.decode_step, _decode_meta(1)
    assert step.serves(meta)
    meta.decode_scores = DecodeScores(temps=torch.ones(1), row_keys=torch.zeros(1, dtype=torch.long),
                                      rows=torch.zeros(1, 5, dtype=torch.long), newest=torch.full((1,), -1),
                                      states=[None])
    assert not step.serves(meta)
    assert not step.serves(_decode_meta(step.max_batch + 1))


def test_an_engine_whose_policy_scores_prepares_its_scored_graphs_at_load(gqa, monkeypatch, tmp_path):
    """The C++ step serves every unscored batch, and scored steps have graphs of their own: where
    the engine's default KV policy scores decode steps, the load compiles those (traced from rows
    that do not score), and its requests' scored steps (batches of 3, 2 and 1) then compile
    nothing, with the same tokens as eager."""
    monkeypatch.setattr(decode_graphs, "graphs_root", lambda: tmp_path / "graphs")  # none saved by earlier runs
    engine = dict(dtype="float32", max_num_seqs=4, kv_policy="h2o", kv_budget=0.5)
    llm = LLM(str(gqa[0]), enforce_eager=False, **engine)
    graphs = llm.engine.runner.decode_graphs
    assert (len(graphs.graphs), graphs.num_compiled) == (2, 2)  # the scored graphs of batch 1 and of 2 on
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert (len(graphs.graphs), graphs.num_compiled) == (2, 2)
    eager = LLM(str(gqa[0]), enforce_eager=True, **engine).generate(PROMPTS, PARAMS, use_tqdm=False)
    assert outs == [o.outputs[0].token_ids for o in eager]


def test_decode_step_serves_batches_up_to_the_first_kernel_switch(gqa, tmp_path, monkeypatch):
    """A plan that hands batches above 4 to a dequantizing GEMM: the C++ step serves up to 4, and
    the load compiles the one graph of batches 5 to 8, which serves a batch of 6 as eager does."""
    from loom.engine import decode_graphs
    from loom.quant import linear as quant_linear
    monkeypatch.setattr(quant_linear, "load_plan", lambda method: ((4, "weight_only"), (5, "dequantized")))
    monkeypatch.setattr(decode_graphs, "graphs_root", lambda: tmp_path / "graphs")  # none saved by earlier runs
    options = dict(dtype="bfloat16", quantization="int8", max_num_seqs=8)
    llm = LLM(str(gqa[0]), enforce_eager=False, **options)
    runner = llm.engine.runner
    assert runner.decode_step.max_batch == 4
    assert runner.decode_graphs.num_compiled == 1
    prompts = [{"prompt_token_ids": [5 + i, 9, 33, 71 + i]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert runner.decode_graphs.num_compiled == 1
    eager = LLM(str(gqa[0]), enforce_eager=True, **options).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.skipif(not (dispatch.panels_available() and dispatch.amx_tiles()),
                    reason="no AMX here (or the kernels were built without it): Loom's AMX kernel does not run")
def test_decode_step_runs_amx_tiles_where_the_plan_names_them(gqa, both_paths, monkeypatch):
    """bf16 layers planned onto AMX tiles from 2 rows: the C++ step serves every batch, runs its
    linear layers on the tiles at batches 2 and 3 and on the panel kernel at 1, and equals the
    compiled graph (which calls the tiles too) bit for bit; the tokens are eager's."""
    monkeypatch.setattr(linear, "load_plan", lambda fmt: ((1, "panel"), (2, "amx")))
    ours, llm = generate(gqa[0], False, dtype="bfloat16")
    step = llm.engine.runner.decode_step
    assert step.max_batch == 4
    assert {rows: set(step.linear_ops(rows)) for rows in (1, 2, 3)} == {
        1: {"loom::dense_linear"}, 2: {"loom::amx_linear"}, 3: {"loom::amx_linear"}}
    assert {a.shape[0] for a, _ in both_paths} == {1, 2, 3}  # the C++ step ran every batch
    assert len(both_paths) > 20 and all(torch.equal(a, b) for a, b in both_paths)
    eager, _ = generate(gqa[0], True, dtype="bfloat16")
    assert ours == eager


def test_models_outside_the_llama_family_run_through_the_graphs(hf_models):
    model_dir, _ = hf_models("gpt_neox_parallel")
    llm = LLM(str(model_dir), enforce_eager=False, max_num_seqs=4)
    assert llm.engine.runner.decode_step is None and llm.engine.runner.decode_graphs is not None
    assert llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_argmax_takes_the_first_largest_and_a_nan_first(tmp_path, dtype):
    """As numpy's argmax over the logits in fp32, which the sampler's scan is: of equal logits the
    first, and a NaN over any number. Head weights in panels of 32 channels: fp32 weight[p, 32 k + c]
    is channel 32 p + c, input k; bf16 weight[p, 64 j + 2 c + t] is the same channel, input 2 j + t."""
    build_hf_model(tmp_path, "llama_gqa", vocab_size=250)  # a last, partial vector of 10 logits
    llm = LLM(str(tmp_path), enforce_eager=False, dtype=dtype, max_num_seqs=4)
    step, head = llm.engine.runner.decode_step, llm.engine.runner.model.lm_head
    ids, positions = torch.tensor([3]), torch.tensor([0])

    def channel(n: int) -> torch.Tensor:
        panel, c = head.weight[n // 32], n % 32
        return panel[c::32] if dtype == "float32" else panel.view(-1, 64)[:, 2 * c:2 * c + 2]

    def logits_and_argmax() -> tuple[torch.Tensor, list[int]]:
        logits, argmax = step(ids, positions, _decode_meta(1))
        assert logits.dtype == getattr(torch, dtype)
        return logits.float(), argmax

    last = head.out_features - 1  # in the partial vector
    head.weight.zero_()  # every logit 0
    channel(last).fill_(1.0)
    sign = 1.0 if logits_and_argmax()[0][0, last] > 0 else -1.0
    channel(last - 1).fill_(sign)
    channel(last).fill_(sign)
    logits, argmax = logits_and_argmax()
    assert logits[0, last] > 0
    assert argmax == first_argmax(logits) == [last - 1]
    channel(35).fill_(2 * sign)  # lane 3 of its vector: larger, and tied with channel 20 (lane 4)
    channel(20).fill_(2 * sign)
    logits, argmax = logits_and_argmax()
    assert argmax == first_argmax(logits) == [20]
    channel(40).fill_(float("nan"))
    channel(70).fill_(float("nan"))
    logits, argmax = logits_and_argmax()
    assert argmax == first_argmax(logits) == [40]


def test_a_token_id_outside_the_vocabulary_is_refused(gqa):
    llm = LLM(str(gqa[0]), enforce_eager=False, max_num_seqs=4)
    step = llm.engine.runner.decode_step
    meta = _decode_meta(1)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        step(torch.tensor([10_000]), torch.tensor([0]), meta)


def _steps_run(monkeypatch) -> list[int]:
    """Each scheduled batch's count of decode steps at once, as the scheduler gives them."""
    from loom.engine.scheduler import Scheduler

    counts, schedule = [], Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", lambda self: counts.append((batch := schedule(self)).num_steps) or batch)
    return counts


@pytest.mark.parametrize("kwargs", FORMATS[:4:3], ids=FORMAT_IDS[:4:3])
def test_several_decode_steps_at_once_decode_as_one_at_a_time(hf_models, monkeypatch, kwargs):
    """Tokens, texts and finish reasons as single steps give them, where rows end between the
    steps of a batch: length limits that are no multiple of 4, a stop id each row meets early, a
    stop string; every block freed, the prefix cache's blocks right for a later prompt."""
    llm = LLM(str(HOUSE), enforce_eager=False, max_num_seqs=4, num_scheduler_steps=4, **kwargs)
    counts = _steps_run(monkeypatch)
    prompts = ["ROMEO:", "To be, or not", "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n"]

    def run(steps: int, params: list[SamplingParams]):
        llm.engine.scheduler.config.num_scheduler_steps = steps
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]

    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 9, 21)]
    first = run(1, free)
    stops = [SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[tokens[k]], ignore_eos=True)
             for n, (tokens, _, _), k in zip((30, 9, 21), first, (5, 2, 6))]
    strings = [SamplingParams(temperature=0, max_tokens=30, stop=[text[7:9]]) for _, text, _ in first]
    for params in (free, stops, strings):
        del counts[:]
        one = run(1, params)
        assert set(counts) == {1}
        del counts[:]
        assert run(4, params) == one
        assert max(counts) == 4
    assert {reason for _, _, reason in run(4, stops)} == {reason for _, _, reason in run(4, strings)} == {"stop"}
    assert llm.stats().num_free_blocks == llm.stats().num_blocks
    assert llm.stats().prefix_cache_hits > 0  # later runs found the third prompt's blocks


def test_several_decode_steps_at_once_only_where_every_row_takes_its_argmax(gqa, monkeypatch):
    """Rows that sample, ask for logprobs or mask stop ids until min_tokens decode a step at a
    time; so does a batch with requests waiting to be admitted."""
    llm = LLM(str(gqa[0]), enforce_eager=False, max_num_seqs=4, num_scheduler_steps=4)
    counts = _steps_run(monkeypatch)
    prompt = PROMPTS[:1]
    for params in (SamplingParams(temperature=0.8, seed=1, max_tokens=12),
                   SamplingParams(temperature=0, max_tokens=12, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=12, min_tokens=12),
                   SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3)):
        del counts[:]
        llm.generate(prompt, params, use_tqdm=False)
        assert set(counts) == {1}, params
    llm.engine.scheduler.config.max_num_seqs = 1  # the second request waits while the first decodes
    del counts[:]
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    waited = counts[:counts.index(4)] if 4 in counts else counts
    assert len(waited) >= 12 and set(waited) == {1}
    assert counts.count(4) >= 2  # the second, alone, decodes 4 steps at once


def test_several_decode_steps_at_once_through_the_cpp_step(gqa):
    """`DecodeStep` with num_steps: the argmax of each step as single calls give them."""
    llm = LLM(str(gqa[0]), enforce_eager=False, max_num_seqs=4)
    step = llm.engine.runner.decode_step
    single, token = [], 7
    for i in range(3):
        meta = _decode_meta(1)
        meta.slot_mapping = torch.tensor([i])
        meta.decode_context_lens = torch.tensor([i + 1], dtype=torch.int32)
        logits, argmax = step(torch.tensor([token]), torch.tensor([i]), meta)
        single.append(argmax[0])
        token = argmax[0]
    meta = _decode_meta(1)
    meta.slot_mapping = torch.tensor([0, 1, 2])
    steps_logits, steps = step(torch.tensor([7]), torch.tensor([0]), meta, 3)
    assert steps == single and torch.equal(steps_logits, logits)
    with pytest.raises(RuntimeError, match=r"slots \[steps \* B\]"):
        step(torch.tensor([7]), torch.tensor([0]), meta, 2)


def _decode_meta(batch: int):
    from loom.kv.attention import AttentionMetadata

    return AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long), num_decode_tokens=batch,
                             decode_block_tables=torch.zeros(batch, 1, dtype=torch.int32),
                             decode_context_lens=torch.ones(batch, dtype=torch.int32))
