// A decoder's elementwise layers: RMSNorm (after the residual add that precedes it), rotary
// embedding (rotate-half, on all of each head's dims or on the first rotary_dim) and SwiGLU's
// product silu(gate) * up. Eager steps (prefill and mixed) call them as operators
// (`loom::rms_norm`, `loom::rotary`, `loom::silu_and_mul`); the C++ decode step calls the same
// functions on its rows (decode_step.cpp); compiled decode graphs trace the layers' plain PyTorch
// instead, which inductor fuses into the graph.
//
// As operators they replace the same PyTorch compiled for any number of tokens: that cost no
// compile at first use, but about 0.2 ms of guards and wrappers a call (49 calls a step for the
// 134M reference model), more than the work itself for a few hundred tokens.
//
// Their results are bit for bit those of the compiled graphs (and, but for the order of the norms'
// sums, of eager PyTorch): every result is rounded to the activations' dtype where eager execution
// rounds it, the code is built without -ffast-math (no fused multiply-adds, true divisions and
// square roots), SiLU's exponential is the one ATen's and inductor's vector code calls (SLEEF's),
// and a norm's sum of squares is added in the order of inductor's vectorized reduction.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bf16.h"

#include <c10/util/BFloat16.h>

// SLEEF's exponentials, exported by libtorch_cpu.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

// Elements of a step's activations (rows times their width) below which a layer is not split over
// threads: a fork and join costs about as much as that many elements' work.
constexpr int64_t kElementsPerTask = 16384;

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

// Lanes of one fp32 vector, as ATen's vector code has them on this build's CPU.
#ifdef __AVX512F__
constexpr int kVecLanes = 16;
#else
constexpr int kVecLanes = 8;
#endif

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return bf16_to_float(x.x); }

// fp32 -> T, rounded to nearest even as c10::BFloat16 rounds (activations are never NaN).
template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float f) {
  return c10::BFloat16(float_to_bf16(f), c10::BFloat16::from_bits());
}

// Sum of x[i]^2 over i < H, added as inductor's vectorized reduction adds it: into lanes of one
// vector of T's width (16 or 32 lanes with AVX-512 for fp32 or bf16), whose fp32 halves are then
// added, and those lanes folded in halves (lane j with j + 8, then + 4, + 2, + 1).
template <typename T>
float sum_squares(const T* x, int64_t H) {
  constexpr int N = sizeof(float) / sizeof(T), L = kVecLanes * N;
  float acc[L] = {};
  int64_t i0 = 0;
  for (; i0 + L <= H; i0 += L)
    for (int j = 0; j < L; ++j) acc[j] += widen(x[i0 + j]) * widen(x[i0 + j]);
  for (int j = 0; i0 + j < H; ++j) acc[j] += widen(x[i0 + j]) * widen(x[i0 + j]);
  for (int part = 1; part < N; ++part)
    for (int j = 0; j < kVecLanes; ++j) acc[j] += acc[part * kVecLanes + j];
  for (int half = kVecLanes / 2; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) acc[j] += acc[j + half];
  return acc[0];
}

// Rows [b0, b1) of H: out = w * round(x / rms(x)), as loom.layers.norm.rms_norm; where y is given,
// of x + y (rounded to T) instead, which also goes to `sum` (which may be x).
template <typename T>
void add_rms_norm(const T* x, const T* y, T* sum, const T* w, int64_t b0, int64_t b1, int64_t H, double eps,
                  T* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const T* xr = x + b * H;
    if (y) {
      T* sr = sum + b * H;
      for (int64_t i = 0; i < H; ++i) sr[i] = narrow<T>(widen(xr[i]) + widen(y[b * H + i]));
      xr = sr;
    }
    const float inv = 1.f / std::sqrt(sum_squares(xr, H) / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) out[b * H + i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(xr[i]) * inv)));
  }
}

