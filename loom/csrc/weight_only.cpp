// Weight-only int8 / int4 matmuls for the small-batch (decode) case: y = x W^T with W kept
// compressed in memory and widened in registers, so each weight byte is read once per step and
// memory bandwidth, not arithmetic, sets the speed.
//
// Layouts (built by loom/quant/linear.py from the portable checkpoint form):
//   int8: q [N, K] int8, scale [N] fp32; w[n, k] = q[n, k] * scale[n]; bf16 dot products of the
//         exactly widened weights with bf16 activations, accumulated in fp32.
//   int4: q [N, Kp/2] uint8, Kp = K rounded up to 128 (the padding is never read as weights):
//         in each 64-byte block (128 weights), nibble e (bits 4e..4e+3) of little-endian 16-bit
//         word i holds weight 32e + i. scale, zero [N, K/G] bf16 with
//         w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], g = k / G (torch's int4
//         convention); bf16 dot products (AVX512-BF16) of exactly converted weights with bf16
//         activations, accumulated in fp32.
// Rows of W are split across threads; every thread keeps x (a few KiB) in cache. Without
// AVX-512 the same layouts run through plain loops (correct, slow).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 8;  // rows of x handled together, sharing each widened weight vector

inline float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// Round to nearest even, as integer arithmetic the compiler vectorizes (c10::BFloat16's
// conversion also handles NaN, which dequantized weights never are).
inline uint16_t float_to_bf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// int8, one output row n for rows m0..m0+MT of x, given as bf16 [MT, K]: out[m] = sum_k x[m, k]
// q[n, k] (before scaling). Each 32 weights are widened once to bf16 (exact: |q| <= 127) and
// used by every row of the tile in a bf16 dot product.
template <int MT>
inline void int8_row(const uint16_t* xb, int64_t K, const int8_t* q, float* out) {
  int64_t k = 0;
  for (int m = 0; m < MT; ++m) out[m] = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  constexpr int U = MT >= 4 ? 1 : 4 / MT;  // independent accumulators per row, to hide latency
  __m512 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  for (; k + 32 * U <= K; k += 32 * U) {
    for (int u = 0; u < U; ++u) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k + 32 * u));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);  // weights k .. k + 31, in order
      for (int m = 0; m < MT; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], w, (__m512bh)_mm512_loadu_si512(xb + m * K + k + 32 * u));
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int u = 1; u < U; ++u) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][u]);
    out[m] = _mm512_reduce_add_ps(acc[m][0]);
  }
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m) out[m] += bf16_to_float(xb[m * K + k]) * static_cast<float>(q[k]);
}

// One int4 weight as a float, read from the kernel layout (the slow paths and the tail).
inline float int4_at(const uint8_t* q, int64_t k) {
  const uint16_t word = reinterpret_cast<const uint16_t*>(q + (k / 128) * 64)[k % 32];
  return static_cast<float>((word >> (4 * ((k % 128) / 32))) & 0x0F);
}

