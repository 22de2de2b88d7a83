// Loom's linear layers on CPU, y = x W^T, for every weight format: fp32 and bf16 (dense), int8
// and int4 (weight-only: kept compressed in memory, widened to bf16 in registers). Each weight
// byte is read once per step; at batch 1 memory bandwidth sets the speed, and with more rows of
// x each weight vector feeds one dot product per row, GEMM style.
//
// Every format is stored in panels of 32 output channels, so that a vector holds 16 output
// channels (no horizontal sums, one broadcast activation per dot product). Panel P covers
// channels 32P .. 32P + 31 (N is padded with zero channels to a multiple of 32); "pair" p is
// inputs (2p, 2p + 1), the two bf16 values one dword lane of a bf16 dot product takes.
//   fp32: w [ceil(N/32), K * 32] fp32: input k of panel P is 32 floats, channel-major; fp32 fma.
//   bf16: w [ceil(N/32), ceil(K/2) * 64] bf16: pair p of panel P is 64 values, element 2c + t
//         is weight (32P + c, 2p + t) (K padded to even with zeros); bf16 dot products.
//   int8: q in the bf16 layout's order, as int8; scale [N] fp32; w = q * scale. Widened exactly
//         to bf16 (|q| <= 127), scaled per channel at the end.
//   int4: q [ceil(N/32), K/8 * 128] uint8, K a multiple of 32. Quad d (inputs 8d .. 8d + 7) of
//         panel P is 128 bytes: two halves of 16 channels, each 32 little-endian 16-bit words;
//         nibble e of word 2j + t in half h is weight (32P + 16h + j, 8d + 2e + t).
//         scale, zero [ceil(N/32), K/G, 32] bf16; w = (q - 8) * scale + zero (torch's int4
//         convention). OR-ing 0x4300 into a 16-bit word holding n in 0..15 makes the bf16
//         number 128 + n exactly: one shift and one ternary-logic op per 32 weights, no
//         shuffles; each group is then scaled once, with its offset times the group's sum of x.
// loom/layers/linear.py and loom/quant/quantize.py build the layouts. Panels are split across
// threads; every thread keeps x in cache. Without AVX-512 (BF16) the quantized kernels
// dequantize with plain loops and call a bf16 GEMM (correct, slow), and the engine leaves dense
// layers to torch.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output channels per panel

inline float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// Round to nearest even (c10::BFloat16's conversion also handles NaN, which weights never are).
inline uint16_t float_to_bf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline int64_t panels(int64_t N) { return (N + kPanel - 1) / kPanel; }

// One weight from each layout (the plain-loop paths).
inline int8_t int8_at(const int8_t* q, int64_t pairs, int64_t n, int64_t k) {
  return q[(n / kPanel) * pairs * 64 + (k / 2) * 64 + (n % kPanel) * 2 + k % 2];
}
inline int int4_at(const uint8_t* q, int64_t K, int64_t n, int64_t k) {
  const int64_t c = n % kPanel, word = 2 * (c % 16) + k % 2;
  const uint8_t* half = q + (n / kPanel) * (K / 8) * 128 + (k / 8) * 128 + (c / 16) * 64;
  const uint16_t bits = static_cast<uint16_t>(half[2 * word] | (half[2 * word + 1] << 8));
  return (bits >> (4 * ((k % 8) / 2))) & 0x0F;
}

// Calls f(m0, std::integral_constant<int, rows>) over M rows of x in near-equal tiles of at most
// MaxRows rows (32 rows as 10 + 11 + 11, not 12 + 12 + 8: every tile keeps its registers busy).
template <int MaxRows, typename F>
inline void for_each_tile(int64_t M, F f) {
  const int64_t tiles = (M + MaxRows - 1) / MaxRows;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t rows = (M - m0) / (tiles - t);  // the remaining rows over the remaining tiles
    auto call = [&](auto self, auto tag) {
      if constexpr (decltype(tag)::value > 1) {
        if (rows < decltype(tag)::value) return self(self, std::integral_constant<int, decltype(tag)::value - 1>{});
      }
      f(m0, tag);
    };
    call(call, std::integral_constant<int, MaxRows>{});
    m0 += rows;
  }
}

// x as the kernels read it: bf16, contiguous, K padded to `padded_k` with zeros.
at::Tensor bf16_input(const at::Tensor& x, int64_t padded_k) {
  at::Tensor xb = x.to(at::kBFloat16).contiguous();
  return padded_k == x.size(1) ? xb : at::constant_pad_nd(xb, {0, padded_k - x.size(1)});
}

