"""The cost model: time, MFU, memory and cost of one layout for one phase (prefill or decode).

Per layer and per chip, four times are computed (PaLM section 2):
  compute  matmul FLOPs and attention FLOPs at the chip's achievable FLOP/s
  weight   weight bytes read from memory (weight-gathered layouts read the gathered weights)
  kv       KV-cache bytes read (decode) or written (prefill)
  comm     the layout's collectives, alpha-beta priced
and, per step, a fixed cost (engine loop, sampler, small ops) where the hardware measured one.
On hardware calibrated with Loom's own layers (`loom calibrate`), weight and KV reads run at the
rates those layers reached rather than at the memory bandwidth (docs/planner.md).
Attention (score/value FLOPs against the KV read) and the projections run as separate kernels,
each bound by the slower of its compute and its memory traffic; communication is added on top,
or hidden behind them with `Workload.overlap` (PaLM's looped collective einsums); weight
all-gathers are always hidden, as they can be issued before the activations exist. Helix puts its
all-to-all inside the attention phase, overlapped batch-wise with HOP-B when the layout says so.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .collectives import Collective, collective_time
from .hardware import Hardware
from .layouts import Layout, helix_all_to_all, hop_b_time, layer_collectives, sharding
from .presets import ModelShape
from .workload import Workload, dtype_bytes


@dataclass(frozen=True)
class StepCost:
    compute_s: float
    weight_s: float
    kv_s: float
    comm_s: float
    time_s: float
    fixed_s: float = 0.0     # per-step cost that no layer accounts for, included in time_s

    def scaled(self, k: float) -> "StepCost":
        return StepCost(*(k * v for v in asdict(self).values()))

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))


@dataclass(frozen=True)
class PhaseEstimate:
    phase: str
    layout: Layout
    batch: int
    steps: int
    per_layer: StepCost      # one layer, one step
    step: StepCost           # the whole model, one step
    latency_s: float         # the whole phase
    tokens: int              # tokens processed (prefill) or generated (decode)
    mfu: float
    memory_per_chip: float   # bytes: weights plus the KV cache at full context
    fits: bool
    max_context: int         # longest context that fits at this batch
    chip_s_per_token: float

    @property
    def chips(self) -> int:
        return self.layout.chips

    def as_dict(self) -> dict:
        d = asdict(self)
        d["layout"] = self.layout.name
        d["chips"] = self.chips
        return d


def layer_weight_bytes(model: ModelShape, weight_bytes: float, qkv_ways: int, o_ways: int,
                       ffn_ways: int, tokens: float) -> float:
    """Weight bytes one chip reads per layer in a step over `tokens` tokens."""
    ffn = model.ffn_params_read(tokens)
    return (model.qkv_params / qkv_ways + model.o_params / o_ways + ffn / ffn_ways) * weight_bytes


def kv_bytes_per_chip(model: ModelShape, kv_bytes: float, seqs: float, context: float,
                      kv_head_ways: int, kv_seq_ways: int) -> float:
    """KV-cache bytes per layer on one chip. Splitting beyond the model's KV heads replicates
    them: each chip still holds at least one whole head (PaLM table 1, Helix figure 2c)."""
    heads_held = math.ceil(model.kv_heads / kv_head_ways) / model.kv_heads
    return seqs * context * model.kv_elems_per_token * kv_bytes * heads_held / kv_seq_ways


def _seqs_per_chip(layout: Layout, model: ModelShape, batch: float) -> float:
    return math.ceil(batch / sharding(layout, model, math.ceil(batch)).batch)


def layer_cost(model: ModelShape, hw: Hardware, wl: Workload, layout: Layout, batch: float,
               tokens_per_seq: int, context: float, kv_tokens: float) -> StepCost:
    """One layer, one step, on one chip, for `batch` sequences of `tokens_per_seq` new tokens
    attending over `context` tokens, reading (decode) or writing (prefill) `kv_tokens` of KV."""
    s = sharding(layout, model, math.ceil(batch))
    tokens = batch * tokens_per_seq
    wb, ab = dtype_bytes(wl.weight_dtype), dtype_bytes(wl.act_dtype)
    mm_flops = 2 * tokens * (model.qkv_params / s.qkv + model.o_params / s.o + model.ffn_active_params / s.ffn)
    attn_flops = tokens * model.attention_flops_per_token(context) / s.attn_compute
    matmul_s = mm_flops / hw.flops(hw.matmul_dtype(wl.weight_dtype))
    # Attention multiplies against the cache, so it runs at the KV dtype's tensor-core rate.
    attn_s = attn_flops / hw.flops(hw.matmul_dtype(wl.kv_dtype))
    weight_s = (layer_weight_bytes(model, wb, s.qkv, s.o, s.ffn, tokens) * layout.gather
                / hw.weight_bandwidth(wl.weight_dtype, tokens))
    kv = kv_bytes_per_chip(model, dtype_bytes(wl.kv_dtype), _seqs_per_chip(layout, model, batch),
                           kv_tokens, s.kv_heads, s.kv_seq)
    kv_s = kv / hw.kv_read_bandwidth(wl.kv_dtype)
    total_weights = (model.qkv_params + model.o_params + model.ffn_params_read(tokens)) * wb
    collectives = layer_collectives(layout, model, batch, tokens_per_seq, total_weights, ab)
    # Weight all-gathers do not depend on this layer's activations, so they are issued ahead
    # and hidden behind the compute; activation collectives sit on the critical path.
    prefetched = sum(collective_time(hw, c) for c in collectives if c.prefetch)
    comm = [collective_time(hw, c) for c in collectives if not c.prefetch]
    attention = max(attn_s, kv_s)
    projections = max(matmul_s, weight_s)
    if layout.kind == "helix":
        a2a = helix_all_to_all(layout, model, batch, ab)
        if layout.hop_b:  # one all-to-all per request, each hidden behind the next request
            per_request = collective_time(hw, Collective(a2a.kind, a2a.nbytes / batch, a2a.group))
            attention = hop_b_time(math.ceil(batch), attention / batch, per_request, overlap=True)
            comm.append(per_request * batch)
        else:
            comm.append(collective_time(hw, a2a))
            attention += comm[-1]
        rest = sum(comm[:-1])
        time = attention + (max(projections, rest) if wl.overlap else projections + rest)
    else:
        exposed = 0.0 if wl.overlap else sum(comm)
        time = max(attention + projections, prefetched + sum(comm) - exposed) + exposed
    return StepCost(compute_s=matmul_s + attn_s, weight_s=weight_s, kv_s=kv_s,
                    comm_s=sum(comm) + prefetched, time_s=time)


def _head_cost(model: ModelShape, hw: Hardware, wl: Workload, layout: Layout, tokens: float) -> StepCost:
    """The vocabulary projection, split over the chips of one stage."""
    flops_s = 2 * tokens * model.vocab * model.d_model / layout.tp / hw.flops(hw.matmul_dtype(wl.weight_dtype))
    weight_s = (model.vocab * model.d_model * dtype_bytes(wl.weight_dtype) / layout.tp
                / hw.weight_bandwidth(wl.weight_dtype, tokens))
    return StepCost(compute_s=flops_s, weight_s=weight_s, kv_s=0.0, comm_s=0.0, time_s=max(flops_s, weight_s))


def step_cost(model: ModelShape, hw: Hardware, wl: Workload, layout: Layout, batch: int,
              tokens_per_seq: int, context: float, kv_tokens: float) -> tuple[StepCost, StepCost]:
    """(one layer, whole model) for one step. A pipeline runs `pp` micro-batches, so one
    micro-batch crosses every layer and every stage boundary per step."""
    if batch % layout.pp:
        raise ValueError(f"a batch of {batch} does not split into {layout.pp} pipeline micro-batches")
    micro = batch / layout.pp
    layer = layer_cost(model, hw, wl, layout, micro, tokens_per_seq, context, kv_tokens)
    fixed = hw.step_overhead_s(micro, model.n_layers)
    step = (layer.scaled(model.n_layers) + _head_cost(model, hw, wl, layout, micro * tokens_per_seq)
            + StepCost(0.0, 0.0, 0.0, 0.0, time_s=fixed, fixed_s=fixed))
    if layout.pp > 1:
        send = Collective("send", micro * tokens_per_seq * model.d_model * dtype_bytes(wl.act_dtype), 2)
        hop = (layout.pp - 1) * collective_time(hw, send)
        step = step + StepCost(0.0, 0.0, 0.0, hop, hop)
    return layer, step


def weights_per_chip(model: ModelShape, wl: Workload, layout: Layout) -> float:
    s = sharding(layout, model, 1)
    wb = dtype_bytes(wl.weight_dtype)
    layer = (model.qkv_params / s.qkv + model.o_params / s.o + model.ffn_params / s.ffn) * wb
    gathered = model.layer_params * wb * layout.gather / layout.chips if layout.gather > 1 else 0.0
    return layer * model.n_layers / layout.pp + model.embedding_params * wb / layout.tp + gathered


def kv_per_token_per_chip(model: ModelShape, wl: Workload, layout: Layout, batch: int) -> float:
    """KV bytes one chip holds per token of context, for every sequence of the batch it serves."""
    s = sharding(layout, model, batch)
    return kv_bytes_per_chip(model, dtype_bytes(wl.kv_dtype), _seqs_per_chip(layout, model, batch), 1,
                             s.kv_heads, s.kv_seq) * model.n_layers / layout.pp


def max_context(model: ModelShape, hw: Hardware, wl: Workload, layout: Layout, batch: int,
                kv_budget: float | None = None) -> int:
    """Longest context per sequence whose KV cache fits: in `kv_budget` bytes per chip if
    given (PaLM table 1 reserves 30% of HBM), else in what the weights leave."""
    if kv_budget is None:
        kv_budget = wl.memory_fraction * hw.memory_bytes - weights_per_chip(model, wl, layout)
    return max(0, int(kv_budget // kv_per_token_per_chip(model, wl, layout, batch)))


def estimate(model: ModelShape, hw: Hardware, wl: Workload, layout: Layout, phase: str) -> PhaseEstimate:
    """Cost of running `phase` of workload `wl` with `layout`."""
    if phase == "prefill":
        steps, t, ctx, kv_tokens = 1, wl.input_len, wl.input_len / 2, wl.input_len
    elif phase == "decode":
        steps, t, ctx, kv_tokens = wl.output_len, 1, wl.decode_context, wl.decode_context
    else:
        raise ValueError(f"phase must be prefill or decode, not {phase!r}")
    layer, step = step_cost(model, hw, wl, layout, wl.batch, t, ctx, kv_tokens)
    latency = step.time_s * steps
    if phase == "prefill" and layout.pp > 1:  # fill and drain the pipeline
        latency *= (2 * layout.pp - 1) / layout.pp
    tokens = wl.batch * t * steps
    peak = hw.peak_flops[hw.matmul_dtype(wl.weight_dtype)]
    mfu = tokens * model.matmul_flops_per_token(useful=True) / (layout.chips * peak * latency) if latency else 0.0
    context = wl.input_len + wl.output_len
    memory = weights_per_chip(model, wl, layout) + kv_per_token_per_chip(model, wl, layout, wl.batch) * context
    return PhaseEstimate(
        phase=phase, layout=layout, batch=wl.batch, steps=steps, per_layer=layer, step=step,
        latency_s=latency, tokens=tokens, mfu=mfu, memory_per_chip=memory,
        fits=memory <= wl.memory_fraction * hw.memory_bytes,
        max_context=max_context(model, hw, wl, layout, wl.batch),
        chip_s_per_token=layout.chips * latency / tokens if tokens else 0.0)


def decode_step_cost(model: ModelShape, hw: Hardware, batch: int, weight_dtype: str = "bf16",
                     context: int = 0, kv_dtype: str = "bf16") -> StepCost:
    """One decode step of the whole model on one chip, `context` tokens cached per sequence."""
    wl = Workload(batch=batch, input_len=context, output_len=0, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    return step_cost(model, hw, wl, Layout("1d", 1), batch, 1, context, context)[1]


def predict_decode_step(model: ModelShape, hw: Hardware, batch: int, weight_dtype: str = "bf16",
                        context: int = 0, kv_dtype: str = "bf16") -> float:
    """Seconds per decode step on one chip: the figure to compare with Loom's measured runs."""
    return decode_step_cost(model, hw, batch, weight_dtype, context, kv_dtype).time_s
