"""Cost of paging: attention read from the block pool (scattered blocks) against
`scaled_dot_product_attention` on a contiguous cache of the same shapes: a decode step of a
batch over every layer of a model (timed per layer; one layer's cache would mostly sit in the
CPU's last-level cache, which a real step's do not), and one layer's prompt chunk on top of a
cached prefix."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from loom.kernels import load_kernels
from loom.kv.attention import PrefillSegment, paged_decode_attention, prefill_attention
from loom.kv.cache import KVCache


def _time(fn, repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _interleaved(first, second, rounds: int, repeats: int) -> tuple[float, float]:
    """Medians over rounds (each the median of `repeats` calls), the two alternating so that
    machine noise hits both alike."""
    a, b = [], []
    for _ in range(rounds):
        a.append(statistics.median(_time(first, repeats)))
        b.append(statistics.median(_time(second, repeats)))
    return statistics.median(a), statistics.median(b)


def _pool(batch: int, context: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
          g: torch.Generator, layers: int = 1) -> tuple[KVCache, torch.Tensor]:
    """A pool of random k/v for `layers` layers and `batch` block tables covering `context`
    tokens each, their blocks scattered over the pool, as after many requests came and went."""
    blocks_per_seq = -(-context // block_size)
    cache = KVCache(layers, batch * blocks_per_seq, kv_heads, head_dim, block_size, dtype, "cpu")
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache, torch.randperm(batch * blocks_per_seq, generator=g).view(batch, blocks_per_seq).to(torch.int32)


def run(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
        layers: int = 1, rounds: int = 7, repeats: int = 10) -> dict:
    """A decode step over `layers` layers: `batch` queries, each over its own `context` cached
    tokens in every layer; times per layer."""
    load_kernels()
    g = torch.Generator().manual_seed(0)
    cache, tables = _pool(batch, context, kv_heads, head_dim, block_size, dtype, g, layers)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    contiguous_kv = [(torch.randn(batch, kv_heads, context, head_dim, generator=g).to(dtype),
                      torch.randn(batch, kv_heads, context, head_dim, generator=g).to(dtype)) for _ in range(layers)]
    scale = head_dim ** -0.5

    def paged():
        for layer in range(layers):
            paged_decode_attention(q, cache, layer, tables, lens, scale, "cpp")

    def contiguous():
        for k, v in contiguous_kv:
            F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=kv_heads != heads)

    p, c = (t / layers for t in _interleaved(paged, contiguous, rounds, repeats))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
    return {"dtype": str(dtype).removeprefix("torch."), "layers": layers, "paged_ms": p * 1e3,
            "contiguous_sdpa_ms": c * 1e3, "ratio_paged_over_contiguous": p / c, "paged_GBps": kv_bytes / p / 1e9,
            "contiguous_GBps": kv_bytes / c / 1e9}


def run_prefill(tokens: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, rounds: int = 7, repeats: int = 5) -> dict:
    """A prompt chunk: the last `tokens` of `context` attend causally over the blocks, against
    SDPA over a contiguous copy of the same keys with the [tokens, context] causal mask."""
    load_kernels()
    g = torch.Generator().manual_seed(0)
    cache, tables = _pool(1, context, kv_heads, head_dim, block_size, dtype, g)
    seg = PrefillSegment(start=0, num_tokens=tokens, context_len=context, block_ids=tables[0])
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k, v = cache.gather(0, tables[0], context)
    k, v = k.contiguous(), v.contiguous()
    visible = torch.arange(context)[None, :] <= torch.arange(context - tokens, context)[:, None]
    scale = head_dim ** -0.5

    def paged():
        prefill_attention(q, cache, 0, seg, scale, "cpp")

    def contiguous():
        F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible, scale=scale,
                                       enable_gqa=kv_heads != heads)

    p, c = _interleaved(paged, contiguous, rounds, repeats)
    # q.k and p.v over the keys each query sees: 2 x 2 x head_dim flops per (query head, key)
    pairs = tokens * (context - tokens) + tokens * (tokens + 1) // 2
    flops = 4 * heads * head_dim * pairs
    return {"dtype": str(dtype).removeprefix("torch."), "paged_ms": p * 1e3, "contiguous_sdpa_ms": c * 1e3,
            "ratio_paged_over_contiguous": p / c, "paged_GFLOPs": flops / p / 1e9,
            "contiguous_GFLOPs": flops / c / 1e9}
