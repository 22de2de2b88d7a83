// Loom's linear layers on CPU, y = x W^T, for every weight format: fp32 and bf16 (dense), int8
// and int4 (weight-only: kept compressed in memory, never widened to floats on the decode path).
// Each weight byte is read once per step; at batch 1 memory bandwidth sets the speed, and with
// more rows of x each weight vector feeds one dot product per row, GEMM style.
//
// Every format is stored in panels of 32 output channels, so that a vector holds 16 output
// channels (no horizontal sums, one broadcast activation per dot product). Panel P covers
// channels 32P .. 32P + 31 (N is padded with zero channels to a multiple of 32).
//   fp32: w [ceil(N/32), K * 32] fp32: input k of panel P is 32 floats, channel-major; fp32 fma.
//   bf16: w [ceil(N/32), ceil(K/2) * 64] bf16: "pair" p (inputs 2p, 2p + 1) of panel P is 64
//         values, element 2c + t is weight (32P + c, 2p + t) (K padded to even); bf16 dot products.
//   int8: u = q + 128 [ceil(N/32), ceil(K/4) * 128] uint8; scale [N] fp32; w = q * scale. Quad d
//         (inputs 4d .. 4d + 3) of panel P is two halves of 64 bytes; byte 4j + t of half h is
//         u of weight (32P + 16h + j, 4d + t): one dword lane per channel, as a uint8 x int8
//         dot product (vpdpbusd) takes it.
//   int4: q [ceil(N/32), K/8 * 128] uint8, K a multiple of 32. Octet d (inputs 8d .. 8d + 7) of
//         panel P is two halves of 64 bytes; byte 4j + t of half h holds weight (32P + 16h + j,
//         8d + t) in its low nibble and (.., 8d + 4 + t) in its high nibble. scale, zero
//         [ceil(N/32), K/G, 32] bf16; w = (q - 8) * scale + zero (torch's int4 convention), or
//         with no zero (symmetric: llama.cpp's Q4_0) w = (q - 8) * scale.
//
// The weight-only kernels never turn weights into floats (the costly step on CPUs without fp16
// arithmetic). Each row of x is quantized to int8 in groups of inputs (64 for int8 weights, 32
// for int4), x ~= s_g a with s_g = max|x over the group| / 127 (llama.cpp quantizes activations
// the same way for its q8_0 and q4_0 dot products), and the weights' unsigned bytes meet a in
// integer dot products (one vpdpbusd per 4 inputs and 16 channels), exact in int32 within a
// group; each group's sum is scaled in fp32. The rounding of x, |x - s_g a| <= s_g / 2 =
// max|x over the group| / 254, is bf16's relative precision (2^-8) for the group's largest element.
// loom/layers/linear.py and loom/quant/quantize.py build the layouts. Panels are split across
// threads; every thread keeps x in cache.
//
// Two builds of the kernels read the same layouts. With AVX-512 (BF16, VNNI) a step's 64-byte
// half is one vector, as above. With AVX2 and FMA (AMD Zen 2/3, and Intel CPUs whose AVX-512
// lacks BF16) it is two vectors of 8 channels, and what those CPUs lack is done with what they have: bf16
// weights are widened to fp32 in registers (a shift or a mask per pair) and meet fp32
// activations in fmas; the integer dot products are vpmaddubsw (uint8 x int8 -> int16 pairs)
// then vpmaddwd with ones (-> int32), with int8 weights' sign moved onto the activations first
// (|q| x sign(a, q)), since u = q + 128 times an int8 would overflow int16. Without either the
// quantized kernels dequantize with plain loops and call a bf16 GEMM (correct, slow), and the
// engine leaves dense layers to torch. Built on a CPU with AMX, bf16 panels also run through its
// tile dot products (amx_linear), for steps of many rows.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LOOM_LINEAR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define LOOM_LINEAR_AVX2 1
#endif
#if defined(LOOM_LINEAR_AVX512) || defined(LOOM_LINEAR_AVX2)
#define LOOM_LINEAR_PANELS 1  // dense_linear and the weight-only kernels exist
#include <immintrin.h>
#endif
#if defined(LOOM_LINEAR_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LOOM_LINEAR_AMX 1  // amx_linear exists (Intel Xeon since Sapphire Rapids)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output channels per panel
// Inputs per scale of the int8 activations. int4 needs a float step per weight group (32 at the
// finest) anyway; int8 weights have one scale per channel, and each activation group adds a
// float step per row and channel: measured on the 134M model's layers at batch 1, groups of
// 32 / 64 / 128 took 0.72 / 0.68 / 0.65 of bf16 weights' time (0.5 would be bandwidth).
constexpr int64_t kInt4ActivationGroup = 32, kInt8ActivationGroup = 64;

inline int64_t panels(int64_t N) { return (N + kPanel - 1) / kPanel; }

