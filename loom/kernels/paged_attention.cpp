// Attention that reads K/V straight from the paged pool (no gather copy), for decode rows and
// for prefill chunks.
//
// Decode: one task per (sequence, kv head): the query heads of the group share each K/V row
// read, so every cached byte is read once per step. Tasks cost what their contexts do, and
// threads share them out with stealing (parallel.h). Scores go to a small per-task buffer;
// softmax and the weighted V sum follow. Prefill: the same two passes for a tile of a chunk's
// queries at once, in register tiles (see prefill_kernel), or in bf16 on CPUs with AMX through
// its tiles. Both also return the log-sum-exp of each row (Helix merges partial attention
// outputs with it).
//
// KV-policy scores: a scored decode call also adds, for each row the policy scores, the row's
// attention over each stored token (its query heads summed) to that sequence's accumulated
// scores, in place: either the plain softmax (H2O) or Keyformer's softmax((x + g) / tau) with
// Gumbel noise g drawn from a counter-based hash, so a token's noise depends only on (row key,
// layer, kv head, position). `attention_row_scores` does the same for prompt rows from their
// logits.
//
// An int8 pool (a scale per token and kv head, in pools of their own): decode reads its rows in
// place, scaling each block's scores by its keys' scales and the probabilities by the values'
// before the weighted sum; prefill first converts the sequence's blocks to the queries' dtype,
// once a call, and attends over them as over a pool of that dtype.
//
// Built with -ffast-math (vectorized exp), so the code never relies on infinities or NaNs.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "parallel.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif
// linear.cpp's condition for its AMX kernel, whose build defines the two functions below.
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LOOM_ATTENTION_AMX 1  // bf16 prefill through AMX tiles (Intel Xeon since Sapphire Rapids)
// linear.cpp's: whether the OS lends this process the tiles, and their shape for every kernel.
bool amx_tiles();
void configure_amx_tiles();
#endif

namespace {

// Blocks lie scattered over the pool, so the hardware prefetcher cannot guess the next one: both
// passes ask for the block kAhead places on. Into L2 (locality 1): L1 prefetches of whole blocks
// overrun the core's miss buffers. Measured reading 2 KB chunks in random order on an AMD EPYC
// (2 threads): 15 GB/s with no prefetch, 20 with L1 prefetches, 31 with L2 ones, as fast as a
// sequential read.
constexpr int64_t kAhead = 4;
// An int8 pool's slices are a quarter of an fp32 one's: its passes ask for twice as many blocks
// ahead (one layer's decode at batch 64 over 12 layers' pools: about 1.05x less time than at
// kAhead, with the decode kernel's other prefetches in place; 16 ahead was slower than 8).
template <typename C>
constexpr int64_t kAheadFor = std::is_same_v<C, int8_t> ? 2 * kAhead : kAhead;

// Block j of a sequence (its block table), kv head kvh's slice of `stride` elements.
template <typename T>
inline const T* head_block(const T* cache, const int32_t* table, int64_t j, int64_t kvh, int64_t num_kv_heads,
                           int64_t stride) {
  return cache + (table[j] * num_kv_heads + kvh) * stride;
}

// Prefetches block j's slice into L2.
template <typename T>
inline void prefetch_block(const T* cache, const int32_t* table, int64_t j, int64_t kvh, int64_t num_kv_heads,
                           int64_t stride) {
  const char* c = reinterpret_cast<const char*>(head_block(cache, table, j, kvh, num_kv_heads, stride));
  for (int64_t off = 0; off < stride * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 1);
}

// Prefetches block j + Ahead's slice, if the sequence has that block.
template <int64_t Ahead = kAhead, typename T>
inline void prefetch_ahead(const T* cache, const int32_t* table, int64_t j, int64_t num_blocks, int64_t kvh,
                           int64_t num_kv_heads, int64_t stride) {
  if (j + Ahead < num_blocks) prefetch_block(cache, table, j + Ahead, kvh, num_kv_heads, stride);
}

// An int8 pool's per-token scales (float32, [num_blocks, KVH, BS] for keys and for values): a
// stored token's K or V is its int8 row times its scale (a block's, of one kv head: head_block
// with a stride of BS, one cache line at BS 16). Null for pools of the model's dtype.
struct KVScales {
  const float* keys = nullptr;
  const float* values = nullptr;
};

// The scales of a sequence's first n stored tokens, in order.
inline void sequence_scales(const float* scales, const int32_t* table, int64_t n, int64_t kvh, int64_t num_kv_heads,
                            int64_t bs, float* out) {
  for (int64_t t0 = 0; t0 < n; t0 += bs) {
    const float* row = head_block(scales, table, t0 / bs, kvh, num_kv_heads, bs);
    std::copy(row, row + std::min(bs, n - t0), out + t0);
  }
}

// Element loads widened to fp32. The bf16 case is spelled as a shift so the compiler
// vectorizes it.
template <typename T>
inline float to_float(const T* p, int64_t i) { return static_cast<float>(p[i]); }
inline float to_float(const c10::BFloat16* p, int64_t i) { return bf16_to_float(p[i].x); }

// Scores of one block's tokens against one query row. Keys are stored transposed within a
// block ([D, BS]), so each step is a BS-wide vector FMA with no horizontal reduction; four
// independent accumulators hide the FMA latency.
template <typename T, int BS>
inline void block_scores(const float* q, const T* kblock, int64_t head_dim, float* out) {
  float acc[4][BS] = {};
  int64_t i = 0;
  for (; i + 4 <= head_dim; i += 4) {
    for (int u = 0; u < 4; ++u) {
      const float qi = q[i + u];
      const T* kcol = kblock + (i + u) * BS;
#pragma omp simd
      for (int t = 0; t < BS; ++t) acc[u][t] += qi * to_float(kcol, t);
    }
  }
  for (; i < head_dim; ++i) {
#pragma omp simd
    for (int t = 0; t < BS; ++t) acc[0][t] += q[i] * to_float(kblock + i * BS, t);
  }
#pragma omp simd
  for (int t = 0; t < BS; ++t) out[t] = (acc[0][t] + acc[1][t]) + (acc[2][t] + acc[3][t]);
}

// out[0:DC] = sum_t p[t] * V[t, d0:d0+DC] over a sequence's blocks. DC is a compile-time width
// so the accumulator stays in registers across all tokens.
template <typename T, int BS, int DC>
inline void weighted_rows(const float* p, const T* v_cache, const int32_t* table, int64_t ctx, int64_t kvh,
                          int64_t num_kv_heads, int64_t head_dim, int64_t d0, float* out) {
  float acc[DC] = {};
  const int64_t head_block_stride = BS * head_dim, num_blocks = (ctx + BS - 1) / BS;
  for (int64_t t0 = 0; t0 < ctx; t0 += BS) {
    const T* vblock = head_block(v_cache, table, t0 / BS, kvh, num_kv_heads, head_block_stride) + d0;
    if (d0 == 0)
      prefetch_ahead<kAheadFor<T>>(v_cache, table, t0 / BS, num_blocks, kvh, num_kv_heads, head_block_stride);
    const int64_t n = std::min<int64_t>(BS, ctx - t0);
    for (int64_t t = 0; t < n; ++t) {
      const float pt = p[t0 + t];
      const T* row = vblock + t * head_dim;
#pragma omp simd
      for (int i = 0; i < DC; ++i) acc[i] += pt * to_float(row, i);
    }
  }
  for (int i = 0; i < DC; ++i) out[i] = acc[i];
}


#ifdef __AVX512F__
// The same two passes for bf16 blocks of 16 tokens and head sizes that are multiples of 16, in
// 16-lane registers: a key block's row of 16 tokens is one register, so scores need no
// horizontal sums; V rows accumulate in registers two tokens at a time (two independent FMA
// chains per register). fp32 stays on the portable loops, which were as fast.
inline __m512 load16(const c10::BFloat16* p) { return load_bf16x16(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {  // rounded to nearest even, as c10::BFloat16 rounds
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  const __m512i rounded = _mm512_srli_epi32(bf16_rounded_lanes(x), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}

template <typename T>
inline void block_scores16(const float* q, const T* kblock, int64_t head_dim, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < head_dim; i += 4) {
    a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[i]), load16(kblock + i * 16), a0);
    a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[i + 1]), load16(kblock + (i + 1) * 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_set1_ps(q[i + 2]), load16(kblock + (i + 2) * 16), a2);
    a3 = _mm512_fmadd_ps(_mm512_set1_ps(q[i + 3]), load16(kblock + (i + 3) * 16), a3);
  }
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// out[0:16C] = sum_t p[t] * V[t, d0:d0+16C].
template <typename T, int C>
inline void weighted_rows16(const float* p, const T* v_cache, const int32_t* table, int64_t ctx, int64_t kvh,
                            int64_t num_kv_heads, int64_t head_dim, int64_t d0, float* out) {
  __m512 even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  const int64_t head_block_stride = 16 * head_dim, num_blocks = (ctx + 15) / 16;
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    const T* vblock = head_block(v_cache, table, t0 / 16, kvh, num_kv_heads, head_block_stride) + d0;
    if (d0 == 0)
      prefetch_ahead<kAheadFor<T>>(v_cache, table, t0 / 16, num_blocks, kvh, num_kv_heads, head_block_stride);
    const int64_t n = std::min<int64_t>(16, ctx - t0);
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
      const __m512 p0 = _mm512_set1_ps(p[t0 + t]), p1 = _mm512_set1_ps(p[t0 + t + 1]);
      const T* row = vblock + t * head_dim;
      for (int c = 0; c < C; ++c) {
        even[c] = _mm512_fmadd_ps(p0, load16(row + 16 * c), even[c]);
        odd[c] = _mm512_fmadd_ps(p1, load16(row + head_dim + 16 * c), odd[c]);
      }
    }
    if (t < n) {
      const __m512 p0 = _mm512_set1_ps(p[t0 + t]);
      for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(p0, load16(vblock + t * head_dim + 16 * c), even[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(even[c], odd[c]));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Where the CPU has AVX-512 BF16, bf16 attention multiplies by pair products (vdpbf16ps: each fp32
// lane adds the products of two bf16 pairs), no operand widened to fp32: the query and the
// probabilities are rounded to bf16 for them, as flash attention's kernels round theirs.

// Lanes (a0, b0, a1, b1, ...) from the two 16-wide rows a, b of one register.
inline __m512i pair_order() {
  alignas(64) int16_t idx[32];
  for (int t = 0; t < 16; ++t) idx[2 * t] = t, idx[2 * t + 1] = 16 + t;
  return _mm512_load_si512(idx);
}

// Orders for _mm512_permutex2var_epi16(x, order, y) that interleave two rows of 32 words, x and y:
// `low` gives (x0, y0, ..., x15, y15), `high` (x16, y16, ..., x31, y31).
inline std::pair<__m512i, __m512i> interleave_orders() {
  alignas(64) int16_t low[32], high[32];
  for (int i = 0; i < 16; ++i) {
    low[2 * i] = i, low[2 * i + 1] = 32 + i;
    high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;
  }
  return {_mm512_load_si512(low), _mm512_load_si512(high)};
}

// out[0:n] = bf16(p[0:n]), and out[n] = 0 when n is odd, so that the last pair holds no garbage.
inline void to_bf16_pairs(const float* p, int64_t n, uint16_t* out) {
  int64_t t = 0;
  for (; t + 32 <= n; t += 32)
    _mm512_storeu_si512(out + t, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + t + 16), _mm512_loadu_ps(p + t)));
  if (t < n) {
    const int64_t left = n - t;
    const __mmask16 lo = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 hi = left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
    const __m512i both =
        (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + t + 16), _mm512_maskz_loadu_ps(lo, p + t));
    const __mmask32 written = (static_cast<__mmask32>(hi) << 16 | lo) | (left % 2 ? __mmask32(1) << left : 0);
    _mm512_mask_storeu_epi16(out + t, written, both);
  }
}

// Decode's scores s[0:16] = q . K[t] for one query over a key block of 16 (keys stored [D, 16]);
// qpairs holds the query as bf16 pairs [D / 2]. Rows d and d + 1 of the block are one 64-byte
// load, put in pairs by one permute; two accumulators hide the product's latency.
inline void block_scores_dot(const uint32_t* qpairs, int64_t head_dim, const c10::BFloat16* kblock, float* s,
                             __m512i order) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t i = 0; i < head_dim / 2; i += 2, kblock += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(kblock)),
                          (__m512bh)_mm512_set1_epi32(static_cast<int>(qpairs[i])));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(kblock + 32)),
                          (__m512bh)_mm512_set1_epi32(static_cast<int>(qpairs[i + 1])));
  }
  _mm512_storeu_ps(s, _mm512_add_ps(a0, a1));
}

