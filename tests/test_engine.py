"""Engine behaviour: prefix caching, chunked prefill, preemption, stats, bad input, no leaks."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loom import LLM, InvalidRequestsError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"


def _workload(seed: int = 0, vocab: int = 256) -> list[dict]:
    """Prompts with shared prefixes (so the prefix cache has work) and various lengths."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 23, 50)]
    prompts += [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 31, 70)]
    return [{"prompt_token_ids": p} for p in prompts]


def _run(model_dir, prompts=None, params=GREEDY, **engine_kw):
    llm = LLM(str(model_dir), **engine_kw)
    outs = llm.generate(prompts or _workload(), params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def gqa_dir(hf_models):
    return hf_models("llama_gqa")[0]


@pytest.fixture(scope="module")
def baseline(gqa_dir):
    """Prefix caching off, no chunking, no preemption: the reference run."""
    _, tokens = _run(gqa_dir, enable_prefix_caching=False, enable_chunked_prefill=False,
                     max_num_batched_tokens=512)
    return tokens


def _assert_no_leak(llm):
    s = llm.stats()
    assert s.num_running == s.num_waiting == 0
    assert s.num_free_blocks == s.num_blocks, "blocks leaked"


def test_prefix_caching_same_outputs_and_hits(gqa_dir, baseline):
    llm, tokens = _run(gqa_dir, enable_prefix_caching=True, max_num_seqs=1)  # one at a time: later ones hit
    assert tokens == baseline
    assert llm.stats().prefix_cache_hits > 0
    # a second identical call reuses the whole prompts (all but the last block of each)
    again = [o.outputs[0].token_ids for o in llm.generate(_workload(), GREEDY, use_tqdm=False)]
    assert again == baseline
    assert llm.stats().prefix_cache_hit_rate > 0.4
    _assert_no_leak(llm)


def test_chunked_prefill_same_outputs(gqa_dir, baseline):
    llm, tokens = _run(gqa_dir, enable_chunked_prefill=True, max_num_batched_tokens=16)
    assert tokens == baseline
    _assert_no_leak(llm)


def test_preemption_same_outputs(gqa_dir, baseline):
    # 2 layers x 2 kv heads x 8 dims x 2 (k, v) x 4 bytes = 256 bytes per token slot; 16-token
    # blocks: 4 KiB each. 12 blocks cannot hold all 7 sequences at once.
    llm, tokens = _run(gqa_dir, kv_cache_memory=12 * 4096, max_model_len=160, max_num_batched_tokens=64)
    assert llm.stats().num_blocks == 12
    assert llm.stats().num_preemptions > 0
    assert tokens == baseline
    _assert_no_leak(llm)


def test_preemption_without_prefix_caching(gqa_dir, baseline):
    llm, tokens = _run(gqa_dir, kv_cache_memory=12 * 4096, max_model_len=160, enable_prefix_caching=False,
                       max_num_batched_tokens=64)
    assert llm.stats().num_preemptions > 0
    assert tokens == baseline
    _assert_no_leak(llm)


def test_torch_attention_backend_same_outputs(gqa_dir, baseline):
    _, tokens = _run(gqa_dir, attention_backend="torch")
    assert tokens == baseline


def test_results_in_order_and_max_num_seqs(gqa_dir, baseline):
    llm, tokens = _run(gqa_dir, max_num_seqs=2)
    assert tokens == baseline


def test_stop_token_ids_and_eos(gqa_dir, baseline):
    llm = LLM(str(gqa_dir))
    first = baseline[0]
    stop_at = first[5]
    out = llm.generate(_workload()[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[: first.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    _assert_no_leak(llm)


def test_seeded_sampling_reproducible_across_batches(gqa_dir):
    llm = LLM(str(gqa_dir))
    prompts = _workload()
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts[2], p, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(prompts, [other, other, p] + [other] * (len(prompts) - 3), use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    different = llm.generate(prompts[2], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_bad_prompts_rejected_others_complete(gqa_dir, baseline):
    llm = LLM(str(gqa_dir), max_model_len=128)
    good = _workload()
    bad = {
        1: {"prompt_token_ids": []},
        3: {"prompt_token_ids": [5] * 200},        # longer than max_model_len
        5: {"prompt_token_ids": [5, 99999, 7]},    # unknown token id
    }
    prompts = list(good)
    for i, p in bad.items():
        prompts.insert(i, p)
    with pytest.raises(InvalidRequestsError) as err:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    e = err.value
    assert isinstance(e, ValueError)
    assert set(e.errors) == set(bad)
    assert "prompt" in str(e.errors[1]) and "max_model_len" in str(e.errors[3])
    assert "prompt_token_ids" in str(e.errors[5])
    completed = [o.outputs[0].token_ids for i, o in enumerate(e.outputs) if i not in bad]
    assert completed == baseline
    _assert_no_leak(llm)


def test_untokenizable_prompt_rejected_others_complete():
    """A lone surrogate (a JSON body can carry one as an escape) makes the tokenizers library
    raise TypeError: that prompt alone is rejected, as a ValueError naming it."""
    llm = LLM(str(HOUSE))
    prompts = ["ROMEO:", "\udcff abc", "JULIET:"]
    with pytest.raises(InvalidRequestsError) as err:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert list(err.value.errors) == [1] and "cannot be tokenized" in str(err.value.errors[1])
    alone = llm.generate([prompts[0], prompts[2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in err.value.outputs if o] == [o.outputs[0].token_ids for o in alone]


def test_failed_step_ends_its_requests_and_the_engine_goes_on(gqa_dir, baseline, caplog):
    """A step that raises ends the requests it ran with finish_reason "error" and frees their
    blocks; requests that were waiting, and later calls, run as if nothing happened."""
    llm = LLM(str(gqa_dir), max_num_seqs=2)
    execute, calls = llm.engine.runner.execute, []

    def fail_once(batch):
        calls.append(len(batch.seqs))
        if len(calls) == 3:
            raise RuntimeError("kernel fault")
        return execute(batch)

    llm.engine.runner.execute = fail_once
    outs = llm.generate(_workload(), GREEDY, use_tqdm=False)
    failed = [i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "error"]
    assert len(failed) == calls[2] and "kernel fault" in caplog.text
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i not in failed] == \
        [t for i, t in enumerate(baseline) if i not in failed]
    _assert_no_leak(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(_workload(), GREEDY, use_tqdm=False)] == baseline


def test_text_prompt_without_tokenizer_is_clear_error(gqa_dir):
    llm = LLM(str(gqa_dir))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)


def test_kv_waste_and_stats_midway(gqa_dir):
    llm = LLM(str(gqa_dir))
    for i, p in enumerate(_workload()):
        llm.engine.add_request(p, GREEDY)
    llm.engine.step()
    llm.engine.step()
    s = llm.stats()
    assert s.num_running == len(_workload())
    assert s.kv_slots_allocated >= s.kv_slots_used > 0
    assert s.num_free_blocks < s.num_blocks
    # Without the slot walk (what the server's per-step metrics take), everything else is the same.
    assert llm.engine.stats(kv_slots=False) == dataclasses.replace(s, kv_slots_allocated=0, kv_slots_used=0)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _assert_no_leak(llm)


def test_abort_frees_blocks_and_reports(gqa_dir):
    llm = LLM(str(gqa_dir))
    rid = llm.engine.add_request(_workload()[3], GREEDY)
    other = llm.engine.add_request(_workload()[4], GREEDY)
    llm.engine.step()
    llm.engine.step()
    assert llm.stats().num_free_blocks < llm.stats().num_blocks
    llm.engine.abort_request(rid)
    outs = {o.request_id: o for o in llm.engine.step()}
    final = outs[rid]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) == 2  # what it had generated before the abort
    assert not outs[other].finished
    while llm.engine.has_unfinished_requests():
        outs = llm.engine.step()
        assert all(o.request_id == other for o in outs)
    llm.engine.abort_request(rid)  # finished or unknown ids are ignored
    assert llm.engine.step() == []
    _assert_no_leak(llm)


def test_abort_of_a_waiting_request(gqa_dir):
    llm = LLM(str(gqa_dir), max_num_seqs=1)
    first = llm.engine.add_request(_workload()[0], GREEDY)
    queued = llm.engine.add_request(_workload()[1], GREEDY)
    llm.engine.step()  # only the first runs
    llm.engine.abort_request(queued)
    outs = {o.request_id: o for o in llm.engine.step()}
    assert outs[queued].finished and outs[queued].outputs[0].finish_reason == "abort"
    assert outs[queued].outputs[0].token_ids == []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.stats().num_free_blocks == llm.stats().num_blocks
    assert first != queued


def test_add_and_abort_from_another_thread_while_stepping(gqa_dir, baseline):
    """Requests added and aborted from other threads while the engine steps: the added ones
    complete with the outputs they have alone, the aborted ones report an abort, nothing leaks."""
    import threading

    llm = LLM(str(gqa_dir))
    engine = llm.engine
    prompts = _workload()
    finals: dict[str, object] = {}
    stop = threading.Event()

    def loop():
        while not stop.is_set() or engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out

    stepper = threading.Thread(target=loop)
    stepper.start()
    try:
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        doomed = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
                  for p in prompts[:3]]
        for request_id in doomed:
            engine.abort_request(request_id)
    finally:
        stop.set()
        stepper.join(timeout=300)
    assert not stepper.is_alive()
    assert [finals[i].outputs[0].token_ids for i in ids] == baseline
    assert all(finals[i].outputs[0].finish_reason == "abort" for i in doomed)
    _assert_no_leak(llm)


@pytest.mark.parametrize("kind", ["delta", "cumulative", "final_only"])
def test_output_kinds(text_model, kind):
    """DELTA outputs add up to the CUMULATIVE ones; FINAL_ONLY gives one output, the same."""
    from loom.sampling_params import RequestOutputKind

    llm = LLM(str(text_model))
    prompt = "To be, or not"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].text[12:15]  # a stop string inside the text: held back, then cut
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=1, prompt_logprobs=2)
    whole = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    expected = whole.outputs[0]
    assert expected.finish_reason == "stop" and stop not in expected.text
    rid = llm.engine.add_request(prompt, SamplingParams(**params, output_kind=RequestOutputKind(kind)))
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.request_id == rid]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    if kind == "final_only":
        assert len(outs) == 1
    if kind == "delta":
        assert len(outs) > 1
        text = "".join(o.outputs[0].text for o in outs)
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        logprobs = [lp for o in outs for lp in o.outputs[0].logprobs]
        assert all(o.prompt_logprobs is None for o in outs[1:])  # sent once, with the first
    else:
        text, tokens, logprobs = outs[-1].outputs[0].text, outs[-1].outputs[0].token_ids, outs[-1].outputs[0].logprobs
    assert (text, tokens, logprobs) == (expected.text, expected.token_ids, expected.logprobs)
    assert outs[-1].outputs[0].finish_reason == expected.finish_reason
    assert outs[0].prompt_logprobs == whole.prompt_logprobs and len(whole.prompt_logprobs) > 1


def test_config_errors(gqa_dir):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(gqa_dir), kv_cache_memory=4096)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(gqa_dir), block_size=12)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(gqa_dir), enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(gqa_dir), dtype="float8")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swap_preemption_same_outputs(gqa_dir, baseline, prefix_caching):
    llm, tokens = _run(gqa_dir, kv_cache_memory=12 * 4096, max_model_len=160, max_num_batched_tokens=64,
                       preemption_mode="swap", swap_space=64 * 4096, enable_prefix_caching=prefix_caching)
    s = llm.stats()
    assert s.num_swap_outs > 0 and s.num_swapped == 0
    assert tokens == baseline
    _assert_no_leak(llm)
    assert s.num_free_swap_blocks == 64


def test_swap_space_too_small_falls_back_to_recompute(gqa_dir, baseline):
    llm, tokens = _run(gqa_dir, kv_cache_memory=12 * 4096, max_model_len=160, max_num_batched_tokens=64,
                       preemption_mode="swap", swap_space=2 * 4096)
    assert llm.stats().num_preemptions > llm.stats().num_swap_outs
    assert tokens == baseline
    _assert_no_leak(llm)


def test_swapped_blocks_come_back_intact(gqa_dir):
    from loom.kv.cache import KVCache
    from loom.kv.swap import SwapSpace

    cache = KVCache(2, 8, 2, 4, 16, torch.float32, "cpu")
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape))
    before = [t[[1, 5]].clone() for t in cache.keys + cache.values]
    swap = SwapSpace(cache, 4)
    swap.swap_out([(1, 2), (5, 0)])
    for t in cache.keys + cache.values:
        t.zero_()
    swap.swap_in([(2, 6), (0, 3)])
    after = [t[[6, 3]] for t in cache.keys + cache.values]
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_bad_preemption_mode(gqa_dir):
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(str(gqa_dir), preemption_mode="sometimes")
