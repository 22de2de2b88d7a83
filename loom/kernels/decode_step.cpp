// A Llama-family model's whole decode step in one call: embedding, every decoder layer (RMSNorm,
// fused QKV projection, rotary embedding, the new keys and values into the paged pool, decode
// attention, O projection, RMSNorm, fused gate/up, SwiGLU, down projection, the residual adds),
// the final norm and the LM head; the logits out, with each row's argmax (what a greedy row
// samples: found here while the logits are in cache, where a scan from Python, after the
// step's weights have streamed through the caches, took about 50 us at batch 1).
//
// At batch 1 a compiled decode graph spends about as long on its own work as on the fused
// elementwise kernels and attention together: a tensor handle for each of its ~150 inputs, a
// boxed dispatcher call for each of its ~60 custom-op calls, ~60 buffers allocated and freed,
// and two Python wrappers. Here the weights and pools are held from load on, the kernels of
// linear.cpp and paged_attention.cpp are plain C++ calls, and the elementwise layers are loops
// over the step's few rows.
//
// Its results are bit for bit those of the compiled decode graphs (and, but for the order of the
// norms' sums, of eager PyTorch): every layer's result is rounded to the model's dtype where
// eager execution rounds it, the elementwise code is built without -ffast-math (no fused
// multiply-adds, true divisions and square roots), SiLU's exponential is the one ATen's and
// inductor's vector code calls (SLEEF's), and a norm's sum of squares is added in the order of
// inductor's vectorized reduction.
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

// The kernels this step calls (linear.cpp, paged_attention.cpp; the same library).
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t N);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& zero, int64_t group_size, int64_t N);
std::tuple<at::Tensor, at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                          const at::Tensor& context_lens, double scale,
                                                          const std::optional<at::Tensor>& key_scales,
                                                          const std::optional<at::Tensor>& value_scales);
void write_kv(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k_in, const at::Tensor& v_in,
              const at::Tensor& slots_in);
void write_kv_rows(void* key_pool, void* value_pool, const void* k, int64_t ldk, const void* v, int64_t ldv,
                   const int64_t* slots, int64_t tokens, int64_t kvh, int64_t head_dim, int64_t bs,
                   int64_t element_bytes);
std::tuple<at::Tensor, at::Tensor> quantize_kv(const at::Tensor& x_in);

// SLEEF's exponentials, exported by libtorch_cpu.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace {

// A linear layer as its module holds it, run by the kernel its plan names at decode batch sizes.
struct Linear {
  enum Kind : int64_t { kPanel = 0, kInt8 = 1, kInt4 = 2 };
  int64_t kind;
  at::Tensor weight;  // panel-layout weights (fp32 / bf16), or the int8 / int4 codes
  std::optional<at::Tensor> scale, zero, bias;
  int64_t group_size, out_features;

  at::Tensor operator()(const at::Tensor& x) const {
    // Named as the operators are, so that a profile of the step counts them alike.
    static constexpr const char* kNames[] = {"loom::dense_linear", "loom::int8_linear", "loom::int4_linear"};
    RECORD_FUNCTION(kNames[kind], std::vector<c10::IValue>());
    at::Tensor y = kind == kPanel  ? dense_linear(x, weight, out_features)
                   : kind == kInt8 ? int8_linear(x, weight, *scale)
                                   : int4_linear(x, weight, *scale, zero, group_size, out_features);
    if (bias) y.add_(*bias);  // rounded once to y's dtype, as eager's out + bias
    return y;
  }
};

// A decoder layer's norms and its KV pools (its linears are DecodeStep's, four a layer).
struct Layer {
  at::Tensor input_norm, post_norm;
  std::vector<at::Tensor> pools;  // keys, values and, for an int8 pool, key and value scales
  // The key and value pools' elements, held as addresses too: a step writes its new keys and
  // values through them without reading the pools' tensors, whose metadata the weights streamed
  // since the last step have pushed out of the caches.
  void* keys;
  void* values;
};

}  // namespace

// The elementwise layers, in IEEE arithmetic (the library is built with -ffast-math): no fused
// multiply-adds, no reassociation, true divisions and square roots. Everything they call is
// defined in this region, so that it inlines and vectorizes under the same options.
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
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// fp32 -> T, rounded to nearest even as c10::BFloat16 rounds (activations are never NaN).
template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
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