// Decode's out[0:32C] = sum_t p[t] V[t, d0:d0 + 32C] over a sequence's blocks of 16, two tokens a
// product: p in bf16 as to_bf16_pairs leaves it (a zero after an odd last token), the two
// tokens' rows interleaved in registers by `low` and `high` (interleave_orders).
template <int C>
inline void weighted_rows_dot(const uint16_t* p, const c10::BFloat16* v_cache, const int32_t* table, int64_t ctx,
                              int64_t kvh, int64_t num_kv_heads, int64_t head_dim, int64_t d0, __m512i low,
                              __m512i high, float* out) {
  __m512 a[2 * C];
  for (int c = 0; c < 2 * C; ++c) a[c] = _mm512_setzero_ps();
  const int64_t stride = 16 * head_dim, num_blocks = (ctx + 15) / 16;
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    const c10::BFloat16* vblock = head_block(v_cache, table, t0 / 16, kvh, num_kv_heads, stride) + d0;
    if (d0 == 0) prefetch_ahead(v_cache, table, t0 / 16, num_blocks, kvh, num_kv_heads, stride);
    const int64_t n = std::min<int64_t>(16, ctx - t0);
    for (int64_t t = 0; t < n; t += 2) {
      int32_t pair;
      std::memcpy(&pair, p + t0 + t, 4);
      const __m512bh pt = (__m512bh)_mm512_set1_epi32(pair);
      const c10::BFloat16* first = vblock + t * head_dim;
      const c10::BFloat16* second = t + 1 < n ? first + head_dim : first;  // past the last: weighted 0
      for (int c = 0; c < C; ++c) {
        const __m512i x = _mm512_loadu_si512(first + 32 * c), y = _mm512_loadu_si512(second + 32 * c);
        a[2 * c] = _mm512_dpbf16_ps(a[2 * c], (__m512bh)_mm512_permutex2var_epi16(x, low, y), pt);
        a[2 * c + 1] = _mm512_dpbf16_ps(a[2 * c + 1], (__m512bh)_mm512_permutex2var_epi16(x, high, y), pt);
      }
    }
  }
  for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(out + 16 * c, a[c]);
}
#endif

// Largest of s[0:n], n >= 1 (GCC leaves a plain max loop scalar and branchy, even with
// -ffast-math).
inline float row_max(const float* s, int64_t n) {
  float top = s[0];
  int64_t t = 0;
#ifdef __AVX512F__
  __m512 lanes = _mm512_set1_ps(top);
  for (; t + 16 <= n; t += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(s + t));
  top = _mm512_reduce_max_ps(lanes);
#endif
  for (; t < n; ++t) top = std::max(top, s[t]);
  return top;
}

#ifdef __AVX512F__
// e^x in 16 lanes, for the softmaxes' x <= 0: 2^n e^r with n = round(x / ln 2) and r = x - n ln 2
// (ln 2 in two parts), e^r by Cephes' degree-6 polynomial (within 1.3 ulp on [-87, 0]), 2^n by
// scalef, which takes what underflows to 0. The vector library's expf, called per 16 lanes, and
// its loop were a fifth of a bf16 prefill's attention; inlined, that kernel runs about 1.1x faster.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}
#endif

// s[t] = exp((s[t] - m) * scale) over s[0:n], in place; returns their sum.
inline float exp_in_place(float* s, int64_t n, float m, float scale = 1.f) {
#ifdef __AVX512F__
  const __m512 top = _mm512_set1_ps(m), by = _mm512_set1_ps(scale);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), top), by));
    _mm512_mask_storeu_ps(s + t, live, e);
    sums = _mm512_mask_add_ps(sums, live, sums, e);
  }
  return _mm512_reduce_add_ps(sums);
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp((s[t] - m) * scale);
    sum += s[t];
  }
  return sum;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// out[t] = bf16(exp((s[t] - m) * scale)) over t < n, for s[t] <= m; returns the sum of the fp32
// exponentials. As 2^y, y = (s[t] - m) * scale * log2(e) in one FMA: 2^(y - round(y)) by a
// degree-4 polynomial (relative error under 3e-6, a thousandth of bf16's rounding), times
// 2^round(y) by scalef. Half the instructions of exp16, whose exponentials come out in fp32.
inline float exp_to_bf16(const float* s, int64_t n, float m, float scale, uint16_t* out) {
  const float by = scale * 1.44269504088896341f;
  const __m512 mul = _mm512_set1_ps(by), shift = _mm512_set1_ps(-m * by);
  const __m512 c0 = _mm512_set1_ps(0.9999992847442627f), c1 = _mm512_set1_ps(0.6931217908859253f),
               c2 = _mm512_set1_ps(0.240247443318367f), c3 = _mm512_set1_ps(0.05591786280274391f),
               c4 = _mm512_set1_ps(0.009570101276040077f);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 y = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, s + t), mul, shift);
    const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, k);
    __m512 p = _mm512_fmadd_ps(c4, f, c3);
    p = _mm512_fmadd_ps(p, f, c2);
    p = _mm512_fmadd_ps(p, f, c1);
    p = _mm512_fmadd_ps(p, f, c0);
    const __m512 e = _mm512_maskz_scalef_ps(live, p, k);
    _mm256_mask_storeu_epi16(out + t, live, (__m256i)_mm512_cvtneps_pbh(e));
    sums = _mm512_add_ps(sums, e);
  }
  return _mm512_reduce_add_ps(sums);
}
#endif

// ---- KV-policy scores -------------------------------------------------------------------------
// Gumbel(0, 1) noise by inverse CDF on a grid: g = -log(-log(u)), u = (i + 0.5) / 2^kGumbelBits,
// i the top bits of a hash. Two logs per key token and step would cost more than the attention.
constexpr int kGumbelBits = 12;

struct GumbelTable {
  float value[1 << kGumbelBits];
  GumbelTable() {
    for (int i = 0; i < (1 << kGumbelBits); ++i) value[i] = static_cast<float>(-std::log(-std::log((i + 0.5) / (1 << kGumbelBits))));
  }
};

const float* gumbel_table() {
  static const GumbelTable table;
  return table.value;
}

// A 32-bit integer hash with good avalanche (two multiply-xorshift rounds).
inline uint32_t mix32(uint32_t x) {
  x = ((x >> 16) ^ x) * 0x45d9f3bu;
  x = ((x >> 16) ^ x) * 0x45d9f3bu;
  return (x >> 16) ^ x;
}

// The noise key of one row's kv head in one layer; a token's noise is then hashed from its position.
inline uint32_t head_noise_key(int64_t row_key, int64_t layer, int64_t kvh) {
  return mix32(mix32(static_cast<uint32_t>(row_key) ^ mix32(static_cast<uint32_t>(layer) + 1u)) ^
               (static_cast<uint32_t>(kvh) + 1u) * 0x9e3779b9u);
}

inline float gumbel(const float* table, uint32_t key, int32_t position) {
  return table[mix32(key ^ static_cast<uint32_t>(position) * 0x85ebca6bu) >> (32 - kGumbelBits)];
}

// tmp[t] = (x[t] + g[t]) / temp over t in [0, n), g the noise keyed by `key` and each token's
// position (positions[t], or t when null). In 16 lanes where AVX-512 is: the hash is integer
// arithmetic and the table a gather, the same values as the scalar loop's.
inline void noisy_logits(const float* x, int64_t n, float inv_temp, uint32_t key, const int32_t* positions,
                         float* tmp) {
  const float* table = gumbel_table();
  int64_t t = 0;
#ifdef __AVX512F__
  const __m512i vkey = _mm512_set1_epi32(static_cast<int32_t>(key)), golden = _mm512_set1_epi32(0x85ebca6b);
  const __m512i mult = _mm512_set1_epi32(0x45d9f3b), iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                                  12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(inv_temp);
  for (; t + 16 <= n; t += 16) {
    const __m512i pos = positions ? _mm512_loadu_si512(positions + t)
                                  : _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(t)), iota);
    __m512i h = _mm512_xor_si512(vkey, _mm512_mullo_epi32(pos, golden));
    h = _mm512_mullo_epi32(_mm512_xor_si512(_mm512_srli_epi32(h, 16), h), mult);
    h = _mm512_mullo_epi32(_mm512_xor_si512(_mm512_srli_epi32(h, 16), h), mult);
    h = _mm512_xor_si512(_mm512_srli_epi32(h, 16), h);
    const __m512 g = _mm512_i32gather_ps(_mm512_srli_epi32(h, 32 - kGumbelBits), table, 4);
    _mm512_storeu_ps(tmp + t, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(x + t), g), scale));
  }
#endif
  for (; t < n; ++t) tmp[t] = (x[t] + gumbel(table, key, positions ? positions[t] : static_cast<int32_t>(t))) * inv_temp;
}

// out[t] += softmax(x / temp)[t] over x[0:n]; with noise, softmax((x + g) / temp), g keyed by `key` and
// each token's position (positions[t], or t when null). `tmp` holds n floats.
inline void add_row_scores(const float* x, int64_t n, float temp, bool noise, uint32_t key, const int32_t* positions,
                           float* tmp, float* out) {
  const float inv_temp = 1.f / temp;
  if (noise) {
    noisy_logits(x, n, inv_temp, key, positions, tmp);
  } else {
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) tmp[t] = x[t] * inv_temp;
  }
  const float inv = 1.f / exp_in_place(tmp, n, row_max(tmp, n));
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) out[t] += tmp[t] * inv;
}

// The index of the lowest of s[0:n] among the entries whose position p[t] is at most `newest`
// (the first of equal ones), or -1 when there is none: a vectorized min, then its first index.
inline int64_t lowest_at_most(const float* s, const int32_t* p, int64_t n, int64_t newest) {
  float low = std::numeric_limits<float>::max();
#pragma omp simd reduction(min : low)
  for (int64_t t = 0; t < n; ++t) low = std::min(low, p[t] <= newest ? s[t] : std::numeric_limits<float>::max());
  for (int64_t t = 0; t < n; ++t)
    if (p[t] <= newest && s[t] == low) return t;
  return -1;
}

// What a scored decode call needs (rows null for a plain one): per row, temps[b] (0: not scored),
// row_keys[b] (-1: no noise), rows[b] = (scores address, positions address, lowest address,
// capacity, layers): the row's sequence's state, float32 scores and int32 positions each laid out
// [layers, KVH, capacity] by stored index, int64 lowest [layers, KVH]; newest[b] (-1: none): once
// the step's scores are in, lowest gets each head's lowest-scored entry at a position at most
// newest[b] (the token a decode step's drop takes); and the layer.
struct DecodeScores {
  const float* temps = nullptr;
  const int64_t* row_keys = nullptr;
  const int64_t* rows = nullptr;
  const int64_t* newest = nullptr;
  int64_t layer = 0;
};

// Block j of a sequence, kv head kvh: its keys, its values and, for an int8 pool, their scales.
// Always inlined: called in the decode kernel's scores loop, a call there made it 1.3x slower.
template <int BS, typename C>
__attribute__((always_inline)) inline void prefetch_kv_block(const C* k_cache, const C* v_cache,
                                                             const KVScales& kv_scales, const int32_t* table,
                                                             int64_t j, int64_t kvh, int64_t num_kv_heads,
                                                             int64_t head_dim) {
  prefetch_block(k_cache, table, j, kvh, num_kv_heads, BS * head_dim);
  prefetch_block(v_cache, table, j, kvh, num_kv_heads, BS * head_dim);
  if constexpr (std::is_same_v<C, int8_t>) {
    prefetch_block(kv_scales.keys, table, j, kvh, num_kv_heads, BS);
    prefetch_block(kv_scales.values, table, j, kvh, num_kv_heads, BS);
  }
}

