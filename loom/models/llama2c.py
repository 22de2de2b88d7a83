"""Convert a llama2.c checkpoint (the legacy, unversioned `.bin` format) to a
Hugging Face Llama directory that the rest of Loom (and `transformers`) can load.

File layout: seven little-endian int32s (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len), then float32 arrays in `nn.Linear` [out, in] order. A negative
vocab_size means the classifier is not tied to the embedding and is stored at the end.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_HEADER = struct.Struct("<7i")
_FLOAT_BYTES = 4
# Versioned llama2.c exports start with this magic ("ak42") instead of the legacy header.
_VERSIONED_MAGIC = 0x616B3432


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def _parse_header(src: Path, raw: bytes) -> Llama2cHeader:
    if len(raw) < _HEADER.size:
        raise ValueError(f"{src}: truncated header ({len(raw)} of {_HEADER.size} bytes)")
    values = _HEADER.unpack(raw)
    if values[0] == _VERSIONED_MAGIC:
        raise ValueError(f"{src}: versioned llama2.c export (magic 'ak42'); "
                         "only the legacy format (plain 7-int header) is supported")
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    fields = dict(zip(names, values))
    for name, value in fields.items():
        if value == 0 or (value < 0 and name != "vocab_size"):
            raise ValueError(f"{src}: header field {name}={value} must be positive")
    header = Llama2cHeader(**{**fields, "vocab_size": abs(fields["vocab_size"])},
                           shared_classifier=fields["vocab_size"] > 0)
    if header.dim % header.n_heads:
        raise ValueError(f"{src}: header field n_heads={header.n_heads} does not divide dim={header.dim}")
    if header.n_heads % header.n_kv_heads:
        raise ValueError(f"{src}: header field n_kv_heads={header.n_kv_heads} "
                         f"does not divide n_heads={header.n_heads}")
    if header.head_dim % 2:
        raise ValueError(f"{src}: header fields dim/n_heads give an odd head size {header.head_dim}; "
                         "RoPE rotates pairs")
    return header


def _layout(h: Llama2cHeader) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays after the header, in file order, with their shapes."""
    L = h.n_layers
    fields = [
        ("token_embedding", (h.vocab_size, h.dim)),
        ("rms_att", (L, h.dim)),
        ("wq", (L, h.dim, h.dim)),
        ("wk", (L, h.kv_dim, h.dim)),
        ("wv", (L, h.kv_dim, h.dim)),
        ("wo", (L, h.dim, h.dim)),
        ("rms_ffn", (L, h.dim)),
        ("w1", (L, h.hidden_dim, h.dim)),
        ("w2", (L, h.dim, h.hidden_dim)),
        ("w3", (L, h.hidden_dim, h.dim)),
        ("rms_final", (h.dim,)),
        # Precomputed RoPE tables from early exports: still present, never used.
        ("freq_cis_real", (h.seq_len, h.head_dim // 2)),
        ("freq_cis_imag", (h.seq_len, h.head_dim // 2)),
    ]
    if not h.shared_classifier:
        fields.append(("wcls", (h.vocab_size, h.dim)))
    return fields


def read_llama2c(src: Path) -> tuple[Llama2cHeader, dict[str, torch.Tensor]]:
    """Read the header and every array of a llama2.c checkpoint (legacy tables dropped)."""
    src = Path(src)
    with src.open("rb") as f:
        header = _parse_header(src, f.read(_HEADER.size))
        offset = _HEADER.size
        arrays: dict[str, torch.Tensor] = {}
        for name, shape in _layout(header):
            count = math.prod(shape)
            buf = bytearray(f.read(count * _FLOAT_BYTES))
            if len(buf) < count * _FLOAT_BYTES:
                raise ValueError(f"{src}: file truncated in field {name} (needs {count * _FLOAT_BYTES} bytes "
                                 f"at offset {offset}, only {len(buf)} left); header or file is wrong")
            offset += len(buf)
            if not name.startswith("freq_cis"):
                arrays[name] = torch.frombuffer(buf, dtype=torch.float32).reshape(shape)
        trailing = f.seek(0, 2) - offset
    if trailing:
        raise ValueError(f"{src}: {trailing} unexpected bytes after the last field; the header "
                         f"(vocab_size sign: shared_classifier={header.shared_classifier}) "
                         "does not match the file size")
    return header, arrays


def _rope_pairs_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from llama2.c's RoPE to Hugging Face's.

    llama2.c rotates consecutive pairs (2i, 2i+1) of each head; HF's rotate_half rotates
    (i, i + head_dim/2) with the same frequency for index i. Moving row 2i to i and row
    2i+1 to i + head_dim/2 within each head makes both compute the same attention scores.
    """
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, in_dim)
             .transpose(1, 2)
             .reshape(out_dim, in_dim))


def _hf_config(h: Llama2cHeader) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h.dim,
        "intermediate_size": h.hidden_dim,
        "num_hidden_layers": h.n_layers,
        "num_attention_heads": h.n_heads,
        "num_key_value_heads": h.n_kv_heads,
        "head_dim": h.head_dim,
        "vocab_size": h.vocab_size,
        "max_position_embeddings": h.seq_len,
        # llama2.c hard-codes these in run.c rather than storing them.
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": h.shared_classifier,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def convert_llama2c(src: Path, dst: Path) -> None:
    """Write `dst/config.json` and `dst/model.safetensors` for the llama2.c checkpoint `src`."""
    from safetensors.torch import save_file

    header, a = read_llama2c(Path(src))
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": a["token_embedding"]}
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = a["rms_att"][i]
        tensors[p + "self_attn.q_proj.weight"] = _rope_pairs_to_halves(a["wq"][i], header.n_heads)
        tensors[p + "self_attn.k_proj.weight"] = _rope_pairs_to_halves(a["wk"][i], header.n_kv_heads)
        tensors[p + "self_attn.v_proj.weight"] = a["wv"][i]
        tensors[p + "self_attn.o_proj.weight"] = a["wo"][i]
        tensors[p + "post_attention_layernorm.weight"] = a["rms_ffn"][i]
        tensors[p + "mlp.gate_proj.weight"] = a["w1"][i]
        tensors[p + "mlp.up_proj.weight"] = a["w3"][i]
        tensors[p + "mlp.down_proj.weight"] = a["w2"][i]
    tensors["model.norm.weight"] = a["rms_final"]
    if not header.shared_classifier:
        tensors["lm_head.weight"] = a["wcls"]

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    # Per-layer slices are views into one buffer; safetensors refuses tensors sharing storage.
    save_file({k: v.clone(memory_format=torch.contiguous_format) for k, v in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(_hf_config(header), indent=2) + "\n")