// out[b] = w * round(x[b] / rms(x[b])) over rows of H, as loom.layers.norm.rms_norm.
template <typename T>
void rms_norm(const T* x, const T* w, int64_t rows, int64_t H, double eps, T* out) {
  for (int64_t b = 0; b < rows; ++b) {
    const T* xr = x + b * H;
    const float inv = 1.f / std::sqrt(sum_squares(xr, H) / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) out[b * H + i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(xr[i]) * inv)));
  }
}

// x += y elementwise, rounded to T.
template <typename T>
void add_into(T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = narrow<T>(widen(x[i]) + widen(y[i]));
}

// Rotate-half RoPE of `heads` heads of D from src (row stride ld) into dst [rows, heads, D], at
// each row's position (tables cos/sin [positions, D/2] fp32).
template <typename T>
void rotate(const T* src, int64_t ld, int64_t rows, int64_t heads, int64_t D, const int64_t* positions,
            const float* cos, const float* sin, T* dst) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < rows; ++b) {
    const float* c = cos + positions[b] * half;
    const float* s = sin + positions[b] * half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = src + b * ld + h * D;
      T* y = dst + (b * heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = widen(x[i]), x2 = widen(x[i + half]);
        y[i] = narrow<T>(x1 * c[i] - x2 * s[i]);
        y[i + half] = narrow<T>(x2 * c[i] + x1 * s[i]);
      }
    }
  }
}

#if defined(__AVX512F__)
// The first n (<= 16) elements at p, widened to fp32 lanes (the others zero).
inline __m512 load16(const float* p, __mmask16 n) { return _mm512_maskz_loadu_ps(n, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 n) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(n, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The lanes rounded to T as narrow<T> rounds them, kept as fp32 (for bf16: the low 16 bits zero).
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
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
// at a time where this build has one (with AVX-512, silu_and_mul calls SLEEF itself).
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

// out[b] = round(silu(gate)) * up over gate_up [rows, 2I] (gate then up), as
// loom.layers.activation.silu_and_mul: silu(x) = x / (1 + e^-x), 16 inputs at a time.
template <typename T>
void silu_and_mul(const T* gate_up, int64_t rows, int64_t I, T* out) {
  for (int64_t b = 0; b < rows; ++b) {
    const T* g = gate_up + b * 2 * I;
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

// out[0:n] = x[0:n] in fp32.
template <typename T>
void widen_into(const T* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = widen(x[i]);
}

// Whether f is a NaN, by its bits (calls that inline into -ffast-math code may have std::isnan
// folded to false).
inline bool is_nan(float f) { return (std::bit_cast<uint32_t>(f) & 0x7FFFFFFFu) > 0x7F800000u; }

// The index of the first largest of x[0:n], n >= 1, a NaN counting as larger than any number
// (numpy's argmax): the token a greedy row samples. One pass where this build has AVX-512: each
// lane keeps its largest value and where it first saw it, and the lanes' winners meet at the end.
inline int64_t first_argmax(const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 top = _mm512_loadu_ps(x);
    __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = where;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);  // strictly: a lane keeps its first
      top = _mm512_mask_blend_ps(larger, top, v);
      where = _mm512_mask_blend_epi32(larger, where, index);
    }
    if (!nan) {
      alignas(64) float values[16];
      alignas(64) int32_t places[16];
      _mm512_store_ps(values, top);
      _mm512_store_si512(places, where);
      int64_t best = places[0];
      for (int j = 1; j < 16; ++j)
        if (values[j] > x[best] || (values[j] == x[best] && places[j] < best)) best = places[j];
      for (; i < n && !is_nan(x[i]); ++i)  // the tail
        if (x[i] > x[best]) best = i;
      if (i == n) return best;
    }
    i = 0;  // a NaN: the scan below finds the first
  }
#endif
  int64_t best = 0;
  for (++i; i < n && !is_nan(x[best]); ++i)
    if (x[i] > x[best] || is_nan(x[i])) best = i;
  return best;
}

}  // namespace

#pragma GCC pop_options

// Elements of a step's activations (rows times their width) below which an elementwise layer is
// not split over threads: a fork and join costs about as much as that many elements' work.
constexpr int64_t kElementsPerTask = 16384;

