"""Quantized checkpoints: written once by `loom quantize`, loaded without re-quantizing.

The directory keeps the source's config.json (plus a `quantization_config` section) and
tokenizer files; model.safetensors holds, in Loom's module names (q/k/v and gate/up merged),
each quantized layer's `qweight` (int8, or int4 two per byte), `scales` and (int4, unless the
config says `symmetric`) `zeros`,
and every other tensor as it was. Linear layers left in floating point are listed in the
config's `modules_to_not_convert`, as transformers' quantization configs name them. Nothing in it depends on the machine that wrote it: the
kernels' packed layouts are rebuilt at load time.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from loom.models.config import QUANT_FORMAT, read_hf_config
from loom.quant.linear import WeightOnlyLinear
from loom.quant.quantize import check_options, pack_int4, unpack_int4

# What a quantized checkpoint keeps of its source besides the weights and config.json.
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "additional_chat_templates")


def write_quantized_checkpoint(model: nn.Module, src: str | Path, dst: str | Path) -> None:
    """Writes `model` (loaded from `src`, then quantized by `quantize_model`) to `dst`."""
    src, dst = Path(src), Path(dst)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, WeightOnlyLinear)}
    if not layers:
        raise ValueError(f"{src}: the model has no weight-only layers; quantize it first")
    method, group_size = next(iter(layers.values())).method, next(iter(layers.values())).group_size
    tensors: dict[str, torch.Tensor] = {}
    for name, module in layers.items():
        q, scales, zeros = module.portable()
        tensors[f"{name}.qweight"] = pack_int4(q) if method == "int4" else q
        tensors[f"{name}.scales"] = scales
        if zeros is not None:
            tensors[f"{name}.zeros"] = zeros
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias
    for name, param in model.named_parameters():
        tensors[name] = param.detach()
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    config = read_hf_config(src)
    config["quantization_config"] = {"quant_method": QUANT_FORMAT, "method": method, "group_size": group_size}
    if method == "int4":
        symmetric = {m.symmetric for m in layers.values()}
        if len(symmetric) > 1:
            raise ValueError(f"{src}: the model's int4 layers mix symmetric ones and ones with zero points")
        config["quantization_config"]["symmetric"] = symmetric.pop()
    unconverted = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if unconverted:
        config["quantization_config"]["modules_to_not_convert"] = unconverted
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED_FILES:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name, dirs_exist_ok=True)
        elif (src / name).is_file():
            shutil.copy(src / name, dst / name)


def load_quantized_checkpoint(model: nn.Module, model_dir: Path, files: list[Path]) -> None:
    """Swaps the model's nn.Linear layers for WeightOnlyLinear and fills everything from files."""
    q = model.config.quantization
    method, group_size, symmetric = q["method"], int(q.get("group_size", 0)), bool(q.get("symmetric", False))
    check_options(method, group_size)
    unconverted = set(q.get("modules_to_not_convert", []))
    unknown = unconverted - {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if unknown:
        raise ValueError(f"{model_dir}: quantization_config.modules_to_not_convert names no linear layer of the "
                         f"model: {sorted(unknown)}")
    layers: dict[str, WeightOnlyLinear] = {}
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in unconverted]:
        parent, _, attr = name.rpartition(".")
        layer = WeightOnlyLinear(linear.in_features, linear.out_features, method, group_size, None)
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        layers[name] = layer
    params = dict(model.named_parameters())
    pieces: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                module, _, field = key.rpartition(".")
                if module in layers:
                    pieces[module][field] = f.get_tensor(key)
                elif key in params:
                    if list(params[key].shape) != f.get_slice(key).get_shape():
                        raise ValueError(f"{path}: tensor {key!r} has the wrong shape for config.json")
                    params[key].data.copy_(f.get_tensor(key))
                else:
                    raise ValueError(f"{path}: tensor {key!r} does not belong to this model")
    for name, layer in layers.items():
        got = pieces[name]
        needed = {"qweight", "scales"} | ({"zeros"} if method == "int4" and not symmetric else set())
        if not needed <= got.keys():
            raise ValueError(f"{model_dir}: quantized layer {name!r} lacks {sorted(needed - got.keys())}")
        if symmetric and "zeros" in got:
            raise ValueError(f"{model_dir}: quantized layer {name!r} has zeros, but quantization_config says "
                             f"symmetric")
        qweight = unpack_int4(got["qweight"]) if method == "int4" else got["qweight"]
        layer.bias = got.get("bias")
        layer.load_quantized(qweight, got["scales"], got.get("zeros"))