// int4, one output row for rows m0..m0+MT of x, given as bf16 [MT, K]: per group
// g, scale[g] * sum x * (128 + q) + (zero[g] - 136 scale[g]) * sum x, which is sum x * w.
// GC = group size / 32.
template <int MT, int GC>
inline void int4_row(const uint16_t* xb, int64_t K, const uint8_t* q, const uint16_t* scale,
                     const uint16_t* zero, const float* xsum, float* out) {
  constexpr int64_t G = 32 * GC, groups_per_block = 4 / GC;
  const int64_t groups = K / G, full_blocks = K / 128;
  for (int m = 0; m < MT; ++m) out[m] = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  // Nibble e of 16-bit word i of a 64-byte block is weight 32e + i of that block: shifting the
  // words by 4e and keeping 4 bits yields 32 consecutive weights, no shuffles. OR-ing 0x4300
  // into a word holding n in 0..15 makes the bf16 number 128 + n exactly.
  const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  // Independent chains into the totals, one per group of a block, while few rows leave the
  // registers room; with more rows, the rows themselves are independent chains.
  constexpr int T = MT >= 4 ? 1 : static_cast<int>(groups_per_block);
  __m512 total[MT][T];
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < T; ++t) total[m][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < full_blocks; ++b) {
    const __m512i block = _mm512_loadu_si512(q + b * 64);
    __m512 acc[MT];
    for (int e = 0; e < 4; ++e) {  // constant trip counts: unrolled, everything in registers
      const __m512i words = _mm512_srli_epi16(block, 4 * e);
      const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(words, nibble, bf16_128, 0xEA);  // (a & b) | c
      for (int m = 0; m < MT; ++m) {
        const __m512 start = e % GC == 0 ? _mm512_setzero_ps() : acc[m];  // a group's first chunk
        acc[m] = _mm512_dpbf16_ps(start, w, (__m512bh)_mm512_loadu_si512(xb + m * K + b * 128 + 32 * e));
      }
      if ((e + 1) % GC == 0) {  // the group's last chunk: scale it into the total
        const int t = e / GC;
        const __m512 sg = _mm512_set1_ps(bf16_to_float(scale[b * groups_per_block + t]));
        for (int m = 0; m < MT; ++m) total[m][t % T] = _mm512_fmadd_ps(acc[m], sg, total[m][t % T]);
      }
    }
  }
  for (int64_t g = 0; g < groups; g += 16) {  // the offsets' share: sum_g offset[g] * xsum[m, g]
    const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, groups - g)) - 1);
    auto widen = [&](const uint16_t* p) {  // 16 bf16 -> fp32
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p + g)), 16));
    };
    const __m512 o = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), widen(scale), widen(zero));
    for (int m = 0; m < MT; ++m)
      total[m][0] = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(live, xsum + m * groups + g), total[m][0]);
  }
  for (int m = 0; m < MT; ++m) {
    for (int t = 1; t < T; ++t) total[m][0] = _mm512_add_ps(total[m][0], total[m][t]);
    out[m] = _mm512_reduce_add_ps(total[m][0]);
  }
  const int64_t first_slow_group = full_blocks * groups_per_block;
#else
  for (int m = 0; m < MT; ++m)
    for (int64_t g = 0; g < groups; ++g)
      out[m] += (bf16_to_float(zero[g]) - 136.f * bf16_to_float(scale[g])) * xsum[m * groups + g];
  const int64_t first_slow_group = 0;
#endif
  for (int m = 0; m < MT; ++m)
    for (int64_t g = first_slow_group; g < groups; ++g) {
      float acc = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) acc += bf16_to_float(xb[m * K + k]) * (128.f + int4_at(q, k));
      out[m] += acc * bf16_to_float(scale[g]);
    }
}

// Calls f(std::integral_constant<int, mt>) for 1 <= mt <= MaxTile.
template <int MaxTile, typename F>
inline void dispatch_tile(int64_t mt, F f) {
  if constexpr (MaxTile > 1) {
    if (mt < MaxTile) return dispatch_tile<MaxTile - 1>(mt, f);
  }
  f(std::integral_constant<int, MaxTile>{});
}

// y [M, N] in the dtype of `options`, y[m, n] from row_fn(tile of up to kTile rows of x
// starting at m0, n); the rows of W are split across threads in runs long enough to stream.
template <typename RowFn>
at::Tensor run_rows(int64_t M, int64_t N, const at::TensorOptions& options, RowFn row_fn) {
  at::Tensor y = at::empty({M, N}, options.dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float vals[kTile];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t mt = std::min<int64_t>(kTile, M - m0);
        dispatch_tile<kTile>(mt, [&](auto tag) { row_fn(tag, m0, n, vals); });
        for (int64_t m = 0; m < mt; ++m) yp[(m0 + m) * N + n] = vals[m];
      }
  });
  return options.dtype() == at::kFloat ? y : y.to(options.dtype());
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_linear: x [M, K], q [N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "int8_linear: q must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == q.size(0),
              "int8_linear: scale [N] fp32");
  const int64_t K = x.size(1);
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();  // the dot products' input
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return run_rows(x.size(0), q.size(0), x.options(), [&](auto tile, int64_t m0, int64_t n, float* vals) {
    constexpr int MT = decltype(tile)::value;
    int8_row<MT>(xp + m0 * K, K, qp + n * K, vals);
    for (int m = 0; m < MT; ++m) vals[m] *= sp[n];
  });
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero,
                       int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2, "int4_linear: x [M, K], q [N, Kp/2]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), Kp = (K + 127) / 128 * 128;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) * 2 == Kp,
              "int4_linear: q must be contiguous uint8 [N, Kp/2], Kp = K rounded up to 128");
  TORCH_CHECK((group_size == 32 || group_size == 64 || group_size == 128) && K % group_size == 0,
              "int4_linear: group size must be 32, 64 or 128 and divide K");
  const int64_t groups = K / group_size;
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && zero.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  zero.is_contiguous() && scale.numel() == N * groups && zero.numel() == N * groups,
              "int4_linear: scale and zero [N, K/G] bf16");
  // x as the kernel reads it (bf16: no copy when it already is), and each group's sum of those
  // values, summed here rather than by tensor ops: this runs once per layer and decode step.
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  std::vector<float> xsum(M * groups, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group_size] += bf16_to_float(xp[m * K + k]);
  const float* xs = xsum.data();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
  return run_rows(M, N, x.options(), [&](auto tile, int64_t m0, int64_t n, float* vals) {
    constexpr int MT = decltype(tile)::value;
    auto row = [&](auto row_fn) {
      row_fn(xp + m0 * K, K, qp + n * (Kp / 2), sp + n * groups, zp + n * groups, xs + m0 * groups, vals);
    };
    switch (group_size) {
      case 32: row(int4_row<MT, 1>); break;
      case 64: row(int4_row<MT, 2>); break;
      case 128: row(int4_row<MT, 4>); break;
      default: TORCH_CHECK(false, "int4_linear: group size must be 32, 64 or 128, got ", group_size);
    }
  });
}

