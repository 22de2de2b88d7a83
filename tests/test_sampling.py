"""Every sampling parameter against an obviously-right reference."""
from __future__ import annotations

import math

import pytest
import torch

from loom import LLM, SamplingParams
from loom.bench.kv_quality import teacher_forcing
from loom.detokenizer import IncrementalDetokenizer, find_stop
from loom.layers.sampler import Sampler, SampleRow, apply_penalties, filtered_probs, first_argmax
from loom.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS
from loom.tokenizer import Tokenizer

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 64, 11, 250, 31]


def row(params: SamplingParams, prompt=(), output=(), banned=()) -> SampleRow:
    return SampleRow(params, [None], list(prompt), list(output), list(banned))


def test_penalties_match_direct_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 50, generator=g) * 3
    prompt, output = [1, 2, 3, 3], [3, 7, 7, 7, 9]
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [row(p, prompt, output), row(SamplingParams())])
    expected = logits[0].clone()
    for tok in range(50):
        x = expected[tok].item()
        if tok in prompt or tok in output:
            x = x / 1.3 if x > 0 else x * 1.3
        count = output.count(tok)
        x -= 0.25 * count + 0.5 * (count > 0)
        expected[tok] = x
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], logits[1])  # no penalties: untouched


def test_greedy_takes_the_first_of_tied_maxima():
    """Greedy picks torch.argmax's token, ties included (the first of equal maxima), whether
    every row of the batch is greedy or only some are."""
    logits = torch.randn(3, 32000, generator=torch.Generator().manual_seed(0))
    logits[0, [7, 900, 31999]] = 10.0
    logits[1, [31000, 5]] = 10.0
    expected = logits.argmax(dim=-1).tolist()
    assert expected[:2] == [7, 5]
    greedy = [row(SamplingParams(temperature=0)) for _ in range(3)]
    assert [r.token_ids for r in Sampler(0)(logits, greedy)] == [[t] for t in expected]
    mixed = greedy[:2] + [row(SamplingParams(temperature=1.0, seed=3))]
    assert [r.token_ids for r in Sampler(0)(logits, mixed)[:2]] == [[t] for t in expected[:2]]
    assert first_argmax(logits.double()) == expected  # torch's path (numpy's serves fp32 on CPU)


def test_greedy_takes_a_given_argmax_only_for_logits_left_as_they_came():
    """A caller's argmax of each row (the C++ decode step's) is a greedy row's token while no
    penalty, banned token or logits processor changes its logits; else the sampler scans."""
    logits = torch.zeros(3, 10)
    logits[:, 4] = 1.0
    given = [6, 7, 8]  # not the logits' argmax: shows which one was taken
    greedy = SamplingParams(temperature=0)
    assert [r.token_ids for r in Sampler(0)(logits, [row(greedy)] * 3, given)] == [[6], [7], [8]]
    mixed = [row(greedy), row(SamplingParams(temperature=1.0, seed=3)), row(greedy)]
    chosen = [r.token_ids for r in Sampler(0)(logits, mixed, given)]
    assert (chosen[0], chosen[2]) == ([6], [8])
    penalized = SamplingParams(temperature=0, presence_penalty=2.0)
    changed = [row(greedy), row(greedy, banned=[4]), row(penalized, output=[4])]
    assert [r.token_ids for r in Sampler(0)(logits, changed, given)] == [[4], [0], [0]]
    # Rows that ask for logprobs take the argmax given, and get their logprobs.
    with_logprobs = Sampler(0)(logits, [row(SamplingParams(temperature=0, logprobs=1))] * 3, given)
    assert [(r.token_ids, sorted(r.logprobs[0])) for r in with_logprobs] == [([t], [4, t]) for t in given]


def test_banned_tokens_masked():
    logits = torch.zeros(1, 10)
    out = apply_penalties(logits, [row(SamplingParams(), banned=[2, 5])])
    assert out[0, 2] == out[0, 5] == float("-inf") and torch.isfinite(out[0, [0, 1, 3]]).all()


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=8, top_p=0.7, min_p=0.05),
                                dict(temperature=0.5, top_p=0.9)])