// Rotate-half RoPE of rows [b0, b1), `heads` heads of D each (head h of row b at src + b *
// row_stride + h * head_stride), on each head's first R dims (the rest copied), at each row's
// position (tables cos/sin [positions, R/2] fp32), into dst [rows, heads, D].
template <typename T>
void rotate(const T* src, int64_t row_stride, int64_t head_stride, int64_t b0, int64_t b1, int64_t heads, int64_t D,
            int64_t R, const int64_t* positions, const float* cos, const float* sin, T* dst) {
  const int64_t half = R / 2;
  for (int64_t b = b0; b < b1; ++b) {
    const float* c = cos + positions[b] * half;
    const float* s = sin + positions[b] * half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = src + b * row_stride + h * head_stride;
      T* y = dst + (b * heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = widen(x[i]), x2 = widen(x[i + half]);
        y[i] = narrow<T>(x1 * c[i] - x2 * s[i]);
        y[i + half] = narrow<T>(x2 * c[i] + x1 * s[i]);
      }
      std::copy(x + R, x + D, y + R);
    }
  }
}

#if defined(__AVX512F__)
// The first n (<= 16) elements at p, widened to fp32 lanes (the others zero).
inline __m512 load16(const float* p, __mmask16 n) { return _mm512_maskz_loadu_ps(n, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 n) { return load_bf16x16(p, n); }

// The lanes rounded to T as narrow<T> rounds them, kept as fp32 (for bf16: the low 16 bits zero).
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_lanes(x), top));
  }
}

// The first n lanes of x, rounded to T, to p.
inline void store16(float* p, __m512 x, __mmask16 n) { _mm512_mask_storeu_ps(p, n, x); }
inline void store16(c10::BFloat16* p, __m512 x, __mmask16 n) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round16<c10::BFloat16>(x)), 16);
  _mm256_mask_storeu_epi16(p, n, _mm512_cvtepi32_epi16(high));
}
#else
// e[0:n] = e^e[0:n], n <= 16, as ATen's vector code computes it: SLEEF's (within 1 ulp) a vector
// at a time where this build has one (with AVX-512, silu_mul calls SLEEF itself).
inline void exp_in_place(float* e, int n) {
#if defined(__AVX2__)
  float lanes[16] = {};
  for (int j = 0; j < n; ++j) lanes[j] = e[j];
  _mm256_storeu_ps(lanes, Sleef_expf8_u10(_mm256_loadu_ps(lanes)));
  _mm256_storeu_ps(lanes + 8, Sleef_expf8_u10(_mm256_loadu_ps(lanes + 8)));
  for (int j = 0; j < n; ++j) e[j] = lanes[j];
#else
  for (int j = 0; j < n; ++j) e[j] = std::exp(e[j]);
#endif
}
#endif

// Rows [b0, b1): out[b] = round(silu(gate)) * up over gate_up (rows of 2I, `stride` elements apart:
// gate then up), as loom.layers.activation.silu_and_mul: silu(x) = x / (1 + e^-x), 16 inputs at a time.
template <typename T>
void silu_mul(const T* gate_up, int64_t stride, int64_t b0, int64_t b1, int64_t I, T* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const T* g = gate_up + b * stride;
    for (int64_t i0 = 0; i0 < I; i0 += 16) {
      const int n = I - i0 < 16 ? static_cast<int>(I - i0) : 16;
#if defined(__AVX512F__)
      const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
      const __m512 x = load16(g + i0, live), up = load16(g + I + i0, live);
      const __m512 minus_x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
      const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_expf16_u10(minus_x)));
      store16(out + b * I + i0, _mm512_mul_ps(round16<T>(silu), up), live);
#else
      float e[16];
      for (int j = 0; j < n; ++j) e[j] = -widen(g[i0 + j]);
      exp_in_place(e, n);
      for (int j = 0; j < n; ++j) {
        const float x = widen(g[i0 + j]);
        out[b * I + i0 + j] = narrow<T>(widen(narrow<T>(x / (1.f + e[j]))) * widen(g[I + i0 + j]));
      }
#endif
    }
  }
}

// f(b0, b1) over `rows` rows of `width` elements each, split over threads once there are enough.
template <typename F>
void over_rows(int64_t rows, int64_t width, const F& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(width, 1)), f);
}

}  // namespace

// The layers over raw rows, for the decode step (pointers to elements of `dtype`: fp32 or bf16).
#define LOOM_ACTIVATION_TYPES(dtype, name, ...) \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

