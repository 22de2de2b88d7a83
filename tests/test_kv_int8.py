"""The int8 KV cache: outputs move from the model-dtype cache's only by the rows' rounding, and
every path a slot's K/V takes (prefix sharing, chunked prefill, preemption by recompute or swap,
compiled decode steps, the reference attention, a KV policy's per-head moves) carries its scale
with it, so each gives the tokens of the plain int8 run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import engine_logprobs
from loom import LLM, SamplingParams

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# The random GQA model: 2 layers x 2 kv heads x (8 int8 + a 4-byte scale) x k and v, 16-token blocks.
INT8_BLOCK_BYTES = 2 * 2 * (8 + 4) * 2 * 16


def _workload(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 9, 23, 50)]
    prompts += [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 31, 70)]
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_workload(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def model_dir(hf_models):
    return hf_models("llama_gqa")[0]


@pytest.fixture(scope="module")
def baseline(model_dir):
    """An int8 pool with no caching, chunking or preemption."""
    return _tokens(LLM(str(model_dir), kv_cache_dtype="int8", enable_prefix_caching=False,
                       enable_chunked_prefill=False, max_num_batched_tokens=512))


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_seqs=1),  # one at a time: later prompts take the shared prefix from the cache
    dict(max_num_batched_tokens=16),
    dict(kv_cache_memory=12 * INT8_BLOCK_BYTES, max_model_len=160, max_num_batched_tokens=64),
    dict(kv_cache_memory=12 * INT8_BLOCK_BYTES, max_model_len=160, max_num_batched_tokens=64,
         preemption_mode="swap", swap_space=4 * INT8_BLOCK_BYTES),
    dict(enforce_eager=True),
    dict(attention_backend="torch"),
], ids=["prefix-caching", "chunked", "recompute", "swap", "eager", "torch-attention"])
def test_int8_pool_same_outputs_every_way(model_dir, baseline, engine_kw):
    llm = LLM(str(model_dir), kv_cache_dtype="int8", **engine_kw)
    assert _tokens(llm) == baseline
    s = llm.stats()
    if "kv_cache_memory" in engine_kw:
        assert s.num_blocks == 12 and s.num_preemptions > 0
        if engine_kw.get("preemption_mode") == "swap":
            assert s.num_swap_outs > 0
    if engine_kw.get("max_num_seqs") == 1:
        assert s.prefix_cache_hits > 0
    assert s.num_free_blocks == s.num_blocks


def test_int8_pool_holds_more_tokens(model_dir):
    """The same memory holds 32 / 12 times the blocks of fp32 (8 dims of 4 bytes against 8 of 1
    plus a 4-byte scale)."""
    memory = 60 * 2 * 2 * (8 * 4) * 2 * 16
    assert LLM(str(model_dir), kv_cache_memory=memory).stats().num_blocks == 60
    assert LLM(str(model_dir), kv_cache_memory=memory, kv_cache_dtype="int8").stats().num_blocks == 160


def test_int8_pool_moves_the_house_models_logprobs_slightly():
    """The trained house model, teacher-forced over a few hundred tokens of English: the int8
    pool does round (logprobs move), by a few thousandths of a nat on average, and the most
    likely next token stays the same nearly everywhere."""
    text = ("The old ferryman kept his boat below the mill, and every morning before the bell he rowed "
            "the miller's daughters across the river to the market. They paid him in bread and in news, "
            "and he never asked for more. One winter the river froze from bank to bank, and the "
            "daughters walked across the ice while he watched from the door of his hut, his oars "
            "across his knees, wondering what a ferryman is for when the water itself becomes a road. ") * 3
    # Prompt logprobs only: no decode step, so no decode graphs to compile.
    full, int8 = LLM(str(HOUSE), enforce_eager=True), LLM(str(HOUSE), kv_cache_dtype="int8", enforce_eager=True)
    ids = full.get_tokenizer().encode(text)
    (want, want_top), (got, got_top) = engine_logprobs(full, ids), engine_logprobs(int8, ids)
    error = (got - want).abs()
    assert len(ids) > 200 and error.max() > 0
    assert error.mean() < 0.02 and error.max() < 0.2, (error.mean(), error.max())
    assert sum(a == b for a, b in zip(got_top, want_top)) >= 0.97 * len(want_top)


@pytest.mark.parametrize("policy", ["h2o", "keyformer"])
def test_int8_pool_under_a_kv_policy_through_swap(model_dir, policy):
    """Per-head drops move single slots' rows and scales; swapped blocks leave and come back with
    their scales: a tight pool that swaps gives a roomy pool's tokens."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_policy=policy, kv_budget=20)
    batch = _workload(2)
    kw = dict(kv_cache_dtype="int8", max_model_len=160, max_num_batched_tokens=64)
    tight = LLM(str(model_dir), kv_cache_memory=10 * INT8_BLOCK_BYTES, preemption_mode="swap",
                swap_space=1 << 20, **kw)
    got = [o.outputs[0].token_ids for o in tight.generate(batch, params, use_tqdm=False)]
    assert tight.stats().num_swap_outs > 0
    roomy = LLM(str(model_dir), **kw)
    assert got == [o.outputs[0].token_ids for o in roomy.generate(batch, params, use_tqdm=False)]


def test_kv_cache_dtype_is_checked(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(model_dir), kv_cache_dtype="fp8")


def test_generate_command_takes_the_int8_cache(capsys):
    """`loom generate --kv-cache-dtype int8` streams what the Python API gives with that cache."""
    from loom.cli import main

    main(["generate", "--model", str(HOUSE), "--kv-cache-dtype", "int8", "--temperature", "0", "--max-tokens", "12",
          "--ignore-eos", "ROMEO:"])
    printed = capsys.readouterr().out
    want = LLM(str(HOUSE), kv_cache_dtype="int8", enforce_eager=True).generate(
        "ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert want and want in printed


def test_int8_pool_under_forks_and_beams(model_dir):
    """Parallel samples and beams share the prompt's blocks and copy a shared block before
    writing into it (scales with it): a pool tight enough to preempt gives a roomy one's
    samples and beams."""
    prompts = _workload(3)[4:6]
    sampled = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)

    def run(**kw) -> tuple[list, list, int]:
        llm = LLM(str(model_dir), kv_cache_dtype="int8", max_model_len=160, **kw)
        samples = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sampled, use_tqdm=False)]
        beams = [[b.token_ids for b in o.outputs] for o in llm.beam_search(prompts, 3, 16, ignore_eos=True,
                                                                            use_tqdm=False)]
        return samples, beams, llm.stats().num_preemptions

    *roomy, _ = run()
    *tight, preemptions = run(kv_cache_memory=10 * INT8_BLOCK_BYTES, max_num_batched_tokens=64)
    assert tight == roomy and preemptions > 0
    assert all(len(s) == 3 for s in roomy[0]) and all(len(b) == 3 for b in roomy[1])
