"""A real pretrained model: SmolLM2-135M-Instruct (30 layers, 9 query heads over 3 KV heads, tied
embeddings, ChatML), converted from the GGUF file of a PyPI wheel, against transformers loading
the same converted directory."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import assert_tracks, engine_logprobs
from loom import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "List three uses of a paperclip:",
           "The theory of relativity was proposed by", "To make a cup of tea, first"]
QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "Name a primary color.",
             "What is 2 + 2?", "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
             "Say hello in Spanish.", "What planet do we live on?"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def models(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return LLM(str(smollm2_dir), dtype="float32"), hf, AutoTokenizer.from_pretrained(smollm2_dir)


def assert_transformers_greedy(hf, prompt: list[int], out) -> None:
    """transformers' greedy generation from `prompt` would be `out`'s tokens: teacher-forced in one
    forward, its argmax after each prefix is the token Loom chose (so, by induction, its own
    generation makes the same choices), and it stops where Loom stopped: at an EOS of its
    generation config, or at the token limit with no EOS before."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
    # row p predicts token p + 1: the rows from the prompt's last token on
    assert logits[len(prompt) - 1:-1].argmax(dim=-1).tolist() == out.token_ids
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in eos and not eos & set(out.token_ids[:-1])
    else:
        assert len(out.token_ids) == NEW_TOKENS and not eos & set(out.token_ids)


def test_greedy_matches_transformers_plain_and_chat(models):
    llm, hf, tok = models
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    chats = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, plain):
        assert out.prompt_token_ids == tok(prompt)["input_ids"]
    for out in plain + chats:
        assert_transformers_greedy(hf, out.prompt_token_ids, out.outputs[0])


def test_logits_track_transformers_over_512_tokens(models):
    """Teacher-forced over 512 tokens of English text neither model saw in this form (this
    repository's README), fp32 against fp32."""
    llm, hf, tok = models
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tok(text)["input_ids"][:512]
    assert len(ids) == 512
    # Measured: at most 4e-5 nats apart (7.5e-6 on average), the same top token everywhere.
    assert_tracks(llm, hf, ids, max_error=1e-3, mean_error=1e-4, agreement=1.0)
    got, _ = engine_logprobs(llm, ids)
    assert got.mean() > -6  # a trained model: -3.6 nats a token here, against -10.8 for uniform


def test_chat_renders_transformers_template_and_stops_at_im_end(models):
    llm, _, tok = models
    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert llm.get_tokenizer().apply_chat_template(messages) == expected
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok(expected, add_special_tokens=False)["input_ids"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    first = out.outputs[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == im_end and "Paris" in first.text
    assert "<|im_end|>" not in first.text