at::Tensor output_like(const at::Tensor& y, const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr int kTileRows = 12;     // rows of x per register tile: 24 accumulators
constexpr int kInt4TileRows = 8;  // int4 also holds a group's scales and offsets (measured best)

// 32 int8 as 32 bf16, in order (exact).
inline __m512bh widen_int8(const int8_t* q) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// x[m, 2p], x[m, 2p + 1] in every lane.
inline __m512bh pair_of(const uint16_t* x, int64_t p) {
  int32_t pair;
  std::memcpy(&pair, x + 2 * p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// 16 bf16 -> fp32.
inline __m512 widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Stores the two vectors of a panel's row (channels n0 .. n0 + 31 of `valid`), times `scale`
// [32] when given, as fp32 or as bf16 (rounded to nearest even, as Tensor.to does).
template <typename Out>
inline void store_panel_row(Out* y, __m512 v0, __m512 v1, const float* scale, int64_t valid) {
  const __m512 both[2] = {v0, v1};
  for (int h = 0; h < 2; ++h) {
    const int64_t live_n = std::clamp<int64_t>(valid - 16 * h, 0, 16);
    if (live_n == 0) return;
    const __mmask16 live = static_cast<__mmask16>((1u << live_n) - 1);
    const __m512 v = scale ? _mm512_mul_ps(both[h], _mm512_maskz_loadu_ps(live, scale + 16 * h)) : both[h];
    if constexpr (std::is_same_v<Out, float>)
      _mm512_mask_storeu_ps(y + 16 * h, live, v);
    else
      _mm256_mask_storeu_epi16(y + 16 * h, live, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// MR rows of x times one panel -> y rows (stride ldy), channels scaled by `scale` when given.
// Step s of the panel broadcasts 32 bits of each row of x (x32, row stride ldx in those units:
// a bf16 pair, or one fp32) and meets the weight vectors weights(s, h) of channel halves h = 0, 1
// in dot(accumulator, weights, broadcast): a bf16 pair dot product, or an fp32 fma.
template <int MR, typename Out, typename Weights, typename Dot>
inline void panel_tile(const uint32_t* x32, int64_t ldx, int64_t steps, Weights weights, Dot dot, const float* scale,
                       int64_t valid, Out* y, int64_t ldy) {
  constexpr int U = MR >= 4 ? 1 : 2;  // few rows: alternate accumulators to hide the dot product's latency
  __m512 acc[U][MR][2];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MR; ++m) acc[u][m][0] = acc[u][m][1] = _mm512_setzero_ps();
  auto step = [&](auto u, int64_t s) {  // u: a compile-time index, so the accumulators stay in registers
    const __m512i b0 = weights(s, 0), b1 = weights(s, 1);
    for (int m = 0; m < MR; ++m) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(x32[m * ldx + s]));
      acc[u][m][0] = dot(acc[u][m][0], b0, a);
      acc[u][m][1] = dot(acc[u][m][1], b1, a);
    }
  };
  int64_t s = 0;
  for (; s + U <= steps; s += U) {
    step(std::integral_constant<int, 0>{}, s);
    if constexpr (U > 1) step(std::integral_constant<int, 1>{}, s + 1);
  }
  for (; s < steps; ++s) step(std::integral_constant<int, 0>{}, s);
  for (int m = 0; m < MR; ++m) {
    for (int u = 1; u < U; ++u)
      for (int h = 0; h < 2; ++h) acc[0][m][h] = _mm512_add_ps(acc[0][m][h], acc[u][m][h]);
    store_panel_row(y + m * ldy, acc[0][m][0], acc[0][m][1], scale, valid);
  }
}

// The two dot products, as types (a function pointer would not be inlined).
constexpr auto dot_bf16 = [](__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); };
constexpr auto dot_fp32 = [](__m512 acc, __m512i w, __m512i x) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
};

// MR rows of x times one int4 panel. Per group: sum over its quads of x * (128 + q) in the
// accumulators, then total += scale * that + (zero - 136 scale) * (the group's sum of x). The
// totals live in L1 (a stack array), leaving every register to the accumulators.
template <int MR, typename Out>
inline void int4_tile(const uint16_t* x, int64_t ldx, int64_t groups, int64_t quads_per_group, const uint8_t* panel,
                      const uint16_t* scale, const uint16_t* zero, const float* xsum, int64_t valid, Out* y,
                      int64_t ldy) {
  constexpr int U = MR >= 4 ? 1 : 4;  // few rows: one accumulator per nibble position
  const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  alignas(64) float total[MR][kPanel] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[U][MR][2];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MR; ++m) acc[u][m][0] = acc[u][m][1] = _mm512_setzero_ps();
    for (int64_t d = g * quads_per_group; d < (g + 1) * quads_per_group; ++d) {
      const __m512i block[2] = {_mm512_loadu_si512(panel + d * 128), _mm512_loadu_si512(panel + d * 128 + 64)};
      for (int e = 0; e < 4; ++e) {  // constant trip count: unrolled
        __m512bh b[2];
        for (int h = 0; h < 2; ++h)  // (words >> 4e) & 0xF | 0x4300
          b[h] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(block[h], 4 * e), nibble, bf16_128, 0xEA);
        for (int m = 0; m < MR; ++m) {
          const __m512bh a = pair_of(x + m * ldx, 4 * d + e);
          for (int h = 0; h < 2; ++h) acc[e % U][m][h] = _mm512_dpbf16_ps(acc[e % U][m][h], b[h], a);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512 s = widen_bf16(scale + g * kPanel + 16 * h);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, widen_bf16(zero + g * kPanel + 16 * h));
      for (int m = 0; m < MR; ++m) {
        __m512 sum = acc[0][m][h];
        for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][m][h]);
        __m512 t = _mm512_fmadd_ps(sum, s, _mm512_load_ps(total[m] + 16 * h));
        _mm512_store_ps(total[m] + 16 * h, _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m * groups + g]), t));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    store_panel_row(y + m * ldy, _mm512_load_ps(total[m]), _mm512_load_ps(total[m] + 16), nullptr, valid);
}

