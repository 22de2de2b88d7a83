"""Attention over the paged KV pool, for a packed batch of decodes and prefill chunks.

A step's tokens are packed as [decode tokens | prefill chunk 1 | prefill chunk 2 | ...]. Every
token's k/v is first written to its slot; then decode rows attend over their sequences' blocks
(one fused kernel for the whole group) and each prefill chunk attends causally over its cached
prefix plus itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loom.kv.cache import KVCache


@dataclass
class PrefillSegment:
    start: int            # first row of this chunk in the packed batch
    num_tokens: int       # rows of this chunk (queries)
    context_len: int      # tokens it attends over: cached prefix + this chunk
    block_ids: torch.Tensor  # int64 block ids covering context_len tokens
    # Position of each of the context_len stored tokens, when they are not 0 .. context_len - 1
    # (tokens were dropped); the chunk's own tokens are the last num_tokens.
    key_positions: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] int64, a slot for every packed token
    num_decode_tokens: int = 0            # the first rows are single-token decodes
    decode_block_tables: torch.Tensor | None = None   # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None   # [num_decode] int32
    prefills: list[PrefillSegment] = field(default_factory=list)


def paged_decode_attention(q: torch.Tensor, cache: KVCache, layer: int, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each row attends over its first context_lens[b] cached tokens."""
    if backend == "cpp":
        out, _lse = torch.ops.loom.paged_decode_attention(q.contiguous(), cache.keys[layer], cache.values[layer],
                                                          block_tables, context_lens, scale)
        return out
    return _decode_reference(q, cache, layer, block_tables, context_lens, scale)


def _decode_reference(q: torch.Tensor, cache: KVCache, layer: int, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain PyTorch: gather each sequence's blocks and run SDPA. Obviously right, not fast."""
    out = torch.empty_like(q)
    bs = cache.block_size
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k, v = cache.gather(layer, block_tables[b, : (n + bs - 1) // bs].long(), n)
        out[b] = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale,
                                                enable_gqa=k.shape[0] != q.shape[1]).squeeze(1)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                      seg: PrefillSegment, scale: float) -> torch.Tensor:
    """One chunk's causal attention. q [n, H, D]; k, v [n, KVH, D] are the chunk's own keys."""
    n = seg.num_tokens
    qh = q.transpose(0, 1)  # [H, n, D]
    gqa = k.shape[1] != q.shape[1]
    if seg.context_len == n:  # no cached prefix: attend over the fresh k/v directly
        kc, vc = k.transpose(0, 1), v.transpose(0, 1)
    else:
        kc, vc = cache.gather(layer, seg.block_ids, seg.context_len)
    if q.device.type == "cpu":
        return _causal_by_matmul(qh, kc, vc, seg.key_positions, scale).transpose(0, 1)
    if seg.context_len == n and seg.key_positions is None:
        return F.scaled_dot_product_attention(qh, kc, vc, is_causal=True, scale=scale,
                                              enable_gqa=gqa).transpose(0, 1)
    # Every query sees the keys at positions up to its own.
    keys = seg.key_positions
    if keys is None:  # stored token i is at position i; query i sits at context_len - n + i
        keys = torch.arange(seg.context_len, device=q.device)
    mask = keys.unsqueeze(0) <= keys[-n:].unsqueeze(1)
    return F.scaled_dot_product_attention(qh, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa).transpose(0, 1)


# fp32 scores held at once by _causal_by_matmul (2 MiB, about an L2 cache): queries are taken in
# chunks below it, which also skips most of the causally hidden scores.
_SCORE_ELEMENTS = 1 << 19


def _causal_by_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_positions: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """q [H, n, D] (the last n of the context), k/v [KVH, ctx, D] -> [H, n, D], in fp32 batched
    matmuls over chunks of queries. On CPU, torch's SDPA reached 23-44 GFLOP/s here (2 cores, n
    512-1024), this 2-3x that. When the stored tokens are in position order (key_positions None)
    each chunk reads only the keys its last query can see and masks only the square it shares
    with them."""
    heads, n, dim = q.shape
    kv_heads, ctx = k.shape[0], k.shape[1]
    group = heads // kv_heads
    rows = max(1, min(n, _SCORE_ELEMENTS // (heads * ctx)))
    kt = k.float().transpose(1, 2)  # [KVH, D, ctx]
    vf = v.float()
    qg = (q.float() * scale).view(kv_heads, group, n, dim)
    out = torch.empty_like(q)
    if key_positions is None:  # query i of a chunk sees the square's columns up to i
        square_hidden = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        visible = ctx - n + r1 if key_positions is None else ctx
        scores = torch.matmul(qg[:, :, r0:r1], kt[:, None, :, :visible])  # [KVH, g, rows, visible]
        if key_positions is None:
            m = r1 - r0
            scores[..., visible - m:].masked_fill_(square_hidden[:m, :m], float("-inf"))
        else:
            hidden = key_positions.unsqueeze(0) > key_positions[ctx - n + r0:ctx - n + r1].unsqueeze(1)
            scores.masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[:, r0:r1] = torch.matmul(probs, vf[:, None, :visible]).view(heads, r1 - r0, dim).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                    meta: AttentionMetadata, scale: float, backend: str) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the packed step -> attention output [T, H, D]."""
    cache.write(layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], cache, layer, meta.decode_block_tables,
                                          meta.decode_context_lens, scale, backend)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_tokens)
        out[rows] = prefill_attention(q[rows], k[rows], v[rows], cache, layer, seg, scale)
    return out
