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
// and two Python wrappers. Here the weights and pools are held from load on, and the kernels of
// linear.cpp and paged_attention.cpp and the elementwise layers of elementwise.cpp are plain C++
// calls over the step's few rows.
//
// Its results are bit for bit those of the compiled decode graphs (and, but for the order of the
// norms' sums, of eager PyTorch), as elementwise.cpp says of its layers.
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
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bf16.h"

// The kernels this step calls (linear.cpp, paged_attention.cpp; the same library).
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t N);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w, int64_t N);
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
// The elementwise layers (elementwise.cpp), over rows of the activations' dtype.
void add_rms_norm_rows(at::ScalarType dtype, const void* x, const void* y, void* sum, const void* w, int64_t rows,
                       int64_t H, double eps, void* out);
void rotary_rows(at::ScalarType dtype, const void* src, int64_t row_stride, int64_t head_stride, int64_t rows,
                 int64_t heads, int64_t D, int64_t R, const int64_t* positions, const float* cos, const float* sin,
                 void* dst);
void silu_and_mul_rows(at::ScalarType dtype, const void* gate_up, int64_t stride, int64_t rows, int64_t I, void* out);

namespace {

// A linear layer as its module holds it, run by the kernel its plan names at decode batch sizes.
struct Linear {
  enum Kind : int64_t { kPanel = 0, kInt8 = 1, kInt4 = 2 };
  int64_t kind;
  at::Tensor weight;  // panel-layout weights (fp32 / bf16), or the int8 / int4 codes
  std::optional<at::Tensor> scale, zero, bias;
  int64_t group_size, out_features;
  // tile_rows[r]: whether a step of r rows runs this bf16 panel layer through AMX tiles (its
  // dispatch plan's choice, as loom/layers/dispatch.py's `choose` makes it for every batch size
  // the step serves).
  std::vector<int64_t> tile_rows;

  bool tiles(int64_t rows) const { return rows < static_cast<int64_t>(tile_rows.size()) && tile_rows[rows]; }

  // The operator this layer runs for a step of `rows` rows, by its registered name (so that a
  // profile of the step counts the calls as the operators' own).
  const char* op(int64_t rows) const {
    static constexpr const char* kNames[] = {"loom::dense_linear", "loom::int8_linear", "loom::int4_linear"};
    return tiles(rows) ? "loom::amx_linear" : kNames[kind];
  }

  at::Tensor operator()(const at::Tensor& x) const {
    const bool tiles = this->tiles(x.size(0));
    RECORD_FUNCTION(op(x.size(0)), std::vector<c10::IValue>());
    at::Tensor y = tiles           ? amx_linear(x, weight, out_features)
                   : kind == kPanel ? dense_linear(x, weight, out_features)
                   : kind == kInt8  ? int8_linear(x, weight, *scale)
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

// The step's scans of its logits, in IEEE arithmetic (the library is built with -ffast-math, whose
// comparisons may assume there are no NaNs).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

// Whether f is a NaN, by its bits (calls that inline into -ffast-math code may have std::isnan
// folded to false).
inline bool is_nan(float f) { return (std::bit_cast<uint32_t>(f) & 0x7FFFFFFFu) > 0x7F800000u; }

// x[i] in fp32.
inline float value_at(const float* x, int64_t i) { return x[i]; }
inline float value_at(const c10::BFloat16* x, int64_t i) { return bf16_to_float(x[i].x); }

#if defined(__AVX512F__)
// x[i:i + 16] in fp32.
inline __m512 load16(const float* x, int64_t i) { return _mm512_loadu_ps(x + i); }
inline __m512 load16(const c10::BFloat16* x, int64_t i) { return load_bf16x16(x + i); }
#endif

// The index of the first largest of x[0:n], n >= 1, a NaN counting as larger than any number
// (numpy's argmax over x in fp32): the token a greedy row samples. One pass where this build has
// AVX-512: each lane keeps its largest value and where it first saw it, and the lanes' winners
// meet at the end.
template <typename T>
int64_t first_argmax(const T* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 top = load16(x, 0);
    __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = where;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = load16(x, i);
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
        if (values[j] > value_at(x, best) || (values[j] == value_at(x, best) && places[j] < best))
          best = places[j];
      for (; i < n && !is_nan(value_at(x, i)); ++i)  // the tail
        if (value_at(x, i) > value_at(x, best)) best = i;
      if (i == n) return best;
    }
    i = 0;  // a NaN: the scan below finds the first
  }
#endif
  int64_t best = 0;
  for (++i; i < n && !is_nan(value_at(x, best)); ++i)
    if (value_at(x, i) > value_at(x, best) || is_nan(value_at(x, i))) best = i;
  return best;
}

}  // namespace