def test_top_k_top_p_min_p_match_direct_formula(kw):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 40, generator=g) * 2
    p = SamplingParams(**{"temperature": 1.0, **kw})
    got = filtered_probs(logits, [p])[0]
    # direct: walk tokens from most to least likely, keeping those each rule allows
    probs = (logits[0] / p.temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    k = p.top_k if p.top_k > 0 else 40
    kept_topk = order[:k]
    pk = torch.zeros(40)
    pk[kept_topk] = probs[kept_topk] / probs[kept_topk].sum()
    kept, mass = [], 0.0
    for tok in kept_topk:
        if mass >= p.top_p:
            break
        kept.append(tok)
        mass += pk[tok].item()
    top = pk[kept_topk[0]].item()
    kept = [t for i, t in enumerate(kept) if i == 0 or pk[t].item() >= p.min_p * top]
    expected = torch.zeros(40)
    expected[kept] = pk[kept] / pk[kept].sum()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_sampling_follows_the_distribution(hf_models):
    """Empirical frequencies of one step's samples match the filtered distribution."""
    from loom.layers.sampler import Sampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = SamplingParams(temperature=1.0, top_k=4)
    sampler = Sampler(seed=0)
    rows = [SampleRow(p, [None] * 20000, [], [], [])]
    tokens = sampler(logits, rows)[0].token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / len(tokens)
    torch.testing.assert_close(freq, filtered_probs(logits, [p])[0], atol=0.015, rtol=0)


def test_logprobs_match_transformers(hf_models):
    model_dir, hf = hf_models("llama_gqa")
    llm = LLM(str(model_dir))
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
                       use_tqdm=False)[0]
    ids = PROMPT + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for step, lp in enumerate(out.outputs[0].logprobs):
        pos = len(PROMPT) - 1 + step
        tok = out.outputs[0].token_ids[step]
        assert lp[tok].rank == 1  # greedy
        top = ref[pos].topk(5)
        assert set(top.indices.tolist()) <= set(lp)
        for t, v in lp.items():
            assert abs(v.logprob - ref[pos, t].item()) < 1e-4
    assert math.isclose(out.outputs[0].cumulative_logprob,
                        sum(lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[PROMPT[pos]].logprob - ref[pos - 1, PROMPT[pos]].item()) < 1e-4
        assert entry[PROMPT[pos]].rank == int((ref[pos - 1] > ref[pos - 1, PROMPT[pos]]).sum()) + 1
        assert len(entry) >= 3


def test_a_logits_processor_forcing_tokens_gives_their_prompt_logprobs(hf_models):
    """Teacher forcing through decode: a processor that leaves only the next token of a given
    continuation makes the engine generate exactly it, with logprobs (the raw model's) equal to
    those of the same tokens scored as part of the prompt."""
    model_dir, _ = hf_models("llama_gqa")
    llm = LLM(str(model_dir))
    continuation = [7, 7, 200, 3, 45, 45, 1, 90]
    seen, forcing = [], teacher_forcing(continuation)

    def force(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_token_ids))
        return forcing(output_token_ids, logits)

    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=len(continuation), ignore_eos=True, logprobs=0, logits_processors=[force]),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == continuation and seen == [continuation[:i] for i in range(len(continuation))]
    scored = llm.generate({"prompt_token_ids": PROMPT + continuation}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0].prompt_logprobs[len(PROMPT):]
    forced = [lp[t].logprob for lp, t in zip(out.logprobs, continuation)]
    assert forced == pytest.approx([lp[t].logprob for lp, t in zip(scored, continuation)], abs=1e-4)
    assert max(forced) < -0.5  # these tokens are not what the model would pick: the forcing did it


