"""Cost of paging: attention read from the block pool (scattered blocks) against
`scaled_dot_product_attention` on a contiguous cache of the same shapes: a decode step of a
batch over every layer of a model (timed per layer; one layer's cache would mostly sit in the
CPU's last-level cache, which a real step's do not), and one layer's prompt chunk on top of a
cached prefix. The decode step also scored for H2O and Keyformer: the scores' own cost. Both
also over an int8 pool of the same shapes (`kv_cache_dtype="int8"`)."""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from loom.bench import clock
from loom.kernels import load_kernels
from loom.kv.attention import DecodeScores, PrefillSegment, paged_decode_attention, prefill_attention
from loom.kv.cache import KVCache, kv_bytes_per_block
from loom.kv.scores import HeadScores, row_key


def _time(fn, repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        t = clock.now()
        fn()
        times.append(clock.now() - t)
    return times


def _interleaved(*fns, rounds: int, repeats: int) -> list[float]:
    """Each function's median over rounds (each the median of `repeats` calls), the functions
    taking turns so that machine noise hits them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t in zip(fns, times):
            t.append(statistics.median(_time(fn, repeats)))
    return [statistics.median(t) for t in times]


def _pool(batch: int, context: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
          g: torch.Generator, layers: int = 1, kv_cache_dtype: str = "auto") -> tuple[KVCache, torch.Tensor]:
    """A pool of random k/v for `layers` layers and `batch` block tables covering `context`
    tokens each, their blocks scattered over the pool, as after many requests came and went."""
    blocks_per_seq = -(-context // block_size)
    cache = KVCache(layers, batch * blocks_per_seq, kv_heads, head_dim, block_size, dtype, "cpu",
                    kv_cache_dtype=kv_cache_dtype)
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=g) if t.is_floating_point()
                else torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
    for t in (cache.key_scales or []) + (cache.value_scales or []):
        t.copy_(torch.rand(t.shape, generator=g) / 64)
    return cache, torch.randperm(batch * blocks_per_seq, generator=g).view(batch, blocks_per_seq).to(torch.int32)


def _scores(policy: str, batch: int, context: int, layers: int, kv_heads: int) -> DecodeScores:
    """Every row scoring its `context` keys as the policy's decode steps do, into a state of its
    own, and finding each head's drop among its older half."""
    states = [HeadScores(layers, kv_heads, capacity=context) for _ in range(batch)]
    for state in states:
        state.append(0, context)
    keyformer = policy == "keyformer"
    return DecodeScores(temps=torch.full((batch,), 1.5 if keyformer else 1.0),
                        row_keys=torch.tensor([row_key(0, b, context) if keyformer else -1 for b in range(batch)]),
                        rows=torch.tensor([s.address() for s in states]), newest=torch.full((batch,), context // 2),
                        states=states)


def run(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
        layers: int = 1, rounds: int = 7, repeats: int = 10) -> dict:
    """A decode step over `layers` layers: `batch` queries, each over its own `context` cached
    tokens in every layer; times per layer. Also the same step scoring its keys for H2O and
    for Keyformer (what a scored KV policy adds to the attention), and over mixed contexts, row b
    of B seeing the first (b + 1) / B of its tokens (what the split of the rows' work over the
    threads must even out)."""
    load_kernels()
    g = torch.Generator().manual_seed(0)
    cache, tables = _pool(batch, context, kv_heads, head_dim, block_size, dtype, g, layers)
    int8_cache, _ = _pool(batch, context, kv_heads, head_dim, block_size, dtype, g, layers, "int8")
    lens = torch.full((batch,), context, dtype=torch.int32)
    mixed_lens = torch.tensor([max(1, context * (b + 1) // batch) for b in range(batch)], dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    contiguous_kv = [(torch.randn(batch, kv_heads, context, head_dim, generator=g).to(dtype),
                      torch.randn(batch, kv_heads, context, head_dim, generator=g).to(dtype)) for _ in range(layers)]
    scale = head_dim ** -0.5

    def paged(scores: DecodeScores | None = None, pool: KVCache = cache, context_lens: torch.Tensor = lens):
        for layer in range(layers):
            paged_decode_attention(q, pool, layer, tables, context_lens, scale, "cpp", scores)

    def contiguous():
        for k, v in contiguous_kv:
            F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=kv_heads != heads)

    h2o, keyformer = (_scores(policy, batch, context, layers, kv_heads) for policy in ("h2o", "keyformer"))
    p, c, ph, pk, p8, pm = (t / layers for t in _interleaved(
        paged, contiguous, lambda: paged(h2o), lambda: paged(keyformer), lambda: paged(pool=int8_cache),
        lambda: paged(context_lens=mixed_lens), rounds=rounds, repeats=repeats))
    kv_bytes = batch * context * kv_bytes_per_block(1, kv_heads, head_dim, 1, dtype)
    mixed_bytes = int(mixed_lens.sum()) * kv_bytes_per_block(1, kv_heads, head_dim, 1, dtype)
    int8_bytes = batch * context * kv_bytes_per_block(1, kv_heads, head_dim, 1, dtype, "int8")  # rows and scales
    return {"dtype": str(dtype).removeprefix("torch."), "layers": layers, "paged_ms": p * 1e3,
            "contiguous_sdpa_ms": c * 1e3, "ratio_paged_over_contiguous": p / c, "paged_GBps": kv_bytes / p / 1e9,
            "contiguous_GBps": kv_bytes / c / 1e9, "scored_h2o_ms": ph * 1e3, "scored_keyformer_ms": pk * 1e3,
            "scoring_overhead": {"h2o": ph / p - 1, "keyformer": pk / p - 1},
            "paged_int8_ms": p8 * 1e3, "paged_int8_GBps": int8_bytes / p8 / 1e9, "speedup_int8": p / p8,
            "paged_mixed_contexts_ms": pm * 1e3, "paged_mixed_contexts_GBps": mixed_bytes / pm / 1e9}


def run_prefill(tokens: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, rounds: int = 7, repeats: int = 5) -> dict:
    """A prompt chunk: the last `tokens` of `context` attend causally over the blocks, against
    SDPA over a contiguous copy of the same keys with the [tokens, context] causal mask."""
    load_kernels()
    g = torch.Generator().manual_seed(0)
    cache, tables = _pool(1, context, kv_heads, head_dim, block_size, dtype, g)
    int8_cache, _ = _pool(1, context, kv_heads, head_dim, block_size, dtype, g, kv_cache_dtype="int8")
    seg = PrefillSegment(start=0, num_tokens=tokens, context_len=context, block_ids=tables[0])
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k, v = cache.gather(0, tables[0], context)
    k, v = k.contiguous(), v.contiguous()
    visible = torch.arange(context)[None, :] <= torch.arange(context - tokens, context)[:, None]
    scale = head_dim ** -0.5

    def paged(pool: KVCache = cache):
        prefill_attention(q, pool, 0, seg, scale, "cpp")

    def contiguous():
        F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible, scale=scale,
                                       enable_gqa=kv_heads != heads)

    p, c, p8 = _interleaved(paged, contiguous, lambda: paged(int8_cache), rounds=rounds, repeats=repeats)
    # q.k and p.v over the keys each query sees: 2 x 2 x head_dim flops per (query head, key)
    pairs = tokens * (context - tokens) + tokens * (tokens + 1) // 2
    flops = 4 * heads * head_dim * pairs
    return {"dtype": str(dtype).removeprefix("torch."), "paged_ms": p * 1e3, "contiguous_sdpa_ms": c * 1e3,
            "ratio_paged_over_contiguous": p / c, "paged_GFLOPs": flops / p / 1e9,
            "contiguous_GFLOPs": flops / c / 1e9, "paged_int8_ms": p8 * 1e3, "speedup_int8": p / p8}
