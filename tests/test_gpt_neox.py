"""GPT-NeoX (partial rotary, LayerNorm with bias, GELU; parallel and serial residual) against
Hugging Face transformers on random checkpoints."""
from __future__ import annotations

import json

import pytest

from loom import LLM, SamplingParams
from tests.conftest import assert_tracks, hf_greedy, random_prompts


@pytest.mark.parametrize("name", ["gpt_neox_parallel", "gpt_neox_serial"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_matches_transformers(hf_models, name, backend):
    model_dir, reference = hf_models(name)
    llm = LLM(str(model_dir), attention_backend=backend)
    # teacher-forced logprobs over a long prompt, then greedy generations of a batch
    assert_tracks(llm, reference, random_prompts(1, 96, seed=5)[0], max_error=1e-3, mean_error=1e-4, agreement=1.0)
    prompts = random_prompts(3, 24, seed=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 24) for p in prompts]


def test_unsupported_activation_is_named(hf_models, tmp_path):
    model_dir, _ = hf_models("gpt_neox_parallel")
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    with pytest.raises(ValueError, match="hidden_act.*'relu'.*gelu only"):
        LLM(str(tmp_path))