// `fast`: the AVX-512 loops above serve this block size, head size and element type. T is the
// queries' and outputs' type, C the pool's: T's own, or int8 with `kv_scales`.
template <typename T, typename C, int BS, bool fast>
void decode_kernel_impl(const T* q, const C* k_cache, const C* v_cache, const KVScales& kv_scales,
                        const int32_t* block_tables, const int32_t* context_lens, T* out, float* lse, int64_t batch,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks,
                        float scale, const DecodeScores& scored) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_block_stride = BS * head_dim;  // one kv head's slice of a block
  constexpr bool quantized = std::is_same_v<C, int8_t>;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  // Scores and values by bf16 pair products, in a call that scores no row: a KV policy's scores
  // are defined on fp32 logits, and a scored call's attention stays what it was with them.
  const bool dot = fast && std::is_same_v<C, c10::BFloat16> && !scored.rows;
#endif
  constexpr int64_t ahead = kAheadFor<C>;
  // Tasks differ in cost by their sequences' contexts: shared out with stealing.
  for_each_task(batch * num_kv_heads, [&](auto next) {
    std::vector<float> qf(group * head_dim), acc(head_dim), scores, tmp, value_scales;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    // The pair products' operands: the queries and one row's probabilities in bf16.
    std::vector<uint32_t> qpairs(group * head_dim / 2);
    std::vector<uint16_t> probs;
    const __m512i order = pair_order();
    const auto [low, high] = interleave_orders();
#endif
    for (TaskClaim claimed = next(); claimed.task >= 0; claimed = next()) {
      const int64_t task = claimed.task, b = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t ctx = context_lens[b], num_blocks = (ctx + BS - 1) / BS;
      const int32_t* table = block_tables + b * max_blocks;
      if (ctx == 0) {  // a shard of the sequence's keys that holds none of them: nothing to attend
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          std::fill_n(out + (b * num_heads + h) * head_dim, head_dim, static_cast<T>(0.f));
          lse[b * num_heads + h] = -std::numeric_limits<float>::infinity();
        }
        continue;
      }
      scores.resize(group * num_blocks * BS);
      // A scored row's state in this layer and kv head; H2O's scores (temperature 1, no noise)
      // are the attention's own probabilities, Keyformer's a softmax of their own.
      const bool score_row = scored.rows && scored.temps[b] > 0.f;
      const bool own_softmax = score_row && (scored.row_keys[b] >= 0 || scored.temps[b] != 1.f);
      float* row_scores = nullptr;
      const int32_t* row_positions = nullptr;
      int64_t* row_lowest = nullptr;
      if (score_row) {
        const int64_t* state = scored.rows + 5 * b;
        const int64_t head = scored.layer * num_kv_heads + kvh;
        row_scores = reinterpret_cast<float*>(state[0]) + head * state[3];
        row_positions = reinterpret_cast<const int32_t*>(state[1]) + head * state[3];
        row_lowest = reinterpret_cast<int64_t*>(state[2]) + head;
        if (own_softmax) tmp.resize(ctx);
      }
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + (b * num_heads + kvh * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] = to_float(qrow, i) * scale;
      }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if (dot) {
        auto* qb = reinterpret_cast<c10::BFloat16*>(qpairs.data());
        for (int64_t i = 0; i < group * head_dim; ++i) qb[i] = static_cast<c10::BFloat16>(qf[i]);
        probs.resize(ctx + 1);
      }
#endif
      // Both passes then prefetch `ahead` blocks on; their first blocks are asked for here (8-25%
      // less time per step on short and long contexts alike).
      for (int64_t j = 0; j < std::min(ahead, num_blocks); ++j)
        prefetch_kv_block<BS>(k_cache, v_cache, kv_scales, table, j, kvh, num_kv_heads, head_dim);
      // Scores of whole blocks (the tail past ctx is written but never read).
      for (int64_t j = 0; j < num_blocks; ++j) {
        const C* kblock = head_block(k_cache, table, j, kvh, num_kv_heads, head_block_stride);
        prefetch_ahead<ahead>(k_cache, table, j, num_blocks, kvh, num_kv_heads, head_block_stride);
        if constexpr (quantized) {  // both scales: the values' are read whole before the second pass
          prefetch_ahead<ahead>(kv_scales.keys, table, j, num_blocks, kvh, num_kv_heads, BS);
          prefetch_ahead<ahead>(kv_scales.values, table, j, num_blocks, kvh, num_kv_heads, BS);
        }
        // Past an int8 task's last blocks, the next task's first ones: the memory stays busy through
        // this task's softmax and the next one's start (batch 64: 1.06x less time; pools of the
        // model's dtype timed the same with it and without).
        if (const int64_t following = task + 1, nj = j + ahead - num_blocks;
            quantized && nj >= 0 && following < claimed.end) {
          const int64_t nb = following / num_kv_heads;
          if (nj * BS < context_lens[nb])
            prefetch_kv_block<BS>(k_cache, v_cache, kv_scales, block_tables + nb * max_blocks, nj,
                                  following % num_kv_heads, num_kv_heads, head_dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* out = scores.data() + g * num_blocks * BS + j * BS;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
          if constexpr (fast && std::is_same_v<C, c10::BFloat16>) {
            if (dot) {
              block_scores_dot(qpairs.data() + g * head_dim / 2, head_dim, kblock, out, order);
              continue;
            }
          }
#endif
#ifdef __AVX512F__
          if constexpr (fast) block_scores16(qf.data() + g * head_dim, kblock, head_dim, out);
          else
#endif
            block_scores<C, BS>(qf.data() + g * head_dim, kblock, head_dim, out);
          if constexpr (quantized) {
            const float* ks = head_block(kv_scales.keys, table, j, kvh, num_kv_heads, BS);
#pragma omp simd
            for (int t = 0; t < BS; ++t) out[t] *= ks[t];
          }
        }
      }
      if constexpr (quantized) {  // the values' scales, prefetched with the keys
        value_scales.resize(ctx);
        sequence_scales(kv_scales.values, table, ctx, kvh, num_kv_heads, BS, value_scales.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        float* s = scores.data() + g * num_blocks * BS;
        if (own_softmax)
          add_row_scores(s, ctx, scored.temps[b], scored.row_keys[b] >= 0,
                         head_noise_key(scored.row_keys[b], scored.layer, kvh), row_positions, tmp.data(), row_scores);
        const float m = row_max(s, ctx);
        const float sum = exp_in_place(s, ctx, m);
        if (score_row && !own_softmax) {
          const float inv = 1.f / sum;
#pragma omp simd
          for (int64_t t = 0; t < ctx; ++t) row_scores[t] += s[t] * inv;
        }
        if constexpr (quantized) {  // p . V = (p * value scales) . int8 V
#pragma omp simd
          for (int64_t t = 0; t < ctx; ++t) s[t] *= value_scales[t];
        }
        int64_t d0 = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if constexpr (fast && std::is_same_v<C, c10::BFloat16>) {
          if (dot) {
            to_bf16_pairs(s, ctx, probs.data());
            for (; d0 + 64 <= head_dim; d0 += 64)
              weighted_rows_dot<2>(probs.data(), v_cache, table, ctx, kvh, num_kv_heads, head_dim, d0, low, high,
                                   acc.data() + d0);
            for (; d0 + 32 <= head_dim; d0 += 32)
              weighted_rows_dot<1>(probs.data(), v_cache, table, ctx, kvh, num_kv_heads, head_dim, d0, low, high,
                                   acc.data() + d0);
          }
        }
#endif
#ifdef __AVX512F__
        if constexpr (fast) {
          for (; d0 + 64 <= head_dim; d0 += 64)
            weighted_rows16<C, 4>(s, v_cache, table, ctx, kvh, num_kv_heads, head_dim, d0, acc.data() + d0);
          for (; d0 < head_dim; d0 += 16)
            weighted_rows16<C, 1>(s, v_cache, table, ctx, kvh, num_kv_heads, head_dim, d0, acc.data() + d0);
        }
#endif
        for (; d0 + 64 <= head_dim; d0 += 64)
          weighted_rows<C, BS, 64>(s, v_cache, table, ctx, kvh, num_kv_heads, head_dim, d0, acc.data() + d0);
        for (; d0 + 16 <= head_dim; d0 += 16)
          weighted_rows<C, BS, 16>(s, v_cache, table, ctx, kvh, num_kv_heads, head_dim, d0, acc.data() + d0);
        for (; d0 < head_dim; ++d0)
          weighted_rows<C, BS, 1>(s, v_cache, table, ctx, kvh, num_kv_heads, head_dim, d0, acc.data() + d0);
        const float inv = 1.f / sum;
        T* orow = out + (b * num_heads + h) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) orow[i] = static_cast<T>(acc[i] * inv);
        lse[b * num_heads + h] = m + std::log(sum);
      }
      if (score_row && scored.newest[b] >= 0)
        *row_lowest = lowest_at_most(row_scores, row_positions, ctx, scored.newest[b]);
    }
  });
}

template <typename T, typename C, int BS>
void decode_kernel(const T* q, const C* k_cache, const C* v_cache, const KVScales& kv_scales,
                   const int32_t* block_tables, const int32_t* context_lens, T* out, float* lse, int64_t batch,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks,
                   float scale, const DecodeScores& scored) {
#ifdef __AVX512F__
  // fp32 pools stay on the portable loops, which were as fast.
  if constexpr (BS == 16 && (std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, int8_t>)) {
    if (head_dim % 16 == 0)
      return decode_kernel_impl<T, C, BS, true>(q, k_cache, v_cache, kv_scales, block_tables, context_lens, out,
                                                lse, batch, num_heads, num_kv_heads, head_dim, max_blocks, scale,
                                                scored);
  }
#endif
  decode_kernel_impl<T, C, BS, false>(q, k_cache, v_cache, kv_scales, block_tables, context_lens, out, lse, batch,
                                      num_heads, num_kv_heads, head_dim, max_blocks, scale, scored);
}

// Prefill: a chunk's n queries are the last n of the ctx tokens stored in a sequence's blocks
// (their k/v already written). Query i sees the stored tokens up to its own: the first
// ctx - n + i + 1 of them, or, when `key_positions` is given (tokens were dropped and slots
// refilled out of order), those whose position is at most its own. With `query_positions` too,
// the blocks are one shard of the sequence's keys (KV parallelism), which need not hold the
// chunk's own: query i's position is query_positions[i], and it may see no key at all.
//
// One task per (kv head, tile of kQueryTile queries). The tile's queries times the group's query
// heads make the task's rows, which share every K and V read: a key block's row of BS tokens
// meets kScoreRows queries in registers, a V row kValueRows probabilities. A task holds its rows'
// scores over the keys its last row can see (rows x ctx floats: 1 MB at 8K context for MHA) and
// takes the softmax exactly in two passes, as decode does; nothing of size [n, ctx] exists. Later
// tiles see more keys: tasks go to threads in an order that pairs the cheapest tiles with the
// dearest. Every tile reads its keys and values again, so a tile of 32 queries rather than 16
// halves that traffic (bf16, 512 queries over 2048 keys: 6.2 against 6.6 ms a layer).
constexpr int64_t kQueryTile = 32;
constexpr int kScoreRows = 8, kValueRows = 4;  // multiples of each other and dividing kQueryTile
// The AVX-512 loops take the values a chunk of kValueChunk keys (whole blocks of 16) at a time,
// every row of the task over one chunk before the next; where the CPU has AVX-512 BF16, bf16
// values go by pair products, kDotValueRows rows at a time (see tile_values_dot).
constexpr int64_t kValueChunk = 64;
constexpr int kDotValueRows = 4;
static_assert(kQueryTile % kDotValueRows == 0);
// Element types the AVX-512 loops read (fp16 stays on the portable ones).
template <typename T>
constexpr bool kFastType = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// s[m, t] = q[m] . K[t] for kScoreRows rows and a key block's BS tokens (keys stored [D, BS]);
// q is [D, kScoreRows] (one pointer for every row's broadcast).
template <typename T, int BS>
inline void tile_scores(const float* q, int64_t head_dim, const T* kblock, float* s, int64_t lds) {
  float acc[kScoreRows][BS] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    float k[BS];
#pragma omp simd
    for (int t = 0; t < BS; ++t) k[t] = to_float(kblock + d * BS, t);
    for (int m = 0; m < kScoreRows; ++m) {
      const float qm = q[d * kScoreRows + m];
#pragma omp simd
      for (int t = 0; t < BS; ++t) acc[m][t] += qm * k[t];
    }
  }
  for (int m = 0; m < kScoreRows; ++m)
#pragma omp simd
    for (int t = 0; t < BS; ++t) s[m * lds + t] = acc[m][t];
}

