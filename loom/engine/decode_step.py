"""A Llama-family model's decode step as one C++ call (loom/kernels/decode_step.cpp).

At batch 1 an int4 step's weights stream in about a millisecond, and a compiled graph's own work
(its inputs' handles, its custom-op calls, its buffers, its Python wrappers) took 0.13-0.3 ms more
(docs/benchmarks, "Decode steps as one C++ call"). `DecodeStep` holds the model's weights and the
KV pools from load on and runs the whole step, embedding to LM head, in Loom's C++: one call a
step, with the step's five tensors. It returns the logits and each row's argmax, which a greedy
row takes as its token without a scan of its own.

It serves the steps it can compute exactly as the model does: a `LlamaForCausalLM` (Llama,
Mistral, Qwen2; MHA, GQA, MQA) in one process, every linear layer on Loom's own kernels at the
step's batch size (the panel, AMX and weight-only kernels, by each layer's dispatch plan), rotary on
every dim, attention by Loom's C++ backend, and no KV policy scoring the step. Other steps run
through the compiled decode graphs.
"""
from __future__ import annotations

import logging

import torch

from loom.kernels import load_kernels
from loom.kv.attention import AttentionMetadata, PagedAttention
from loom.kv.cache import KVCache
from loom.layers.dispatch import OWN_KERNELS, Plan, choose
from loom.layers.linear import DenseLinear
from loom.models.llama import LlamaForCausalLM
from loom.quant.linear import WeightOnlyLinear

logger = logging.getLogger(__name__)

_KINDS = {"panel": 0, "int8": 1, "int4": 2}  # decode_step.cpp's Linear::Kind


def _own_until(plan: Plan) -> float:
    """The largest token count up to which `plan` runs Loom's own kernel at every count."""
    until = 0
    for bound, kernel in plan:
        if kernel not in OWN_KERNELS:
            return until
        until = bound
    return float("inf")  # the last entry covers every larger count


def _unserved(model: torch.nn.Module) -> str | None:
    """Why `model`'s decode steps cannot run as one C++ call, or None."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not a Llama-family model"
    for layer in model.layers:
        attn = layer.self_attn
        if type(attn.attn) is not PagedAttention or attn.attn.backend != "cpp":
            return "attention is not Loom's C++ paged attention"
        if attn.rotary.rotary_dim:
            return "rotary embedding on part of each head"
    for linear in _linears(model):
        if not (isinstance(linear, DenseLinear) and linear.packed or isinstance(linear, WeightOnlyLinear)):
            return f"a linear layer ({type(linear).__name__}) not on Loom's kernels"
    return None


def _linears(model: LlamaForCausalLM) -> list[torch.nn.Module]:
    """The linear layers in the order the step runs them: four a layer, then the LM head."""
    layers = [(l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj) for l in model.layers]
    return [linear for four in layers for linear in four] + [model.lm_head]


class DecodeStep:
    """`step(ids, positions, meta)`: the logits (and each row's argmax) of a decode-only step
    that `step.serves(meta)`."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, max_batch: int) -> None:
        kernels = load_kernels()
        first = model.layers[0].self_attn
        cfg = model.config
        linears = _linears(model)
        # The largest batch every layer runs on Loom's own kernels.
        self.max_batch = min(max_batch, *(_own_until(m.plan) for m in linears))
        self.step = kernels.DecodeStep(
            model.embed_tokens.weight, model.norm.weight, first.rotary.cos, first.rotary.sin, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, model.norm.eps, first.attn.scale)
        dtype = model.embed_tokens.weight.dtype
        for i, layer in enumerate(model.layers):
            for linear in linears[4 * i:4 * i + 4]:
                self._add_linear(linear, dtype)
            pools = [p[i] for keys, values in cache.pools() for p in (keys, values)]
            self.step.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, pools)
        self._add_linear(model.lm_head, dtype)

    def _add_linear(self, linear: DenseLinear | WeightOnlyLinear, dtype: torch.dtype) -> None:
        bias = None if linear.bias is None else linear.bias.to(dtype)
        if isinstance(linear, DenseLinear):
            # Whether its plan runs AMX tiles, for each batch size the step serves.
            tile_rows = [choose(linear.plan, rows) == "amx" for rows in range(self.max_batch + 1)]
            self.step.add_linear(_KINDS["panel"], linear.weight, None, None, bias, 0, linear.out_features, tile_rows)
        else:
            self.step.add_linear(_KINDS[linear.method], linear.q, linear.scales, linear.zeros, bias,
                                 linear.group_size, linear.out_features, [])

    @staticmethod
    def build(model: torch.nn.Module, cache: KVCache, max_batch: int) -> DecodeStep | None:
        """The model's C++ decode step, or None (logged with the reason) where it cannot serve."""
        reason = _unserved(model)
        if reason is None:
            step = DecodeStep(model, cache, max_batch)
            if step.max_batch >= 1:
                logger.info("decode steps of up to %d rows run as one C++ call", step.max_batch)
                return step
            reason = "no linear layer runs Loom's own kernel at batch 1"
        logger.info("decode steps run through compiled graphs only: %s", reason)
        return None

    def serves(self, meta: AttentionMetadata) -> bool:
        return meta.decode_scores is None and meta.row_exchange is None and meta.num_decode_tokens <= self.max_batch

    def linear_ops(self, rows: int) -> list[str]:
        """The operator each linear layer runs at a step of `rows` rows (by registered name), in
        the step's order: four a layer, then the LM head."""
        return self.step.linear_ops(rows)

    def time_kernels(self, on: bool) -> None:
        """Starts (or stops) adding up the time the steps spend in the linear layers (the LM head
        among them) and in attention, from zero (`kernel_seconds`): a benchmark's split of the
        steps it times."""
        self.step.set_timing(on)

    def kernel_seconds(self) -> tuple[float, float, int]:
        """Seconds in the linear layers, seconds in attention, and steps, since `time_kernels(True)`."""
        return self.step.timings()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 num_steps: int = 1) -> tuple[torch.Tensor, list[int]]:
        """The step's logits [B, vocab] in the model's dtype (`compute_logits` widens the same
        values to float32; the sampler does, where a row needs more than its argmax) and each
        row's argmax (its first largest logit, in float32). With `num_steps` > 1, that many steps
        in a row, each row's token the argmax of its step before (`meta.slot_mapping` holds every
        step's slots, a step's B after another; its block tables cover them all): the last step's
        logits, and every step's argmax, a step's B after another."""
        return self.step.run(ids, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                             num_steps)