// Byte offset of weight (n, k) in the int8 and int4 layouts: panel, then 4 (int8) or 8 (int4)
// inputs at a time, then the channel's half, then its dword lane.
inline int64_t quantized_offset(int64_t n, int64_t k, int64_t steps, int64_t inputs_per_step) {
  const int64_t c = n % kPanel;
  return (n / kPanel) * steps * 128 + (k / inputs_per_step) * 128 + (c / 16) * 64 + (c % 16) * 4 + k % 4;
}
inline int int8_at(const uint8_t* u, int64_t quads, int64_t n, int64_t k) {
  return static_cast<int>(u[quantized_offset(n, k, quads, 4)]) - 128;
}
inline int int4_at(const uint8_t* q, int64_t octets, int64_t n, int64_t k) {
  return (q[quantized_offset(n, k, octets, 8)] >> ((k % 8) / 4 * 4)) & 0x0F;
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

at::Tensor output_like(const at::Tensor& y, const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

#ifdef LOOM_LINEAR_PANELS
// Every format's panel is a sequence of 128-byte steps (32 channels x 4 bytes: one fp32 input,
// a bf16 pair, an int8 quad or an int4 octet), two 64-byte halves of 16 channels each.
// Loading step s also prefetches step s + kPrefetchSteps: at batch 1 the hardware prefetcher
// alone left each core short of memory parallelism (measured on the 134M model's layers:
// bf16 weights streamed at 0.68 of the machine's read bandwidth without, 0.85 with 32 steps).
// Into L2 (T1), not L1: an L1 prefetch holds one of the core's few L1 miss buffers until its
// line arrives, which capped the stream; the L2 tracks more (Zen 4 decode steps at batch 1:
// bf16 1.1-1.2x as fast, int8 up to 1.35x, fp32 and int4 level or a little faster).
// The AVX2 build prefetches 8 steps (1 KB) ahead: on Zen 3 (512 KB of L2 a core) decode steps at
// batch 1 ran faster than with 32 (bf16 1.11x, int8 1.05x, int4 1.09x, fp32 1.03x); bf16 gained
// less with 16 or 4.
constexpr int64_t kStepBytes = 128;
#ifdef LOOM_LINEAR_AVX512
constexpr int64_t kPrefetchSteps = 32;
#else
constexpr int64_t kPrefetchSteps = 8;
#endif
// int4 also prefetches 128 steps (16 KB) ahead. Without it, a batch-1 step's int4 layers (about
// 1 MB a call) read at the same pace whether the memory gave 30 or 45 GB/s, and not for their
// arithmetic: half of it removed changed nothing. With it, Zen 4 decode steps at batch 1 ran 1.07x
// as fast at about 30 GB/s and 1.14x at 40-50. In the other kernels it was level or slower (bf16
// 0.96x, fp32 0.94x at 45-50 GB/s). On Zen 3 (AVX2) it made no difference either way.
constexpr int64_t kInt4FarPrefetchSteps = 128;

// Step s's two lines into L2.
inline void prefetch_step(const void* panel, int64_t s) {
  const char* p = static_cast<const char*>(panel) + s * kStepBytes;
  _mm_prefetch(p, _MM_HINT_T1);
  _mm_prefetch(p + 64, _MM_HINT_T1);
}

inline const char* prefetched_step(const void* panel, int64_t s) {
  prefetch_step(panel, s + kPrefetchSteps);
  return static_cast<const char*>(panel) + s * kStepBytes;
}

// Four int8 activations as one 32-bit value, to broadcast to every lane.
inline int32_t quad_at(const int8_t* a) {
  int32_t quad;
  std::memcpy(&quad, a, sizeof quad);
  return quad;
}

// Calls step(u, i) for i in [begin, end), u = i % U as a compile-time index (accumulators
// chosen by u stay in registers): few rows alternate accumulators to hide the dot product's latency.
template <int U, typename Step>
inline void unrolled(int64_t begin, int64_t end, Step step) {
  int64_t i = begin;
  for (; i + U <= end; i += U)
    [&]<int... u>(std::integer_sequence<int, u...>) { (step(std::integral_constant<int, u>{}, i + u), ...); }(
        std::make_integer_sequence<int, U>{});
  for (; i < end; ++i) step(std::integral_constant<int, 0>{}, i);
}
#endif

// Zeroes an accumulator: one vector, or every vector of a (nested) array of them.
#ifdef LOOM_LINEAR_AVX512
inline void set_zero(__m512& v) { v = _mm512_setzero_ps(); }
inline void set_zero(__m512i& v) { v = _mm512_setzero_si512(); }
#elif defined(LOOM_LINEAR_AVX2)
inline void set_zero(__m256& v) { v = _mm256_setzero_ps(); }
inline void set_zero(__m256i& v) { v = _mm256_setzero_si256(); }
#endif
template <typename V, size_t N>
inline void set_zero(V (&a)[N]) {
  for (auto& v : a) set_zero(v);
}

#ifdef LOOM_LINEAR_PANELS
// x [M, K] as a kernel reads it: contiguous rows of `dtype`, each padded with zeros to `width`
// inputs. x itself where it already is that, else one copy.
at::Tensor kernel_rows(const at::Tensor& x, at::ScalarType dtype, int64_t width) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == dtype && x.is_contiguous() && width == K) return x;
  at::Tensor rows = at::empty({M, width}, x.options().dtype(dtype));
  rows.narrow(1, 0, K).copy_(x);
  if (width > K) rows.narrow(1, K, width - K).zero_();
  return rows;
}
#endif

#ifdef LOOM_LINEAR_AVX512
constexpr int kTileRows = 12;       // dense: rows of x per register tile, 24 accumulators
constexpr int kIntTileRows = 6;     // int8 / int4: two int32 and two fp32 accumulators a row

// x[m, 2p], x[m, 2p + 1] in every lane.
inline __m512bh pair_of(const uint16_t* x, int64_t p) {
  int32_t pair;
  std::memcpy(&pair, x + 2 * p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Four int8 activations in every lane.
inline __m512i quad_of(const int8_t* a) { return _mm512_set1_epi32(quad_at(a)); }

inline void load_step(const void* panel, int64_t s, __m512i& half0, __m512i& half1) {
  const char* p = prefetched_step(panel, s);
  half0 = _mm512_loadu_si512(p);
  half1 = _mm512_loadu_si512(p + 64);
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

// MR rows of x times one dense panel -> y rows (stride ldy). Step s of the panel broadcasts 32
// bits of each row of x (x32, row stride ldx in those units: a bf16 pair, or one fp32) and meets
// the step's two weight vectors (channel halves) in dot(accumulator, weights, broadcast): a bf16
// pair dot product, or an fp32 fma.
template <int MR, typename Out, typename Dot>
inline void panel_tile(const uint32_t* x32, int64_t ldx, int64_t steps, const void* panel, Dot dot, int64_t valid,
                       Out* y, int64_t ldy) {
  constexpr int U = MR >= 4 ? 1 : 2;  // few rows: alternate accumulators to hide the dot product's latency
  __m512 acc[U][MR][2];
  set_zero(acc);
  auto step = [&](auto u, int64_t s) {  // u: a compile-time index, so the accumulators stay in registers
    __m512i b0, b1;
    load_step(panel, s, b0, b1);
    for (int m = 0; m < MR; ++m) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(x32[m * ldx + s]));
      acc[u][m][0] = dot(acc[u][m][0], b0, a);
      acc[u][m][1] = dot(acc[u][m][1], b1, a);
    }
  };
  unrolled<U>(0, steps, step);
  for (int m = 0; m < MR; ++m) {
    for (int u = 1; u < U; ++u)
      for (int h = 0; h < 2; ++h) acc[0][m][h] = _mm512_add_ps(acc[0][m][h], acc[u][m][h]);
    store_panel_row(y + m * ldy, acc[0][m][0], acc[0][m][1], nullptr, valid);
  }
}

// The two dense dot products, as types (a function pointer would not be inlined).
constexpr auto dot_bf16 = [](__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); };
constexpr auto dot_fp32 = [](__m512 acc, __m512i w, __m512i x) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
};
#elif defined(LOOM_LINEAR_AVX2)
// Rows of x per register tile, with 16 vector registers. Dense: one or two rows take a panel's
// 32 channels at once (four accumulators a row); three to six take it in two halves of 16
// channels (two accumulators a row, 12 at most), so that each widened weight vector meets up to
// six inputs. Quantized: four accumulators a row, two rows.
constexpr int kTileRows = 6, kIntTileRows = 2;

// Four int8 activations in every lane.
inline __m256i quad_of(const int8_t* a) { return _mm256_set1_epi32(quad_at(a)); }

// A step as four vectors of 8 channels each (channels 8i .. 8i + 7 in w[i]).
inline void load_step(const void* panel, int64_t s, __m256i (&w)[4]) {
  const char* p = prefetched_step(panel, s);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i));
}

