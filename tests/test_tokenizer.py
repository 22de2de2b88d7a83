"""Text in and out: tokenizer.json, the chat template, `loom generate` streaming."""
from __future__ import annotations

import subprocess
import sys

import pytest

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


CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# tojson, loop controls, a namespace and raise_exception: what current templates use
TOOLS = ("{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m['role'] == 'tool' %}{% continue %}"
         "{% endif %}{%- set ns.n = ns.n + 1 %}[{{ ns.n }}:{{ m['role'] }}] {{ m['content'] | tojson }}\n"
         "{%- endfor %}{%- if tools %}TOOLS {{ tools | tojson }}{% endif %}"
         "{%- if messages | length > 3 %}{{ raise_exception('too long') }}{% endif %}")


def _model_with(src, dst, config_template=None, files: dict[str, str] | None = None):
    """A copy of the text model whose chat templates are only the ones given."""
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if config_template is not None:
        config["chat_template"] = config_template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(text)
    return dst


def test_no_template_is_refused(text_model, tmp_path):
    llm = LLM(str(_model_with(text_model, tmp_path / "none")))
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "a"}])


@pytest.mark.parametrize("layout", ["jinja file over config", "named list", "config string"])
def test_chat_template_sources_match_transformers(text_model, tmp_path, layout):
    """Where today's checkpoints keep their templates, and what each renders, against
    transformers' own apply_chat_template on the same directory."""
    from transformers import AutoTokenizer

    files, config = {}, None
    if layout == "jinja file over config":
        files, config = {"chat_template.jinja": CHATML, "additional_chat_templates/tools.jinja": TOOLS}, TOOLS
    elif layout == "named list":
        config = [{"name": "default", "template": CHATML}, {"name": "tools", "template": TOOLS}]
    else:
        config = CHATML
    d = _model_with(text_model, tmp_path / "m", config, files)
    ours, theirs = LLM(str(d)).get_tokenizer(), AutoTokenizer.from_pretrained(d)
    conversations = [[{"role": "user", "content": "Café?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "\"quoted\" ü"}]]
    for messages in conversations:
        for generation_prompt in (True, False):
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    assert ours.apply_chat_template(conversations[0]).startswith("<|im_start|>system\nYou are helpful.")
    if layout != "config string":
        messages = [{"role": "user", "content": "x"}, {"role": "tool", "content": "skipped"},
                    {"role": "assistant", "content": "ü"}]
        tools = [{"name": "f", "description": "é"}]
        expected = theirs.apply_chat_template(messages, tokenize=False, chat_template="tools", tools=tools)
        assert ours.apply_chat_template(messages, template="tools", tools=tools) == expected
        assert "TOOLS" in expected and "\\u00e9" not in expected  # tojson keeps non-ASCII
        with pytest.raises(ValueError, match="too long"):
            ours.apply_chat_template(messages * 2, template="tools")
    with pytest.raises(ValueError, match="no template 'nope'"):
        ours.apply_chat_template(conversations[0], template="nope")


def test_generation_config_eos_ends_generation(text_model, tmp_path):
    import json

    llm = LLM(str(text_model))
    free = llm.generate("To be", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    d = _model_with(text_model, tmp_path / "g", files={"generation_config.json": json.dumps({"eos_token_id": [free[3]]})})
    out = LLM(str(d)).generate("To be", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: free.index(free[3]) + 1] and out.finish_reason == "stop"


def test_generate_command_streams_whole_characters(text_model):
    args = [sys.executable, "-m", "loom.cli", "generate", "--model", str(text_model), "--max-tokens", "24",
            "--temperature", "0", "--ignore-eos", "Café naïve"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.startswith("Café naïve")
    llm = LLM(str(text_model))
    expected = llm.generate("Café naïve", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    assert out == "Café naïve" + expected + "\n"
