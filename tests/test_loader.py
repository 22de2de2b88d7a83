"""Loading Hugging Face directories: sharded checkpoints and clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loom import LLM, SamplingParams
from loom.models.config import ModelConfig
from loom.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 9, 33, 71, 2, 200, 14]}


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_gives_same_outputs(hf_models, tmp_path):
    model_dir, hf = hf_models("llama_gqa")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = LLM(str(model_dir)).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(str(sharded)).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_missing_directory_and_files(tmp_path, hf_models):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope", torch.float32)
    d = _copy(hf_models("llama_mha")[0], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(d, torch.float32)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(d, torch.float32)


def test_unsupported_architecture_names_the_field(tmp_path, hf_models):
    d = _copy(hf_models("llama_mha")[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_dir(d)


def test_shape_mismatch_names_file_and_tensor(tmp_path, hf_models):
    d = _copy(hf_models("llama_mha")[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors.*up_proj.*shape"):
        load_model(d, torch.float32)


def test_missing_tensor_is_reported(tmp_path, hf_models):
    d = _copy(hf_models("llama_mha")[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(d, torch.float32)


def test_unknown_tensor_is_reported(tmp_path, hf_models):
    d = _copy(hf_models("llama_mha")[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="mystery"):
        load_model(d, torch.float32)
