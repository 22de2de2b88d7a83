"""The model shape Loom needs, read from a Hugging Face `config.json`."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF architecture name -> whether q/k/v projections carry a bias by default
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "GPTNeoXForCausalLM": True,
}
GPT_NEOX = "GPTNeoXForCausalLM"


def config_path(model: str | Path) -> Path:
    """The config.json of a model directory (or the file itself)."""
    path = Path(model)
    if path.is_dir():
        return path / "config.json"
    if path.name == "config.json" or path.suffix == ".json":
        return path
    raise FileNotFoundError(f"{path}: model directory not found")


def read_hf_config(model: str | Path) -> dict[str, Any]:
    """A Hugging Face config.json as a dict, from a model directory or the file's path."""
    path = config_path(model)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization: dict[str, Any] | None = None  # Loom's weight-only checkpoint format, if quantized
    # generation_config.json's eos_token_id: where the model's generation ends besides config.json's
    generation_eos_token_ids: tuple[int, ...] = ()
    # GPT-NeoX: RoPE on the first rotary_dim dims of each head only (0: all of them), LayerNorm
    # with bias, GELU, and attention and FFN side by side on the same input when parallel_residual
    rotary_dim: int = 0
    layer_norm_eps: float = 1e-5
    parallel_residual: bool = False

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = config_path(model_dir)
        config = cls.from_dict(read_hf_config(path), source=str(path))
        generation = path.with_name("generation_config.json")
        if not generation.is_file():
            return config
        eos = read_hf_config(generation).get("eos_token_id")
        return dataclasses.replace(config, generation_eos_token_ids=_ids(eos))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: field 'architectures' is {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )

        def need(name: str) -> Any:
            if name not in raw:
                raise ValueError(f"{source}: required field {name!r} is missing")
            return raw[name]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        act = raw.get("hidden_act", "gelu" if arch == GPT_NEOX else "silu")
        if act != ("gelu" if arch == GPT_NEOX else "silu"):
            raise ValueError(f"{source}: field 'hidden_act' is {act!r}; {arch} is supported with "
                             f"{'gelu' if arch == GPT_NEOX else 'silu'} only")
        max_positions = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        if arch == "MistralForCausalLM" and window and raw.get("use_sliding_window", True):
            # Attention is exact (full) while the context fits the window, so cap the context there.
            max_positions = min(max_positions, int(window))
        # transformers 4 writes rope_theta / rope_scaling; transformers 5 nests both in rope_parameters
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("llama3", "default"):
            raise ValueError(f"{source}: rope type {kind!r} is not supported (default or llama3)")
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", raw.get("rotary_emb_base", 10000.0)))
        # GPT-NeoX: transformers 4 writes rotary_pct, transformers 5 rope_parameters' partial_rotary_factor
        rotary_fraction = float(rope.get("partial_rotary_factor", raw.get("rotary_pct", 1.0)))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if kind == "llama3" else None,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", SUPPORTED_ARCHITECTURES[arch])),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_ids(raw.get("eos_token_id")),
            quantization=_quantization(raw.get("quantization_config"), source),
            rotary_dim=int(head_dim * rotary_fraction),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
            parallel_residual=arch == GPT_NEOX and bool(raw.get("use_parallel_residual", True)),
        )


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A token id field that may hold one id, a list, or nothing."""
    return tuple(value) if isinstance(value, list) else ((value,) if value is not None else ())


QUANT_FORMAT = "loom-weight-only"


def _quantization(raw: dict[str, Any] | None, source: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    if raw.get("quant_method") != QUANT_FORMAT:
        raise ValueError(f"{source}: field 'quantization_config.quant_method' is {raw.get('quant_method')!r}; "
                         f"only checkpoints written by `loom quantize` ({QUANT_FORMAT!r}) are supported")
    return raw
