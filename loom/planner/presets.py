"""Model shapes: the presets the papers use, and shapes read from a Hugging Face config.json.

Only what the cost model needs is kept: dimensions, attention kind (MHA/GQA/MQA or MLA),
MoE routing, block structure. Per-layer quantities are averages over the layers, which is
exact for dense models and a good approximation for MoE models with a few dense layers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    vocab: int
    gated_ffn: bool = True          # SwiGLU-style FFN: three matrices instead of two
    parallel_block: bool = False    # attention and FFN read the same normalized input
    tied_embeddings: bool = False
    useful_heads: int | None = None  # heads that count towards MFU when heads were padded
    # Multi-head latent attention (DeepSeek): the cache holds a latent plus a rope key.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts.
    n_experts: int = 0
    experts_per_token: int = 0
    n_shared_experts: int = 0
    moe_d_ff: int = 0
    n_dense_layers: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def kv_heads(self) -> int:
        """KV heads attention can be split by: MLA has one shared latent."""
        return 1 if self.is_mla else self.n_kv_heads

    @property
    def kv_elems_per_token(self) -> int:
        """Cached elements per token per layer (all KV heads)."""
        if self.is_mla:
            return self.kv_lora_rank + self.rope_head_dim
        return 2 * self.n_kv_heads * self.d_head

    @property
    def attn_out_dim(self) -> int:
        """Width of the attention output that the O projection reads."""
        return self.n_heads * (self.v_head_dim or self.d_head)

    @property
    def qkv_params(self) -> float:
        e, h = self.d_model, self.n_heads
        if self.is_mla:
            q = (e * self.q_lora_rank + self.q_lora_rank * h * (self.d_head + self.rope_head_dim)
                 if self.q_lora_rank else e * h * (self.d_head + self.rope_head_dim))
            kv = e * (self.kv_lora_rank + self.rope_head_dim)
            kv += self.kv_lora_rank * h * (self.d_head + (self.v_head_dim or self.d_head))
            return q + kv
        return e * (h + 2 * self.n_kv_heads) * self.d_head

    @property
    def o_params(self) -> float:
        return self.attn_out_dim * self.d_model

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.gated_ffn else 2

    @property
    def expert_params(self) -> float:
        return self.ffn_matrices * self.d_model * self.moe_d_ff

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    @property
    def ffn_params(self) -> float:
        """Stored FFN parameters per layer (mean over layers)."""
        dense = self.ffn_matrices * self.d_model * self.d_ff
        if not self.is_moe:
            return dense
        moe = (self.n_experts + self.n_shared_experts) * self.expert_params
        moe += self.d_model * self.n_experts  # router
        return (self.n_dense_layers * dense + self.n_moe_layers * moe) / self.n_layers

    def ffn_params_read(self, tokens: float) -> float:
        """FFN parameters one step reads per layer: MoE steps touch only the routed experts."""
        dense = self.ffn_matrices * self.d_model * self.d_ff
        if not self.is_moe:
            return dense
        # Expected number of distinct experts hit by `tokens` tokens routed uniformly.
        p_miss = (1 - self.experts_per_token / self.n_experts) ** tokens
        touched = self.n_experts * (1 - p_miss) + self.n_shared_experts
        return (self.n_dense_layers * dense + self.n_moe_layers * touched * self.expert_params) / self.n_layers

    @property
    def ffn_active_params(self) -> float:
        """FFN parameters each token multiplies with, per layer (mean over layers)."""
        dense = self.ffn_matrices * self.d_model * self.d_ff
        if not self.is_moe:
            return dense
        active = (self.experts_per_token + self.n_shared_experts) * self.expert_params
        return (self.n_dense_layers * dense + self.n_moe_layers * active) / self.n_layers

    @property
    def ffn_width(self) -> float:
        """Effective d_ff of one token's FFN, the F of the PaLM communication formulas."""
        return self.ffn_active_params / (self.ffn_matrices * self.d_model)

    @property
    def layer_params(self) -> float:
        return self.qkv_params + self.o_params + self.ffn_params

    @property
    def embedding_params(self) -> float:
        return self.vocab * self.d_model * (1 if self.tied_embeddings else 2)

    @property
    def n_params(self) -> float:
        return self.n_layers * self.layer_params + self.embedding_params

    def matmul_flops_per_token(self, useful: bool = False) -> float:
        """2 x (active parameters) per token, LM head included, input embedding excluded.

        `useful` discounts padded heads, which cost time but do not count towards MFU.
        """
        scale = (self.useful_heads / self.n_heads) if (useful and self.useful_heads) else 1.0
        per_layer = (self.qkv_params + self.o_params) * scale + self.ffn_active_params
        return 2 * (self.n_layers * per_layer + self.vocab * self.d_model)

    def attention_flops_per_token(self, context: float) -> float:
        """Score and value FLOPs of one query token over `context` cached tokens, per layer."""
        if self.is_mla:  # weights absorbed: attend in the latent space
            qk, v = self.kv_lora_rank + self.rope_head_dim, self.kv_lora_rank
        else:
            qk = v = self.d_head
        return 2 * self.n_heads * (qk + v) * context