// The whole matrix in bf16, for the large-batch path (a bf16 GEMM on the result): rows split
// across threads, plain loops the compiler vectorizes.
at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "int8_dequantize: q [N, K] int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == q.size(0),
              "int8_dequantize: scale [N] fp32");
  const int64_t N = q.size(0), K = q.size(1);
  at::Tensor w = at::empty({N, K}, q.options().dtype(at::kBFloat16));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  uint16_t* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      // Restricted row pointers: int8_t is a char type, which may alias the output otherwise.
      const int8_t* __restrict__ row = qp + n * K;
      uint16_t* __restrict__ out = wp + n * K;
      const float s = sp[n];
      int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      const __m512 sv = _mm512_set1_ps(s);
      for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, sv)));
      }
#endif
      for (; k < K; ++k) out[k] = float_to_bf16(static_cast<float>(row[k]) * s);
    }
  });
  return w;
}

at::Tensor int4_dequantize(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero, int64_t group_size,
                           int64_t K) {
  const int64_t N = q.size(0), Kp = (K + 127) / 128 * 128, groups = K / group_size;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() && q.size(1) * 2 == Kp,
              "int4_dequantize: q [N, Kp/2] uint8 in the kernel layout");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && zero.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  zero.is_contiguous() && scale.numel() == N * groups && zero.numel() == N * groups,
              "int4_dequantize: scale and zero [N, K/G] bf16");
  at::Tensor w = at::empty({N, K}, q.options().dtype(at::kBFloat16));
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
  uint16_t* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* words = reinterpret_cast<const uint16_t*>(qp + n * (Kp / 2));
      for (int64_t c = 0; c < K / 32; ++c) {  // a chunk of 32 weights lies in one group
        const int64_t g = n * groups + c * 32 / group_size;
        const float s = bf16_to_float(sp[g]), z = bf16_to_float(zp[g]) - 8.f * s;
        const uint16_t* cw = words + (c / 4) * 32;
        const int shift = 4 * static_cast<int>(c % 4);
        uint16_t* out = wp + n * K + c * 32;
        for (int i = 0; i < 32; ++i) out[i] = float_to_bf16(static_cast<float>((cw[i] >> shift) & 0x0F) * s + z);
      }
    }
  });
  return w;
}

}  // namespace

// Whether this build has the vector paths above; without them the kernels are plain loops.
bool weight_only_vectorized() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("weight_only_vectorized() -> bool", &weight_only_vectorized);
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor q, Tensor scale, Tensor zero, int group_size) -> Tensor");
  m.def("int8_dequantize(Tensor q, Tensor scale) -> Tensor");
  m.def("int4_dequantize(Tensor q, Tensor scale, Tensor zero, int group_size, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_dequantize", &int8_dequantize);
  m.impl("int4_dequantize", &int4_dequantize);
}
