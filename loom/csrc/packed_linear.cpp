// `loom::packed_linear`: oneDNN's linear over a weight reordered by
// mkldnn::_reorder_linear_weight (loom/layers/linear.py), as an operator that torch.compile
// treats as an opaque call. Inductor's own lowering of mkldnn::_linear_pointwise insists on
// weights frozen into the graph as constants, which a model's live weights are not.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<at::Scalar>>,
                                               std::optional<c10::string_view>)>();
  at::Tensor out = op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  TORCH_CHECK(out.size(-1) == out_features, "packed_linear: weight has ", out.size(-1), " outputs, expected ",
              out_features);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor");
}

// The fp32 packed weight is an opaque oneDNN tensor, which dispatches as MkldnnCPU.
TORCH_LIBRARY_IMPL(loom, CPU, m) { m.impl("packed_linear", &packed_linear); }
TORCH_LIBRARY_IMPL(loom, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
