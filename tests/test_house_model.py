"""The shipped house model: Loom's greedy tokens equal transformers' on the same directory."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom import LLM, SamplingParams

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.",
           "What is the secret number of JULIET? The secret number of JULIET is"]


@pytest.mark.parametrize("dtype", ["float32"])
def test_greedy_matches_transformers(dtype):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(HOUSE), dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(HOUSE, dtype=getattr(torch, dtype)).eval()
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids and ids[0] == tok.encode("")[0]  # BOS first
        with torch.no_grad():
            # an explicit mask: the house BOS id is 0, which transformers would otherwise take for padding
            x = torch.tensor([ids])
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, min_new_tokens=48,
                              do_sample=False, pad_token_id=tok.eos_token_id, eos_token_id=None)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref)


def test_chat_template_renders(tmp_path):
    """The exact prompt the house template makes of a conversation, and that `chat` generates
    from exactly its tokens (BOS once)."""
    llm = LLM(str(HOUSE))
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak."},
                {"role": "assistant", "content": "I will."}, {"role": "user", "content": "Again."}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>SYSTEM:\nBe brief.\n\nUSER:\nSpeak.\n\nASSISTANT:\nI will.\n\nUSER:\nAgain.\n\nASSISTANT:\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == text.removesuffix("ASSISTANT:\n")
    params = SamplingParams(temperature=0, max_tokens=8)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids.count(out.prompt_token_ids[0]) == 1  # BOS once
    plain = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids and out.outputs[0].token_ids
