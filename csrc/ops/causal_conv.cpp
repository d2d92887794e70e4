// The Mamba-2 mixer's causal depthwise convolution with SiLU, continuing from a conv state:
//
//   window = [conv_state; x]                 conv_state [b, K-1, C], x [b, L, C]
//   y[t]   = silu(bias + sum_k window[t + k] * weight[:, k])      t < L
//   state' = window[L:]                      the last K-1 inputs, for the next call
//
// x is read in place at columns [offset, offset + C) of the in_proj output. Composed, that is a
// concatenation and a fused elementwise kernel per Mamba layer; on CUDA it is one launch here.
// Everywhere else, MLX ops (also the reference: voicechat.kernels.causal_conv).

#include "voicechat/causal_conv.h"

#include <optional>
#include <stdexcept>
#include <string>

#include "cuda/cuda_sources.h"
#include "jit_sources.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace voicechat {
namespace {

constexpr int kThreads = 256;

const CudaSource& source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int c, int k, int l, int w, int offset, const std::string& ts) {
    return CudaInstance{{"float", ts, "float", "float"},
                        {"float", "float"},
                        {P{"B", "int:1"}, P{"C", int_arg(c)}, P{"K", int_arg(k)},
                         P{"L", int_arg(l)}, P{"W", int_arg(w)},
                         P{"OFFSET", int_arg(offset)}, P{"HAS_BIAS", "bool:true"},
                         P{"TS", type_arg(ts)}, P{"THREADS", int_arg(kThreads)}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_causal_conv_silu",
      {"conv_state", "src", "weight", "bias"},
      {"y", "new_state"},
      jit::causal_conv::vc_causal_conv_silu_body,
      "",
      // the published mixer: a step and a prefix; bfloat16 input; a small odd one
      {inst(12288, 4, 1, 22656, 10240, "float"), inst(12288, 4, 64, 22656, 10240, "float"),
       inst(12288, 4, 1, 22656, 10240, "__nv_bfloat16"), inst(40, 3, 5, 50, 7, "float")},
  });
  return src;
}

std::vector<mx::array> composed(const mx::array& state, const mx::array& x, const mx::array& weight,
                                const std::optional<mx::array>& bias, mx::Stream s) {
  const int k_size = weight.shape(1), length = x.shape(1);
  auto window = mx::concatenate({state, mx::astype(x, state.dtype(), s)}, 1, s);
  auto out = bias ? mx::astype(*bias, mx::float32, s) : mx::array(0.0f);
  for (int k = 0; k < k_size; ++k) {
    auto tap = mx::slice(window, {0, k, 0}, {window.shape(0), k + length, window.shape(2)}, s);
    out = mx::add(out, mx::multiply(tap, mx::reshape(mx::slice(weight, {0, k}, {weight.shape(0), k + 1}, s),
                                                     {weight.shape(0)}, s), s), s);
  }
  auto y = mx::multiply(out, mx::sigmoid(out, s), s);
  auto next = mx::slice(window, {0, length, 0}, window.shape(), s);
  return {y, next};
}

}  // namespace

std::vector<mx::array> causal_conv_silu(const mx::array& conv_state, const mx::array& src, int offset,
                                        const mx::array& weight, const std::optional<mx::array>& bias,
                                        mx::StreamOrDevice s_) {
  if (conv_state.ndim() != 3 || src.ndim() != 3 || conv_state.shape(0) != src.shape(0)) {
    throw std::invalid_argument("causal_conv_silu: expected conv_state [b, K-1, C] and src [b, L, W]");
  }
  const int b = conv_state.shape(0), c = conv_state.shape(2), length = src.shape(1), width = src.shape(2);
  const int k_size = conv_state.shape(1) + 1;
  if (weight.ndim() < 2 || weight.shape(0) != c || weight.shape(1) != k_size || weight.size() != size_t(c) * k_size) {
    throw std::invalid_argument("causal_conv_silu: weight must be [C, K] (or [C, K, 1]) with K = conv_state's K-1 + 1");
  }
  if (offset < 0 || offset + c > width) {
    throw std::invalid_argument("causal_conv_silu: columns [offset, offset + C) lie outside src");
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != c)) {
    throw std::invalid_argument("causal_conv_silu: bias must be [C]");
  }
  auto s = mx::to_stream(s_);
  const bool kernel_path = gpu_stream(s) && cuda_build() && b > 0 && length > 0 &&
                           conv_state.dtype() == mx::float32 && float_dtype(src.dtype()) &&
                           weight.dtype() == mx::float32 && (!bias || bias->dtype() == mx::float32);
  if (!kernel_path) {
    auto x = mx::slice(src, {0, 0, offset}, {b, length, offset + c}, s);
    return composed(conv_state, x, mx::reshape(weight, {c, k_size}, s), bias, s);
  }
  static auto kernel = make_cuda_kernel(source());
  const size_t threads = size_t(b) * (length + k_size - 1) * c;
  const int grid = static_cast<int>((threads + kThreads - 1) / kThreads) * kThreads;
  // The weight as stored ([C, K] or [C, K, 1]: the same flat values), not reshaped: one node less a layer.
  return kernel({conv_state, src, weight, bias ? *bias : weight},
                {{b, length, c}, {b, k_size - 1, c}}, {mx::float32, mx::float32}, {grid, 1, 1}, {kThreads, 1, 1},
                {{"B", b}, {"C", c}, {"K", k_size}, {"L", length}, {"W", width}, {"OFFSET", offset},
                 {"HAS_BIAS", bias.has_value()}, {"TS", src.dtype()}, {"THREADS", kThreads}},
                std::nullopt, false, s);
}

VC_CUDA_SOURCES(source);
}  // namespace voicechat
