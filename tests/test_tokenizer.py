"""Text in and out: tokenizer.json, the chat template, `loom generate` streaming."""
from __future__ import annotations

import subprocess
import sys

from loom import LLM, SamplingParams

def test_text_prompt_round_trip(text_model):
    llm = LLM(str(text_model))
    tok = llm.get_tokenizer()
    out = llm.generate("To be, or not", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt == "To be, or not"
    assert out.prompt_token_ids == tok.encode("To be, or not") and out.prompt_token_ids[0] == 1
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_chat_template_rendered_once_with_bos(text_model):
    llm = LLM(str(text_model))
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Café?"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s><|user|>Café?\n<|assistant|>"
    ids = tok.encode_chat(messages)
    assert ids.count(1) == 1 and ids[0] == 1  # the template's BOS, not a second one
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_no_template_concatenates(text_model, tmp_path):
    from loom.tokenizer import Tokenizer as LoomTokenizer

    tok = LoomTokenizer.from_dir(text_model)
    tok.chat_template = None
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "a\nb\n"


def test_generate_command_streams_whole_characters(text_model):
    args = [sys.executable, "-m", "loom.cli", "generate", "--model", str(text_model), "--max-tokens", "24",
            "--temperature", "0", "--ignore-eos", "Café naïve"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.startswith("Café naïve")
    llm = LLM(str(text_model))
    expected = llm.generate("Café naïve", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    assert out == "Café naïve" + expected + "\n"
