"""Partitioning layouts: how each one shards weights and KV cache, and the collectives it
issues per layer (PaLM section 3 and appendix A; Helix).

A layer is one or two "blocks": an in-projection to a hidden width and an out-projection
back to d_model. A parallel attention/FFN block fuses both into one block whose hidden width
is d_ff plus the attention width; a serial block has an attention block and an FFN block,
hence twice the activation collectives (PaLM section 3.4).
"""
from __future__ import annotations

from dataclasses import dataclass

from .collectives import Collective, torus_axes
from .presets import ModelShape

WS_KINDS = ("1d", "2d")
WG_KINDS = ("wg-x", "wg-xy", "wg-xyz")
KINDS = WS_KINDS + WG_KINDS + ("helix", "pipeline")


@dataclass(frozen=True)
class Layout:
    kind: str
    chips: int
    attention: str = "heads"  # "heads", "batch" (multi-query by batch), "kvp" (Helix)
    x: int = 1                # torus axes of the 2D / weight-gathered layouts: E_x F_yz
    y: int = 1
    z: int = 1
    tpa: int = 1              # Helix: attention tensor parallelism (<= KV heads)
    kvp: int = 1              # Helix: KV (sequence) parallelism
    pp: int = 1               # pipeline stages; tensor parallel 1D inside a stage
    hop_b: bool = False       # Helix: overlap the all-to-all with the next request's attention

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown layout {self.kind!r}")
        if self.kind in ("2d",) + WG_KINDS and self.x * self.y * self.z != self.chips:
            raise ValueError(f"{self.kind}: axes {self.x}x{self.y}x{self.z} != {self.chips} chips")
        if self.kind == "helix" and self.tpa * self.kvp != self.chips:
            raise ValueError("helix: tpa x kvp must equal the chip count")
        if self.chips % self.pp:
            raise ValueError("pipeline stages must divide the chip count")

    @property
    def tp(self) -> int:
        """Chips sharing one layer."""
        return self.chips // self.pp

    @property
    def gather(self) -> int:
        """Chips each weight shard is all-gathered over (N of PaLM A.2.2); 1 if stationary."""
        return {"wg-x": self.x, "wg-xy": self.x * self.y, "wg-xyz": self.chips}.get(self.kind, 1)

    @property
    def name(self) -> str:
        if self.kind == "1d":
            return f"1D-WS tp{self.chips} attn:{self.attention}"
        if self.kind == "2d":
            return f"2D-WS {self.x}x{self.y * self.z} attn:{self.attention}"
        if self.kind in WG_KINDS:
            return f"{self.kind.upper()} {self.x}x{self.y}x{self.z} attn:{self.attention}"
        if self.kind == "helix":
            return f"Helix kvp{self.kvp}xtpa{self.tpa} ffn-tp{self.chips}" + (" hop-b" if self.hop_b else "")
        return f"PP{self.pp}xTP{self.tp}"


@dataclass(frozen=True)
class Sharding:
    """Ways each tensor is split across the chips of one layer (stored per chip = total / ways)."""
    qkv: int
    o: int
    ffn: int
    kv_heads: int     # ways the KV heads are split; heads beyond the model's are replicated
    kv_seq: int       # ways one sequence's cache is split along the sequence
    batch: int        # ways the batch is split for attention
    attn_compute: int  # ways the attention score/value FLOPs are split


def sharding(layout: Layout, model: ModelShape, batch: int) -> Sharding:
    n = layout.tp
    if layout.kind == "helix":
        return Sharding(qkv=layout.tpa, o=n, ffn=n, kv_heads=layout.tpa, kv_seq=layout.kvp,
                        batch=1, attn_compute=n)
    if layout.attention == "batch":
        return Sharding(qkv=n, o=n, ffn=n, kv_heads=1, kv_seq=1, batch=n, attn_compute=min(n, batch))
    return Sharding(qkv=n, o=n, ffn=n, kv_heads=min(n, model.kv_heads), kv_seq=1, batch=1,
                    attn_compute=min(n, model.n_heads))