// Stores a panel's row (channels n0 .. n0 + 8V - 1 of `valid`, V vectors), times `scale` [8V]
// when given, as fp32 or as bf16 (rounded to nearest even). Through a buffer: AVX2 has no masked
// bf16 store, and a row costs this once per K * 32 weights.
template <typename Out, size_t V>
inline void store_panel_row(Out* y, const __m256 (&v)[V], const float* scale, int64_t valid) {
  alignas(32) float row[8 * V];
  for (size_t i = 0; i < V; ++i) _mm256_store_ps(row + 8 * i, v[i]);
  for (int64_t c = 0; c < std::min<int64_t>(valid, 8 * V); ++c) {
    const float r = scale ? row[c] * scale[c] : row[c];
    if constexpr (std::is_same_v<Out, float>)
      y[c] = r;
    else
      y[c] = float_to_bf16(r);
  }
}

// The dense panel's steps: with fp32 weights, step s is input s; with bf16 weights, inputs 2s and
// 2s + 1, each channel's pair in one dword lane: shifting the lane left by 16 bits gives input
// 2s's weight as fp32, masking its low half gives input 2s + 1's.

// Three to six rows take half `Half` of the panel (channels 16 Half .. 16 Half + 15: bytes 64 Half
// .. 64 Half + 63 of each step), widening the even inputs' weights, then the odd ones', into the
// same two registers. The first half's loads prefetch the whole step ahead; the second half
// finds it in cache.
template <int MR, bool Bf16Weights, int Half, typename Out>
inline void dense_half_tile(const float* x, int64_t ldx, int64_t steps, const char* panel, int64_t valid, Out* y,
                            int64_t ldy) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // Rows as a pack m..., every accumulator named by a constant: GCC keeps them in registers only
  // so (a loop over rows, before or after the steps, had it store each one to memory every step).
  [&]<int... m>(std::integer_sequence<int, m...>) {
    __m256 acc[MR][2] = {};
    // Input k of each row times 16 channels' weights (inlined, or the accumulators go to memory).
    auto meet = [&](__m256 w0, __m256 w1, int64_t k) __attribute__((always_inline)) {
      __m256 xs;
      ((xs = _mm256_broadcast_ss(x + m * ldx + k), acc[m][0] = _mm256_fmadd_ps(w0, xs, acc[m][0]),
        acc[m][1] = _mm256_fmadd_ps(w1, xs, acc[m][1])), ...);
    };
    for (int64_t s = 0; s < steps; ++s) {
      const char* p = (Half == 0 ? prefetched_step(panel, s) : panel + s * kStepBytes) + 64 * Half;
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      if constexpr (Bf16Weights) {
        meet(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), 2 * s);
        meet(_mm256_castsi256_ps(_mm256_and_si256(w0, high_half)),
             _mm256_castsi256_ps(_mm256_and_si256(w1, high_half)), 2 * s + 1);
      } else {
        meet(_mm256_castsi256_ps(w0), _mm256_castsi256_ps(w1), s);
      }
    }
    auto store = [&](int r, __m256 a0, __m256 a1) {
      const __m256 row[2] = {a0, a1};
      store_panel_row(y + r * ldy + 16 * Half, row, nullptr, valid - 16 * Half);
    };
    (store(m, acc[m][0], acc[m][1]), ...);
  }(std::make_integer_sequence<int, MR>{});
}

// MR rows of fp32 x (row stride ldx) times one dense panel -> y rows (stride ldy): one or two rows
// take the panel whole, three to six in halves (dense_half_tile).
template <int MR, bool Bf16Weights, typename Out>
inline void dense_tile(const float* x, int64_t ldx, int64_t steps, const void* panel, int64_t valid, Out* y,
                       int64_t ldy) {
  if constexpr (MR >= 3) {
    const char* p = static_cast<const char*>(panel);
    dense_half_tile<MR, Bf16Weights, 0>(x, ldx, steps, p, valid, y, ldy);
    if (valid > 16) dense_half_tile<MR, Bf16Weights, 1>(x, ldx, steps, p, valid, y, ldy);
    return;
  }
  constexpr int U = MR >= 2 ? 1 : 2;  // one row: alternate accumulators to hide the fma's latency
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[U][MR][4];
  set_zero(acc);
  unrolled<U>(0, steps, [&](auto u, int64_t s) {
    __m256i w[4];
    load_step(panel, s, w);
    for (int m = 0; m < MR; ++m) {
      if constexpr (Bf16Weights) {
        const __m256 even = _mm256_broadcast_ss(x + m * ldx + 2 * s), odd = _mm256_broadcast_ss(x + m * ldx + 2 * s + 1);
        for (int i = 0; i < 4; ++i) {
          acc[u][m][i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w[i], 16)), even, acc[u][m][i]);
          acc[u][m][i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w[i], high_half)), odd, acc[u][m][i]);
        }
      } else {
        const __m256 xs = _mm256_broadcast_ss(x + m * ldx + s);
        for (int i = 0; i < 4; ++i) acc[u][m][i] = _mm256_fmadd_ps(_mm256_castsi256_ps(w[i]), xs, acc[u][m][i]);
      }
    }
  });
  for (int m = 0; m < MR; ++m) {
    for (int u = 1; u < U; ++u)
      for (int i = 0; i < 4; ++i) acc[0][m][i] = _mm256_add_ps(acc[0][m][i], acc[u][m][i]);
    store_panel_row(y + m * ldy, acc[0][m], nullptr, valid);
  }
}
#endif

// Rows of x as int8 in groups of `group` inputs (see the top of this file):
// x[m, k] ~= scale[m, g] * a[m, k] with g = k / group, K padded with zeros to `stride`;
// sums[m, g] = sum of a over group g (the weights' offsets meet it).
struct QuantizedRows {
  int64_t stride, group, groups;  // stride = group * groups
  std::vector<int8_t> a;        // [M, stride]
  std::vector<float> scale;     // [M, groups]
  std::vector<int32_t> sums;    // [M, groups]
};

#ifdef LOOM_LINEAR_AVX512
// 16 inputs of a row (fewer at its end: `live`) as fp32.
inline __m512 load_row(const float* x, __mmask16 live) { return _mm512_maskz_loadu_ps(live, x); }
inline __m512 load_row(const uint16_t* x, __mmask16 live) { return load_bf16x16(x, live); }