// out[m, d0:d0 + DC] = sum over t < visible of p[m, t] * V[t, d0:d0 + DC] for kValueRows rows.
template <typename T, int BS, int DC>
inline void tile_values(const float* p, int64_t ldp, const T* v_cache, const int32_t* table, int64_t visible,
                        int64_t kvh, int64_t num_kv_heads, int64_t head_dim, int64_t d0, float* out) {
  float acc[kValueRows][DC] = {};
  for (int64_t t0 = 0; t0 < visible; t0 += BS) {
    const T* vblock = head_block(v_cache, table, t0 / BS, kvh, num_kv_heads, BS * head_dim) + d0;
    const int64_t tokens = std::min<int64_t>(BS, visible - t0);
    for (int64_t t = 0; t < tokens; ++t) {
      float v[DC];
#pragma omp simd
      for (int i = 0; i < DC; ++i) v[i] = to_float(vblock + t * head_dim, i);
      for (int m = 0; m < kValueRows; ++m) {
        const float pm = p[m * ldp + t0 + t];
#pragma omp simd
        for (int i = 0; i < DC; ++i) acc[m][i] += pm * v[i];
      }
    }
  }
  for (int m = 0; m < kValueRows; ++m)
#pragma omp simd
    for (int i = 0; i < DC; ++i) out[m * head_dim + d0 + i] = acc[m][i];
}

#ifdef __AVX512F__
// The same two loops in 16-lane registers, for blocks of 16 tokens and head sizes that are
// multiples of 16 (GCC vectorizes the portable ones at 256 bits here: half the rate).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// NB key blocks at once (blocks[b] the b-th, its scores at s + 16b): each broadcast query
// element meets NB key registers, so the loop is bound by the FMAs rather than by the broadcasts
// (one core of an AMD EPYC Zen 5, fp32: 235 GFLOP/s at 3 blocks, 190 at 1).
constexpr int kScoreBlocks = 3;

template <typename T, int NB>
inline void tile_scores16(const float* q, int64_t head_dim, const T* const* blocks, float* s, int64_t lds) {
  __m512 acc[kScoreRows][NB];
  for (int m = 0; m < kScoreRows; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 k[NB];
    for (int b = 0; b < NB; ++b) k[b] = load16(blocks[b] + d * 16);
    for (int m = 0; m < kScoreRows; ++m) {
      const __m512 qm = _mm512_set1_ps(q[d * kScoreRows + m]);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(qm, k[b], acc[m][b]);
    }
  }
  for (int m = 0; m < kScoreRows; ++m)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + m * lds + 16 * b, acc[m][b]);
}

// out[m, d0:d0 + 16C] += sum over t in [t0, t1) of p[m, t] * V[t, d0:d0 + 16C] for kValueRows rows.
template <typename T, int C>
inline void tile_values16(const float* p, int64_t ldp, const T* v_cache, const int32_t* table, int64_t t0, int64_t t1,
                          int64_t kvh, int64_t num_kv_heads, int64_t head_dim, int64_t d0, float* out) {
  __m512 acc[kValueRows][C];
  for (int m = 0; m < kValueRows; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = load16(out + m * head_dim + d0 + 16 * c);
  for (int64_t t = t0; t < t1; ++t) {
    const T* vrow = head_block(v_cache, table, t / 16, kvh, num_kv_heads, 16 * head_dim) + t % 16 * head_dim + d0;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vrow + 16 * c);
    for (int m = 0; m < kValueRows; ++m) {
      const __m512 pm = _mm512_set1_ps(p[m * ldp + t]);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_fmadd_ps(pm, v[c], acc[m][c]);
    }
  }
  for (int m = 0; m < kValueRows; ++m)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + m * head_dim + d0 + 16 * c, acc[m][c]);
}

// acc [rows, D] = p [rows, visible] (rows ldp apart) times the first `visible` keys' V, for
// blocks of 16 and head sizes that are multiples of 16, a chunk of kValueChunk keys at a time:
// each chunk's V rows are read from memory once and by every row group from L1 after (the whole
// context's V, read anew by every 4 rows, ran from L2 at two thirds of the FMA rate).
template <typename T>
inline void values16(const float* p, int64_t ldp, int64_t rows, const T* v_cache, const int32_t* table, int64_t visible,
                     int64_t kvh, int64_t num_kv_heads, int64_t head_dim, float* acc) {
  std::fill(acc, acc + rows * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < visible; t0 += kValueChunk) {
    const int64_t t1 = std::min(t0 + kValueChunk, visible);
    for (int64_t m0 = 0; m0 < rows; m0 += kValueRows) {
      int64_t d0 = 0;
      for (; d0 + 64 <= head_dim; d0 += 64)
        tile_values16<T, 4>(p + m0 * ldp, ldp, v_cache, table, t0, t1, kvh, num_kv_heads, head_dim, d0,
                            acc + m0 * head_dim);
      for (; d0 < head_dim; d0 += 16)
        tile_values16<T, 1>(p + m0 * ldp, ldp, v_cache, table, t0, t1, kvh, num_kv_heads, head_dim, d0,
                            acc + m0 * head_dim);
    }
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 blocks of 16 on CPUs with AVX-512 BF16: the scores by bf16 pair products (vdpbf16ps: each
// fp32 lane adds the products of two head dims), the keys never widened to fp32; queries go in
// unscaled and the caller scales the scores. 8 rows times 2 key blocks a call: each broadcast
// query pair meets two key registers (bf16, 512 queries over 2048 keys: 1.05x the attention of
// 16 rows times one block).
//
// The values by the same products, two tokens a lane: the probabilities rounded to bf16 (as
// flash attention's kernels round them before their second product), and each chunk of
// kValueChunk keys' V rows interleaved in pairs of tokens once into a buffer that every row of
// the task then reads from L1. One core of an AMD EPYC Zen 5: 490 GFLOP/s for these products
// against 235 for the fp32 FMA loop, 300 with the interleaving counted at 16 rows a task.
constexpr int kDotScoreRows = 8;
constexpr int kDotScoreBlocks = 2;
static_assert(kQueryTile % kDotScoreRows == 0);

// s[m, t] = q[m] . K[t] for kDotScoreRows rows and NB key blocks of 16 tokens (blocks[b] the b-th,
// keys stored [D, 16], its scores at s + 16b); qpairs holds the rows' queries as bf16 pairs
// [D / 2, kDotScoreRows].
template <int NB>
inline void tile_scores_dot(const uint32_t* qpairs, int64_t head_dim, const c10::BFloat16* const* blocks, float* s,
                            int64_t lds, __m512i order) {
  __m512 acc[kDotScoreRows][NB];
  for (int m = 0; m < kDotScoreRows; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < head_dim * 16; i += 32, qpairs += kDotScoreRows) {  // rows d and d + 1: one 64-byte load
    __m512bh k[NB];
    for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(blocks[b] + i));
    for (int m = 0; m < kDotScoreRows; ++m) {
      const __m512bh qm = (__m512bh)_mm512_set1_epi32(static_cast<int>(qpairs[m]));
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], k[b], qm);
    }
  }
  for (int m = 0; m < kDotScoreRows; ++m)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + m * lds + 16 * b, acc[m][b]);
}

// vp[j, d] = (V[t0 + 2j, d], V[t0 + 2j + 1, d]) for the n <= kValueChunk keys from t0 (a multiple
// of 16), a token past them read as zeros: [ceil(n / 2), head_dim] pairs.
inline void pack_value_pairs(const c10::BFloat16* v_cache, const int32_t* table, int64_t t0, int64_t n, int64_t kvh,
                             int64_t num_kv_heads, int64_t head_dim, uint32_t* vp) {
  const auto [low, high] = interleave_orders();
  const __m512i order = pair_order();
  for (int64_t t = 0; t < n; t += 2, vp += head_dim) {
    const c10::BFloat16* a =
        head_block(v_cache, table, (t0 + t) / 16, kvh, num_kv_heads, 16 * head_dim) + (t0 + t) % 16 * head_dim;
    if (t + 1 == n) {  // the last key alone
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d));
        _mm512_storeu_si512(vp + d, _mm512_permutexvar_epi16(order, _mm512_zextsi256_si512(x)));
      }
      break;
    }
    const c10::BFloat16* b = a + head_dim;
    int64_t d = 0;
    for (; d + 32 <= head_dim; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
      _mm512_storeu_si512(vp + d, _mm512_permutex2var_epi16(x, low, y));
      _mm512_storeu_si512(vp + d + 16, _mm512_permutex2var_epi16(x, high, y));
    }
    if (d < head_dim) {  // 16 dims left
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d));
      _mm512_storeu_si512(vp + d, _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1)));
    }
  }
}

// acc[m, d0:d0 + 16C] += sum over j < pairs of the bf16 pair p[m, 2j:2j + 2] . vp[j, d0:d0 + 16C]
// for kDotValueRows rows (p's rows ldp apart, acc's head_dim).
template <int C>
inline void tile_values_dot(const uint16_t* p, int64_t ldp, const uint32_t* vp, int64_t pairs, int64_t head_dim,
                            int64_t d0, float* acc) {
  __m512 a[kDotValueRows][C];
  for (int m = 0; m < kDotValueRows; ++m)
    for (int c = 0; c < C; ++c) a[m][c] = _mm512_loadu_ps(acc + m * head_dim + d0 + 16 * c);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + j * head_dim + d0 + 16 * c);
    for (int m = 0; m < kDotValueRows; ++m) {
      int32_t pair;
      std::memcpy(&pair, p + m * ldp + 2 * j, 4);
      const __m512bh pm = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) a[m][c] = _mm512_dpbf16_ps(a[m][c], v[c], pm);
    }
  }
  for (int m = 0; m < kDotValueRows; ++m)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + m * head_dim + d0 + 16 * c, a[m][c]);
}

// acc [rows, D] = p [rows, visible] (bf16, rows ldp apart, as to_bf16_pairs leaves them) times the
// first `visible` keys' V, a chunk at a time; vp holds one packed chunk.
inline void values_dot(const uint16_t* p, int64_t ldp, int64_t rows, const c10::BFloat16* v_cache,
                       const int32_t* table, int64_t visible, int64_t kvh, int64_t num_kv_heads, int64_t head_dim,
                       uint32_t* vp, float* acc) {
  std::fill(acc, acc + rows * head_dim, 0.f);
  const int64_t num_blocks = (visible + 15) / 16, chunk_blocks = kValueChunk / 16;
  for (int64_t j = 0; j < std::min(chunk_blocks, num_blocks); ++j)
    prefetch_block(v_cache, table, j, kvh, num_kv_heads, 16 * head_dim);
  for (int64_t t0 = 0; t0 < visible; t0 += kValueChunk) {
    const int64_t n = std::min(kValueChunk, visible - t0), pairs = (n + 1) / 2;
    for (int64_t j = (t0 + kValueChunk) / 16; j < std::min((t0 + 2 * kValueChunk) / 16, num_blocks); ++j)
      prefetch_block(v_cache, table, j, kvh, num_kv_heads, 16 * head_dim);  // the next chunk's
    pack_value_pairs(v_cache, table, t0, n, kvh, num_kv_heads, head_dim, vp);
    for (int64_t m0 = 0; m0 < rows; m0 += kDotValueRows) {
      const uint16_t* pm = p + m0 * ldp + t0;
      float* am = acc + m0 * head_dim;
      int64_t d0 = 0;
      for (; d0 + 64 <= head_dim; d0 += 64) tile_values_dot<4>(pm, ldp, vp, pairs, head_dim, d0, am);
      for (; d0 < head_dim; d0 += 16) tile_values_dot<1>(pm, ldp, vp, pairs, head_dim, d0, am);
    }
  }
}
#endif

#ifdef LOOM_ATTENTION_AMX
// Where the CPU has AMX, bf16 prefill takes both products through tiles (tdpbf16ps: a 16 x 16
// fp32 tile adds a 16 x 32 bf16 tile times a 32 x 16 one, the latter given as 16 rows of bf16
// pairs along the inner dimension). The keys and values become such rows once a call, in a
// buffer each that every query tile then reads (the vector path interleaves each chunk of V anew
// per tile): a block's keys as [D / 2, 16] (head dims d, d + 1 of a token a pair), its values as
// [8, D] (tokens t, t + 1 of a head dim a pair), each kv head's blocks in table order, their count
// rounded up to even, and tokens past the context zeros. Both products run two 16-row tiles of A
// against two B tiles, into four accumulator tiles; the scores come out in fp32 for the same
// softmax as the vector path's, whose bf16 probabilities are the second product's A.

