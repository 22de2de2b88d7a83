"""GGUF files (llama.cpp's format) to Hugging Face directories and back: the house model's round
trip, the dequantized values the GGUF specification defines, and bad input."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_tracks
from loom import LLM, SamplingParams
from loom.quant.linear import WeightOnlyLinear
from loom.models.gguf import convert_gguf, convert_gguf_int4, export_gguf, gguf_tensor_name, hf_tensor_name, int4_codes

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


def test_four_bit_blocks_keep_their_codes():
    """int4_codes reads Q4_0 / Q4_1 blocks as Loom's int4 holds them, w = (q - 8) scale + zero:
    the nibbles unchanged, and the same weights as the gguf package's dequantizer."""
    import gguf

    from loom.quant.quantize import dequantize_int4

    rng = np.random.default_rng(0)
    nibbles = rng.integers(0, 16, size=(3, 64))  # 3 rows of 2 blocks
    packed = np.concatenate([nibbles.reshape(3, 2, 32)[..., :16] | (nibbles.reshape(3, 2, 32)[..., 16:] << 4)],
                            axis=-1).astype(np.uint8)
    for qtype, header in [(gguf.GGMLQuantizationType.Q4_0, lambda d, m: _f16(d)),
                          (gguf.GGMLQuantizationType.Q4_1, lambda d, m: _f16(d) + _f16(m))]:
        rows = [b"".join(header(0.01 * (r + 1) * (b + 1), -0.3 * r + 0.1 * b) + packed[r, b].tobytes() for b in range(2))
                for r in range(3)]
        data = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(3, -1)
        q, scales, zeros = int4_codes(data, qtype)
        assert q.shape == (3, 64) and scales.shape == zeros.shape == (3, 2)
        assert torch.equal(q, torch.from_numpy(nibbles).to(torch.uint8)), qtype
        np.testing.assert_allclose(dequantize_int4(q, scales, zeros).numpy(), gguf.quants.dequantize(data, qtype),
                                   rtol=1e-6, atol=1e-7)


def test_int4_conversion_keeps_the_gguf_weights(tmp_path):
    """A Q4_0 file to Loom's int4 checkpoint: every projection holds the file's own weights, up to
    the bf16 rounding of its scales (2^-9 relative), symmetric as Q4_0 is; the head, tied to the
    embedding, stays in floating point. The checkpoint's logits track transformers' on the
    dequantized file."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = export_gguf(HOUSE, tmp_path / "house-q4_0.gguf", "q4_0")
    assert convert_gguf_int4(path, tmp_path / "int4") == ["lm_head"]
    dequantized = load_file(convert_gguf(path, tmp_path / "float") / "model.safetensors")
    llm = LLM(str(tmp_path / "int4"))
    model = llm.engine.runner.model
    assert type(model.lm_head) is not WeightOnlyLinear
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, WeightOnlyLinear):
            continue
        q, scales, zeros = module.portable()
        got = module.reference_weight()
        parent, _, attr = name.rpartition(".")
        fragments = [f for f, (packed, _) in sorted(model.packed_params.items(), key=lambda kv: kv[1][1])
                     if packed == attr] or [attr]
        want = torch.cat([dequantized[f"model.{parent}.{f}.weight"] for f in fragments]).float()
        assert zeros is None and module.symmetric, name
        bound = (q.float() - 8).abs().reshape(*scales.shape, -1) * scales.float().abs()[..., None] * 2**-8 + 1e-7
        assert ((got - want).abs().reshape(bound.shape) <= bound).all(), name
        checked += 1
    assert checked == 6 * 4  # qkv, o, gate_up, down in each of the house model's 6 layers
    # Teacher-forced against transformers on the dequantized weights, fp32. Measured: at most
    # 0.05 nats apart, 0.009 on average, the same top token at 99.6% of positions (an engine
    # quantizing the dequantized weights to int4 again, head included: 1.27 / 0.21 / 89%).
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode((HOUSE.parents[1] / "README.md").read_text())[:512]
    assert_tracks(llm, hf, ids, max_error=0.25, mean_error=0.03, agreement=0.98)


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
    main(["convert", "gguf", str(export_gguf(HOUSE, tmp_path / "house-q4_0.gguf", "q4_0")), str(tmp_path / "int4"),
          "--int4"])
    assert "left in float32 (no 4-bit codes in the file): lm_head" in capsys.readouterr().out
    quantization = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    assert quantization["method"] == "int4" and quantization["group_size"] == 32 and quantization["symmetric"]
    assert quantization["modules_to_not_convert"] == ["lm_head"]
    assert (tmp_path / "int4" / "chat_template.jinja").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