#pragma GCC pop_options

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
                  std::optional<at::Tensor> bias, int64_t group_size, int64_t out_features,
                  std::vector<int64_t> tile_rows) {
    TORCH_CHECK(kind >= Linear::kPanel && kind <= Linear::kInt4, "DecodeStep: unknown linear kind ", kind);
    TORCH_CHECK(kind == Linear::kPanel || tile_rows.empty(), "DecodeStep: only bf16 panel layers run AMX tiles");
    linears.push_back(Linear{kind, weight, scale, zero, bias, group_size, out_features, std::move(tile_rows)});
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

  // The operator each linear layer runs at a step of `rows` rows, in the step's order.
  std::vector<std::string> linear_ops(int64_t rows) const {
    std::vector<std::string> ops;
    for (const Linear& l : linears) ops.emplace_back(l.op(rows));
    return ops;
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
  // step's logits [B, vocab] (the model's dtype) and every step's argmax, a step's B after
  // another: the first largest logit (a NaN counting as the largest, as numpy's argmax has it),
  // as the list the sampler takes (it took a tensor's tolist() at every step).
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
  // The LM head's output [B, vocab] as it is, in the model's dtype, and each row's argmax. Its
  // widening to fp32 (compute_logits') is left to the rows that need more than their argmax: a
  // copy of every row's logits cost 12 MB of memory traffic a bf16 step at batch 64.
  template <typename T>
  static std::tuple<at::Tensor, std::vector<int64_t>> logits_and_argmax(const at::Tensor& head) {
    TORCH_INTERNAL_ASSERT(head.is_contiguous());
    const int64_t B = head.size(0), V = head.size(1);
    std::vector<int64_t> argmax(B);
    const T* hp = head.data_ptr<T>();
    int64_t* ap = argmax.data();
    at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {  // four rows' scans outweigh a fork
      for (int64_t b = b0; b < b1; ++b) ap[b] = first_argmax(hp + b * V, V);
    });
    return {head, argmax};
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
    const at::ScalarType dtype = embed.scalar_type();
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
      add_rms_norm_rows(dtype, xp, y, xp, w.data_ptr<T>(), B, H, eps, np);
    };
    add_and_norm(nullptr, layers[0].input_norm);
    for (size_t l = 0; l < layers.size(); ++l) {
      Layer& layer = layers[l];
      const Linear* lin = &linears[4 * l];
      const at::Tensor qkv = linear(lin[0], normed);
      const T* qkvp = qkv.data_ptr<T>();
      const int64_t ld = qkv.size(1);
      rotary_rows(dtype, qkvp, ld, head_dim, B, num_heads, head_dim, head_dim, pos, cp, sp, qp);
      rotary_rows(dtype, qkvp + q_size, ld, head_dim, B, num_kv_heads, head_dim, head_dim, pos, cp, sp, kp);
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
      silu_and_mul_rows(dtype, gate_up_p, 2 * I, B, I, actp);
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
      .def("linear_ops", &DecodeStep::linear_ops)
      .def("set_timing", &DecodeStep::set_timing)
      .def("timings", &DecodeStep::timings)
      .def("run", &DecodeStep::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