// y [M, N] in x's dtype (fp32 or bf16 written by the tiles; others converted from fp32);
// tile(panel, m0, rows tag, pointer to y[m0, 32 * panel]) computes one tile.
template <int MaxRows, typename Tile>
at::Tensor run_panels(int64_t M, int64_t N, const at::Tensor& x, Tile tile) {
  auto run = [&](auto* yp) {
    at::parallel_for(0, panels(N), 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for_each_tile<MaxRows>(M, [&](int64_t m0, auto rows) { tile(p, m0, rows, yp + m0 * N + p * kPanel); });
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    at::Tensor y = at::empty({M, N}, x.options());
    run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    return y;
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  run(y.data_ptr<float>());
  return output_like(y, x);
}

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 dwords (each dword a bf16 pair).
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + c
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i c0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), c1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), c3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

// bf16 pairs of 16 channels: the even inputs in the low halves, the odd ones in the high halves,
// each times s and plus o (per channel), rounded to nearest even.
inline __m512i scale_pairs(__m512i pairs, __m512 s, __m512 o) {
  const __m512 even = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)), s, o);
  const __m512 odd = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF0000))), s, o);
  auto round = [](__m512 v) {  // rounded, in the high half of each dword
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  };
  return _mm512_or_si512(_mm512_srli_epi32(round(even), 16), _mm512_and_si512(round(odd), _mm512_set1_epi32(0xFFFF0000)));
}

// Pair p of half h of an int4 panel, dequantized to bf16 pairs: (128 + q) s + zero - 136 s.
inline __m512i int4_pairs(const uint8_t* q, const uint16_t* scale, const uint16_t* zero, int64_t K,
                          int64_t group_size, int64_t panel, int64_t p, int h) {
  const __m512i words = _mm512_loadu_si512(q + panel * (K / 8) * 128 + (p / 4) * 128 + 64 * h);
  const __m512i pairs = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4 * static_cast<int>(p % 4)),
                                                  _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA);
  const int64_t at = (panel * (K / group_size) + 2 * p / group_size) * kPanel + 16 * h;
  const __m512 s = widen_bf16(scale + at);
  return scale_pairs(pairs, s, _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, widen_bf16(zero + at)));
}

