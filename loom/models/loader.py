"""Builds a Loom model from a local Hugging Face directory (config.json + safetensors), and
the model an engine runs: loaded, quantized if asked, on the kernels this machine has."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loom.config import EngineConfig
from loom.kernels import load_kernels
from loom.layers.elementwise import use_kernels
from loom.layers.linear import use_dense_linears
from loom.models.config import GPT_NEOX, ModelConfig
from loom.models.gpt_neox import GPTNeoXForCausalLM
from loom.models.huge_pages import move_to_huge_pages
from loom.models.llama import LlamaForCausalLM
from loom.parallel.state import ParallelState
from loom.parallel.tensor_parallel import shard_model
from loom.quant.checkpoint import load_quantized_checkpoint
from loom.quant.model import quantize_model

# Architectures with a class of their own; the rest (Llama, Mistral, Qwen2) are LlamaForCausalLM.
_MODELS: dict[str, type[nn.Module]] = {GPT_NEOX: GPTNeoXForCausalLM}
CausalLM = LlamaForCausalLM | GPTNeoXForCausalLM

# HF tensors that carry no weights Loom needs (RoPE caches some checkpoints still ship).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: field 'weight_map' is missing or empty")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: lists shard files that do not exist: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"{model_dir}: no model.safetensors, model.safetensors.index.json or *.safetensors")


def build_model(config: EngineConfig, parallel: ParallelState | None = None) -> CausalLM:
    """The model as an engine runs it: weights loaded (or read quantized), quantized at load
    time if asked, cut to this rank's tensor-parallel shard, linear layers choosing their kernel by
    tokens per step, attention backend set (Loom's C++ attention with its elementwise layers too);
    on a CPU, its weights on huge pages."""
    if config.attention_backend == "cpp":
        load_kernels()  # build or load now, so a missing compiler fails here and not mid-run
    model = load_model(config.model, config.dtype, config.device, config.max_model_len, config.model_config)
    model.set_attention_backend(config.attention_backend)
    if config.attention_backend == "cpp":
        use_kernels(model)
    if config.quantization is not None:
        quantize_model(model, config.quantization, config.group_size, progress=parallel is None or parallel.is_driver,
                       symmetric=config.symmetric)
    if parallel is not None and parallel.tp_size > 1:
        shard_model(model, parallel)
    if torch.device(config.device).type == "cpu":
        if config.linear_dispatch:
            use_dense_linears(model)
        move_to_huge_pages(model)
    return model


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
               max_positions: int | None = None, cfg: ModelConfig | None = None) -> CausalLM:
    """The checkpoint's model with plain nn.Linear layers (or, for a quantized checkpoint,
    its weight-only layers). `cfg`: the directory's config, if already read."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory not found")
    cfg = cfg or ModelConfig.from_dir(model_dir)
    with torch.device("meta"):  # no time spent on random init: every weight comes from the checkpoint
        model = _MODELS.get(cfg.architecture, LlamaForCausalLM)(cfg, max_positions or cfg.max_position_embeddings,
                                                                 device)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty re-creates parameters, so tie again
    if cfg.quantization is not None:
        load_quantized_checkpoint(model, model_dir, safetensors_files(model_dir))
        model.to(dtype=dtype)
        return model.eval()
    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {name: set() for name in params}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                _load_tensor(model, params, filled, name, f.get_tensor(name), path)
    missing = [name for name, shards in filled.items() if len(shards) < _num_shards(model, name)]
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    model.to(dtype=dtype)
    return model.eval()


def _num_shards(model: CausalLM, param_name: str) -> int:
    packed = {p for p, _ in model.packed_params.values()}
    return next((len(model.shard_sizes(p)) for p in packed if f".{p}." in param_name), 1)


def _load_tensor(model: CausalLM, params: dict[str, torch.nn.Parameter], filled: dict[str, set[int]],
                 name: str, tensor: torch.Tensor, path: Path) -> None:
    target = name.removeprefix(model.checkpoint_prefix)
    if target == f"{model.head_name}.weight" and model.config.tie_word_embeddings:
        return  # tied: the embedding is the head
    for fragment, (packed, shard) in model.packed_params.items():
        if f".{fragment}." in target:
            target = target.replace(fragment, packed)
            if target not in params:
                break
            sizes = model.shard_sizes(packed)
            start = sum(sizes[:shard])
            dest = params[target].data[start:start + sizes[shard]]
            _copy(dest, tensor, name, path)
            filled[target].add(shard)
            return
    if target not in params:
        raise ValueError(f"{path}: tensor {name!r} does not belong to a {model.config.architecture}")
    _copy(params[target].data, tensor, name, path)
    filled[target].add(0)


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str, path: Path) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"{path}: tensor {name!r} has shape {tuple(src.shape)}, config.json implies {tuple(dest.shape)}")
    dest.copy_(src)
