"""The benchmarks' reference model: a random-weight Llama of 134M parameters (hidden 768,
12 layers, 12 heads, intermediate 2048, vocab 32000, untied), written once to a cache folder
in the Hugging Face layout so Loom and its peers load the very same files. It has no
tokenizer (the benchmarks feed token ids); `with_tokenizer` gives it one for peers that take
text only."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from loom.config import cache_root

REFERENCE_134M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048)


def reference_model_dir(shape: dict | None = None, name: str = "ref-134m", seed: int = 0) -> Path:
    """Writes (once) and returns the directory of a random-weight Llama with the given shape."""
    shape = shape or REFERENCE_134M
    out = cache_root() / "bench-models" / name
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  torch_dtype="float32", **shape)
    g = torch.Generator().manual_seed(seed)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g) * 0.02

    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h), "lm_head.weight": rand(v, h)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
        }
    tmp = out / "model.safetensors.partial"
    save_file(tensors, str(tmp))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out / "model.safetensors")  # last: a half-written model is never mistaken for a whole one
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def with_tokenizer(model_dir: Path, tokenizer_dir: Path) -> Path:
    """A sibling of `model_dir` that reads text with `tokenizer_dir`'s tokenizer (whose ids must
    fit the model's vocabulary): the same weights (linked, not copied), the tokenizer's files,
    and its BOS/EOS ids in the config. Made once."""
    model_dir, tokenizer_dir = Path(model_dir), Path(tokenizer_dir)
    out = model_dir.with_name(f"{model_dir.name}-{tokenizer_dir.resolve().name}-tokenizer")
    if (out / "config.json").is_file():
        return out
    config = json.loads((model_dir / "config.json").read_text())
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    if len(vocab) > config["vocab_size"]:
        raise ValueError(f"{tokenizer_dir}: {len(vocab)} tokens do not fit the model's vocabulary of "
                         f"{config['vocab_size']}")
    ids = json.loads((tokenizer_dir / "config.json").read_text())
    config |= {k: ids[k] for k in ("bos_token_id", "eos_token_id") if k in ids}
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    for weights in model_dir.glob("*.safetensors"):
        (out / weights.name).unlink(missing_ok=True)
        (out / weights.name).symlink_to(weights.resolve())
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: marks the folder whole
    return out
