"""n > 1: samples forked from one prefill share the prompt's blocks, copied only on write."""
from __future__ import annotations

import pytest
import torch

from conftest import build_hf_model
from loom import LLM, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    build_hf_model(d, "llama_gqa", max_positions=1024)
    return d


@pytest.mark.parametrize("prompt_len", [512, 500])  # whole blocks; a shared partial last block
def test_n_samples_share_prompt_blocks(long_model, prompt_len):
    llm = LLM(str(long_model))
    engine = llm.engine
    prompt = torch.randint(3, 256, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    n = 8
    rid = engine.add_request({"prompt_token_ids": prompt},
                             SamplingParams(n=n, temperature=1.0, max_tokens=40, ignore_eos=True, seed=7))
    prompt_blocks = -(-len(prompt) // BS)
    # The copy-on-write pairs each step asks the runner for, seen where they are handed over.
    copies: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def spy(batch):
        copies.extend(batch.copies)
        return execute(batch)

    engine.runner.execute = spy
    final = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        mine = next((o for o in outs if o.request_id == rid), None)
        if mine is None:
            continue
        used = llm.stats().num_blocks - llm.stats().num_free_blocks
        if final is None:  # the step that ended the prompt forked the samples: no new block
            assert len(mine.outputs) == n and used == prompt_blocks
        bound = prompt_blocks + sum(-(-len(o.token_ids) // BS) + 1 for o in mine.outputs)
        assert used <= bound, (used, bound)
        final = mine
    assert final.finished and len(final.outputs) == n
    assert all(len(o.token_ids) == 40 for o in final.outputs)
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1  # really different samples
    if prompt_len % BS == 0:  # nothing partial is shared: nothing is ever copied
        assert copies == []
    else:  # only the shared partial block, once for each sequence but the last to write into it
        assert len(copies) == n - 1 and len({src for src, _ in copies}) == 1
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_n_samples_reproducible_with_seed(hf_models):
    model_dir, _ = hf_models("llama_gqa")
    params = SamplingParams(n=4, temperature=0.9, max_tokens=10, seed=3, ignore_eos=True)
    a = LLM(str(model_dir)).generate({"prompt_token_ids": [4, 5, 6, 7]}, params, use_tqdm=False)[0]
    llm = LLM(str(model_dir))
    others = [{"prompt_token_ids": [9, 9, 9]}] * 3
    b = llm.generate(others + [{"prompt_token_ids": [4, 5, 6, 7]}],
                     [SamplingParams(temperature=1.0, max_tokens=5)] * 3 + [params], use_tqdm=False)[3]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n_samples_same_under_preemption(hf_models, mode):
    model_dir, _ = hf_models("llama_gqa")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=11, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 45 + i))} for i in range(4)]
    free = LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)
    small = LLM(str(model_dir), kv_cache_memory=14 * 4096, max_model_len=128, max_num_batched_tokens=64,
                preemption_mode=mode, swap_space=64 * 4096)
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in tight] == [[o.token_ids for o in r.outputs] for r in free]
    assert small.stats().num_free_blocks == small.stats().num_blocks


def test_first_sample_equals_single_sample(hf_models):
    model_dir, _ = hf_models("llama_gqa")
    llm = LLM(str(model_dir))
    one = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=1.0, max_tokens=8, seed=5),
                       use_tqdm=False)[0].outputs[0].token_ids
    many = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5),
                        use_tqdm=False)[0].outputs
    assert many[0].token_ids == one and many[1].token_ids != one
