"""The Llama family (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Tokens arrive packed ([T] ids and positions, no padding); q/k/v and gate/up are each one
merged projection (fewer, larger matmuls), filled from the checkpoint's separate tensors by
the loader through `packed_params`.
"""
from __future__ import annotations

import torch
from torch import nn

from loom.kv.attention import AttentionMetadata, PagedAttention
from loom.kv.cache import KVCache
from loom.layers.activation import silu_and_mul
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding
from loom.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(layer_idx, cfg.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, cache, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.kernel = False  # eager calls run Loom's operator (loom/layers/elementwise.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), kernel=self.kernel))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    checkpoint_prefix = "model."  # of every checkpoint tensor but the head's
    head_name = "lm_head"
    # checkpoint tensor name fragment -> (Loom parameter fragment, shard index)
    packed_params = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)
        # Weights come from the checkpoint: no random init (on the meta device that init alone
        # imports torch's compiler, seconds in a process that never compiles).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def shard_sizes(self, packed_name: str) -> list[int]:
        """Sizes along dim 0 of the shards that make up a merged projection."""
        c = self.config
        if packed_name == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        if packed_name == "gate_up_proj":
            return [c.intermediate_size, c.intermediate_size]
        raise KeyError(packed_name)

    def set_attention_backend(self, backend: str) -> None:
        for layer in self.layers:
            layer.self_attn.attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Packed ids/positions [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        # Indexed, not iterated: iterating a ModuleList makes a compiled graph check its dict's
        # key order, which a graph loaded from disk cannot.
        for i in range(len(self.layers)):
            x = self.layers[i](positions, x, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