// The context's blocks of every kv head in the tiles' pair layouts, `blocks` (even) a head, each
// 8 * D pairs: key_pairs [KVH, blocks, D / 2, 16], value_pairs [KVH, blocks, 8, D].
void pack_tile_pairs(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* table, int64_t ctx,
                     int64_t num_kv_heads, int64_t head_dim, int64_t blocks, uint32_t* key_pairs,
                     uint32_t* value_pairs) {
  const __m512i order = pair_order();
  at::parallel_for(0, num_kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kvh = i / blocks, j = i % blocks, tokens = std::clamp<int64_t>(ctx - 16 * j, 0, 16);
      uint32_t* kp = key_pairs + i * 8 * head_dim;
      uint32_t* vp = value_pairs + i * 8 * head_dim;
      if (tokens == 0) {  // the block that rounds the count up
        std::fill(kp, kp + 8 * head_dim, 0u);
        std::fill(vp, vp + 8 * head_dim, 0u);
        continue;
      }
      // Token t's pair is words 2t, 2t + 1 of a row: the words of tokens past the context are zeroed.
      const __mmask32 live = tokens == 16 ? ~__mmask32(0) : (__mmask32(1) << 2 * tokens) - 1;
      const c10::BFloat16* k = head_block(k_cache, table, j, kvh, num_kv_heads, 16 * head_dim);
      for (int64_t d = 0; d < head_dim; d += 2)  // rows d and d + 1 of the block: one 64-byte load
        _mm512_storeu_si512(kp + d / 2 * 16,
                            _mm512_maskz_permutexvar_epi16(live, order, _mm512_loadu_si512(k + d * 16)));
      pack_value_pairs(v_cache, table, 16 * j, tokens, kvh, num_kv_heads, head_dim, vp);
      std::fill(vp + (tokens + 1) / 2 * head_dim, vp + 8 * head_dim, 0u);
    }
  });
}

// Tiles 0-3 += tiles 4-5 (two row tiles of A) times tiles 6-7 (two B tiles).
inline void tile_products() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

inline void zero_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// c[0:32, 0:32] (ldc floats a row) = tiles 0-3.
inline void store_tiles(float* c, int64_t ldc) {
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  _tile_stored(2, c + 16 * ldc, ldc * 4);
  _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

// s [rows, 16 * blocks] (lds floats a row) = q [rows, D] (bf16, D a row) times the keys of
// `blocks` (even) blocks in pairs (key_pairs of one kv head), rows a multiple of 32, D of 32.
inline void scores_tiles(const uint16_t* q, int64_t rows, int64_t head_dim, const uint32_t* kp, int64_t blocks,
                         float* s, int64_t lds) {
  for (int64_t m0 = 0; m0 < rows; m0 += 32)
    for (int64_t j = 0; j < blocks; j += 2) {
      const uint32_t* k = kp + j * 8 * head_dim;
      zero_tiles();
      for (int64_t d = 0; d < head_dim; d += 32) {
        _tile_loadd(4, q + m0 * head_dim + d, head_dim * 2);
        _tile_loadd(5, q + (m0 + 16) * head_dim + d, head_dim * 2);
        _tile_loadd(6, k + d * 8, 64);
        _tile_loadd(7, k + 8 * head_dim + d * 8, 64);
        tile_products();
      }
      store_tiles(s + m0 * lds + 16 * j, lds);
    }
}

// acc [rows, D] = p [rows, 16 * blocks] (bf16, ldp a row) times the values of `blocks` (even)
// blocks in pairs (value_pairs of one kv head), rows a multiple of 32, D of 32.
inline void values_tiles(const uint16_t* p, int64_t ldp, int64_t rows, const uint32_t* vp, int64_t blocks,
                         int64_t head_dim, float* acc) {
  for (int64_t m0 = 0; m0 < rows; m0 += 32)
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
      zero_tiles();
      for (int64_t t0 = 0; t0 < 16 * blocks; t0 += 32) {
        _tile_loadd(4, p + m0 * ldp + t0, ldp * 2);
        _tile_loadd(5, p + (m0 + 16) * ldp + t0, ldp * 2);
        _tile_loadd(6, vp + t0 / 2 * head_dim + d0, head_dim * 4);
        _tile_loadd(7, vp + t0 / 2 * head_dim + d0 + 16, head_dim * 4);
        tile_products();
      }
      store_tiles(acc + m0 * head_dim + d0, head_dim);
    }
}
#endif

// Turns row s[0:visible] (scores yet to be multiplied by `scale`) into unnormalized
// probabilities (0 for keys the row cannot see, whose scores may be anything) and returns its
// log-sum-exp. Without key positions the row sees the keys up to `own`, its own key; with them,
// those at or before `position`, its own position. A row that sees no key (a shard of the keys
// may hold none before it) gets zero probabilities, *inv_sum 0 and a log-sum-exp of -inf.
// With `probs`, the probabilities go there in bf16 as to_bf16_pairs leaves them (s is then
// scratch), the sum still taken over their fp32 values.
inline float softmax_row(float* s, int64_t visible, int64_t own, const int64_t* key_positions, int64_t position,
                         float scale, float* inv_sum, uint16_t* probs) {
  float top, sum = 0.f;
  if (key_positions) {
    top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < visible; ++t)
      if (key_positions[t] <= position) top = std::max(top, s[t]);
    if (top == -std::numeric_limits<float>::infinity()) {
      std::fill(s, s + visible, 0.f);
      *inv_sum = 0.f;
      return top;
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < visible; ++t) {
      s[t] = key_positions[t] <= position ? std::exp((s[t] - top) * scale) : 0.f;
      sum += s[t];
    }
  } else {  // the keys up to its own
    top = row_max(s, own + 1);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (probs) {  // one pass: exponentials, their sum, bf16
      sum = exp_to_bf16(s, own + 1, top, scale, probs);
      std::fill(probs + own + 1, probs + visible + visible % 2, uint16_t{0});
      *inv_sum = 1.f / sum;
      return top * scale + std::log(sum);
    }
#endif
    sum = exp_in_place(s, own + 1, top, scale);
    std::fill(s + own + 1, s + visible, 0.f);
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (probs) to_bf16_pairs(s, visible, probs);
#endif
  *inv_sum = 1.f / sum;
  return top * scale + std::log(sum);
}

// Up to `most` of a sequence's key blocks of BS tokens from block j on, kv head kvh's slices,
// into blocks[], each asking for the block kAhead places on; returns how many there were.
template <typename T, int BS>
inline int64_t key_blocks_from(const T* k_cache, const int32_t* table, int64_t j, int64_t most, int64_t num_blocks,
                               int64_t kvh, int64_t num_kv_heads, int64_t head_dim, const T** blocks) {
  const int64_t nb = std::min(most, num_blocks - j);
  for (int64_t b = 0; b < nb; ++b) {
    blocks[b] = head_block(k_cache, table, j + b, kvh, num_kv_heads, BS * head_dim);
    prefetch_ahead(k_cache, table, j + b, num_blocks, kvh, num_kv_heads, BS * head_dim);
  }
  return nb;
}