template <typename T>
void quantize_row(const T* x, int64_t K, QuantizedRows& r, int64_t m) {
  auto live = [&](int64_t k) {
    return static_cast<__mmask16>(K - k >= 16 ? 0xFFFF : K > k ? (1u << (K - k)) - 1 : 0);
  };
  int8_t* a = r.a.data() + m * r.stride;
  for (int64_t g = 0; g < r.groups; ++g) {
    const int64_t k0 = g * r.group, k1 = k0 + r.group;
    __m512 largest = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(load_row(x + k, live(k))));
    const float top = _mm512_reduce_max_ps(largest);
    r.scale[m * r.groups + g] = top / 127.f;
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 16) {
      // Rounded to nearest even; |x / s| <= 127 up to the rounding of 1 / s: clamped to int8.
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_row(x + k, live(k)), inv));
      q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a + k), _mm512_cvtepi32_epi8(q));
      sum = _mm512_add_epi32(sum, q);
    }
    r.sums[m * r.groups + g] = _mm512_reduce_add_epi32(sum);
  }
}
#elif defined(LOOM_LINEAR_AVX2)
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }

inline float max_of(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

inline int32_t sum_of(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}

template <typename T>
void quantize_row(const T* x, int64_t K, QuantizedRows& r, int64_t m) {
  alignas(32) float xs[kInt8ActivationGroup];  // a group as fp32, zeros past K (groups are 32 or 64)
  const __m256 sign = _mm256_set1_ps(-0.f);
  int8_t* a = r.a.data() + m * r.stride;
  for (int64_t g = 0; g < r.groups; ++g) {
    const int64_t k0 = g * r.group;
    for (int64_t i = 0; i < r.group; ++i) xs[i] = k0 + i < K ? to_float(x[k0 + i]) : 0.f;
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < r.group; i += 8) largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_load_ps(xs + i)));
    const float top = max_of(largest);
    r.scale[m * r.groups + g] = top / 127.f;
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < r.group; i += 32) {
      __m256i q[4];
      for (int j = 0; j < 4; ++j) {
        // Rounded to nearest even; |x / s| <= 127 up to the rounding of 1 / s: clamped to int8.
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(xs + i + 8 * j), inv));
        q[j] = _mm256_max_epi32(_mm256_min_epi32(q[j], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        sum = _mm256_add_epi32(sum, q[j]);
      }
      // The packs work within 128-bit lanes: their dwords (4 inputs each) come out as q0..q3's
      // first four inputs, then their last four; a permutation restores the inputs' order.
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + k0 + i),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    r.sums[m * r.groups + g] = sum_of(sum);
  }
}
#endif

#ifdef LOOM_LINEAR_PANELS

// x [M, K] -> QuantizedRows in groups of `group` inputs covering at least `min_k` (zeros past K).
QuantizedRows quantize_rows(const at::Tensor& x, int64_t min_k, int64_t group) {
  const at::Tensor xc = (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) ? x.contiguous()
                                                                                               : x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = (std::max(K, min_k) + group - 1) / group;
  QuantizedRows r{groups * group, group, groups, std::vector<int8_t>(M * groups * group),
                  std::vector<float>(M * groups), std::vector<int32_t>(M * groups)};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (xc.scalar_type() == at::kBFloat16)
        quantize_row(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()) + m * K, K, r, m);
      else
        quantize_row(xc.data_ptr<float>() + m * K, K, r, m);
    }
  });
  return r;
}
#endif

// Calls f(panel) for every panel, shared out over torch's threads with stealing (parallel.h).
template <typename F>
void for_each_panel(int64_t num_panels, F f) {
  for_each_task(num_panels, [&](auto next) {
    for (TaskClaim c = next(); c.task >= 0; c = next()) f(c.task);
  });
}

// y [M, N] in x's dtype: run(pointer to y) writes it as bf16 (bf16 x) or fp32 (then converted).
template <typename Run>
at::Tensor output_of(int64_t M, int64_t N, const at::Tensor& x, Run run) {
  if (x.scalar_type() == at::kBFloat16) {
    at::Tensor y = at::empty({M, N}, x.options());
    run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    return y;
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  run(y.data_ptr<float>());
  return output_like(y, x);
}

// y [M, N] in x's dtype; tile(panel, m0, rows tag, pointer to y[m0, 32 * panel]) computes one tile.
template <int MaxRows, typename Tile>
at::Tensor run_panels(int64_t M, int64_t N, const at::Tensor& x, Tile tile) {
  return output_of(M, N, x, [&](auto* yp) {
    for_each_panel(panels(N), [&](int64_t p) {
      for_each_tile<MaxRows>(M, [&](int64_t m0, auto rows) { tile(p, m0, rows, yp + m0 * N + p * kPanel); });
    });
  });
}

#ifdef LOOM_LINEAR_AVX512
// Accumulators per channel half and row: at 1-2 rows, two, so that more dot products are in
// flight (4 per row measured no faster at batch 1, where memory sets the pace).
template <int MR>
constexpr int kChains = MR >= 3 ? 1 : 2;

// MR rows of x times one int8 panel. Per activation group (16 quads) and row: sum(u a) in int32,
// then total += s_g (sum(u a) - 128 sum(a)), as q = u - 128; the channel scales come last.
template <int MR, typename Out>
inline void int8_tile(const QuantizedRows& a, int64_t m0, int64_t quads, const uint8_t* panel, const float* scale,
                      int64_t valid, Out* y, int64_t ldy) {
  constexpr int U = kChains<MR>;
  const int64_t quads_per_group = a.group / 4;
  __m512 total[MR][2];
  set_zero(total);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i acc[U][MR][2];
    set_zero(acc);
    unrolled<U>(g * quads_per_group, std::min((g + 1) * quads_per_group, quads), [&](auto u, int64_t d) {
      __m512i w0, w1;
      load_step(panel, d, w0, w1);
      for (int m = 0; m < MR; ++m) {
        const __m512i x4 = quad_of(a.a.data() + (m0 + m) * a.stride + 4 * d);
        acc[u][m][0] = _mm512_dpbusd_epi32(acc[u][m][0], w0, x4);
        acc[u][m][1] = _mm512_dpbusd_epi32(acc[u][m][1], w1, x4);
      }
    });
    for (int m = 0; m < MR; ++m) {
      const int64_t row = (m0 + m) * a.groups + g;
      const __m512i offset = _mm512_set1_epi32(128 * a.sums[row]);
      const __m512 s = _mm512_set1_ps(a.scale[row]);
      for (int h = 0; h < 2; ++h) {
        for (int u = 1; u < U; ++u) acc[0][m][h] = _mm512_add_epi32(acc[0][m][h], acc[u][m][h]);
        total[m][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[0][m][h], offset)), s, total[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) store_panel_row(y + m * ldy, total[m][0], total[m][1], scale, valid);
}

// MR rows of x times one int4 panel. Per activation group (4 octets) and row: sum(q a) in int32
// (low nibbles meet inputs 8d .. 8d + 3, high nibbles 8d + 4 .. 8d + 7), then with the weight
// group's scale and zero (none, kZero false: 0), total += s_g (scale sum(q a) + (zero - 8 scale) sum(a)).
template <int MR, bool kZero, typename Out>
inline void int4_tile(const QuantizedRows& a, int64_t m0, int64_t group_size, const uint8_t* panel,
                      const uint16_t* scale, const uint16_t* zero, int64_t valid, Out* y, int64_t ldy) {
  constexpr int U = kChains<MR>;
  constexpr int64_t kOctetsPerGroup = kInt4ActivationGroup / 8;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 total[MR][2];
  set_zero(total);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i acc[U][MR][2];
    set_zero(acc);
    for (int64_t d = g * kOctetsPerGroup; d < (g + 1) * kOctetsPerGroup; ++d) {
      __m512i block[2];
      load_step(panel, d, block[0], block[1]);
      prefetch_step(panel, d + kInt4FarPrefetchSteps);
      for (int e = 0; e < 2; ++e) {  // low, then high nibbles (in their own accumulators when U = 2)
        const __m512i w0 = _mm512_and_si512(e ? _mm512_srli_epi16(block[0], 4) : block[0], nibble);
        const __m512i w1 = _mm512_and_si512(e ? _mm512_srli_epi16(block[1], 4) : block[1], nibble);
        for (int m = 0; m < MR; ++m) {
          const __m512i x4 = quad_of(a.a.data() + (m0 + m) * a.stride + 8 * d + 4 * e);
          acc[e % U][m][0] = _mm512_dpbusd_epi32(acc[e % U][m][0], w0, x4);
          acc[e % U][m][1] = _mm512_dpbusd_epi32(acc[e % U][m][1], w1, x4);
        }
      }
    }
    const int64_t wg = g * kInt4ActivationGroup / group_size;  // the weight group holding this activation group
    for (int h = 0; h < 2; ++h) {
      const __m512 ws = load_bf16x16(scale + wg * kPanel + 16 * h);
      const __m512 offset = kZero ? _mm512_fnmadd_ps(_mm512_set1_ps(8.f), ws, load_bf16x16(zero + wg * kPanel + 16 * h))
                                  : _mm512_mul_ps(_mm512_set1_ps(-8.f), ws);
      for (int m = 0; m < MR; ++m) {
        const int64_t row = (m0 + m) * a.groups + g;
        for (int u = 1; u < U; ++u) acc[0][m][h] = _mm512_add_epi32(acc[0][m][h], acc[u][m][h]);
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0][m][h]), ws,
                                         _mm512_mul_ps(offset, _mm512_set1_ps(static_cast<float>(a.sums[row]))));
        total[m][h] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.scale[row]), total[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) store_panel_row(y + m * ldy, total[m][0], total[m][1], nullptr, valid);
}

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 dwords.
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