def test_prompt_logprobs_across_chunks_and_with_prefix_cache(hf_models):
    model_dir, _ = hf_models("llama_gqa")
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    whole = LLM(str(model_dir)).generate({"prompt_token_ids": PROMPT * 3}, params, use_tqdm=False)[0]
    llm = LLM(str(model_dir), max_num_batched_tokens=8)
    llm.generate({"prompt_token_ids": PROMPT * 3}, SamplingParams(max_tokens=1), use_tqdm=False)  # fill the cache
    chunked = llm.generate({"prompt_token_ids": PROMPT * 3}, params, use_tqdm=False)[0]
    assert chunked.num_cached_tokens == 0  # prompt logprobs are computed, never taken from the cache
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_min_tokens_suppresses_eos_and_stop_ids(hf_models, tmp_path):
    import json
    import shutil

    model_dir, _ = hf_models("llama_gqa")
    free = LLM(str(model_dir)).generate({"prompt_token_ids": PROMPT},
                                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                        use_tqdm=False)[0].outputs[0].token_ids
    first = free[0]
    eos_model = tmp_path / "eos"  # the same model with the greedy first token as its EOS
    shutil.copytree(model_dir, eos_model)
    config = json.loads((eos_model / "config.json").read_text())
    (eos_model / "config.json").write_text(json.dumps(dict(config, eos_token_id=first)))
    llm = LLM(str(eos_model))
    stopped = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, min_tokens=3),
                        use_tqdm=False)[0].outputs[0]
    assert held.token_ids[0] != first and len(held.token_ids) >= 3
    assert first not in held.token_ids[:3]
    by_id = LLM(str(model_dir)).generate({"prompt_token_ids": PROMPT},
                                         SamplingParams(temperature=0, max_tokens=8, min_tokens=2,
                                                        stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert first not in by_id.token_ids[:2]


def test_stop_strings_across_token_boundaries(text_model):
    llm = LLM(str(text_model))
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("To be, or not", base, use_tqdm=False)[0].outputs[0]
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tok.decode([t]) for t in full.token_ids]
    ends = [len("".join(pieces[: i + 1])) for i in range(len(pieces))]
    k = next(i for i in range(1, len(pieces)) if len(pieces[i]) >= 1 and len(pieces[i - 1]) >= 2)
    start = ends[k - 1] - 1
    stop = full.text[start : ends[k] + 1] if k + 1 < len(pieces) else full.text[start : ends[k]]
    assert len(stop) >= 2
    cut = full.text.find(stop)
    for include in (False, True):
        out = llm.generate("To be, or not", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                             include_stop_str_in_output=include),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (full.text[: cut + len(stop)] if include else full.text[:cut])
        assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_find_stop_earliest_in_new_tail():
    assert find_stop("abcdef", 2, ["de", "f"]) == (3, "de")
    assert find_stop("abcdef", 1, ["ab"]) is None  # an old match is not new


def test_incremental_detokenizer_equals_full_decode(text_model):
    tok = Tokenizer.from_dir(text_model)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        ids = torch.randint(0, tok.vocab_size, (30,), generator=g).tolist()
        detok = IncrementalDetokenizer(tok, [1, 40, 41], skip_special_tokens=True)
        pieces = [detok.append(t) for t in ids]
        assert all(not p.endswith("\ufffd") for p in pieces)
        text = "".join(pieces) + detok.finish()
        assert text == tok.decode(ids) == detok.text


def test_incremental_detokenizer_holds_back_split_characters(text_model):
    tok = Tokenizer.from_dir(text_model)
    ids = tok.encode("✓ Café ünïcödé ✓", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    seen = ""
    for t in ids:
        seen += detok.append(t)
        assert "\ufffd" not in seen
        assert "✓ Café ünïcödé ✓".startswith(seen)
    assert seen == "✓ Café ünïcödé ✓"


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(n=4, temperature=0), "n"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=2.0), "min_p"),
    # types, checked before ranges
    (dict(top_k=2.5), "top_k: must be an int"),
    (dict(seed="abc"), "seed: must be an int or None"),
    (dict(n=True), "n: must be an int"),
    (dict(max_tokens=None), "max_tokens: must be an int"),
    (dict(temperature=float("nan")), "temperature: must be a finite number"),
    (dict(top_p="0.5"), "top_p: must be a finite number"),
    (dict(ignore_eos=1), "ignore_eos: must be a bool"),
    (dict(stop=["a", 3]), "stop: must be a list of strings"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids: must be a list of ints"),
    (dict(logprobs=2.0), "logprobs: must be an int or None"),
    (dict(logits_processors=[3]), "logits_processors: must be a list of callables"),
])
def test_bad_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_strings_need_a_tokenizer(hf_models):
    llm = LLM(str(hf_models("llama_gqa")[0]))
    with pytest.raises(ValueError, match="stop"):
        llm.engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(stop=["x"]))
