"""GPT-NeoX (Pythia and kin) over the paged KV cache: LayerNorm with bias, GELU, rotary
embedding on part of each head, and, with `use_parallel_residual`, attention and FFN side by
side on the same input (PaLM's "parallel" block: x + attn(ln1(x)) + mlp(ln2(x))).

The module and parameter names are the checkpoint's (under `gpt_neox.`, head as `embed_out`):
`query_key_value` keeps Hugging Face's fused layout, per head [q; k; v]. Where the ranks of a
tensor-parallel run hold partial sums, a `PartialSum` marks the spot (an identity here; tensor
parallel hooks an all-reduce onto it): after the attention and after the FFN in a serial block,
once after both in a parallel block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kv.attention import AttentionMetadata, PagedAttention
from loom.kv.cache import KVCache
from loom.layers.rotary import RotaryEmbedding
from loom.models.config import ModelConfig


class PartialSum(nn.Module):
    """The identity; where the ranks' partial sums of a tensor-parallel forward meet."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class GPTNeoXAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.dense = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=True)
        self.rotary = rotary
        self.attn = PagedAttention(layer_idx, cfg.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.query_key_value(x).view(-1, self.num_heads, 3 * self.head_dim)
        q, k, v = (t.contiguous() for t in qkv.split(self.head_dim, dim=-1))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, cache, meta)
        return self.dense(out.flatten(1))


class GPTNeoXMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.dense_4h_to_h = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attention = GPTNeoXAttention(cfg, layer_idx, rotary)
        self.mlp = GPTNeoXMLP(cfg)
        self.attention_sum = PartialSum()  # serial blocks only
        self.block_sum = PartialSum()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(x), cache, meta)
        if self.parallel_residual:
            return x + self.block_sum(attn + self.mlp(self.post_attention_layernorm(x)))
        x = x + self.attention_sum(attn)
        return x + self.block_sum(self.mlp(self.post_attention_layernorm(x)))


class GPTNeoXForCausalLM(nn.Module):
    checkpoint_prefix = "gpt_neox."  # of every checkpoint tensor but the head's
    head_name = "embed_out"
    packed_params: dict[str, tuple[str, int]] = {}  # the checkpoint's fused q/k/v is kept as it is

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, cfg.rotary_dim)
        # Weights come from the checkpoint: no random init (on the meta device that init alone
        # imports torch's compiler, seconds in a process that never compiles).
        self.embed_in = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(GPTNeoXLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.embed_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.embed_out.weight = self.embed_in.weight

    def set_attention_backend(self, backend: str) -> None:
        for layer in self.layers:
            layer.attention.attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Packed ids/positions [T] -> final hidden states [T, hidden]."""
        x = self.embed_in(input_ids)
        # Indexed, not iterated: iterating a ModuleList makes a compiled graph check its dict's
        # key order, which a graph loaded from disk cannot.
        for i in range(len(self.layers)):
            x = self.layers[i](positions, x, cache, meta)
        return self.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_out(hidden).float()