// The whole matrix [N, K] in bf16, 16 channels and 16 steps (quads or octets) at a time: the
// steps' 64-byte halves are transposed so that each vector holds one channel's inputs, then
// row(n, v, k0, out) writes channel n's inputs from k0 (4 or 8 per step, as bf16) into out.
template <typename Row>
at::Tensor dequantize_panels(int64_t N, int64_t K, int64_t steps, const uint8_t* q, const at::Tensor& like, Row row) {
  at::Tensor w = at::empty({N, K}, like.options().dtype(at::kBFloat16));
  uint16_t* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels(N), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t panel = p0; panel < p1; ++panel)
      for (int h = 0; h < 2; ++h) {
        const int64_t n0 = panel * kPanel + 16 * h;
        if (n0 >= N) break;
        for (int64_t c = 0; c < steps; c += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i)
            r[i] = c + i < steps ? _mm512_loadu_si512(q + (panel * steps + c + i) * 128 + 64 * h) : _mm512_setzero_si512();
          transpose16(r);
          for (int64_t i = 0; i < std::min<int64_t>(16, N - n0); ++i) row(n0 + i, r[i], c, wp + (n0 + i) * K);
        }
      }
  });
  return w;
}

// 16 floats -> bf16 at out[k0 .. k0 + 15], the inputs below K only.
inline void store_bf16(uint16_t* out, int64_t k0, int64_t K, __m512 v) {
  const int64_t live_k = std::clamp<int64_t>(K - k0, 0, 16);
  if (live_k > 0)
    _mm256_mask_storeu_epi16(out + k0, static_cast<__mmask16>((1u << live_k) - 1), (__m256i)_mm512_cvtneps_pbh(v));
}
#elif defined(LOOM_LINEAR_AVX2)
// MR rows of x times one int8 panel. Per activation group (16 quads) and row: sum(q a) in int32,
// each quad's four products by vpmaddubsw(|q|, sign(a, q)) (|q| <= 127 and |a| <= 127, so an
// int16 pair sum cannot saturate) and vpmaddwd with ones; then total += s_g sum(q a), and the
// channel scales come last.
template <int MR, typename Out>
inline void int8_tile(const QuantizedRows& a, int64_t m0, int64_t quads, const uint8_t* panel, const float* scale,
                      int64_t valid, Out* y, int64_t ldy) {
  const int64_t quads_per_group = a.group / 4;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 total[MR][4];
  set_zero(total);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i acc[MR][4];
    set_zero(acc);
    for (int64_t d = g * quads_per_group; d < std::min((g + 1) * quads_per_group, quads); ++d) {
      __m256i w[4];
      load_step(panel, d, w);
      for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_xor_si256(w[i], flip);  // u - 128
        const __m256i magnitude = _mm256_abs_epi8(q);
        for (int m = 0; m < MR; ++m) {
          const __m256i x4 = quad_of(a.a.data() + (m0 + m) * a.stride + 4 * d);
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x4, q));
          acc[m][i] = _mm256_add_epi32(acc[m][i], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_set1_ps(a.scale[(m0 + m) * a.groups + g]);
      for (int i = 0; i < 4; ++i) total[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][i]), s, total[m][i]);
    }
  }
  for (int m = 0; m < MR; ++m) store_panel_row(y + m * ldy, total[m], scale, valid);
}

