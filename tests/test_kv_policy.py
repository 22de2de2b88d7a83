"""KV-cache compression policies: the exact tokens each keeps, generations equal to a dense
model that attends only to those tokens, and the memory bound at every step with prefix
caching, n > 1, beam search and preemption in play."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts as prompts

from loom import LLM, SamplingParams
from loom.config import CacheConfig
from loom.kv.policy import NUM_SINKS, KVPolicy

BLOCK = 8


def test_fields_are_checked():
    for bad in ({"kv_policy": "lru"}, {"kv_budget": 0}, {"kv_budget": 1.5}, {"kv_budget": -3},
                {"kv_budget": True}, {"kv_budget": "half"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="kv_budget: the window policy needs a budget"):
        CacheConfig(kv_policy="window")


def test_kept_tokens_of_each_policy():
    # Stored order is not position order once holes were filled from the tail.
    positions = [0, 1, 2, 3, 17, 5, 6, 7, 8, 16, 10, 11, 12, 13, 14, 15, 18]
    window = KVPolicy("window", 6).tokens_to_drop(positions)
    assert sorted(positions[i] for i in set(range(len(positions))) - set(window)) == [13, 14, 15, 16, 17, 18]
    streaming = KVPolicy("streaming", 7).tokens_to_drop(positions)
    assert sorted(positions[i] for i in set(range(len(positions))) - set(streaming)) == [0, 1, 2, 3, 16, 17, 18]
    assert KVPolicy("window", 20).tokens_to_drop(positions) == []

    assert KVPolicy.resolve("full", 0.5, 100) is None
    assert KVPolicy.resolve("window", 0.25, 102) == KVPolicy("window", 26)
    assert KVPolicy.resolve("streaming", 64, 10) == KVPolicy("streaming", 64)
    with pytest.raises(ValueError, match="leaves no window"):
        KVPolicy.resolve("streaming", 0.1, 40)
    with pytest.raises(ValueError, match="needs a budget"):
        KVPolicy.resolve("window", None, 40)


def visible_keys(policy: str, budget: int, prompt_len: int, total: int) -> torch.Tensor:
    """[total, total] bool: what each position attends to. Prompt tokens are computed before any
    drop (causal); a later query sees the tokens kept after the previous step, and itself."""
    q = torch.arange(total)[:, None]
    k = torch.arange(total)[None, :]
    recent = budget - (NUM_SINKS if policy == "streaming" else 0)
    kept = k >= q - recent
    if policy == "streaming":
        kept |= k < NUM_SINKS
    return (k <= q) & ((q < prompt_len) | kept)


def masked_greedy(model, prompt: list[int], max_tokens: int, policy: str, budget: int) -> list[int]:
    """The reference: the dense Hugging Face model re-run over the whole sequence at every token,
    with an explicit mask of the tokens the policy keeps."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            n = len(ids)
            allowed = visible_keys(policy, budget, len(prompt), n)
            mask = torch.zeros(1, 1, n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)
            logits = model(torch.tensor([ids]), attention_mask=mask).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("policy", ["window", "streaming"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_generations_equal_the_masked_dense_model(gqa, policy, backend):
    model_dir, hf = gqa
    llm = LLM(str(model_dir), block_size=BLOCK, attention_backend=backend, max_num_batched_tokens=24)
    budget = 0.5
    batch = prompts(3, 37)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, kv_policy=policy, kv_budget=budget)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, out in zip(batch, outs):
        expected = masked_greedy(hf, p, 30, policy, round(budget * len(p)))
        assert out.outputs[0].token_ids == expected
    # Compression changed the outputs (the test is not vacuous) and freed everything at the end.
    full = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert any(f.outputs[0].token_ids != o.outputs[0].token_ids for f, o in zip(full, outs))
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_full_and_roomy_budgets_change_nothing(gqa):
    model_dir, _ = gqa
    batch = [{"prompt_token_ids": p} for p in prompts(3, 29, seed=1)]
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(model_dir), block_size=BLOCK).generate(batch, base, use_tqdm=False)]
    llm = LLM(str(model_dir), block_size=BLOCK, kv_policy="window", kv_budget=8)
    cases = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, kv_policy="full"),
             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, kv_budget=64)]  # never reached
    for params in cases:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == plain
    # The engine's own policy (window of 8) applies to requests that set nothing.
    assert [o.outputs[0].token_ids for o in llm.generate(batch, base, use_tqdm=False)] != plain