def block_collectives(layout: Layout, tokens: float, d_model: int, width: float,
                      weight_bytes: float, act_bytes: float) -> list[Collective]:
    """Collectives of one in/out projection pair over `tokens` tokens (per layer, per step).

    width: hidden width between the projections (d_ff, the attention width, or both fused).
    weight_bytes: bytes of the pair's weights (all chips), gathered by weight-gathered layouts.
    """
    n, bte = layout.tp, tokens * d_model * act_bytes
    if layout.kind in ("1d", "pipeline", "helix"):
        # Megatron: gather the input, reduce-scatter the output, over all chips (PaLM 3.2.1).
        return [Collective("all-gather", bte, n), Collective("reduce-scatter", bte, n)]
    if layout.kind == "2d":
        # E_x F_yz: the d_model pair runs over yz with BLE/X, the d_ff pair over x with BLF/YZ.
        yz, btf = layout.y * layout.z, tokens * width * act_bytes
        return [Collective("all-gather", bte / layout.x, yz), Collective("reduce-scatter", btf / yz, layout.x),
                Collective("all-gather", btf / yz, layout.x), Collective("reduce-scatter", bte / layout.x, yz)]
    # Weight-gathered: weights are all-gathered over N chips, activations move over the rest.
    g = layout.gather
    return [Collective("all-gather", weight_bytes * g / n, g, prefetch=True),
            Collective("all-gather", bte / g, n // g), Collective("reduce-scatter", bte / g, n // g)]


def layer_collectives(layout: Layout, model: ModelShape, batch: int, tokens_per_seq: int,
                      weight_bytes: float, act_bytes: float) -> list[Collective]:
    """All collectives of one layer except Helix's attention all-to-all (see helix_all_to_all)."""
    tokens = batch * tokens_per_seq
    attn_w = (model.qkv_params + model.o_params) / model.layer_params * weight_bytes
    if model.parallel_block:
        blocks = [(model.ffn_width + model.attn_out_dim, weight_bytes)]
    else:
        blocks = [(model.attn_out_dim, attn_w), (model.ffn_width, weight_bytes - attn_w)]
    out = [c for width, w in blocks
           for c in block_collectives(layout, tokens, model.d_model, width, w, act_bytes)]
    if layout.attention == "batch":
        # Re-shard queries from heads to batch and the outputs back (PaLM figure 5b).
        q = tokens * (model.n_heads * model.d_head + model.kv_elems_per_token) * act_bytes / layout.tp
        out += [Collective("all-to-all", q, layout.tp), Collective("all-to-all", q, layout.tp)]
    return out


def helix_all_to_all(layout: Layout, model: ModelShape, requests: float, act_bytes: float) -> Collective:
    """Helix: exchange partial attention outputs plus their log-sum-exp (fp32) across KVP ranks."""
    heads = model.n_heads / layout.tpa
    nbytes = requests * heads * ((model.v_head_dim or model.d_head) * act_bytes + 4)
    return Collective("all-to-all", nbytes, layout.kvp)


def hop_b_time(items: int, compute: float, comm: float, overlap: bool) -> float:
    """Helix HOP-B: item i's communication overlaps item i+1's compute.

    Without overlap every item pays compute then communication; with it the schedule is a
    two-stage pipeline whose slower stage sets the pace.
    """
    if not overlap or items <= 1:
        return items * (compute + comm)
    return compute + comm + (items - 1) * max(compute, comm)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelShape, chips: int, phase: str) -> list[Layout]:
    """Every layout worth evaluating on `chips` chips for `phase` ("prefill" or "decode")."""
    out = [Layout("1d", chips)]
    out += [Layout("2d", chips, x=x, y=chips // x) for x in _divisors(chips) if 1 < x < chips]
    out += [Layout("pipeline", chips, pp=p) for p in _divisors(chips) if 1 < p <= model.n_layers]
    if phase == "prefill":
        # Weight-gathered layouts pay off only with many tokens per batch (PaLM 3.2.3); they
        # gather over one, two or all three axes of the slice.
        x, y, z = torus_axes(chips)
        seen: set[int] = set()
        for kind in WG_KINDS:
            layout = Layout(kind, chips, x=x, y=y, z=z)
            if layout.gather > 1 and layout.gather not in seen:
                seen.add(layout.gather)
                out.append(layout)
        return out
    # Decode: also multi-query attention sharded by batch, and Helix.
    out += [Layout(l.kind, l.chips, attention="batch", x=l.x, y=l.y, z=l.z)
            for l in out if l.kind in WS_KINDS and l.chips > 1]
    for tpa in _divisors(chips):
        if tpa <= model.kv_heads and chips // tpa > 1:
            out += [Layout("helix", chips, attention="kvp", tpa=tpa, kvp=chips // tpa, hop_b=h)
                    for h in (False, True)]
    return out


__all__ = ["Layout", "Sharding", "sharding", "block_collectives", "layer_collectives",
           "helix_all_to_all", "hop_b_time", "candidate_layouts"]