// MR rows of x times one int4 panel. Per activation group (4 octets) and row: sum(q a) with
// vpmaddubsw (q in 0..15 unsigned, a int8), accumulated in int16 over the group (at most
// 8 x 2 x 15 x 127 = 30480, no saturation), widened to int32 once; then as the AVX-512 path,
// total += s_g (scale sum(q a) + (zero - 8 scale) sum(a)), zero 0 where there is none.
template <int MR, bool kZero, typename Out>
inline void int4_tile(const QuantizedRows& a, int64_t m0, int64_t group_size, const uint8_t* panel,
                      const uint16_t* scale, const uint16_t* zero, int64_t valid, Out* y, int64_t ldy) {
  constexpr int64_t kOctetsPerGroup = kInt4ActivationGroup / 8;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 total[MR][4];
  set_zero(total);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i acc[MR][4];  // int16 pairs
    set_zero(acc);
    for (int64_t d = g * kOctetsPerGroup; d < (g + 1) * kOctetsPerGroup; ++d) {
      __m256i w[4];
      load_step(panel, d, w);
      prefetch_step(panel, d + kInt4FarPrefetchSteps);
      for (int i = 0; i < 4; ++i) {
        const __m256i low = _mm256_and_si256(w[i], nibble), high = _mm256_and_si256(_mm256_srli_epi16(w[i], 4), nibble);
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = a.a.data() + (m0 + m) * a.stride + 8 * d;
          acc[m][i] = _mm256_add_epi16(acc[m][i], _mm256_add_epi16(_mm256_maddubs_epi16(low, quad_of(x)),
                                                                   _mm256_maddubs_epi16(high, quad_of(x + 4))));
        }
      }
    }
    const int64_t wg = g * kInt4ActivationGroup / group_size;  // the weight group holding this activation group
    for (int i = 0; i < 4; ++i) {
      const __m256 ws = load_bf16x8(scale + wg * kPanel + 8 * i);
      const __m256 offset = kZero ? _mm256_fnmadd_ps(_mm256_set1_ps(8.f), ws, load_bf16x8(zero + wg * kPanel + 8 * i))
                                  : _mm256_mul_ps(_mm256_set1_ps(-8.f), ws);
      for (int m = 0; m < MR; ++m) {
        const int64_t row = (m0 + m) * a.groups + g;
        const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][i], ones)), ws,
                                         _mm256_mul_ps(offset, _mm256_set1_ps(static_cast<float>(a.sums[row]))));
        total[m][i] = _mm256_fmadd_ps(t, _mm256_set1_ps(a.scale[row]), total[m][i]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) store_panel_row(y + m * ldy, total[m], nullptr, valid);
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
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(0) == panels(N) &&
                  q.size(1) == (K + 3) / 4 * 128,
              "int8: q must be contiguous uint8 [ceil(N/32), ceil(K/4) * 128] (the panel layout, q + 128) for N = ",
              N, ", K = ", K);
}

// The zero points' bf16 values, or null for a symmetric matrix (none given).
const uint16_t* check_int4(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                           int64_t group_size, int64_t K) {
  TORCH_CHECK((group_size == 32 || group_size == 64 || group_size == 128) && K % group_size == 0,
              "int4: group size must be 32, 64 or 128 and divide K = ", K);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(1) == K / 8 * 128,
              "int4: q must be contiguous uint8 [ceil(N/32), K/8 * 128] (the panel layout)");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() && scale.dim() == 3 &&
                  scale.size(0) == q.size(0) && scale.size(1) == K / group_size && scale.size(2) == kPanel,
              "int4: scale must be bf16 [ceil(N/32), K/G, 32]");
  if (!zero) return nullptr;
  TORCH_CHECK(zero->scalar_type() == at::kBFloat16 && zero->is_contiguous() && zero->sizes() == scale.sizes(),
              "int4: zero must be bf16 [ceil(N/32), K/G, 32], as scale");
  return reinterpret_cast<const uint16_t*>(zero->data_ptr<at::BFloat16>());
}

#ifdef LOOM_LINEAR_AMX
// AMX: bf16 panels through tile dot products. The bf16 panel layout is already what a B tile of
// tdpbf16ps reads: 16 rows of bf16 pairs for 16 channels, 64 bytes a row. Pairs q .. q + 15 of a
// panel's channels 0-15 are the first 64 bytes of its steps q .. q + 15 (128 bytes apart), channels
// 16-31 the second 64. So one weight layout serves the vector kernel (few rows) and the tiles
// (many), and neither repacks anything per call.

// Linux lends a process the tiles' register state only once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the answer holds for every thread.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// 16 * RowTiles rows of x (bf16, ldx elements a row; rows 0-15 from x0, 16-31 from x1) times
// `blocks` blocks of 16 pairs of one panel -> c [16 * RowTiles][32] fp32. Tiles 0-3 accumulate c
// (rows 0-15 / 16-31 times channels 0-15 / 16-31), tiles 4-5 hold 16 rows of x (32 bf16 inputs),
// tiles 6-7 the panel's two channel halves over 16 pairs.
template <int RowTiles>
inline void amx_tile(const uint16_t* x0, const uint16_t* x1, int64_t ldx, const uint16_t* panel, int64_t blocks,
                     float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* w = panel + b * 16 * 64;
    _tile_loadd(6, w, kStepBytes);
    _tile_loadd(7, w + 32, kStepBytes);
    _tile_loadd(4, x0 + b * 32, ldx * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RowTiles == 2) {
      _tile_loadd(5, x1 + b * 32, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 32 * sizeof(float));
  _tile_stored(1, c + 16, 32 * sizeof(float));
  if constexpr (RowTiles == 2) {
    _tile_stored(2, c + 16 * 32, 32 * sizeof(float));
    _tile_stored(3, c + 16 * 32 + 16, 32 * sizeof(float));
  }
}

// Panels per group, for x of x_bytes. Once x outgrows half of L2, a thread takes a group of
// panels and passes every 32 rows of x over each of them in turn: a 32-row slice of x is then
// read once per group rather than once per panel, and the group's weights stay in L2 the while.
// Panel by panel, all of x would stream from L3 for every 32 channels. The groups take 3/8 of L2
// and are as many as the threads, or a multiple, so that every thread gets as much. Smaller x
// goes panel by panel (groups of one), which was faster there: it is in L2 anyway, and a
// thread done early takes single panels from the other's share. On an AMX Xeon (2 cores, 2 MB of
// L2 each) the 134M model's four layer shapes took 21.2-21.8 ms panel by panel at 2048 rows and
// 15.1-15.3 in groups (runs in turns); at 1024 rows 8.2-8.4 and 7.7; at 512 rows and fewer, level.
// Groups of a quarter or a half of L2 were no faster.
int64_t amx_panels_per_group(int64_t num_panels, int64_t panel_bytes, int64_t x_bytes) {
  static const int64_t l2_bytes = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? int64_t{size} : int64_t{2} << 20;
  }();
  if (2 * x_bytes <= l2_bytes) return 1;
  const int64_t most = std::max<int64_t>(1, l2_bytes * 3 / 8 / panel_bytes),
                threads = std::max(1, at::get_num_threads());
  const int64_t groups = std::min(num_panels, ((num_panels + most - 1) / most + threads - 1) / threads * threads);
  return (num_panels + groups - 1) / groups;
}
#endif

}  // namespace

#ifdef LOOM_LINEAR_AMX
// Eight tiles of 16 rows x 64 bytes, the shape of every tile Loom's kernels use (here and in
// paged_attention.cpp). The configuration is a thread's state, and torch's other AMX users
// (oneDNN) load their own: each stretch of tile work loads this one first. It is constant data:
// GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so the rest of a configuration
// built on the stack may never be stored (ldtilecfg then faults on garbage).
void configure_amx_tiles() {
  struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  static constexpr TileConfig config{1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
  _tile_loadconfig(&config);
}
#endif

// The operators (and decode_step.cpp's calls).
at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, int64_t K);
at::Tensor int4_dequantize(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                           int64_t group_size, int64_t K, int64_t N);

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = scale.numel(), quads = (K + 3) / 4;
  check_int8(q, scale, K);
