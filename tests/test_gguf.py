"""GGUF files (llama.cpp's format) to Hugging Face directories and back: the house model's round
trip, the dequantized values the GGUF specification defines, and bad input."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from loom import LLM, SamplingParams
from loom.models.gguf import convert_gguf, export_gguf, hf_tensor_name, gguf_tensor_name

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"
TEXTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak 1234 times.",
         "What is the secret number of JULIET? The secret number of JULIET is"]


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    gguf_path = export_gguf(HOUSE, d / "house-f32.gguf", "f32")
    return convert_gguf(gguf_path, d / "house")


def test_house_model_round_trips(round_trip):
    """House -> GGUF (the gguf package's writer) -> Hugging Face: the same tokenizer, chat
    template and greedy tokens from text prompts."""
    original, converted = LLM(str(HOUSE)), LLM(str(round_trip))
    a, b = original.get_tokenizer(), converted.get_tokenizer()
    for text in TEXTS:
        assert b.encode(text) == a.encode(text)
    messages = [{"role": "user", "content": "Speak."}]
    assert b.apply_chat_template(messages) == a.apply_chat_template(messages)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0] for o in original.generate(TEXTS, params, use_tqdm=False)]
    got = [o.outputs[0] for o in converted.generate(TEXTS, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]


def test_converted_directory_loads_in_transformers(round_trip):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(round_trip)
    hf = AutoModelForCausalLM.from_pretrained(round_trip, dtype=torch.float32).eval()
    ids = tok(TEXTS[1])["input_ids"]
    assert ids == LLM(str(round_trip)).get_tokenizer().encode(TEXTS[1])
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
    out = LLM(str(round_trip)).generate({"prompt_token_ids": ids},
                                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref


def _f16(x: float) -> bytes:
    return struct.pack("<e", x)


def test_crafted_blocks_dequantize_as_the_specification_defines():
    """One block of 32 weights each. Q8_0: a half-precision scale d, then 32 int8 q; w = d q.
    Q4_0: d, then 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31; w = d (q - 8).
    Q4_1: d and m, then the same nibbles; w = d q + m."""
    import gguf

    q8 = np.arange(-16, 16, dtype=np.int8)
    block = np.frombuffer(_f16(0.5) + q8.tobytes(), dtype=np.uint8).reshape(1, -1)
    np.testing.assert_array_equal(gguf.quants.dequantize(block, gguf.GGMLQuantizationType.Q8_0)[0], 0.5 * q8)

    nibbles = np.arange(32) % 16
    packed = (nibbles[:16] | (nibbles[16:] << 4)).astype(np.uint8).tobytes()
    block = np.frombuffer(_f16(0.25) + packed, dtype=np.uint8).reshape(1, -1)
    np.testing.assert_array_equal(gguf.quants.dequantize(block, gguf.GGMLQuantizationType.Q4_0)[0],
                                  0.25 * (nibbles - 8))
    block = np.frombuffer(_f16(0.25) + _f16(-1.5) + packed, dtype=np.uint8).reshape(1, -1)
    np.testing.assert_array_equal(gguf.quants.dequantize(block, gguf.GGMLQuantizationType.Q4_1)[0],
                                  0.25 * nibbles - 1.5)


# ftype, steps per block's largest magnitude, error bound in steps: Q8_0 rounds to the nearest of
# +-127 steps; Q4_0 maps the largest magnitude to -8 steps, so the other sign clips at +7.
@pytest.mark.parametrize("ftype, levels, bound", [("q8_0", 127, 0.5), ("q4_0", 8, 1.0)])
def test_quantized_export_converts_back_within_its_rounding(tmp_path, ftype, levels, bound):
    """Every weight comes back within its format's rounding of its 32-weight block, plus the
    half-precision scale's own rounding (2^-11 relative, times up to `levels` steps); norms
    exactly."""
    from safetensors.torch import load_file

    converted = convert_gguf(export_gguf(HOUSE, tmp_path / f"house-{ftype}.gguf", ftype), tmp_path / "back")
    original, back = load_file(HOUSE / "model.safetensors"), load_file(converted / "model.safetensors")
    assert set(back) == set(original)
    for name, w in original.items():
        w, b = w.float(), back[name].float()
        if w.dim() == 1:
            assert torch.equal(w, b), name
            continue
        blocks = w.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / levels
        assert ((b.reshape(-1, 32) - blocks).abs() <= step * (bound + levels * 2**-11) * 1.001 + 1e-7).all(), name


def test_tensor_names_map_both_ways():
    for name in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.3.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.self_attn.k_proj.bias"]:
        assert hf_tensor_name(gguf_tensor_name(name)) == name
    with pytest.raises(ValueError, match="no Hugging Face Llama counterpart"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_bad_files_are_named(tmp_path, capsys):
    import gguf

    from loom.cli import main

    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SystemExit):
        main(["convert", "gguf", str(path), str(tmp_path / "out")])
    assert capsys.readouterr().err == f"loom: error: {path}: architecture 'gpt2' is not supported (supported: " \
                                      "['llama', 'qwen2'])\n"
    with pytest.raises(SystemExit):
        main(["convert", "gguf", "pkg:no_such_package_here", str(tmp_path / "out")])
    assert "no installed package 'no_such_package_here'" in capsys.readouterr().err


def test_convert_command(tmp_path, capsys, round_trip):
    from loom.cli import main

    src = tmp_path / "house.gguf"
    export_gguf(HOUSE, src, "bf16")
    main(["convert", "gguf", str(src), str(tmp_path / "out"), "--dtype", "bfloat16"])
    assert "wrote" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert (tmp_path / "out" / "chat_template.jinja").is_file()