// Built once per engine (add_linear four times a layer: QKV, O, gate/up, down; then add_layer;
// after the last layer, add_linear once more: the LM head); run() is a step of decode rows.
struct DecodeStep {
  at::Tensor embed, final_norm, cos, sin;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  std::vector<Linear> linears;
  std::vector<Layer> layers;
  std::vector<int64_t> pool_shape;  // every layer's key pool's: [blocks, KVH, D, BS]
  // While timing: seconds in the linear layers and in attention, and steps run, since
  // set_timing turned it on, for a benchmark to split the steps it times (two steady-clock
  // readings a call); off, each call pays a branch.
  bool timing = false;
  double linear_s = 0, attention_s = 0;
  int64_t timed_steps = 0;

  DecodeStep(at::Tensor embed, at::Tensor final_norm, at::Tensor cos, at::Tensor sin, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : embed(embed.contiguous()), final_norm(final_norm.contiguous()), cos(cos.contiguous()), sin(sin.contiguous()),
        num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps), scale(scale) {
    TORCH_CHECK(this->cos.scalar_type() == at::kFloat && this->cos.size(1) * 2 == head_dim,
                "DecodeStep: rotary tables must be fp32 [positions, head_dim / 2]");
  }

  void add_linear(int64_t kind, at::Tensor weight, std::optional<at::Tensor> scale, std::optional<at::Tensor> zero,
                  std::optional<at::Tensor> bias, int64_t group_size, int64_t out_features) {
    TORCH_CHECK(kind >= Linear::kPanel && kind <= Linear::kInt4, "DecodeStep: unknown linear kind ", kind);
    linears.push_back(Linear{kind, weight, scale, zero, bias, group_size, out_features});
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<at::Tensor> pools) {
    TORCH_CHECK(linears.size() == 4 * (layers.size() + 1), "DecodeStep: add four linears before each layer");
    TORCH_CHECK(pools.size() == 2 || pools.size() == 4, "DecodeStep: keys and values, and an int8 pool's scales");
    const at::Tensor& key_pool = pools[0];
    if (layers.empty()) pool_shape = key_pool.sizes().vec();
    TORCH_CHECK(key_pool.sizes() == pool_shape && pools[1].numel() == key_pool.numel() && key_pool.is_contiguous() &&
                    pools[1].is_contiguous() && key_pool.size(1) == num_kv_heads && key_pool.size(2) == head_dim,
                "DecodeStep: every layer's pools contiguous, keys [blocks, KVH, D, BS] of one shape");
    TORCH_CHECK(key_pool.scalar_type() == (pools.size() == 4 ? at::kChar : embed.scalar_type()),
                "DecodeStep: pools of the model's dtype, or int8 with their scales");
    void* keys = key_pool.data_ptr();
    void* values = pools[1].data_ptr();
    layers.push_back(Layer{input_norm.contiguous(), post_norm.contiguous(), std::move(pools), keys, values});
  }

  void set_timing(bool on) {
    timing = on;
    linear_s = attention_s = 0;
    timed_steps = 0;
  }

  std::tuple<double, double, int64_t> timings() const { return {linear_s, attention_s, timed_steps}; }