#ifdef LOOM_LINEAR_PANELS
  const QuantizedRows a = quantize_rows(x, 4 * quads, kInt8ActivationGroup);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  return run_panels<kIntTileRows>(M, N, x, [&](int64_t p, int64_t m0, auto rows, auto* y) {
    int8_tile<decltype(rows)::value>(a, m0, quads, qp + p * quads * 128, sp + p * kPanel, N - p * kPanel, y, N);
  });
#else
  return output_like(at::linear(x.to(at::kBFloat16), int8_dequantize(q, scale, K)).to(at::kFloat), x);
#endif
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& zero, int64_t group_size, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  [[maybe_unused]] const uint16_t* zp = check_int4(q, scale, zero, group_size, K);
  TORCH_CHECK(q.size(0) == panels(N), "int4_linear: q has ", q.size(0), " panels, expected ", panels(N));
#ifdef LOOM_LINEAR_PANELS
  const int64_t groups = K / group_size;
  const QuantizedRows a = quantize_rows(x, K, kInt4ActivationGroup);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  // The zero points' presence is a template argument: the symmetric tile has no per-group test.
  return run_panels<kIntTileRows>(M, N, x, [&](int64_t p, int64_t m0, auto rows, auto* y) {
    constexpr int MR = decltype(rows)::value;
    const uint8_t* panel = qp + p * (K / 8) * 128;
    const uint16_t* scales = sp + p * groups * kPanel;
    if (zp)
      int4_tile<MR, true>(a, m0, group_size, panel, scales, zp + p * groups * kPanel, N - p * kPanel, y, N);
    else
      int4_tile<MR, false>(a, m0, group_size, panel, scales, nullptr, N - p * kPanel, y, N);
  });
#else
  return output_like(at::linear(x.to(at::kBFloat16), int4_dequantize(q, scale, zero, group_size, K, N)).to(at::kFloat), x);
#endif
}

#ifdef LOOM_LINEAR_AVX512
// Rows of x a dense tile takes where they are a multiple of 4 KB apart. A dense tile broadcasts
// from each of its rows at every step, and rows 4 KB apart all fall in one set of the L1 (64
// sets of 64 bytes), which holds 8 lines on Zen 4: 12 rows evict one another, 8 fit. That is
// K = 1024 or 2048 in fp32, 2048 in bf16 (the 134M model's down projection), 4096 in 7B-class
// models. Measured on Zen 4, the two taking turns in one process over 16 to 2047 rows of K = 2048:
// 8-row tiles over x as it is ran 1.02-1.17x (bf16) and 1.04-1.11x (fp32) as fast as 12-row tiles
// over a copy of x with its rows a cache line further apart (the copy alone was a tenth of the
// time at 16 rows); over other widths 8-row tiles were no faster overall (0.95-1.05x).
constexpr int kSetTileRows = 8;

// run_panels for a dense kernel whose rows of x are `row_bytes` apart, with tiles that fit the L1.
template <typename Tile>
at::Tensor run_dense_panels(int64_t M, int64_t N, const at::Tensor& x, int64_t row_bytes, Tile tile) {
  if (row_bytes % 4096 == 0) return run_panels<kSetTileRows>(M, N, x, tile);
  return run_panels<kTileRows>(M, N, x, tile);
}
#endif

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.is_contiguous() && w.size(0) == panels(N),
              "dense_linear: x [M, K], w [ceil(N/32), ...] contiguous (the panel layout)");
  const int64_t M = x.size(0), K = x.size(1), pairs = (K + 1) / 2;
  const bool fp32 = w.scalar_type() == at::kFloat;
  TORCH_CHECK(fp32 ? w.size(1) == K * kPanel : w.scalar_type() == at::kBFloat16 && w.size(1) == pairs * 2 * kPanel,
              "dense_linear: w must be fp32 [ceil(N/32), K * 32] or bf16 [ceil(N/32), ceil(K/2) * 64]");
#ifdef LOOM_LINEAR_AVX512
  if (fp32) {
    const at::Tensor xf = kernel_rows(x, at::kFloat, K);
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xf.data_ptr<float>());
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<float>());
    return run_dense_panels(M, N, x, K * sizeof(float), [&](int64_t p, int64_t m0, auto rows, auto* y) {
      panel_tile<decltype(rows)::value>(xp + m0 * K, K, K, wp + p * K * kPanel, dot_fp32, N - p * kPanel, y, N);
    });
  }
  const at::Tensor xb = kernel_rows(x, at::kBFloat16, 2 * pairs);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());  // one bf16 pair per uint32
  return run_dense_panels(M, N, x, pairs * sizeof(uint32_t), [&](int64_t p, int64_t m0, auto rows, auto* y) {
    panel_tile<decltype(rows)::value>(xp + m0 * pairs, pairs, pairs, wp + p * pairs * kPanel, dot_bf16,
                                      N - p * kPanel, y, N);
  });
#elif defined(LOOM_LINEAR_AVX2)
  // x in fp32 whatever its dtype (bf16 weights are widened to meet it), K padded to even for bf16.
  const int64_t ldx = fp32 ? K : 2 * pairs;
  const at::Tensor xf = kernel_rows(x, at::kFloat, ldx);
  const float* xp = xf.data_ptr<float>();
  const char* wp = static_cast<const char*>(w.data_ptr());
  const int64_t steps = fp32 ? K : pairs;
  return run_panels<kTileRows>(M, N, x, [&](int64_t p, int64_t m0, auto rows, auto* y) {
    constexpr int MR = decltype(rows)::value;
    const char* panel = wp + p * steps * kStepBytes;
    if (fp32)
      dense_tile<MR, false>(xp + m0 * ldx, ldx, steps, panel, N - p * kPanel, y, N);
    else
      dense_tile<MR, true>(xp + m0 * ldx, ldx, steps, panel, N - p * kPanel, y, N);
  });
#else
  TORCH_CHECK(false, "dense_linear: this build has no AVX2 or AVX-512 kernels (the engine keeps torch's linear layers)");
#endif
}

// dense_linear's bf16 product through AMX tiles (bf16 weights only): the kernel for many rows,
// where the vector kernel's broadcasts cap it at the CPU's vector dot-product rate.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.is_contiguous() && w.size(0) == panels(N),
              "amx_linear: x [M, K], w [ceil(N/32), ...] contiguous (the panel layout)");
  const int64_t M = x.size(0), K = x.size(1), pairs = (K + 1) / 2;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == pairs * 2 * kPanel,
              "amx_linear: w must be bf16 [ceil(N/32), ceil(K/2) * 64]");