template <typename T, int BS>
void prefill_kernel(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, const int64_t* key_positions,
                    const int64_t* query_positions, T* out, float* lse, int64_t n, int64_t ctx, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, float scale) {
  const int64_t group = num_heads / num_kv_heads, tiles = (n + kQueryTile - 1) / kQueryTile;
  const int64_t rows = kQueryTile * group;
  const int64_t first = ctx - n;  // stored index of the chunk's first token
#ifdef __AVX512F__
  // The AVX-512 loops serve this block size, head size and element type.
  const bool fast = BS == 16 && kFastType<T> && head_dim % 16 == 0;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const bool dot = fast && std::is_same_v<T, c10::BFloat16>;  // the pair products serve
  const __m512i order = pair_order();
#else
  const bool dot = false;
#endif
#ifdef LOOM_ATTENTION_AMX
  // The AMX tiles serve the pair products' cases with head sizes of multiples of 32, where the OS
  // lends them; the context's keys and values go into their pair layouts first.
  bool amx = false;
  const int64_t pair_blocks = (ctx + 31) / 32 * 2, pairs_per_head = pair_blocks * 8 * head_dim;
  std::unique_ptr<uint32_t[]> paired_keys, paired_values;
  if constexpr (BS == 16 && std::is_same_v<T, c10::BFloat16>) {
    static_assert(kQueryTile % 32 == 0, "a task's rows fill whole pairs of row tiles");
    amx = dot && head_dim % 32 == 0 && amx_tiles();
    if (amx) {
      paired_keys.reset(new uint32_t[num_kv_heads * pairs_per_head]);
      paired_values.reset(new uint32_t[num_kv_heads * pairs_per_head]);
      pack_tile_pairs(k_cache, v_cache, table, ctx, num_kv_heads, head_dim, pair_blocks, paired_keys.get(),
                      paired_values.get());
    }
  }
#else
  const bool amx = false;
#endif
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    // qf holds each kScoreRows rows' queries as [D, kScoreRows], or for the pair products qpairs
    // each kDotScoreRows rows' as bf16 pairs [D / 2, kDotScoreRows]; acc the outputs [rows, D].
    // With them, the probabilities also go to probs as bf16 [rows, lds], and value_pairs holds a
    // packed chunk of V. For the AMX tiles, qrows holds the rows' queries as bf16 [rows, D].
    std::vector<float> qf(dot ? 0 : rows * head_dim), acc(rows * head_dim), inv_sum(rows), scores;
    std::vector<uint32_t> qpairs(dot && !amx ? rows * head_dim / 2 : 0),
        value_pairs(dot && !amx ? kValueChunk / 2 * head_dim : 0);
    std::vector<uint16_t> probs, qrows(amx ? rows * head_dim : 0);
#ifdef LOOM_ATTENTION_AMX
    if (amx) configure_amx_tiles();
#endif
    // A task's kv head and first query (its tile's).
    auto task_of = [&](int64_t task) -> std::pair<int64_t, int64_t> {
      const int64_t k = task % tiles;
      return {task / tiles, (k % 2 == 0 ? k / 2 : tiles - 1 - k / 2) * kQueryTile};
    };
    // Where row m's query and output start in q and out (query r0 + m % kQueryTile of head
    // kvh * group + m / kQueryTile).
    auto row_offset = [&](int64_t kvh, int64_t r0, int64_t m) {
      return ((r0 + m % kQueryTile) * num_heads + kvh * group + m / kQueryTile) * head_dim;
    };
    for (int64_t task = begin; task < end; ++task) {
      const auto [kvh, r0] = task_of(task);
      const int64_t live = std::min(n - r0, kQueryTile);
      // Keys any row of the tile can see, and the length of a row of scores (whole blocks; for
      // the AMX tiles, whole pairs of blocks).
      const int64_t visible = key_positions ? ctx : first + r0 + live;
      const int64_t lds = amx ? (visible + 31) / 32 * 32 : (visible + BS - 1) / BS * BS;
      // Grown, never shrunk: tiles alternate between cheap and dear, and a regrown vector zeroes
      // its new part every time.
      if (scores.size() < static_cast<size_t>(rows * lds)) scores.resize(rows * lds);
      if (dot && probs.size() < static_cast<size_t>(rows * lds)) probs.resize(rows * lds);
      // Rows past the chunk's end have zero queries and probabilities: computed, never stored.
      std::fill(qf.begin(), qf.end(), 0.f);
      std::fill(qpairs.begin(), qpairs.end(), 0u);
      std::fill(qrows.begin(), qrows.end(), uint16_t{0});
      for (int64_t m = 0; m < rows; ++m) {
        if (m % kQueryTile >= live) continue;
        const T* qrow = q + row_offset(kvh, r0, m);
        if (amx) {
          std::memcpy(qrows.data() + m * head_dim, qrow, head_dim * sizeof(T));
          continue;
        }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if (dot) {
          uint32_t* dst = qpairs.data() + (m / kDotScoreRows) * kDotScoreRows * head_dim / 2 + m % kDotScoreRows;
          for (int64_t i = 0; i < head_dim; i += 2) std::memcpy(dst + i / 2 * kDotScoreRows, qrow + i, 4);
          continue;
        }
#endif
        float* dst = qf.data() + (m / kScoreRows) * kScoreRows * head_dim + m % kScoreRows;
        for (int64_t i = 0; i < head_dim; ++i) dst[i * kScoreRows] = to_float(qrow, i) * scale;
      }
      const int64_t key_blocks = lds / BS;
#ifdef LOOM_ATTENTION_AMX
      if (amx) scores_tiles(qrows.data(), rows, head_dim, paired_keys.get() + kvh * pairs_per_head, key_blocks,
                            scores.data(), lds);
#endif
      for (int64_t j = 0; !amx && j < key_blocks;) {
        float* s = scores.data() + j * BS;  // row 0's scores of block j; row m's lds further each
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if constexpr (BS == 16 && std::is_same_v<T, c10::BFloat16>) {
          if (dot) {
            const T* blocks[kDotScoreBlocks];
            const int64_t nb = key_blocks_from<T, BS>(k_cache, table, j, kDotScoreBlocks, key_blocks, kvh, num_kv_heads,
                                                      head_dim, blocks);
            static_assert(kDotScoreBlocks == 2, "one call per block count");
            for (int64_t m0 = 0; m0 < rows; m0 += kDotScoreRows) {
              const uint32_t* qp = qpairs.data() + m0 * head_dim / 2;
              if (nb == 2) tile_scores_dot<2>(qp, head_dim, blocks, s + m0 * lds, lds, order);
              else tile_scores_dot<1>(qp, head_dim, blocks, s + m0 * lds, lds, order);
            }
            j += nb;
            continue;
          }
        }
#endif
#ifdef __AVX512F__
        if constexpr (BS == 16 && kFastType<T>) {
          if (fast) {
            const T* blocks[kScoreBlocks];
            const int64_t nb = key_blocks_from<T, BS>(k_cache, table, j, kScoreBlocks, key_blocks, kvh, num_kv_heads,
                                                      head_dim, blocks);
            static_assert(kScoreBlocks == 3, "one call per block count");
            for (int64_t m0 = 0; m0 < rows; m0 += kScoreRows) {
              const float* qtile = qf.data() + m0 * head_dim;
              if (nb == 3) tile_scores16<T, 3>(qtile, head_dim, blocks, s + m0 * lds, lds);
              else if (nb == 2) tile_scores16<T, 2>(qtile, head_dim, blocks, s + m0 * lds, lds);
              else tile_scores16<T, 1>(qtile, head_dim, blocks, s + m0 * lds, lds);
            }
            j += nb;
            continue;
          }
        }
#endif
        const T* kblock;
        key_blocks_from<T, BS>(k_cache, table, j, 1, key_blocks, kvh, num_kv_heads, head_dim, &kblock);
        for (int64_t m0 = 0; m0 < rows; m0 += kScoreRows)
          tile_scores<T, BS>(qf.data() + m0 * head_dim, head_dim, kblock, s + m0 * lds, lds);
        ++j;
      }
      for (int64_t m = 0; m < rows; ++m) {
        float* s = scores.data() + m * lds;
        if (m % kQueryTile >= live) {
          std::fill(s, s + visible, 0.f);
          if (dot) std::fill(probs.begin() + m * lds, probs.begin() + (m + 1) * lds, uint16_t{0});
          continue;
        }
        const int64_t r = r0 + m % kQueryTile;
        const int64_t position = query_positions ? query_positions[r] : key_positions ? key_positions[first + r] : 0;
        lse[r * num_heads + kvh * group + m / kQueryTile] =
            softmax_row(s, visible, first + r, key_positions, position, dot ? scale : 1.f, &inv_sum[m],
                        dot ? probs.data() + m * lds : nullptr);
        if (amx)  // the tiles read whole pairs of blocks
          std::fill(probs.begin() + m * lds + visible + visible % 2, probs.begin() + (m + 1) * lds, uint16_t{0});
      }
      if (task + 1 < end) {  // the next task's queries, scattered over q, on their way while the values run
        const auto [next_kvh, next_r0] = task_of(task + 1);
        for (int64_t m = 0; m < rows; ++m) {
          if (m % kQueryTile >= n - next_r0) continue;
          const char* row = reinterpret_cast<const char*>(q + row_offset(next_kvh, next_r0, m));
          for (int64_t off = 0; off < head_dim * static_cast<int64_t>(sizeof(T)); off += 64)
            __builtin_prefetch(row + off);
        }
      }
#ifdef LOOM_ATTENTION_AMX
      if (amx)
        values_tiles(probs.data(), lds, rows, paired_values.get() + kvh * pairs_per_head, key_blocks, head_dim,
                     acc.data());
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (dot && !amx)
          values_dot(probs.data(), lds, rows, v_cache, table, visible, kvh, num_kv_heads, head_dim, value_pairs.data(),
                     acc.data());
      }
#endif
#ifdef __AVX512F__
      if constexpr (BS == 16 && kFastType<T>) {
        if (fast && !dot)
          values16(scores.data(), lds, rows, v_cache, table, visible, kvh, num_kv_heads, head_dim, acc.data());
      }
      const bool portable = !fast;
#else
      const bool portable = true;
#endif
      for (int64_t m0 = 0; portable && m0 < rows; m0 += kValueRows) {
        const float* p = scores.data() + m0 * lds;
        float* o = acc.data() + m0 * head_dim;
        int64_t d0 = 0;
        for (; d0 + 16 <= head_dim; d0 += 16)
          tile_values<T, BS, 16>(p, lds, v_cache, table, visible, kvh, num_kv_heads, head_dim, d0, o);
        for (; d0 < head_dim; ++d0)
          tile_values<T, BS, 1>(p, lds, v_cache, table, visible, kvh, num_kv_heads, head_dim, d0, o);
      }
      for (int64_t m = 0; m < rows; ++m) {
        if (m % kQueryTile >= live) continue;
        T* orow = out + row_offset(kvh, r0, m);
        for (int64_t i = 0; i < head_dim; ++i) orow[i] = static_cast<T>(acc[m * head_dim + i] * inv_sum[m]);
      }
    }
#ifdef LOOM_ATTENTION_AMX
    if (amx) _tile_release();
#endif
  });
}

// Blocks table[0 .. num_blocks) of an int8 pool, every kv head, as T in the pool's layouts (block
// j of the table at j), each token's rows times their scales: what a prefill chunk attends over.
// Converted once a call, where the prefill kernel's query tiles would each read every block again.
template <typename T, int BS>
void dequantize_blocks(const int8_t* k_cache, const int8_t* v_cache, const KVScales& scales, const int32_t* table,
                       int64_t num_blocks, int64_t num_kv_heads, int64_t head_dim, T* k_out, T* v_out) {
  const int64_t stride = BS * head_dim;
  at::parallel_for(0, num_blocks * num_kv_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j = i / num_kv_heads, kvh = i % num_kv_heads;
      const int8_t* k = head_block(k_cache, table, j, kvh, num_kv_heads, stride);
      const int8_t* v = head_block(v_cache, table, j, kvh, num_kv_heads, stride);
      const float* ks = head_block(scales.keys, table, j, kvh, num_kv_heads, BS);
      const float* vs = head_block(scales.values, table, j, kvh, num_kv_heads, BS);
      T* ko = k_out + i * stride;
      T* vo = v_out + i * stride;
#ifdef __AVX512F__
      if constexpr (BS == 16 && kFastType<T>) {  // GCC leaves the bf16 rounding below scalar
        if (head_dim % 16 == 0) {
          const __m512 kscale = _mm512_loadu_ps(ks);
          for (int64_t d = 0; d < head_dim; ++d) store16(ko + d * 16, _mm512_mul_ps(load16(k + d * 16), kscale));
          for (int t = 0; t < 16; ++t)
            for (int64_t d = 0; d < head_dim; d += 16)
              store16(vo + t * head_dim + d, _mm512_mul_ps(load16(v + t * head_dim + d), _mm512_set1_ps(vs[t])));
          continue;
        }
      }
#endif
      for (int64_t d = 0; d < head_dim; ++d)
#pragma omp simd
        for (int t = 0; t < BS; ++t) ko[d * BS + t] = static_cast<T>(k[d * BS + t] * ks[t]);
      for (int t = 0; t < BS; ++t)
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) vo[t * head_dim + d] = static_cast<T>(v[t * head_dim + d] * vs[t]);
    }
  });
}

// Calls run(std::integral_constant<int, BS>{}) with the pool's block size as a compile-time BS.
// One kv head's row x [D] as int8 q [D] and its scale: see quantize_kv.
template <typename T>
inline void quantize_row(const T* x, int64_t head_dim, int8_t* q, float* scale) {
#ifdef __AVX512F__
  if constexpr (kFastType<T>) {  // the same arithmetic 16 lanes at a time (rounding: MXCSR's, to even)
    if (head_dim % 16 == 0) {
      __m512 top = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + d)));
      const float amax = _mm512_reduce_max_ps(top);
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      *scale = amax * (1.f / 127.f);
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + d), inv));
        const __m512i clamped = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d), _mm512_cvtepi32_epi8(clamped));
      }
      return;
    }
  }
#endif
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::abs(to_float(x, d)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax * (1.f / 127.f);
  for (int64_t d = 0; d < head_dim; ++d)
    q[d] = static_cast<int8_t>(std::clamp(std::nearbyint(to_float(x, d) * inv), -127.f, 127.f));
}

template <typename F>
void with_block_size(int64_t block_size, const char* op, F&& run) {
  switch (block_size) {
    case 8: run(std::integral_constant<int, 8>{}); break;
    case 16: run(std::integral_constant<int, 16>{}); break;
    case 32: run(std::integral_constant<int, 32>{}); break;
    default: TORCH_CHECK(false, op, " supports block sizes 8, 16 and 32, got ", block_size);
  }
}

// Ops that only copy pool elements run on an unsigned type of the element's size.
template <typename F>
void with_element_bytes(int64_t bytes, const char* op, F&& run) {
  switch (bytes) {
    case 1: run(uint8_t{}); break;
    case 2: run(uint16_t{}); break;
    case 4: run(uint32_t{}); break;
    default: TORCH_CHECK(false, op, " supports 1-, 2- and 4-byte elements");
  }
}

}  // namespace

// The scales of a pool that holds int8 (checked against it; none for a pool of q's dtype):
// key_scales [blocks, KVH, 1, BS] and value_scales [blocks, KVH, BS, 1] float32, the pool's own
// layouts with one element a token and head.
static KVScales pool_scales(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const std::optional<at::Tensor>& key_scales, const std::optional<at::Tensor>& value_scales) {
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (quantized || q.scalar_type() == k_cache.scalar_type()),
              "the pools must hold q's dtype or int8");
  TORCH_CHECK(quantized == key_scales.has_value() && quantized == value_scales.has_value(),
              "an int8 pool comes with its key and value scales, a pool of q's dtype without");
  if (!quantized) return {};
  const int64_t per_pool = k_cache.size(0) * k_cache.size(1) * k_cache.size(3);
  for (const at::Tensor* t : {&*key_scales, &*value_scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == per_pool,
                "scales must be contiguous float32 with one entry per slot and kv head of the pool");
  return {key_scales->data_ptr<float>(), value_scales->data_ptr<float>()};
}

// Calls run(pool element tag): the pool's own type is q's scalar_t, or int8.
template <typename scalar_t, typename F>
void with_pool_type(const at::Tensor& k_cache, F&& run) {
  if (k_cache.scalar_type() == at::kChar) run(int8_t{});
  else run(scalar_t{});
}

// Checks and runs a decode call, scored when `scored.rows` is set.
static std::tuple<at::Tensor, at::Tensor> run_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              const KVScales& kv_scales, const at::Tensor& block_tables_in,
                                              const at::Tensor& context_lens_in, double scale,
                                              const DecodeScores& scored) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables_in.scalar_type() == at::kInt && context_lens_in.scalar_type() == at::kInt, "int32 tables");
  const at::Tensor block_tables = block_tables_in.contiguous();
  const at::Tensor context_lens = context_lens_in.contiguous();
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(3);
  TORCH_CHECK(k_cache.size(1) == num_kv_heads && k_cache.size(2) == head_dim && k_cache.size(3) == block_size &&
                  v_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "cache shapes");
  auto out = at::empty_like(q);
  auto lse = at::empty({batch, num_heads}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    with_pool_type<scalar_t>(k_cache, [&](auto pool_tag) {
      using C = decltype(pool_tag);
      auto run = [&](auto block_size_tag) {
        constexpr int BS = decltype(block_size_tag)::value;
        decode_kernel<scalar_t, C, BS>(q.data_ptr<scalar_t>(), static_cast<const C*>(k_cache.data_ptr()),
                                       static_cast<const C*>(v_cache.data_ptr()), kv_scales,
                                       block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                                       out.data_ptr<scalar_t>(), lse.data_ptr<float>(), batch, num_heads,
                                       num_kv_heads, head_dim, block_tables.size(1), static_cast<float>(scale), scored);
      };
      with_block_size(block_size, "paged_decode_attention", run);
    });
  });
  return {out, lse};
}

