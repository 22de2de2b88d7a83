"""Attention over block tables against plain dense attention."""
from __future__ import annotations

import pytest
import torch

from loom.kernels import load_kernels
from loom.kv.attention import AttentionMetadata, PrefillSegment, paged_attention, paged_decode_attention
from loom.kv.cache import KVCache, quantize_kv_reference


@pytest.fixture(autouse=True, scope="module")
def kernels():
    load_kernels()  # the engine does this at start; these tests call the kernels directly


def dense_attention(q, k, v, causal_offset: int | None = None):
    """q [n, H, D], k/v [L, KVH, D] -> [n, H, D]; the textbook formula in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) / q.shape[-1] ** 0.5
    if causal_offset is not None:
        n, L = q.shape[0], k.shape[0]
        allowed = torch.arange(L)[None, :] <= (torch.arange(n)[:, None] + causal_offset)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def fill_cache(cache: KVCache, layer: int, lengths: list[int], kvh: int, d: int, dtype, g):
    """Writes random k/v for sequences of the given lengths into scattered blocks."""
    bs = cache.block_size
    free = torch.randperm(cache.num_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // bs))]
        k = torch.randn(n, kvh, d, generator=g).to(dtype)
        v = torch.randn(n, kvh, d, generator=g).to(dtype)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        cache.write(layer, k, v, slots)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return tables, ks, vs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Blocks of 16 and head sizes of multiples of 16 take the kernel's AVX-512 bf16 loops where the CPU
# has them: with AVX-512 BF16, head sizes of 32, 64 and 128 the pair products throughout, 16 and 48
# the pair products for the scores and widened values for the last 16 dims.
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(4, 4, 16, 16), (8, 2, 32, 8), (4, 1, 64, 32),
                                                                    (6, 3, 24, 16), (8, 2, 64, 16), (4, 4, 128, 16),
                                                                    (4, 2, 32, 16), (4, 4, 48, 16)])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_decode_matches_dense(dtype, heads, kv_heads, head_dim, block_size, backend):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    cache = KVCache(1, 64, kv_heads, head_dim, block_size, dtype, "cpu")
    lengths = [1, 5, block_size, block_size + 1, 3 * block_size + 7, 10 * block_size + 3]  # the last: prefetch
    tables, ks, vs = fill_cache(cache, 0, lengths, kv_heads, head_dim, dtype, g)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out, _ = paged_decode_attention(q, cache, 0, bt, lens, head_dim ** -0.5, backend)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(lengths)):
        ref = dense_attention(q[b : b + 1], ks[b], vs[b])[0]
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)


def test_decode_kernel_returns_log_sum_exp():
    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 16, 2, 16, 16, torch.float32, "cpu")
    tables, ks, _ = fill_cache(cache, 0, [37], 2, 16, torch.float32, g)
    q = torch.randn(1, 4, 16, generator=g)
    _, lse = torch.ops.loom.paged_decode_attention(q, cache.keys[0], cache.values[0],
                                                   torch.tensor([tables[0]], dtype=torch.int32),
                                                   torch.tensor([37], dtype=torch.int32), 0.25)
    k = ks[0].repeat_interleave(2, 1)  # [L, H, D]
    ref = (torch.einsum("hd,lhd->hl", q[0], k) * 0.25).logsumexp(-1)
    torch.testing.assert_close(lse[0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_packed_step_with_cached_prefixes_matches_dense(backend):
    """A mixed step: two decodes, a chunk on top of a cached prefix, and a fresh prompt."""
    g = torch.Generator().manual_seed(1)
    H, KVH, D, BS = 4, 2, 16, 8
    cache = KVCache(1, 64, KVH, D, BS, torch.float32, "cpu")
    # cached history: two decoding sequences (lengths 9, 20) and a prefix of 13 for the chunk
    tables, ks, vs = fill_cache(cache, 0, [9, 20, 13], KVH, D, torch.float32, g)
    new_lens = [1, 1, 6, 11]  # decode, decode, chunk after prefix 13, fresh prompt
    fresh_table = [b for b in range(64) if all(b not in t for t in tables)][:2]
    tables[2] += [b for b in range(64) if all(b not in t for t in tables) and b not in fresh_table][:1]
    tables.append(fresh_table)
    starts = [9, 20, 13, 0]
    T = sum(new_lens)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, KVH, D, generator=g)
    v = torch.randn(T, KVH, D, generator=g)
    slots, row = [], 0
    for table, start, n in zip(tables, starts, new_lens):
        slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=2,
        decode_block_tables=torch.tensor([tables[0] + [0], tables[1]], dtype=torch.int32),
        decode_context_lens=torch.tensor([10, 21], dtype=torch.int32),
        prefills=[PrefillSegment(2, 6, 19, torch.tensor(tables[2], dtype=torch.int32)),
                  PrefillSegment(8, 11, 11, torch.tensor(tables[3], dtype=torch.int32))],
    )
    out, _ = paged_attention(q, k, v, cache, 0, meta, D ** -0.5, backend)
    full_k = [torch.cat([ks[0], k[0:1]]), torch.cat([ks[1], k[1:2]]), torch.cat([ks[2], k[2:8]]), k[8:]]
    full_v = [torch.cat([vs[0], v[0:1]]), torch.cat([vs[1], v[1:2]]), torch.cat([vs[2], v[2:8]]), v[8:]]
    row = 0
    for i, n in enumerate(new_lens):
        ref = dense_attention(q[row : row + n], full_k[i], full_v[i], causal_offset=full_k[i].shape[0] - n)
        torch.testing.assert_close(out[row : row + n], ref, atol=1e-5, rtol=1e-5)
        row += n


def _long_prefill_case(dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, prefix: int, seed: int,
                       kv_cache_dtype: str = "auto"):
    """A chunk of 70 - prefix queries over a pool of 16 blocks whose never-written slots hold NaN
    (an int8 pool: its scales), the first `prefix` tokens already stored in scattered blocks:
    (cache, (q, k, v) of the chunk, its metadata, (the prefix's k, v as lists))."""
    g = torch.Generator().manual_seed(seed)
    n, num_blocks = 70 - prefix, 16
    cache = KVCache(1, num_blocks, kv_heads, head_dim, block_size, dtype, "cpu", kernels=kv_cache_dtype == "int8",
                    kv_cache_dtype=kv_cache_dtype)
    for pool in (cache.key_scales + cache.value_scales if cache.quantized else cache.keys + cache.values):
        pool.fill_(float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, ks, vs = fill_cache(cache, 0, [prefix], kv_heads, head_dim, dtype, g) if prefix else ([[]], [], [])
    table = tables[0] + [b for b in free if b not in tables[0]][: -(-70 // block_size) - len(tables[0])]
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(prefix, 70)])
    meta = AttentionMetadata(slot_mapping=slots,
                             prefills=[PrefillSegment(0, n, 70, torch.tensor(table, dtype=torch.int32))])
    return cache, (q, k, v), meta, (ks, vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (12, 12, 64, 16), (9, 3, 64, 16), (8, 1, 128, 16) and (6, 2, 80, 16) take the prefill kernel's AVX-512 loops where
# the CPU has them (in bf16, its pair products where it has AVX-512 BF16); 80 dims also their 16-wide remainders.
# In bf16 the first three (MHA, GQA, MQA) take its AMX tiles instead where the CPU has AMX.
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(12, 12, 64, 16), (9, 3, 64, 16), (8, 1, 128, 16),
                                                                    (6, 2, 80, 16), (8, 2, 32, 8), (6, 3, 24, 16),
                                                                    (4, 1, 128, 32)])
@pytest.mark.parametrize("prefix", [0, 21])
def test_long_prefill_matches_dense(dtype, heads, kv_heads, head_dim, block_size, prefix):
    """A chunk of 70 - prefix queries: the kernel's query tiles and key blocks end mid-way, and
    each tile reads keys up to its last query, from blocks scattered over the pool. Slots never
    written hold NaN: a kernel that reads past the context (the last block's tail) fails."""
    cache, (q, k, v), meta, (ks, vs) = _long_prefill_case(dtype, heads, kv_heads, head_dim, block_size, prefix,
                                                          seed=heads + prefix)
    out, _ = paged_attention(q, k, v, cache, 0, meta, head_dim ** -0.5, "cpp")
    full_k, full_v = (torch.cat(ks + [k]), torch.cat(vs + [v])) if prefix else (k, v)
    ref = dense_attention(q, full_k, full_v, causal_offset=prefix)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_prefill_kernel_returns_log_sum_exp():
    g = torch.Generator().manual_seed(4)
    cache = KVCache(1, 8, 2, 16, 16, torch.float32, "cpu")
    tables, ks, _ = fill_cache(cache, 0, [37], 2, 16, torch.float32, g)
    q = torch.randn(20, 4, 16, generator=g)  # the last 20 of the 37 stored tokens
    _, lse = torch.ops.loom.paged_prefill_attention(q, cache.keys[0], cache.values[0],
                                                    torch.tensor(tables[0], dtype=torch.int32), 37, None, 0.25)
    k = ks[0].repeat_interleave(2, 1)  # [L, H, D]
    s = torch.einsum("nhd,lhd->nhl", q, k) * 0.25
    hidden = torch.arange(37)[None, :] > torch.arange(17, 37)[:, None]
    ref = s.masked_fill(hidden[:, None, :], float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
# bf16 with 32 dims and blocks of 16: the prefill kernel's AMX tiles where the CPU has them
@pytest.mark.parametrize("dtype, D, BS", [(torch.float32, 16, 8), (torch.bfloat16, 32, 16)])
def test_attention_after_dropping_tokens_reads_exactly_the_kept_ones(backend, dtype, D, BS):
    """Tokens dropped from the middle of a sequence (their slots refilled by the block manager's
    moves): a decode query and a prefill chunk then attend over exactly the kept tokens, each
    chunk query over the kept keys at positions up to its own."""
    from loom.kv.block_manager import BlockManager

    g = torch.Generator().manual_seed(2)
    H, KVH, L = 4, 2, 29
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    cache = KVCache(1, 16, KVH, D, BS, dtype, "cpu")
    bm = BlockManager(16, BS)
    slots = bm.new_slot_map()
    k, v = torch.randn(L + 4, KVH, D, generator=g).to(dtype), torch.randn(L + 4, KVH, D, generator=g).to(dtype)
    assert bm.allocate(slots, L)
    cache.write(0, k[:L], v[:L], torch.tensor(slots.slots(0, L)))
    bm.commit(slots, L, 0, lambda: list(range(L)))
    dropped = [0, 3, 4, 11, 17, 18, 25]
    assert bm.drop(slots, dropped)
    cache.move_slots(bm.take_moves())
    kept = [p for p in range(L) if p not in dropped]
    assert sorted(slots.positions) == kept

    # a decode of the token at position L
    assert bm.allocate(slots, 1)
    q = torch.randn(1, H, D, generator=g).to(dtype)
    stored = slots.num_tokens
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots.slots(stored, stored + 1)), num_decode_tokens=1,
                             decode_block_tables=torch.tensor([slots.block_ids], dtype=torch.int32),
                             decode_context_lens=torch.tensor([stored + 1], dtype=torch.int32))
    out, _ = paged_attention(q, k[L:L + 1], v[L:L + 1], cache, 0, meta, D ** -0.5, backend)
    ref = dense_attention(q, k[kept + [L]], v[kept + [L]])
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    bm.commit(slots, 1, L, lambda: list(range(L + 1)))

    # a chunk of three more tokens on top (positions L + 1 .. L + 3)
    n = 3
    assert bm.allocate(slots, n)
    stored = slots.num_tokens
    q = torch.randn(n, H, D, generator=g).to(dtype)
    seg = PrefillSegment(0, n, stored + n, torch.tensor(slots.blocks_for(stored + n), dtype=torch.int32),
                         key_positions=torch.tensor(slots.positions + [L + 1, L + 2, L + 3]))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots.slots(stored, stored + n)), prefills=[seg])
    out, _ = paged_attention(q, k[L + 1:], v[L + 1:], cache, 0, meta, D ** -0.5, backend)
    history = kept + [L]
    ref = dense_attention(q, k[history + [L + 1, L + 2, L + 3]], v[history + [L + 1, L + 2, L + 3]],
                          causal_offset=len(history))
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_attention_benchmark_runs_in_a_fresh_process():
    """`loom bench attention` builds the kernels it runs (it once called them unbuilt). Each
    function it would time runs once and is given a figure instead: nothing is timed."""
    import subprocess
    import sys

    code = ("from loom.bench import attention; attention._time = lambda fn, repeats: [fn(), 1e-3][1:]; "
            "from loom.bench.attention import run, run_prefill; import torch; "
            "print(sorted(run(2, 32, 4, 2, 16, 16, torch.float32, layers=2, rounds=1, repeats=1))); "
            "print(sorted(run_prefill(8, 32, 4, 2, 16, 16, torch.float32, rounds=1, repeats=1)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    decode, prefill = out.splitlines()
    assert "'contiguous_sdpa_ms'" in decode and "'paged_ms'" in decode and "'scored_keyformer_ms'" in decode
    assert "'paged_GFLOPs'" in prefill and "'contiguous_sdpa_ms'" in prefill
    assert "'paged_int8_ms'" in decode and "'paged_int8_ms'" in prefill and "'paged_mixed_contexts_ms'" in decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kernel_equals_the_pytorch_write(dtype):
    """KVCache.write by Loom's op (eager steps) and by indexing: the same pools, for k and v
    that are views of one fused projection, slots in any order across blocks; a slot outside
    the pool is refused."""
    load_kernels()
    g = torch.Generator().manual_seed(0)
    caches = [KVCache(2, 5, 3, 16, 8, dtype, "cpu", kernels=use_op) for use_op in (True, False)]
    for c in caches:
        for pool in c.keys + c.values:
            pool.zero_()
    fused = torch.randn(11, 2 * 3 * 16, generator=g).to(dtype)
    k, v = (t.view(11, 3, 16) for t in fused.split(3 * 16, dim=1))
    slots = torch.randperm(40, generator=g)[:11]
    for c in caches:
        c.write(1, k, v, slots)
    for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        assert torch.equal(a, b)
    assert torch.equal(caches[0].keys[1][slots[0] // 8, :, :, slots[0] % 8], k[0])
    with pytest.raises(RuntimeError, match="outside the pool"):
        caches[0].write(0, k[:1], v[:1], torch.tensor([40]))


def _as_stored(x: torch.Tensor) -> torch.Tensor:
    """x [T, KVH, D] as an int8 pool holds it: each row rounded to 255 levels of its own scale."""
    q, scales = quantize_kv_reference(x)
    return q.float() * scales


def test_quantize_kv_matches_its_reference():
    """Loom's op and the plain PyTorch one agree bit for bit (the engine's pool writes through
    either, by its attention backend), whether the op's vector loop serves the head size (a
    multiple of 16) or not, and a head of zeros gets scale 0."""
    g = torch.Generator().manual_seed(5)
    for dtype, head_dim in [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 24), (torch.bfloat16, 40)]:
        x = (torch.randn(37, 3, head_dim, generator=g) * torch.rand(37, 3, 1, generator=g) * 8).to(dtype)
        x[5, 1] = 0
        q, scales = torch.ops.loom.quantize_kv(x)
        ref_q, ref_scales = quantize_kv_reference(x)
        assert q.dtype == torch.int8 and scales.shape == (37, 3, 1)
        assert torch.equal(q, ref_q) and torch.equal(scales, ref_scales)
        assert scales[5, 1].item() == 0 and not q[5, 1].any()
        assert (q.abs().amax(-1)[scales.squeeze(-1) > 0] == 127).all()  # every other row spans the levels
        err = (q.float() * scales - x.float()).abs()
        assert (err <= scales / 2 + 1e-6).all()  # within half a level


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(4, 4, 16, 16), (8, 2, 32, 8), (4, 1, 64, 32),
                                                                    (6, 3, 24, 16), (8, 2, 64, 16)])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_int8_decode_matches_dense_over_the_stored_rows(dtype, heads, kv_heads, head_dim, block_size, backend):
    """An int8 pool: decode attends exactly over what it stores (each row times its scale)."""
    g = torch.Generator().manual_seed(heads * 10 + head_dim)
    cache = KVCache(1, 64, kv_heads, head_dim, block_size, dtype, "cpu", kernels=backend == "cpp",
                    kv_cache_dtype="int8")
    for pool in cache.key_scales + cache.value_scales:
        pool.fill_(float("nan"))  # a read past a context shows
    lengths = [1, 5, block_size, block_size + 1, 3 * block_size + 7, 10 * block_size + 3]
    tables, ks, vs = fill_cache(cache, 0, lengths, kv_heads, head_dim, dtype, g)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    out, _ = paged_decode_attention(q, cache, 0, bt, torch.tensor(lengths, dtype=torch.int32), head_dim ** -0.5,
                                    backend)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(lengths)):
        ref = dense_attention(q[b : b + 1], _as_stored(ks[b]), _as_stored(vs[b]))[0]
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(12, 12, 64, 16), (9, 3, 64, 16), (6, 2, 80, 16),
                                                                    (8, 2, 32, 8), (6, 3, 24, 16)])
@pytest.mark.parametrize("prefix", [0, 21])
def test_int8_prefill_matches_dense_over_the_stored_rows(dtype, heads, kv_heads, head_dim, block_size, prefix):
    """The long-prefill case over an int8 pool; unwritten slots' scales hold NaN."""
    cache, (q, k, v), meta, (ks, vs) = _long_prefill_case(dtype, heads, kv_heads, head_dim, block_size, prefix,
                                                          seed=heads + prefix + 1, kv_cache_dtype="int8")
    out, _ = paged_attention(q, k, v, cache, 0, meta, head_dim ** -0.5, "cpp")
    reference, _ = paged_attention(q, k, v, cache, 0, meta, head_dim ** -0.5, "torch")
    full_k, full_v = (torch.cat(ks + [k]), torch.cat(vs + [v])) if prefix else (k, v)
    ref = dense_attention(q, _as_stored(full_k), _as_stored(full_v), causal_offset=prefix)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(reference.float(), ref, atol=tol, rtol=tol)
