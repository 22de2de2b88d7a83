"""Cost of paging: one decode step's attention read from the block pool (scattered blocks)
against `scaled_dot_product_attention` on a contiguous cache of the same shapes."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from loom.kernels import load_kernels
from loom.kv.attention import paged_decode_attention
from loom.kv.cache import KVCache


def _time(fn, repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def run(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
        rounds: int = 7, repeats: int = 10) -> dict:
    load_kernels()
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    cache = KVCache(1, batch * blocks_per_seq, kv_heads, head_dim, block_size, dtype, "cpu")
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=g))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=g))
    # blocks scattered over the pool, as after many requests came and went
    tables = torch.randperm(batch * blocks_per_seq, generator=g).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, context, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, context, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5

    def paged():
        paged_decode_attention(q, cache, 0, tables, lens, scale, "cpp")

    def contiguous():
        F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=kv_heads != heads)

    paged_t, contig_t = [], []
    for _ in range(rounds):  # interleaved so that machine noise hits both alike
        paged_t.append(statistics.median(_time(paged, repeats)))
        contig_t.append(statistics.median(_time(contiguous, repeats)))
    p, c = statistics.median(paged_t), statistics.median(contig_t)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
    return {"dtype": str(dtype).removeprefix("torch."), "paged_ms": p * 1e3, "contiguous_sdpa_ms": c * 1e3,
            "ratio_paged_over_contiguous": p / c, "paged_GBps": kv_bytes / p / 1e9, "contiguous_GBps": kv_bytes / c / 1e9}