// The whole matrix [N, K] in bf16 from pair vectors: pairs(panel, half, p) gives pair p of the 16
// channels of a panel's half as bf16 pairs, already scaled. Sixteen pairs at a time are
// transposed into 32 inputs of each channel.
template <typename Pairs>
at::Tensor dequantize_panels(int64_t N, int64_t K, const at::Tensor& like, Pairs pairs) {
  at::Tensor w = at::empty({N, K}, like.options().dtype(at::kBFloat16));
  uint16_t* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t npairs = (K + 1) / 2;
  at::parallel_for(0, panels(N), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t panel = p0; panel < p1; ++panel)
      for (int h = 0; h < 2; ++h) {
        const int64_t n0 = panel * kPanel + 16 * h;
        if (n0 >= N) break;
        for (int64_t c = 0; c < npairs; c += 16) {
          __m512i r[16];
          for (int j = 0; j < 16; ++j) r[j] = c + j < npairs ? pairs(panel, h, c + j) : _mm512_setzero_si512();
          transpose16(r);
          const int64_t live_k = std::min<int64_t>(32, K - 2 * c);
          const __mmask32 live = live_k == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << live_k) - 1);
          for (int64_t i = 0; i < std::min<int64_t>(16, N - n0); ++i)
            _mm512_mask_storeu_epi16(wp + (n0 + i) * K + 2 * c, live, r[i]);
        }
      }
  });
  return w;
}
#endif

// The plain-loop path: dequantize, then a bf16 GEMM.
template <typename Weight>
at::Tensor dequantize_plain(int64_t N, int64_t K, const at::Tensor& like, Weight weight) {
  at::Tensor w = at::empty({N, K}, like.options().dtype(at::kBFloat16));
  uint16_t* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) wp[n * K + k] = float_to_bf16(weight(n, k));
  });
  return w;
}

void check_int8(const at::Tensor& q, const at::Tensor& scale, int64_t K) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(), "int8: scale [N] fp32");
  const int64_t N = scale.numel();
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 2 && q.size(0) == panels(N) &&
                  q.size(1) == (K + 1) / 2 * 64,
              "int8: q must be contiguous int8 [ceil(N/32), ceil(K/2) * 64] (the panel layout) for N = ", N,
              ", K = ", K);
}

void check_int4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero, int64_t group_size, int64_t K) {
  TORCH_CHECK((group_size == 32 || group_size == 64 || group_size == 128) && K % group_size == 0,
              "int4: group size must be 32, 64 or 128 and divide K = ", K);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(1) == K / 8 * 128,
              "int4: q must be contiguous uint8 [ceil(N/32), K/8 * 128] (the panel layout)");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && zero.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  zero.is_contiguous() && scale.dim() == 3 && scale.sizes() == zero.sizes() &&
                  scale.size(0) == q.size(0) && scale.size(1) == K / group_size && scale.size(2) == kPanel,
              "int4: scale and zero must be bf16 [ceil(N/32), K/G, 32]");
}

at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, int64_t K);
at::Tensor int4_dequantize(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero, int64_t group_size,
                           int64_t K, int64_t N);

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = scale.numel(), pairs = (K + 1) / 2;
  check_int8(q, scale, K);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const at::Tensor xb = bf16_input(x, 2 * pairs);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return run_panels<kTileRows>(M, N, x, [&](int64_t p, int64_t m0, auto rows, auto* y) {
    const int8_t* panel = qp + p * pairs * 64;
    panel_tile<decltype(rows)::value>(
        reinterpret_cast<const uint32_t*>(xp + m0 * 2 * pairs), pairs, pairs,
        [&](int64_t pair, int h) { return (__m512i)widen_int8(panel + pair * 64 + 32 * h); }, dot_bf16,
        sp + p * kPanel, N - p * kPanel, y, N);
  });
#else
  return output_like(at::linear(x.to(at::kBFloat16), int8_dequantize(q, scale, K)).to(at::kFloat), x);
#endif
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero,
                       int64_t group_size, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_int4(q, scale, zero, group_size, K);
  TORCH_CHECK(q.size(0) == panels(N), "int4_linear: q has ", q.size(0), " panels, expected ", panels(N));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const int64_t groups = K / group_size;
  const at::Tensor xb = bf16_input(x, K);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
  // Each group's sum of x as the kernel reads it, summed here rather than by tensor ops: this
  // runs once per layer and decode step.
  std::vector<float> xsum(M * groups);
  for (int64_t i = 0; i < M * groups; ++i) {  // rows of x are whole groups apart
    float sum = 0.f;
    for (int64_t k = 0; k < group_size; ++k) sum += bf16_to_float(xp[i * group_size + k]);
    xsum[i] = sum;
  }
  return run_panels<kInt4TileRows>(M, N, x, [&](int64_t p, int64_t m0, auto rows, auto* y) {
    int4_tile<decltype(rows)::value>(xp + m0 * K, K, groups, group_size / 8, qp + p * (K / 8) * 128,
                                     sp + p * groups * kPanel, zp + p * groups * kPanel, xsum.data() + m0 * groups,
                                     N - p * kPanel, y, N);
  });