// q [B, H, D]; k_cache [num_blocks, KVH, D, block_size];
// v_cache [num_blocks, KVH, block_size, D]; block_tables [B, max_blocks]
// int32; context_lens [B] int32 (0: a row with no key in this shard of the cache, whose out is 0
// and lse -inf); key_scales, value_scales: an int8 pool's (see pool_scales). Returns
// (out [B, H, D], lse [B, H] float32).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                          const at::Tensor& context_lens, double scale,
                                                          const std::optional<at::Tensor>& key_scales,
                                                          const std::optional<at::Tensor>& value_scales) {
  return run_decode(q, k_cache, v_cache, pool_scales(q, k_cache, v_cache, key_scales, value_scales), block_tables,
                    context_lens, scale, DecodeScores{});
}

// paged_decode_attention that also adds each scored row's attention over its stored tokens to
// its sequence's accumulated scores, in place: score_temps [B] float32 (0: row not scored),
// row_keys [B] int64 (-1: no noise), score_rows [B, 5] int64, each scored row's state as
// (scores address, positions address, lowest address, capacity, layers): float32 scores and int32
// positions laid out [layers, KVH, capacity] by stored index, capacity at least the row's
// context, and int64 lowest [layers, KVH] (a sequence's states differ in size, so they cannot be
// one tensor of a compiled step: they are addressed); newest [B] int64: see DecodeScores.
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_scored(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
    const at::Tensor& context_lens_in, double scale, const at::Tensor& score_rows_in, const at::Tensor& score_temps_in,
    const at::Tensor& row_keys_in, const at::Tensor& newest_in, int64_t layer,
    const std::optional<at::Tensor>& key_scales, const std::optional<at::Tensor>& value_scales) {
  const int64_t batch = q.size(0);
  const at::Tensor temps = score_temps_in.contiguous(), keys = row_keys_in.contiguous();
  const at::Tensor rows = score_rows_in.contiguous(), context_lens = context_lens_in.contiguous();
  const at::Tensor newest = newest_in.contiguous();
  TORCH_CHECK(newest.scalar_type() == at::kLong && newest.numel() == batch, "newest must be [B] int64");
  TORCH_CHECK(temps.scalar_type() == at::kFloat && temps.numel() == batch, "score_temps must be [B] float32");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.numel() == batch, "row_keys must be [B] int64");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == batch && rows.size(1) == 5,
              "score_rows must be [B, 5] int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.numel() == batch, "context_lens must be [B] int32");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    if (temps.data_ptr<float>()[b] <= 0.f) continue;
    TORCH_CHECK(r[5 * b] != 0 && r[5 * b + 1] != 0 && r[5 * b + 2] != 0, "a scored row without a state");
    TORCH_CHECK(r[5 * b + 3] >= context_lens.data_ptr<int32_t>()[b], "a scored row's state is shorter than its context");
    TORCH_CHECK(layer >= 0 && layer < r[5 * b + 4], "a scored row's state has no such layer");
  }
  DecodeScores scored{temps.data_ptr<float>(), keys.data_ptr<int64_t>(), r, newest.data_ptr<int64_t>(), layer};
  return run_decode(q, k_cache, v_cache, pool_scales(q, k_cache, v_cache, key_scales, value_scales), block_tables,
                    context_lens, scale, scored);
}

// Prompt rows' scores: logits [H, r, ctx] float32 (scaled q.k of r query rows over ctx stored
// tokens, in position order), visible [r] int64 (keys each row sees: the first visible[r]),
// score_temps [r] float32 (0: row not scored), row_keys [r] int64 (-1: no noise). Returns
// [KVH, ctx] float32: each kv head's scores summed over its query heads and the rows.
at::Tensor attention_row_scores(const at::Tensor& logits_in, int64_t num_kv_heads, const at::Tensor& visible_in,
                                const at::Tensor& score_temps_in, const at::Tensor& row_keys_in, int64_t layer) {
  const at::Tensor logits = logits_in.contiguous(), visible = visible_in.contiguous();
  const at::Tensor temps = score_temps_in.contiguous(), keys = row_keys_in.contiguous();
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat, "logits must be [H, r, ctx] float32");
  const int64_t num_heads = logits.size(0), rows = logits.size(1), ctx = logits.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(visible.scalar_type() == at::kLong && visible.numel() == rows, "visible must be [r] int64");
  TORCH_CHECK(temps.scalar_type() == at::kFloat && temps.numel() == rows, "score_temps must be [r] float32");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.numel() == rows, "row_keys must be [r] int64");
  const int64_t group = num_heads / num_kv_heads;
  auto out = at::zeros({num_kv_heads, ctx}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* vis = visible.data_ptr<int64_t>();
  const float* tp = temps.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(ctx);
    for (int64_t kvh = begin; kvh < end; ++kvh)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t r = 0; r < rows; ++r) {
          if (tp[r] <= 0.f) continue;
          TORCH_CHECK(vis[r] >= 1 && vis[r] <= ctx, "visible out of range");
          add_row_scores(x + ((kvh * group + g) * rows + r) * ctx, vis[r], tp[r], kp[r] >= 0,
                         head_noise_key(kp[r], layer, kvh), nullptr, tmp.data(), o + kvh * ctx);
        }
  });
  return out;
}

// The noise a scored row adds: [r, KVH, P] for row_keys [r] int64 and positions [P] int32 (to
// check it against its definition).
at::Tensor gumbel_noise(const at::Tensor& row_keys_in, int64_t layer, int64_t num_kv_heads,
                        const at::Tensor& positions_in) {
  const at::Tensor keys = row_keys_in.contiguous().to(at::kLong), positions = positions_in.contiguous().to(at::kInt);
  const int64_t rows = keys.numel(), n = positions.numel();
  auto out = at::empty({rows, num_kv_heads, n}, keys.options().dtype(at::kFloat));
  const float* table = gumbel_table();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const uint32_t key = head_noise_key(keys.data_ptr<int64_t>()[r], layer, h);
      for (int64_t t = 0; t < n; ++t)
        out.data_ptr<float>()[(r * num_kv_heads + h) * n + t] = gumbel(table, key, positions.data_ptr<int32_t>()[t]);
    }
  return out;
}

// q [n, H, D], the chunk's queries; caches as above; block_ids [>= ceil(context_len / block_size)]
// int32, the sequence's blocks; key_positions [context_len] int64 or None; query_positions [n]
// int64 or None, given only with key_positions (see prefill_kernel).
// Returns (out [n, H, D], lse [n, H] float32).
std::tuple<at::Tensor, at::Tensor> paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                           const at::Tensor& v_cache, const at::Tensor& block_ids_in,
                                                           int64_t context_len,
                                                           const std::optional<at::Tensor>& key_positions_in,
                                                           double scale,
                                                           const std::optional<at::Tensor>& query_positions_in,
                                                           const std::optional<at::Tensor>& key_scales,
                                                           const std::optional<at::Tensor>& value_scales) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  const KVScales kv_scales = pool_scales(q, k_cache, v_cache, key_scales, value_scales);
  TORCH_CHECK(block_ids_in.scalar_type() == at::kInt, "block_ids must be int32");
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == head_dim && v_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "cache shapes");
  const bool sharded = query_positions_in.has_value();
  TORCH_CHECK(n >= 1 && (sharded ? context_len >= 0 : context_len >= n),
              "context_len must be at least the number of queries");
  TORCH_CHECK(block_ids_in.numel() * block_size >= context_len, "block_ids cover fewer than context_len tokens");
  const at::Tensor block_ids = block_ids_in.contiguous();
  at::Tensor key_positions;
  if (key_positions_in.has_value()) {
    key_positions = key_positions_in->contiguous();
    TORCH_CHECK(key_positions.scalar_type() == at::kLong && key_positions.numel() == context_len,
                "key_positions must be int64 with context_len entries");
  }
  at::Tensor query_positions;
  if (sharded) {
    query_positions = query_positions_in->contiguous();
    TORCH_CHECK(key_positions.defined() && query_positions.scalar_type() == at::kLong && query_positions.numel() == n,
                "query_positions must be int64 with an entry per query, and come with key_positions");
  }
  if (context_len == 0)  // a shard of the keys holding none of the sequence's: nothing to attend
    return {at::zeros_like(q), at::full({n, num_heads}, -std::numeric_limits<float>::infinity(),
                                        q.options().dtype(at::kFloat))};
  auto out = at::empty_like(q);
  auto lse = at::empty({n, num_heads}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    auto run = [&](auto block_size_tag) {
      constexpr int BS = decltype(block_size_tag)::value;
      // An int8 pool: the sequence's blocks in q's dtype first, in the order of their table, which
      // then counts them 0, 1, ...
      at::Tensor keys = k_cache, values = v_cache, table = block_ids;
      if (kv_scales.keys) {
        const int64_t used = (context_len + BS - 1) / BS;
        keys = at::empty({used, num_kv_heads, head_dim, BS}, q.options());
        values = at::empty({used, num_kv_heads, BS, head_dim}, q.options());
        dequantize_blocks<scalar_t, BS>(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), kv_scales,
                                        block_ids.data_ptr<int32_t>(), used, num_kv_heads, head_dim,
                                        keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>());
        table = at::arange(used, block_ids.options());
      }
      prefill_kernel<scalar_t, BS>(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                                   table.data_ptr<int32_t>(),
                                   key_positions.defined() ? key_positions.data_ptr<int64_t>() : nullptr,
                                   sharded ? query_positions.data_ptr<int64_t>() : nullptr,
                                   out.data_ptr<scalar_t>(), lse.data_ptr<float>(), n, context_len, num_heads,
                                   num_kv_heads, head_dim, static_cast<float>(scale));
    };
    with_block_size(block_size, "paged_prefill_attention", run);
  });
  return {out, lse};
}

// Copies single (layer, kv head, slot) entries of the pool, src -> dst, reading every source
// before writing any: moves [M, 4] int64 rows of (layer, kv head, src slot, dst slot); keys and
// values are the per-layer pools in the layouts above.
template <typename E>  // E: an integer type of the element's size (elements are only copied)
void move_head_slots_impl(at::TensorList keys, at::TensorList values, const int64_t* mv, int64_t m) {
  const int64_t kvh = keys[0].size(1), head_dim = keys[0].size(2), bs = keys[0].size(3);
  std::vector<E> staged(2 * m * head_dim);
  // Moves of different layers never touch the same memory: threads take layers, each in the
  // moves' order (a later write into a slot must land last).
  const int64_t layers = static_cast<int64_t>(keys.size());
  for (int pass = 0; pass < 2; ++pass) at::parallel_for(0, layers, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = 0; i < m; ++i) {
      const int64_t* r = mv + 4 * i;
      if (r[0] < first || r[0] >= last) continue;
      const int64_t slot = pass == 0 ? r[2] : r[3], head_block = (slot / bs) * kvh + r[1];
      E* k = static_cast<E*>(keys[r[0]].data_ptr()) + head_block * head_dim * bs + slot % bs;  // stride bs
      E* v = static_cast<E*>(values[r[0]].data_ptr()) + (head_block * bs + slot % bs) * head_dim;
      E* kbuf = staged.data() + 2 * i * head_dim;
      E* vbuf = kbuf + head_dim;
      if (pass == 0) {
        for (int64_t d = 0; d < head_dim; ++d) kbuf[d] = k[d * bs];
        std::copy(v, v + head_dim, vbuf);
      } else {
        for (int64_t d = 0; d < head_dim; ++d) k[d * bs] = kbuf[d];
        std::copy(vbuf, vbuf + head_dim, v);
      }
    }
  });
}