class BoundChecker:
    """Steps an engine to the end, asserting after every step that each compressed sequence
    past its prompt stores at most its budget (snapkv: plus what it generated), in no more
    blocks than that needs, and that a scored policy's per-head state matches its slot map."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.engine = llm, llm.engine
        self.checked = 0

    def run(self) -> list:
        outputs = []
        while self.engine.has_unfinished_requests():
            outputs += [o for o in self.engine.step() if o.finished]
            for seq in self.engine.scheduler.running:
                policy = seq.request.kv_policy
                if policy is None or seq.num_computed_tokens < seq.num_prompt_tokens:
                    continue
                generated = seq.num_computed_tokens - seq.num_prompt_tokens if policy.name == "snapkv" else 0
                assert seq.kv.num_tokens <= policy.budget + generated
                assert len(seq.kv.block_ids) == -(-seq.kv.num_tokens // BLOCK)
                if policy.scored:
                    assert seq.kv_scores.num_tokens == seq.kv.num_tokens
                self.checked += 1
        stats = self.llm.stats()
        assert stats.num_free_blocks == stats.num_blocks  # back to idle
        return sorted(outputs, key=lambda o: int(o.request_id))


def add(llm: LLM, batch: list[list[int]], params: SamplingParams) -> None:
    for p in batch:
        llm.engine.add_request({"prompt_token_ids": p}, params)


@pytest.mark.parametrize("policy", ["window", "h2o", "keyformer"])
def test_freed_blocks_let_more_sequences_run(gqa, policy):
    """A pool that holds two full-length sequences runs six compressed ones at once."""
    model_dir, _ = gqa
    blocks_per_seq = 128 // BLOCK
    bytes_per_block = 2 * 2 * 2 * 8 * BLOCK * 4  # k and v, 2 layers, 2 kv heads, head dim 8, fp32
    batch = prompts(6, 40, seed=2)
    runs = {}
    for policy in ("full", policy):
        llm = LLM(str(model_dir), block_size=BLOCK, max_model_len=128,
                  kv_cache_memory=2 * blocks_per_seq * bytes_per_block, max_num_batched_tokens=48)
        add(llm, batch, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, kv_policy=policy, kv_budget=16))
        checker = BoundChecker(llm)
        checker.run()
        runs[policy] = llm.stats().num_preemptions, checker.checked
    assert runs["full"][0] > 0 and runs[policy][0] == 0
    assert runs[policy][1] > 6 * 70  # the bound was checked at (nearly) every decode step of every sequence


@pytest.mark.parametrize("policy", ["streaming", "keyformer", "snapkv"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_bound_holds_through_preemption(gqa, mode, policy):
    model_dir, _ = gqa
    batch = prompts(8, 48, seed=3)
    budget = 36 if policy == "snapkv" else 20  # snapkv keeps its window of 32 prompt tokens
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, kv_policy=policy, kv_budget=budget)
    kw = dict(block_size=BLOCK, max_model_len=128, max_num_batched_tokens=64)
    llm = LLM(str(model_dir), kv_cache_memory=20 * 2048, preemption_mode=mode, swap_space=1 << 20, **kw)
    add(llm, batch, params)
    tight = BoundChecker(llm).run()
    assert llm.stats().num_preemptions > 0
    roomy = LLM(str(model_dir), **kw)
    add(roomy, batch, params)
    reference = BoundChecker(roomy).run()
    assert all(len(o.outputs[0].token_ids) == 60 for o in tight)
    if mode == "swap":  # the compressed state comes back as it left
        assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in reference]


@pytest.mark.parametrize("policy", ["window", "h2o"])
def test_prefix_cache_is_never_written_by_a_compressed_sequence(gqa, policy):
    model_dir, _ = gqa
    shared = prompts(1, 40, seed=4)[0]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fresh = LLM(str(model_dir), block_size=BLOCK).generate({"prompt_token_ids": shared + [7]}, plain, use_tqdm=False)
    llm = LLM(str(model_dir), block_size=BLOCK)
    llm.generate({"prompt_token_ids": shared}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                             kv_policy=policy, kv_budget=12), use_tqdm=False)
    later = llm.generate({"prompt_token_ids": shared + [7]}, plain, use_tqdm=False)
    assert later[0].num_cached_tokens == 40  # every full block of the shared prompt came from the cache
    assert later[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids


@pytest.mark.parametrize("policy", ["window", "keyformer", "snapkv"])
def test_parallel_samples_and_beams_stay_within_the_bound(gqa, policy):
    model_dir, _ = gqa
    batch = prompts(2, 36, seed=5)
    llm = LLM(str(model_dir), block_size=BLOCK, kv_policy=policy, kv_budget=34 if policy == "snapkv" else 0.5)
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)
    add(llm, batch, sampled)
    many = BoundChecker(llm).run()
    add(llm, batch, SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True))
    single = BoundChecker(llm).run()
    for m, s in zip(many, single):  # sample 0 forks from the compressed prompt exactly as n = 1 runs
        assert len(m.outputs) == 3 and m.outputs[0].token_ids == s.outputs[0].token_ids
    for p in batch:
        llm.engine.add_beam_request({"prompt_token_ids": p}, beam_width=3, max_tokens=20, ignore_eos=True)
    beams = BoundChecker(llm).run()
    assert all(len(o.outputs) == 3 and all(len(b.token_ids) == 20 for b in o.outputs) for o in beams)


def test_kv_speed_bench_reports_memory_and_capacity(gqa, tmp_path, capsys, monkeypatch):
    """The bench's own bookkeeping on a tiny model: every case decodes in each round, compressed
    sequences hold less KV, and the same memory runs more of them at once. Its decodes run here in
    this process (not in one of their own), each step given a duration instead of timed."""
    import json

    from loom.bench import kv_speed
    from loom.cli import main

    def decodes_here(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return kv_speed._run_decodes(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    monkeypatch.setattr(kv_speed, "run_decodes", decodes_here)
    monkeypatch.setattr(kv_speed, "_seconds", lambda fn: [fn(), 1e-3][1])

    model_dir, _ = gqa
    main(["bench", "kv-speed", "--model", str(model_dir), "--dtype", "float32", "--batch", "2", "--prompt-len", "64",
          "--output-len", "16", "--capacity-requests", "6", "--rounds", "2", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "kv_speed.json").read_text())
    decode, capacity = report["decode"], report["capacity"]
    assert [(d["policy"], d["budget"]) for d in decode] == [(c["policy"], c["budget"]) for c in capacity] == [
        ("full", None)] + [(p, b) for p in ("window", "streaming", "h2o", "keyformer", "snapkv") for b in (0.5, 0.25)]
    per_slot = 2 * 2 * 2 * 8 * 4  # k and v, 2 layers, 2 kv heads, head dim 8, fp32
    assert decode[0]["kv_bytes_per_seq"] == 80 * per_slot  # 64 + 16 tokens in five blocks of 16
    assert decode[2]["kv_bytes_per_seq"] == 16 * per_slot  # the 16 kept, between steps
    assert decode[8]["kv_bytes_per_seq"] == 16 * per_slot  # keyformer's 16 too (per head, the same count)
    assert all("decode_tok_per_s" in d and len(d["rounds_ms_per_step"]) == 2 for d in decode)
    # A decode step reads each stored token and its new one: 64 + 1 ... 64 + 15 over the 15 steps
    # (the first output comes from the prefill), 16 + 1 once the window keeps 16.
    assert decode[0]["kv_bytes_read_per_step"] == 2 * 72 * per_slot
    assert decode[2]["kv_bytes_read_per_step"] == 2 * 17 * per_slot
    assert decode[0]["memory_bound_vs_full"] == 1 and decode[2]["memory_bound_vs_full"] == pytest.approx(
        decode[0]["bytes_per_step"] / decode[2]["bytes_per_step"])
    assert decode[2]["bytes_per_step"] - decode[2]["kv_bytes_read_per_step"] == decode[0]["bytes_per_step"] - \
        decode[0]["kv_bytes_read_per_step"] > 0  # the same weights
    assert [s["policy"] for s in report["scoring_only"]] == ["h2o", "keyformer"]
    assert all(s["kv_bytes_per_seq"] == decode[0]["kv_bytes_per_seq"] for s in report["scoring_only"])  # no drop
    assert capacity[0]["largest_batch"] == 2 and capacity[2]["largest_batch"] > 2
    assert (tmp_path / "kv_speed.png").is_file() and "wrote" in capsys.readouterr().out


def test_kv_quality_bench_scores_every_policy_and_budget(tmp_path, capsys):
    """On the house model: the full cache scores ROUGE 1 against itself, every policy and
    budget gets a row, and the smallest budgets change generations and lose needles."""
    import json

    from conftest import SHARED
    from loom.bench import kv_quality
    from loom.bench.kv_quality import BUDGETS
    from loom.bench.quality import split_corpus
    from loom.cli import main
    from loom.cli.generate import DEFAULT_MODEL

    corpus = SHARED / "corpora" / "tinyshakespeare.txt"
    if not corpus.is_file():
        pytest.skip("../shared/corpora/tinyshakespeare.txt not found (a user's clone without the shared fixtures)")
    main(["bench", "kv-quality", "--corpus", str(corpus), "--prompts", "6", "--prompt-len", "160", "--max-tokens",
          "24", "--needles", "8", "--needle-context", "320", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "kv_quality.json").read_text())["rows"]
    assert rows[0]["policy"] == "full" and rows[0]["rouge1"] == rows[0]["rougeL"] == 1.0
    assert [(r["policy"], r["budget"]) for r in rows[1:]] == [
        (p, b) for p in ("window", "streaming", "h2o", "keyformer", "snapkv") for b in BUDGETS]
    assert all(0 <= r[k] <= 1 for r in rows for k in ("rouge1", "rouge2", "rougeL", "needle_accuracy"))
    smallest = [r for r in rows if r["budget"] == BUDGETS[0]]
    assert all(r["rougeL"] < 1 for r in smallest)
    # 10% of 320 tokens keeps little beyond the question itself: most needles are lost.
    assert min(r["needle_accuracy"] for r in smallest) < rows[0]["needle_accuracy"]
    assert max(r["heldout_loss"] for r in smallest) > rows[0]["heldout_loss"]
    assert (tmp_path / "kv_quality.png").is_file() and "wrote" in capsys.readouterr().out
    # The full cache's loss of the continuations, teacher-forced through decode steps, is the
    # one their prompt logprobs give when they follow the prompt as part of it.
    llm = LLM(str(DEFAULT_MODEL), dtype="float32")
    passages = kv_quality.passages(llm, split_corpus(corpus)[1], 6, 160, 24)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"] + p["continuation"]} for p in passages],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [o.prompt_logprobs[160 + i][t].logprob for p, o in zip(passages, outs)
                for i, t in enumerate(p["continuation"])]
    assert rows[0]["heldout_loss"] == pytest.approx(-sum(logprobs) / len(logprobs), abs=1e-4)