void add_rms_norm_rows(at::ScalarType dtype, const void* x, const void* y, void* sum, const void* w, int64_t rows,
                       int64_t H, double eps, void* out) {
  LOOM_ACTIVATION_TYPES(dtype, "rms_norm", [&] {
    using T = scalar_t;
    over_rows(rows, H, [&](int64_t b0, int64_t b1) {
      add_rms_norm(static_cast<const T*>(x), static_cast<const T*>(y), static_cast<T*>(sum), static_cast<const T*>(w),
                   b0, b1, H, eps, static_cast<T*>(out));
    });
  });
}

void rotary_rows(at::ScalarType dtype, const void* src, int64_t row_stride, int64_t head_stride, int64_t rows,
                 int64_t heads, int64_t D, int64_t R, const int64_t* positions, const float* cos, const float* sin,
                 void* dst) {
  LOOM_ACTIVATION_TYPES(dtype, "rotary", [&] {
    using T = scalar_t;
    over_rows(rows, heads * D, [&](int64_t b0, int64_t b1) {
      rotate(static_cast<const T*>(src), row_stride, head_stride, b0, b1, heads, D, R, positions, cos, sin,
             static_cast<T*>(dst));
    });
  });
}

void silu_and_mul_rows(at::ScalarType dtype, const void* gate_up, int64_t stride, int64_t rows, int64_t I, void* out) {
  LOOM_ACTIVATION_TYPES(dtype, "silu_and_mul", [&] {
    using T = scalar_t;
    over_rows(rows, 2 * I, [&](int64_t b0, int64_t b1) {
      silu_mul(static_cast<const T*>(gate_up), stride, b0, b1, I, static_cast<T*>(out));
    });
  });
}

#undef LOOM_ACTIVATION_TYPES
#pragma GCC pop_options

namespace {

// The operators' activations are the layers': fp32 or bf16.
void check_activations(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": activations must be float32 or bfloat16, got ", x.scalar_type());
}

// x [..., H] -> w * round(x / rms(x)), w [H] of x's dtype.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x_in.size(-1) &&
                  weight.scalar_type() == x_in.scalar_type(),
              "rms_norm: x [..., H] and weight [H] of one dtype");
  check_activations(x_in, "rms_norm");
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t H = x.size(-1);
  add_rms_norm_rows(x.scalar_type(), x.const_data_ptr(), nullptr, nullptr, w.const_data_ptr(), H ? x.numel() / H : 0,
                    H, eps, out.data_ptr());
  return out;
}

// q [T, H, D] and k [T, KVH, D] (each head's dims contiguous; rows and heads at any stride) rotated
// at positions [T], on each head's first rotary_dim dims (0: all), from tables cos, sin
// [max positions, rotary dims / 2] fp32. Returns both, contiguous.
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions_in, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t rotary_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.scalar_type() == k.scalar_type(),
              "rotary: q [T, H, D] and k [T, KVH, D] of one dtype");
  check_activations(q, "rotary");
  const int64_t T = q.size(0), D = q.size(2), R = rotary_dim ? rotary_dim : D;
  TORCH_CHECK(0 < R && R <= D && R % 2 == 0, "rotary: rotary_dim ", rotary_dim, " must be even and within ", D);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) * 2 == R && cos.sizes() == sin.sizes() &&
                  sin.scalar_type() == at::kFloat,
              "rotary: tables cos and sin [positions, rotary dims / 2] float32");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T, "rotary: one position per row");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= pos[t] && pos[t] < cos.size(0), "rotary: position ", pos[t], " outside the tables' ", cos.size(0));
  auto rotated = [&](const at::Tensor& x_in) {
    const at::Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
    at::Tensor y = at::empty(x.sizes(), x.options());
    rotary_rows(x.scalar_type(), x.const_data_ptr(), x.stride(0), x.stride(1), T, x.size(1), D, R, pos,
                cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), y.data_ptr());
    return y;
  };
  return {rotated(q), rotated(k)};
}

// gate_up [..., 2I] (gate, then up) -> silu(gate) * up [..., I].
at::Tensor silu_and_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.dim() >= 1 && gate_up_in.size(-1) % 2 == 0, "silu_and_mul: gate_up [..., 2I]");
  check_activations(gate_up_in, "silu_and_mul");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, gate_up.options());
  silu_and_mul_rows(gate_up.scalar_type(), gate_up.const_data_ptr(), 2 * I, rows, I, out.data_ptr());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin, int rotary_dim) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