#else
  return output_like(at::linear(x.to(at::kBFloat16), int4_dequantize(q, scale, zero, group_size, K, N)).to(at::kFloat), x);
#endif
}


at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.is_contiguous() && w.size(0) == panels(N),
              "dense_linear: x [M, K], w [ceil(N/32), ...] contiguous (the panel layout)");
  const int64_t M = x.size(0), K = x.size(1), pairs = (K + 1) / 2;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (w.scalar_type() == at::kFloat) {
    TORCH_CHECK(w.size(1) == K * kPanel, "dense_linear: fp32 w must be [ceil(N/32), K * 32]");
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xf.data_ptr<float>());
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<float>());
    return run_panels<kTileRows>(M, N, x, [&](int64_t p, int64_t m0, auto rows, auto* y) {
      const uint32_t* panel = wp + p * K * kPanel;
      panel_tile<decltype(rows)::value>(
          xp + m0 * K, K, K, [&](int64_t k, int h) { return _mm512_loadu_si512(panel + k * kPanel + 16 * h); },
          dot_fp32, nullptr, N - p * kPanel, y, N);
    });
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == pairs * 2 * kPanel,
              "dense_linear: w must be fp32 [ceil(N/32), K * 32] or bf16 [ceil(N/32), ceil(K/2) * 64]");
  const at::Tensor xb = bf16_input(x, 2 * pairs);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());  // one bf16 pair per uint32
  return run_panels<kTileRows>(M, N, x, [&](int64_t p, int64_t m0, auto rows, auto* y) {
    const uint32_t* panel = wp + p * pairs * kPanel;
    panel_tile<decltype(rows)::value>(
        xp + m0 * pairs, pairs, pairs, [&](int64_t pair, int h) { return _mm512_loadu_si512(panel + pair * kPanel + 16 * h); },
        dot_bf16, nullptr, N - p * kPanel, y, N);
  });
#else
  TORCH_CHECK(false, "dense_linear: this build has no AVX-512 BF16 kernels (the engine keeps torch's linear layers)");
#endif
}

// The whole matrix in bf16 [N, K], for the large-batch path (a bf16 GEMM on the result).
at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, int64_t K) {
  check_int8(q, scale, K);
  const int64_t N = scale.numel(), pairs = (K + 1) / 2;
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return dequantize_panels(N, K, q, [&](int64_t panel, int h, int64_t p) {
    const int64_t n0 = panel * kPanel + 16 * h;
    const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(live, sp + n0);
    // The 16 channels' pairs, widened exactly, then scaled and rounded once.
    return scale_pairs((__m512i)widen_int8(qp + panel * pairs * 64 + p * 64 + 32 * h), s, _mm512_setzero_ps());
  });
#else
  return dequantize_plain(N, K, q, [&](int64_t n, int64_t k) { return int8_at(qp, pairs, n, k) * sp[n]; });
#endif
}

at::Tensor int4_dequantize(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero, int64_t group_size,
                           int64_t K, int64_t N) {
  check_int4(q, scale, zero, group_size, K);
  const int64_t groups = K / group_size;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return dequantize_panels(N, K, q, [&](int64_t panel, int h, int64_t p) {
    return int4_pairs(qp, sp, zp, K, group_size, panel, p, h);
  });
#else
  return dequantize_plain(N, K, q, [&](int64_t n, int64_t k) {
    const int64_t at = ((n / kPanel) * groups + k / group_size) * kPanel + n % kPanel;
    const float s = bf16_to_float(sp[at]);
    return (int4_at(qp, K, n, k) - 8) * s + bf16_to_float(zp[at]);
  });
#endif
}

}  // namespace

// Whether this build has the vector paths above: without them dense_linear is unavailable and
// the quantized kernels are plain loops.
bool linear_vectorized() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("linear_vectorized() -> bool", &linear_vectorized);
  m.def("dense_linear(Tensor x, Tensor w, int out_features) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor q, Tensor scale, Tensor zero, int group_size, int out_features) -> Tensor");
  m.def("int8_dequantize(Tensor q, Tensor scale, int in_features) -> Tensor");
  m.def("int4_dequantize(Tensor q, Tensor scale, Tensor zero, int group_size, int in_features, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("dense_linear", &dense_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_dequantize", &int8_dequantize);
  m.impl("int4_dequantize", &int4_dequantize);
}
