"""Megatron 1D weight-stationary tensor parallelism, applied to a loaded model: each rank keeps
its slice of every weight, and a forward hook all-reduces what row-parallel layers leave as
partial sums. The models' own code stays single-device.

Per Llama decoder layer, rank r of T keeps:
  qkv_proj      its H/T query heads and the KV heads they read (a KV head is split when T divides
                the KV heads, else replicated on the T/KVH ranks that read it: PaLM's baseline)
  o_proj        the input columns of its query heads; the attention's output is all-reduced
  gate_up_proj  its I/T rows of gate and of up
  down_proj     the matching I/T input columns; the MLP's output is all-reduced
GPT-NeoX is cut the same way; its parallel block (attention and FFN on the same input)
all-reduces once per layer, the sum of both partial outputs, as the PaLM paper describes.
With Helix KV parallelism (helix.py) the ranks form a TPA x KVP grid: qkv_proj keeps the
TPA share of the heads (the same on the KVP ranks of a group), the attention's all-to-all leaves
rank r the heads [r H/T, (r+1) H/T) with T all the ranks, and o_proj keeps their columns; the
FFN and vocabulary are split over all T ranks as above.
Row-parallel biases stay on rank 0 only. Embedding and LM head are split by vocabulary (padded
to a multiple of T): each rank looks up or scores its share; the lookup is all-reduced, the
logits gathered on rank 0.

Sharding runs after weight-only quantization (a quantized layer is cut in its portable form, so
every rank keeps the codes and scales one process would have) and before the panel-layout swap.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loom.kv.attention import PagedAttention
from loom.models.config import ModelConfig
from loom.models.gpt_neox import GPTNeoXForCausalLM
from loom.models.llama import LlamaForCausalLM
from loom.quant.linear import WeightOnlyLinear
from loom.parallel import comm
from loom.parallel.batch_attention import BatchShardedAttention, batch_attention_bytes
from loom.parallel.ffn_2d import WeightStationary2DMLP, ffn_2d_collectives, ffn_2d_cuts
from loom.parallel.helix import HelixAttention, helix_attention_bytes
from loom.parallel.state import ParallelState


def local_kv_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank `tp_rank`'s query heads read."""
    if num_kv_heads % tp_size == 0:
        count = num_kv_heads // tp_size
        return tp_rank * count, count
    heads_per_kv = num_heads // num_kv_heads
    return tp_rank * (num_heads // tp_size) // heads_per_kv, 1


def kv_replication(num_kv_heads: int, tp_size: int) -> int:
    """How many ranks hold a copy of each KV head."""
    return 1 if num_kv_heads % tp_size == 0 else tp_size // num_kv_heads


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return linear


Layer = nn.Linear | WeightOnlyLinear


def keep_rows(layer: Layer, rows: torch.Tensor) -> Layer:
    """Column parallel: the output channels `rows` of a layer (with their bias and scales)."""
    bias = None if layer.bias is None else layer.bias[rows]
    if isinstance(layer, nn.Linear):
        return _linear(layer.weight[rows], bias)
    q, scales, zeros = layer.portable()
    part = WeightOnlyLinear(layer.in_features, len(rows), layer.method, layer.group_size, bias, layer.plan)
    part.load_quantized(q[rows], scales[rows], None if zeros is None else zeros[rows])
    return part


def keep_columns(layer: Layer, columns: slice, name: str, state: ParallelState) -> Layer:
    """Row parallel: the input features `columns` of a layer; its output is a partial sum, so
    rank 0 alone keeps the bias (the sum over ranks adds it once)."""
    bias = layer.bias if state.is_driver else None
    if isinstance(layer, nn.Linear):
        return _linear(layer.weight[:, columns], bias)
    q, scales, zeros = layer.portable()
    part = WeightOnlyLinear(columns.stop - columns.start, layer.out_features, layer.method, layer.group_size, bias,
                            layer.plan)
    if layer.method == "int8":  # a scale per output channel: unchanged by the cut
        part.load_quantized(q[:, columns], scales)
        return part
    g = layer.group_size
    if columns.start % g or columns.stop % g:
        raise ValueError(f"tensor_parallel_size: {name}'s input splits at {columns.start}..{columns.stop}, which "
                         f"int4 groups of {g} inputs would straddle; use a group size dividing each rank's share")
    groups = slice(columns.start // g, columns.stop // g)
    part.load_quantized(q[:, columns], scales[:, groups], None if zeros is None else zeros[:, groups])
    return part


def _all_reduce_output(state: ParallelState):
    def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(output, state.group, state.shm_group)
    return hook


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding; ids outside them look up zeros, and the sum over
    ranks is the full lookup."""

    def __init__(self, weight: torch.Tensor, start: int, state: ParallelState) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.state = start, state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        state = self.state
        return comm.all_reduce(torch.where(inside.unsqueeze(-1), rows, 0), state.group, state.shm_group)


class VocabParallelHead(nn.Module):
    """The LM head's rows for this rank's vocabulary share (an nn.Linear, so quantization and
    the panel swap apply to it). Rank 0 gathers the full fp32 logits; the others, which never
    sample, get an empty [tokens, 0]."""

    def __init__(self, linear: nn.Linear, vocab_size: int, state: ParallelState) -> None:
        super().__init__()
        self.linear, self.vocab_size, self.state = linear, vocab_size, state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        state = self.state
        parts = comm.gather_to_driver(self.linear(hidden).float().contiguous(), state.group, state.shm_group,
                                      state.rank, state.world_size)
        if parts is None:
            return hidden.new_empty(hidden.shape[0], 0, dtype=torch.float32)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


def _vocab_shard(weight: torch.Tensor, state: ParallelState) -> tuple[torch.Tensor, int]:
    """This rank's rows of a [vocab, hidden] weight, zero-padded to vocab / T rounded up."""
    per_rank = -(-weight.shape[0] // state.tp_size)
    start = state.tp_rank * per_rank
    shard = weight[start:start + per_rank]
    return F.pad(shard, (0, 0, 0, per_rank - shard.shape[0])).contiguous(), start


def _attention_shares(cfg: ModelConfig, state: ParallelState) -> tuple[int, int, slice]:
    """(query heads this rank's QKV projection computes: the TPA share, the first of them, the
    input columns of its output projection: the heads the attention leaves it). Without KV
    parallelism both are the rank's H/T heads; with it, the TPA share is split again over the
    KVP ranks by Helix's all-to-all."""
    hd, heads, out_heads = cfg.head_dim, cfg.num_heads // state.tpa_size, cfg.num_heads // state.tp_size
    return heads, state.tpa_rank * heads, slice(state.rank * out_heads * hd, (state.rank + 1) * out_heads * hd)


def _sharded_attention(attention: PagedAttention, cfg: ModelConfig, state: ParallelState) -> nn.Module:
    """The attention for this layout: Helix's, batch-sharded, or the plain one over this rank's heads."""
    if state.kvp_size > 1:
        return HelixAttention(attention, state)
    if state.batch_sharded:
        kv_heads = [local_kv_heads(cfg.num_heads, cfg.num_kv_heads, state.tp_size, r) for r in range(state.tp_size)]
        return BatchShardedAttention(attention, state, kv_heads)
    return attention


def shard_llama(model: LlamaForCausalLM, state: ParallelState) -> None:
    """The Llama family's shard, in place: each attention and each FFN all-reduces its output."""
    cfg, tp, r = model.config, state.tp_size, state.tp_rank
    hd, ffn = cfg.head_dim, cfg.intermediate_size // tp
    heads, first_head, o_columns = _attention_shares(cfg, state)
    kv_first, kv_count = local_kv_heads(cfg.num_heads, cfg.num_kv_heads, state.tpa_size, state.tpa_rank)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q_rows = torch.arange(first_head * hd, (first_head + heads) * hd)
            kv_rows = torch.arange(kv_first * hd, (kv_first + kv_count) * hd)
            attn.qkv_proj = keep_rows(attn.qkv_proj, torch.cat([q_rows, attn.q_size + kv_rows,
                                                                attn.q_size + attn.kv_size + kv_rows]))
            attn.o_proj = keep_columns(attn.o_proj, o_columns, f"layers.{i}.self_attn.o_proj", state)
            attn.attn = _sharded_attention(attn.attn, cfg, state)
            attn.num_heads, attn.num_kv_heads = heads, kv_count
            attn.q_size, attn.kv_size = heads * hd, kv_count * hd
            attn.register_forward_hook(_all_reduce_output(state))

            if state.ffn_x is not None:
                layer.mlp = _mlp_2d(mlp, cfg, state, i)
                continue
            ffn_rows = torch.arange(r * ffn, (r + 1) * ffn)
            mlp.gate_up_proj = keep_rows(mlp.gate_up_proj, torch.cat([ffn_rows, cfg.intermediate_size + ffn_rows]))
            mlp.down_proj = keep_columns(mlp.down_proj, slice(r * ffn, (r + 1) * ffn), f"layers.{i}.mlp.down_proj",
                                         state)
            mlp.intermediate_size = ffn
            mlp.register_forward_hook(_all_reduce_output(state))

        model.embed_tokens, model.lm_head = _vocab_parallel(model.embed_tokens, model.lm_head, cfg, state)


def _mlp_2d(mlp: nn.Module, cfg: ModelConfig, state: ParallelState, i: int) -> WeightStationary2DMLP:
    """A Llama MLP cut to this rank's blocks of PaLM's 2D weight-stationary layout."""
    gate_up_rows, model_dim, ffn_dim = ffn_2d_cuts(cfg.hidden_size, cfg.intermediate_size, state)
    gate_up = keep_columns(keep_rows(mlp.gate_up_proj, gate_up_rows), model_dim, f"layers.{i}.mlp.gate_up_proj", state)
    down = keep_columns(keep_rows(mlp.down_proj, torch.arange(model_dim.start, model_dim.stop)), ffn_dim,
                        f"layers.{i}.mlp.down_proj", state)
    return WeightStationary2DMLP(gate_up, down, model_dim, state)


def _vocab_parallel(embedding: nn.Embedding, head: Layer, cfg: ModelConfig,
                    state: ParallelState) -> tuple[VocabParallelEmbedding, VocabParallelHead]:
    """The embedding and LM head cut to this rank's share of the vocabulary (tied stays tied)."""
    weight, start = _vocab_shard(embedding.weight, state)
    embedding = VocabParallelEmbedding(weight, start, state)
    if isinstance(head, nn.Linear):
        part = _linear(embedding.weight if cfg.tie_word_embeddings else _vocab_shard(head.weight, state)[0], None)
        if cfg.tie_word_embeddings:
            part.weight = embedding.weight
    else:  # quantized: this rank's vocabulary rows, padded with copies of the last (their logits are cut off)
        part = keep_rows(head, torch.arange(start, start + weight.shape[0]).clamp(max=cfg.vocab_size - 1))
    return embedding, VocabParallelHead(part, cfg.vocab_size, state)


def shard_gpt_neox(model: GPTNeoXForCausalLM, state: ParallelState) -> None:
    """GPT-NeoX's shard, in place: the fused query_key_value holds each head's [q; k; v] rows
    together, so a rank's heads are one run of rows. A parallel block all-reduces once, the sum
    of its attention's and FFN's partial outputs; a serial block after each."""
    cfg, tp, r = model.config, state.tp_size, state.tp_rank
    hd, ffn = cfg.head_dim, cfg.intermediate_size // tp
    heads, first_head, dense_columns = _attention_shares(cfg, state)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.attention, layer.mlp
            attn.query_key_value = keep_rows(attn.query_key_value, torch.arange(first_head * 3 * hd,
                                                                                (first_head + heads) * 3 * hd))
            attn.dense = keep_columns(attn.dense, dense_columns, f"layers.{i}.attention.dense", state)
            attn.attn = _sharded_attention(attn.attn, cfg, state)
            attn.num_heads = heads
            mlp.dense_h_to_4h = keep_rows(mlp.dense_h_to_4h, torch.arange(r * ffn, (r + 1) * ffn))
            mlp.dense_4h_to_h = keep_columns(mlp.dense_4h_to_h, slice(r * ffn, (r + 1) * ffn),
                                             f"layers.{i}.mlp.dense_4h_to_h", state)
            for partial_sum in (layer.attention_sum, layer.block_sum):
                partial_sum.register_forward_hook(_all_reduce_output(state))
        model.embed_in, model.embed_out = _vocab_parallel(model.embed_in, model.embed_out, cfg, state)


def shard_model(model: LlamaForCausalLM | GPTNeoXForCausalLM, state: ParallelState) -> None:
    """Cuts `model` (loaded whole; nn.Linear or weight-only quantized layers) down to rank
    `state.rank`'s shard, in place."""
    if isinstance(model, GPTNeoXForCausalLM):
        shard_gpt_neox(model, state)
    else:
        shard_llama(model, state)


def model_collectives(cfg: ModelConfig, dtype: torch.dtype, state: ParallelState, num_tokens: int,
                      logit_rows: list[int], rows_per_rank: int = 0,
                      helix_items: int = 1) -> list[tuple[str, int, int]]:
    """(kind, calls, bytes each rank puts in) of one forward over `num_tokens` tokens whose
    logits are computed in calls of `logit_rows` rows each: the embedding's all-reduce, one
    after each attention and each FFN (one per layer for a parallel block), the all-to-alls of
    each attention (Helix's one, or one per item with HOP-B; two by batch, over `rows_per_rank`
    rows for each rank), and the LM head's gathers of fp32 logits."""
    activations = num_tokens * cfg.hidden_size * dtype.itemsize
    vocab_per_rank = -(-cfg.vocab_size // state.tp_size)
    ffn_2d = state.ffn_x is not None
    all_reduces = (1 if cfg.parallel_residual or ffn_2d else 2) * cfg.num_layers + 1
    counts = [("all_reduce", all_reduces, all_reduces * activations),
              ("gather", len(logit_rows), sum(logit_rows) * vocab_per_rank * 4)]
    if ffn_2d:
        counts += [(kind, calls * cfg.num_layers, nbytes * cfg.num_layers) for kind, calls, nbytes in
                   ffn_2d_collectives(num_tokens, cfg.hidden_size, cfg.intermediate_size, dtype.itemsize, state)]
    if state.kvp_size > 1:
        per_layer = helix_attention_bytes(num_tokens, cfg.num_heads, cfg.head_dim, dtype.itemsize, state)
        counts.append(("all_to_all", helix_items * cfg.num_layers, cfg.num_layers * per_layer))
    elif state.batch_sharded:
        kv_heads = local_kv_heads(cfg.num_heads, cfg.num_kv_heads, state.tp_size, state.tp_rank)[1]
        counts.append(("all_to_all", 2 * cfg.num_layers,
                       cfg.num_layers * batch_attention_bytes(rows_per_rank, cfg.num_heads // state.tp_size, kv_heads,
                                                              cfg.head_dim, dtype.itemsize, state.tp_size)))
    return counts