#ifdef LOOM_LINEAR_AMX
  TORCH_CHECK(amx_permitted(), "amx_linear: the OS did not grant this process AMX's tile state");
  // x as bf16 with K padded to even. A tile reads 16 rows: the rows after the last whole tile of
  // 16 go to a tile of their own, padded with zeros (padding all of x would copy it).
  const at::Tensor xb = kernel_rows(x, at::kBFloat16, 2 * pairs);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t ldx = 2 * pairs, blocks = pairs / 16, whole = M / 16 * 16;
  std::vector<uint16_t> tail(whole < M ? 16 * ldx : 0);
  std::copy(xp + whole * ldx, xp + M * ldx, tail.begin());
  // Row r0's tile of 16 (r0 a multiple of 16).
  auto rows_from = [&](int64_t r0) { return r0 < whole ? xp + r0 * ldx : tail.data(); };
  const int64_t P = panels(N), group = amx_panels_per_group(P, pairs * kPanel * 2 * sizeof(uint16_t), M * ldx * 2);
  return output_of(M, N, x, [&](auto* y) {
    for_each_panel((P + group - 1) / group, [&](int64_t g) {  // shares out groups as it does panels
      configure_amx_tiles();
      alignas(64) float c[32 * 32];
      const int64_t first = g * group, last = std::min(P, first + group);
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int64_t rows = std::min<int64_t>(32, M - m0);
        for (int64_t p = first; p < last; ++p) {
          const uint16_t* panel = wp + p * pairs * kPanel * 2;
          if (rows > 16)
            amx_tile<2>(rows_from(m0), rows_from(m0 + 16), ldx, panel, blocks, c);
          else
            amx_tile<1>(rows_from(m0), nullptr, ldx, panel, blocks, c);
          for (int64_t m = 0; m < rows; ++m) {
            __m512 acc0 = _mm512_load_ps(c + m * 32), acc1 = _mm512_load_ps(c + m * 32 + 16);
            for (int64_t q = blocks * 16; q < pairs; ++q) {  // the pairs after the last whole block
              __m512i b0, b1;
              load_step(panel, q, b0, b1);
              const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(
                  reinterpret_cast<const uint32_t*>(xp + (m0 + m) * ldx)[q]));
              acc0 = dot_bf16(acc0, b0, a);
              acc1 = dot_bf16(acc1, b1, a);
            }
            store_panel_row(y + (m0 + m) * N + p * kPanel, acc0, acc1, nullptr, N - p * kPanel);
          }
        }
      }
      _tile_release();
    });
  });
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX kernels (built on a CPU without AMX)");
#endif
}

// Whether amx_linear runs here: built with AMX, and the OS lends this process the tiles.
bool amx_tiles() {
#ifdef LOOM_LINEAR_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// The whole matrix in bf16 [N, K], for the large-batch path (a bf16 GEMM on the result).
at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, int64_t K) {
  check_int8(q, scale, K);
  const int64_t N = scale.numel(), quads = (K + 3) / 4;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
#ifdef LOOM_LINEAR_AVX512
  // After the transpose, lane i of a channel's vector holds its 4 inputs of quad c + i.
  return dequantize_panels(N, K, quads, qp, q, [&](int64_t n, __m512i v, int64_t c, uint16_t* out) {
    const __m512 s = _mm512_set1_ps(sp[n]);
    for (int i = 0; i < 4; ++i) {
      const __m512i u = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, i));
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128))), s);
      store_bf16(out, 4 * c + 16 * i, K, w);
    }
  });
#else
  return dequantize_plain(N, K, q, [&](int64_t n, int64_t k) { return int8_at(qp, quads, n, k) * sp[n]; });
#endif
}

at::Tensor int4_dequantize(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                           int64_t group_size, int64_t K, int64_t N) {
  const uint16_t* zp = check_int4(q, scale, zero, group_size, K);
  const int64_t groups = K / group_size, octets = K / 8;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  auto zero_at = [&](int64_t at) { return zp ? bf16_to_float(zp[at]) : 0.f; };
#ifdef LOOM_LINEAR_AVX512
  // After the transpose, lane i of a channel's vector holds its octet c + i: low nibbles are
  // inputs 8(c + i) + t, high nibbles 8(c + i) + 4 + t. Interleaving the two nibble vectors by
  // dwords puts 128-bit lane L of `even` = inputs 32L .. 32L + 15 and of `odd` = the next 16.
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  return dequantize_panels(N, K, octets, qp, q, [&](int64_t n, __m512i v, int64_t c, uint16_t* out) {
    const __m512i low = _mm512_and_si512(v, nibble), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    const __m512i halves[2] = {_mm512_unpacklo_epi32(low, high), _mm512_unpackhi_epi32(low, high)};
    for (int lane = 0; lane < 4; ++lane) {
      const int64_t k0 = 8 * c + 32 * lane;  // one group: groups are 32, 64 or 128 inputs, chunks 128
      if (k0 >= K) break;
      const int64_t at = ((n / kPanel) * groups + k0 / group_size) * kPanel + n % kPanel;
      const float s = bf16_to_float(sp[at]);
      const __m512 vs = _mm512_set1_ps(s), offset = _mm512_set1_ps(zero_at(at) - 8.f * s);
      for (int e = 0; e < 2; ++e) {
        const __m512i qv = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(halves[e], lane));
        store_bf16(out, k0 + 16 * e, K, _mm512_fmadd_ps(_mm512_cvtepi32_ps(qv), vs, offset));
      }
    }
  });
#else
  return dequantize_plain(N, K, q, [&](int64_t n, int64_t k) {
    const int64_t at = ((n / kPanel) * groups + k / group_size) * kPanel + n % kPanel;
    const float s = bf16_to_float(sp[at]);
    return (int4_at(qp, octets, n, k) - 8) * s + zero_at(at);
  });
#endif
}

// Which vector paths this build has: "avx512_bf16", "avx2", or "" (then dense_linear is
// unavailable and the quantized kernels are plain loops).
std::string linear_isa() {
#if defined(LOOM_LINEAR_AVX512)
  return "avx512_bf16";
#elif defined(LOOM_LINEAR_AVX2)
  return "avx2";
#else
  return "";
#endif
}

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("linear_isa() -> str", &linear_isa);
  m.def("amx_tiles() -> bool", &amx_tiles);
  m.def("dense_linear(Tensor x, Tensor w, int out_features) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor w, int out_features) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor q, Tensor scale, Tensor? zero, int group_size, int out_features) -> Tensor");
  m.def("int8_dequantize(Tensor q, Tensor scale, int in_features) -> Tensor");
  m.def("int4_dequantize(Tensor q, Tensor scale, Tensor? zero, int group_size, int in_features, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("dense_linear", &dense_linear);
  m.impl("amx_linear", &amx_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_dequantize", &int8_dequantize);
  m.impl("int4_dequantize", &int4_dequantize);
}