  // `steps` decode steps of B rows, each step's token of a row the argmax of its step before.
  // ids, positions [B] int64 and context_lens [B] int32 (each row's context with its new token)
  // are the first step's (each later step is one position further); slots [steps * B] int64, a
  // step's B after another; block_tables [B, W] int32 hold every step's slots. Returns the last
  // step's logits [B, vocab] fp32 and every step's argmax, a step's B after another: the first
  // largest logit (a NaN counting as the largest, as numpy's argmax has it), as the list the
  // sampler takes (it took a tensor's tolist() at every step).
  std::tuple<at::Tensor, std::vector<int64_t>> run(at::Tensor ids, at::Tensor positions, at::Tensor slots,
                                         at::Tensor block_tables, at::Tensor context_lens, int64_t steps) {
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && ids.is_contiguous() &&
                    positions.is_contiguous() && ids.numel() == positions.numel(),
                "DecodeStep: ids and positions [B] int64");
    TORCH_CHECK(steps >= 1, "DecodeStep: steps must be >= 1, got ", steps);
    TORCH_CHECK(!layers.empty() && linears.size() == 4 * layers.size() + 1,
                "DecodeStep: add the layers, then the LM head");
    const int64_t B = ids.numel(), H = embed.size(1), vocab = embed.size(0), max_pos = cos.size(0);
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == steps * B,
                "DecodeStep: slots [steps * B] int64");
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t pool_slots = pool_shape[0] * pool_shape[3];
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(0 <= id[b] && id[b] < vocab, "DecodeStep: token id ", id[b], " outside the vocabulary of ", vocab);
      TORCH_CHECK(0 <= pos[b] && pos[b] + steps <= max_pos, "DecodeStep: position ", pos[b] + steps - 1, " beyond ",
                  max_pos);
    }
    for (int64_t i = 0; i < steps * B; ++i)
      TORCH_CHECK(0 <= slot[i] && slot[i] < pool_slots, "DecodeStep: slot ", slot[i], " outside the pool of ", pool_slots);
    timed_steps += timing ? steps : 0;
    auto one_step = [&](const int64_t* step_ids, const int64_t* step_pos, const at::Tensor& step_slots,
                        const at::Tensor& lens) {
      std::tuple<at::Tensor, std::vector<int64_t>> out;
      AT_DISPATCH_SWITCH(embed.scalar_type(), "DecodeStep",
          AT_DISPATCH_CASE(at::kFloat, [&] {
            out = logits_and_argmax<scalar_t>(
                forward<scalar_t>(B, H, step_ids, step_pos, step_slots, block_tables, lens));
          })
          AT_DISPATCH_CASE(at::kBFloat16, [&] {
            out = logits_and_argmax<scalar_t>(
                forward<scalar_t>(B, H, step_ids, step_pos, step_slots, block_tables, lens));
          }));
      return out;
    };
    if (steps == 1) return one_step(id, pos, slots, context_lens);  // the usual step: no copies of its inputs
    std::vector<int64_t> tokens(id, id + B), position(pos, pos + B), argmax;
    argmax.reserve(steps * B);
    at::Tensor logits;
    for (int64_t step = 0; step < steps; ++step) {
      if (step > 0) {
        std::copy(argmax.end() - B, argmax.end(), tokens.begin());
        for (int64_t& p : position) ++p;
      }
      auto [step_logits, step_argmax] = one_step(tokens.data(), position.data(), slots.narrow(0, step * B, B),
                                                 step > 0 ? context_lens + step : context_lens);
      logits = std::move(step_logits);
      argmax.insert(argmax.end(), step_argmax.begin(), step_argmax.end());
    }
    return {logits, argmax};
  }

 private:
  // The LM head's output [B, vocab] in fp32 (as compute_logits gives it) and each row's argmax, a
  // row at a time while it is in cache.
  template <typename T>
  static std::tuple<at::Tensor, std::vector<int64_t>> logits_and_argmax(const at::Tensor& head) {
    TORCH_INTERNAL_ASSERT(head.is_contiguous());
    const int64_t B = head.size(0), V = head.size(1);
    at::Tensor logits = std::is_same_v<T, float> ? head : at::empty({B, V}, head.options().dtype(at::kFloat));
    std::vector<int64_t> argmax(B);
    const T* hp = head.data_ptr<T>();
    float* lp = logits.data_ptr<float>();
    int64_t* ap = argmax.data();
    at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {  // four rows' scans outweigh a fork
      for (int64_t b = b0; b < b1; ++b) {
        if constexpr (!std::is_same_v<T, float>) widen_into(hp + b * V, V, lp + b * V);
        ap[b] = first_argmax(lp + b * V, V);
      }
    });
    return {logits, argmax};
  }

  template <typename T>
  at::Tensor forward(int64_t B, int64_t H, const int64_t* id, const int64_t* pos, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& context_lens) {
    const int64_t* slot = slots.data_ptr<int64_t>();
    const auto options = embed.options();
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    at::Tensor x = at::empty({B, H}, options), normed = at::empty({B, H}, options);
    at::Tensor q = at::empty({B, num_heads, head_dim}, options), k = at::empty({B, num_kv_heads, head_dim}, options);
    const int64_t I = linears[2].out_features / 2;
    at::Tensor act = at::empty({B, I}, options);
    T* xp = x.data_ptr<T>();
    T* np = normed.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    T* actp = act.data_ptr<T>();
    const T* table = embed.data_ptr<T>();
    for (int64_t b = 0; b < B; ++b) std::copy(table + id[b] * H, table + (id[b] + 1) * H, xp + b * H);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    // The elementwise layers split their rows over threads once there are enough of them.
    auto over_rows = [B](int64_t width, const auto& f) {
      at::parallel_for(0, B, std::max<int64_t>(1, kElementsPerTask / width), f);
    };
    auto now = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
    // f(), its time added to `total` while timing.
    auto time_into = [&](double& total, const auto& f) {
      if (!timing) return f();
      const double start = now();
      at::Tensor result = f();
      total += now() - start;
      return result;
    };
    auto linear = [&](const Linear& l, const at::Tensor& in) { return time_into(linear_s, [&] { return l(in); }); };
    auto add_and_norm = [&](const T* y, const at::Tensor& w) {  // x += y; normed = norm(x)
      over_rows(H, [&](int64_t b0, int64_t b1) {
        if (y) add_into(xp + b0 * H, y + b0 * H, (b1 - b0) * H);
        rms_norm(xp + b0 * H, w.data_ptr<T>(), b1 - b0, H, eps, np + b0 * H);
      });
    };
    add_and_norm(nullptr, layers[0].input_norm);
    for (size_t l = 0; l < layers.size(); ++l) {
      Layer& layer = layers[l];
      const Linear* lin = &linears[4 * l];
      const at::Tensor qkv = linear(lin[0], normed);
      const T* qkvp = qkv.data_ptr<T>();
      const int64_t ld = qkv.size(1);
      over_rows(q_size + kv_size, [&](int64_t b0, int64_t b1) {
        rotate(qkvp + b0 * ld, ld, b1 - b0, num_heads, head_dim, pos + b0, cp, sp, qp + b0 * q_size);
        rotate(qkvp + b0 * ld + q_size, ld, b1 - b0, num_kv_heads, head_dim, pos + b0, cp, sp, kp + b0 * kv_size);
      });
      std::optional<at::Tensor> key_scales, value_scales;
      if (layer.pools.size() == 4) {  // an int8 pool: rows and their scales
        const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
        auto [kq, ks] = quantize_kv(k);
        auto [vq, vs] = quantize_kv(v);
        write_kv(layer.pools[0], layer.pools[1], kq, vq, slots);
        write_kv(layer.pools[2], layer.pools[3], ks, vs, slots);
        key_scales = layer.pools[2];
        value_scales = layer.pools[3];
      } else {  // slots checked in run()
        write_kv_rows(layer.keys, layer.values, kp, kv_size, qkvp + q_size + kv_size, ld, slot, B, num_kv_heads,
                      head_dim, pool_shape[3], sizeof(T));
      }
      const at::Tensor attn = time_into(attention_s, [&] {
        RECORD_FUNCTION("loom::paged_decode_attention", std::vector<c10::IValue>());
        return std::get<0>(paged_decode_attention(q, layer.pools[0], layer.pools[1], block_tables, context_lens,
                                                  scale, key_scales, value_scales));
      });
      const at::Tensor o = linear(lin[1], attn.view({B, q_size}));
      add_and_norm(o.data_ptr<T>(), layer.post_norm);
      const at::Tensor gate_up = linear(lin[2], normed);
      const T* gate_up_p = gate_up.data_ptr<T>();
      over_rows(2 * I, [&](int64_t b0, int64_t b1) {
        silu_and_mul(gate_up_p + b0 * 2 * I, b1 - b0, I, actp + b0 * I);
      });
      const at::Tensor down = linear(lin[3], act);
      add_and_norm(down.data_ptr<T>(), l + 1 < layers.size() ? layers[l + 1].input_norm : final_norm);
    }
    return linear(linears.back(), normed);  // the LM head
  }
};

// A Python class of the library's module, not a torch class: a call through pybind11 converts
// five tensors, where a torch class's method goes through TorchScript's schema matching and
// stack (measured at batch 1: about 0.1 ms a step with the caches cold from the weights, 15 us
// warm). The step runs without the GIL, as torch's operators do.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("add_linear", &DecodeStep::add_linear)
      .def("add_layer", &DecodeStep::add_layer)
      .def("set_timing", &DecodeStep::set_timing)
      .def("timings", &DecodeStep::timings)
      .def("run", &DecodeStep::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