def _palm(name: str, layers: int, d_model: int, heads: int, useful_heads: int | None = None) -> ModelShape:
    # PaLM: multi-query attention with d_head 256, SwiGLU d_ff = 4 d_model, parallel block,
    # 256k vocabulary with tied embeddings.
    return ModelShape(name=name, n_layers=layers, d_model=d_model, n_heads=heads, n_kv_heads=1,
                      d_head=256, d_ff=4 * d_model, vocab=256_000, parallel_block=True,
                      tied_embeddings=True, useful_heads=useful_heads)


PRESETS: dict[str, ModelShape] = {m.name: m for m in [
    _palm("palm-8b", 32, 4096, 16),
    _palm("palm-62b", 64, 8192, 32),
    _palm("palm-540b", 118, 18432, 48),
    # The paper pads 48 heads to 64 to partition over 64+ chips (+18B parameters).
    _palm("palm-540b-64h", 118, 18432, 64, useful_heads=48),
    ModelShape(name="mt-nlg-530b", n_layers=105, d_model=20480, n_heads=128, n_kv_heads=128,
               d_head=160, d_ff=81920, vocab=51200, gated_ffn=False, tied_embeddings=True),
    ModelShape(name="llama-3.1-405b", n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8,
               d_head=128, d_ff=53248, vocab=128256),
    ModelShape(name="deepseek-r1", n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128,
               d_head=128, d_ff=18432, vocab=129280, kv_lora_rank=512, q_lora_rank=1536,
               rope_head_dim=64, v_head_dim=128, n_experts=256, experts_per_token=8,
               n_shared_experts=1, moe_d_ff=2048, n_dense_layers=3),
    # The 134M reference Llama of the benchmarks.
    ModelShape(name="llama-134m", n_layers=12, d_model=768, n_heads=12, n_kv_heads=12,
               d_head=64, d_ff=2048, vocab=32000),
]}

# The house model ships with the repository; its shape is read from its config.json.
HOUSE_CONFIG = Path(__file__).resolve().parents[2] / "models" / "house" / "config.json"


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a model shape from a Hugging Face config.json (or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = json.loads(path.read_text())
    d_model = cfg.get("hidden_size") or cfg["n_embd"]
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    n_experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    model_type = cfg.get("model_type", "")
    return ModelShape(
        name=cfg.get("_name_or_path") or path.parent.name or model_type,
        n_layers=cfg.get("num_hidden_layers") or cfg["n_layer"],
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        d_head=cfg.get("qk_nope_head_dim") or cfg.get("head_dim") or d_model // heads,
        d_ff=cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * d_model,
        vocab=cfg["vocab_size"],
        gated_ffn=model_type not in ("gpt_neox", "gptj", "gpt2"),
        parallel_block=model_type == "gptj" or bool(cfg.get("use_parallel_residual", False)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        kv_lora_rank=cfg.get("kv_lora_rank") or 0,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
        v_head_dim=cfg.get("v_head_dim") or 0,
        n_experts=n_experts,
        experts_per_token=cfg.get("num_experts_per_tok") or 0,
        n_shared_experts=cfg.get("n_shared_experts") or 0,
        moe_d_ff=cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if n_experts else 0),
        n_dense_layers=cfg.get("first_k_dense_replace") or 0,
    )


def load_model(spec: str) -> ModelShape:
    """A preset name, `house`, or a path to a config.json / checkpoint directory."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "house":
        if not HOUSE_CONFIG.exists():
            raise ValueError("the house model is not in this checkout (models/house/config.json)")
        return replace(from_hf_config(HOUSE_CONFIG), name="house")
    if Path(spec).exists():
        return from_hf_config(spec)
    raise ValueError(f"unknown model {spec!r}: a preset ({', '.join(PRESETS)}, house) or a config.json path")


def with_block(model: ModelShape, block: str) -> ModelShape:
    """The same model with a serial or parallel attention/FFN block (PaLM section 4.3)."""
    if block == "model":
        return model
    return replace(model, parallel_block=(block == "parallel"), name=f"{model.name}-{block}")


__all__ = ["ModelShape", "PRESETS", "from_hf_config", "load_model", "with_block"]