// Copies single (layer, kv head, slot) entries of the pool, src -> dst, reading every source
// before writing any, writing in order: moves [M, 4] int64 rows of (layer, kv head, src slot,
// dst slot); keys and values are the per-layer pools in the layouts above.
void move_head_slots(at::TensorList keys, at::TensorList values, const at::Tensor& moves_in) {
  const at::Tensor moves = moves_in.contiguous();
  TORCH_CHECK(moves.scalar_type() == at::kLong && moves.dim() == 2 && moves.size(1) == 4, "moves must be [M, 4] int64");
  TORCH_CHECK(!keys.empty() && keys.size() == values.size(), "one key and one value pool per layer");
  const int64_t m = moves.size(0), layers = keys.size(), slots = keys[0].size(0) * keys[0].size(3);
  const int64_t* mv = moves.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(mv[4 * i] >= 0 && mv[4 * i] < layers && mv[4 * i + 1] >= 0 && mv[4 * i + 1] < keys[0].size(1) &&
                    mv[4 * i + 2] >= 0 && mv[4 * i + 2] < slots && mv[4 * i + 3] >= 0 && mv[4 * i + 3] < slots,
                "move ", i, " is outside the pool");
  with_element_bytes(keys[0].element_size(), "move_head_slots", [&](auto element_tag) {
    move_head_slots_impl<decltype(element_tag)>(keys, values, mv, m);
  });
}

// For each row of scores [R, n] (float32), the index of its lowest score among the entries whose
// position (positions [R, n] int32) is at most `newest`, as [R, 1] int64 (the first of equal
// ones); a row with no such entry gets -1.
at::Tensor lowest_unprotected(const at::Tensor& scores_in, const at::Tensor& positions_in, int64_t newest) {
  TORCH_CHECK(scores_in.scalar_type() == at::kFloat && positions_in.scalar_type() == at::kInt &&
                  scores_in.sizes() == positions_in.sizes() && scores_in.dim() >= 1,
              "scores float32 and positions int32 of one shape");
  // Rows may be spaced apart (a view of the first n of each row of a wider buffer): no copy.
  const at::Tensor scores = scores_in.dim() > 1 ? scores_in.flatten(0, -2) : scores_in.unsqueeze(0);
  const at::Tensor positions = positions_in.dim() > 1 ? positions_in.flatten(0, -2) : positions_in.unsqueeze(0);
  const at::Tensor s_rows = scores.stride(1) == 1 ? scores : scores.contiguous();
  const at::Tensor p_rows = positions.stride(1) == 1 ? positions : positions.contiguous();
  const int64_t n = s_rows.size(1), rows = s_rows.size(0), lds = s_rows.stride(0), ldp = p_rows.stride(0);
  std::vector<int64_t> shape(scores_in.sizes().begin(), scores_in.sizes().end());
  shape.back() = 1;
  auto out = at::empty(shape, scores_in.options().dtype(at::kLong));
  const float* s = s_rows.data_ptr<float>();
  const int32_t* p = p_rows.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = lowest_at_most(s + r * lds, p + r * ldp, n, newest);
  });
  return out;
}

// A scored policy's drop of the same count k of stored entries in each (layer, kv head) of one
// sequence's state: positions [L, KVH, cap] int32 and scores [L, KVH, cap] float32 (its first
// num_tokens entries stored), dropped [L, KVH, k] int64 distinct indices per head. In each head
// the entries kept beyond the new count n - k fill its holes below it, both in ascending order,
// in place; returns the same moves for the KV pool, [M, 4] int64 rows of (layer, kv head, source
// slot through old_block_ids, destination slot through new_block_ids), head by head, holes
// ascending.
at::Tensor drop_head_entries(at::Tensor& positions, at::Tensor& scores, const at::Tensor& dropped_in,
                             int64_t num_tokens, const at::Tensor& old_block_ids_in,
                             const at::Tensor& new_block_ids_in, int64_t block_size) {
  TORCH_CHECK(positions.scalar_type() == at::kInt && scores.scalar_type() == at::kFloat && positions.dim() == 3 &&
                  positions.sizes() == scores.sizes() && positions.is_contiguous() && scores.is_contiguous(),
              "positions int32 and scores float32, [L, KVH, capacity] and contiguous");
  const at::Tensor dropped = dropped_in.contiguous();
  const at::Tensor old_ids = old_block_ids_in.to(at::kLong).contiguous();
  const at::Tensor new_ids = new_block_ids_in.to(at::kLong).contiguous();
  const int64_t heads = positions.size(0) * positions.size(1), kvh = positions.size(1), cap = positions.size(2);
  TORCH_CHECK(dropped.scalar_type() == at::kLong && dropped.dim() == 3 && dropped.size(0) == positions.size(0) &&
                  dropped.size(1) == kvh, "dropped must be [L, KVH, k] int64");
  const int64_t k = dropped.size(2), kept = num_tokens - k;
  TORCH_CHECK(0 <= kept && num_tokens <= cap, "drop of ", k, " from ", num_tokens, " stored of capacity ", cap);
  TORCH_CHECK(block_size > 0 && old_ids.size(0) * block_size >= num_tokens && new_ids.size(0) * block_size >= kept,
              "block tables too short for ", num_tokens, " stored and ", kept, " kept");
  const int64_t* drop = dropped.data_ptr<int64_t>();
  const int64_t* old_b = old_ids.data_ptr<int64_t>();
  const int64_t* new_b = new_ids.data_ptr<int64_t>();
  int32_t* pos = positions.data_ptr<int32_t>();
  float* sc = scores.data_ptr<float>();
  // Each head's indices sorted: its holes are those below `kept`, and the entries that fill
  // them are the ones of [kept, num_tokens) not dropped. All checked before anything moves.
  std::vector<int64_t> sorted(drop, drop + heads * k);
  for (int64_t h = 0; h < heads; ++h) {
    int64_t* d = sorted.data() + h * k;
    std::sort(d, d + k);
    for (int64_t j = 0; j < k; ++j)
      TORCH_CHECK(0 <= d[j] && d[j] < num_tokens && (j == 0 || d[j] != d[j - 1]), "dropped index ", d[j],
                  " repeated or outside [0, ", num_tokens, ")");
  }
  std::vector<int64_t> moves;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t* d = sorted.data() + h * k;
    const int64_t* holes_end = std::lower_bound(d, d + k, kept);
    const int64_t* skip = holes_end;  // the next dropped entry at or past `kept`
    int32_t* p = pos + h * cap;
    float* s = sc + h * cap;
    int64_t fill = kept;
    for (const int64_t* hole = d; hole < holes_end; ++hole, ++fill) {
      for (; skip < d + k && *skip == fill; ++skip) ++fill;
      p[*hole] = p[fill];
      s[*hole] = s[fill];
      moves.insert(moves.end(), {h / kvh, h % kvh, old_b[fill / block_size] * block_size + fill % block_size,
                                 new_b[*hole / block_size] * block_size + *hole % block_size});
    }
  }
  const int64_t m = static_cast<int64_t>(moves.size()) / 4;
  at::Tensor out = at::empty({m, 4}, dropped.options());
  std::copy(moves.begin(), moves.end(), out.data_ptr<int64_t>());
  return out;
}

// Stores a step's new keys and values at their slots [T] of one layer's pools (the layouts
// above), from rows k and v of KVH * D elements, each token's row `ldk` / `ldv` elements after the
// last. Threads take runs of tokens: within a block the transposed keys of consecutive tokens
// share cache lines, so a run writes them together. The slots are the caller's to check.
template <typename E>  // E: an integer type of the element's size (elements are only copied)
void write_kv_impl(E* kc, E* vc, const E* k, const E* v, const int64_t* slots, int64_t tokens, int64_t kvh,
                   int64_t head_dim, int64_t bs, int64_t ldk, int64_t ldv) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      const int64_t block = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < kvh; ++h) {
        const E* krow = k + t * ldk + h * head_dim;
        E* kdst = kc + ((block * kvh + h) * head_dim) * bs + off;
        for (int64_t d = 0; d < head_dim; ++d) kdst[d * bs] = krow[d];
        std::copy(v + t * ldv + h * head_dim, v + t * ldv + (h + 1) * head_dim,
                  vc + ((block * kvh + h) * bs + off) * head_dim);
      }
    }
  });
}

void write_kv_rows(void* key_pool, void* value_pool, const void* k, int64_t ldk, const void* v, int64_t ldv,
                   const int64_t* slots, int64_t tokens, int64_t kvh, int64_t head_dim, int64_t bs,
                   int64_t element_bytes) {
  with_element_bytes(element_bytes, "write_kv", [&](auto element_tag) {
    using E = decltype(element_tag);
    write_kv_impl<E>(static_cast<E*>(key_pool), static_cast<E*>(value_pool), static_cast<const E*>(k),
                     static_cast<const E*>(v), slots, tokens, kvh, head_dim, bs, ldk, ldv);
  });
}

void write_kv(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k_in, const at::Tensor& v_in,
              const at::Tensor& slots_in) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(), "caches must be contiguous [blocks, KVH, D, BS] and [blocks, KVH, BS, D]");
  const int64_t blocks = key_cache.size(0), kvh = key_cache.size(1), head_dim = key_cache.size(2),
                bs = key_cache.size(3);
  TORCH_CHECK(k_in.dim() == 3 && k_in.sizes() == v_in.sizes() && k_in.size(1) == kvh && k_in.size(2) == head_dim &&
                  k_in.scalar_type() == key_cache.scalar_type() && v_in.scalar_type() == value_cache.scalar_type(),
              "k and v must be [T, KVH, D] of the caches' dtype");
  // Tokens may be spaced apart (k and v are views of one fused projection); each token's heads contiguous.
  const at::Tensor k = k_in.stride(2) == 1 && k_in.stride(1) == head_dim ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(2) == 1 && v_in.stride(1) == head_dim ? v_in : v_in.contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0), "one slot per token");
  const int64_t tokens = k.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(0 <= sl[t] && sl[t] < blocks * bs, "slot ", sl[t], " is outside the pool of ", blocks * bs);
  write_kv_rows(key_cache.data_ptr(), value_cache.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                sl, tokens, kvh, head_dim, bs, key_cache.element_size());
}

// Each token's kv head of x [T, KVH, D] as int8 times one scale, for an int8 pool: scale =
// max|x| * fl(1 / 127) (a product: -ffast-math makes a division by a constant one anyway) and
// q = round(x * (127 / max|x|)), ties to even (an all-zero head: scale 0, q 0).
// Returns (q [T, KVH, D] int8, scales [T, KVH, 1] float32). The same arithmetic as
// loom.kv.cache.quantize_kv_reference, so the two agree bit for bit.
std::tuple<at::Tensor, at::Tensor> quantize_kv(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 3, "x must be [T, KVH, D]");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0) * x.size(1), head_dim = x.size(2);
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scales = at::empty({x.size(0), x.size(1), 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_kv", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    int8_t* dst = q.data_ptr<int8_t>();
    float* sc = scales.data_ptr<float>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(src + r * head_dim, head_dim, dst + r * head_dim, sc + r);
    });
  });
  return {q, scales};
}

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor? key_scales=None, Tensor? value_scales=None) -> (Tensor, Tensor)");
  m.def("paged_prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_ids, "
        "int context_len, Tensor? key_positions, float scale, Tensor? query_positions=None, "
        "Tensor? key_scales=None, Tensor? value_scales=None) -> (Tensor, Tensor)");
  m.def("paged_decode_attention_scored(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor score_rows, Tensor score_temps, Tensor row_keys, Tensor newest, "
        "int layer, Tensor? key_scales=None, Tensor? value_scales=None) -> (Tensor, Tensor)");
  m.def("quantize_kv(Tensor x) -> (Tensor, Tensor)");
  m.def("attention_row_scores(Tensor logits, int num_kv_heads, Tensor visible, Tensor score_temps, "
        "Tensor row_keys, int layer) -> Tensor");
  m.def("gumbel_noise(Tensor row_keys, int layer, int num_kv_heads, Tensor positions) -> Tensor");
  m.def("move_head_slots(Tensor(a!)[] keys, Tensor(b!)[] values, Tensor moves) -> ()");
  m.def("lowest_unprotected(Tensor scores, Tensor positions, int newest) -> Tensor");
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("drop_head_entries(Tensor(a!) positions, Tensor(b!) scores, Tensor dropped, int num_tokens, "
        "Tensor old_block_ids, Tensor new_block_ids, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("paged_decode_attention_scored", &paged_decode_attention_scored);
  m.impl("attention_row_scores", &attention_row_scores);
  m.impl("gumbel_noise", &gumbel_noise);
  m.impl("move_head_slots", &move_head_slots);
  m.impl("lowest_unprotected", &lowest_unprotected);
  m.impl("drop_head_entries", &drop_head_entries);
  m.impl("write_kv", &write_kv);
  m.impl("quantize_kv", &quantize_kv);
}
