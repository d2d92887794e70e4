// The Mamba-2 mixer's gated group RMSNorm in one launch:
//
//   h   = y * silu(gate)                      gate: columns [gate_offset, gate_offset + C) of gate_src
//   out = h / sqrt(mean_group(h^2) + eps) * weight      over G equal groups of the C channels
//
// Composed, that is a fused elementwise kernel, MLX's rms_norm and another elementwise kernel per
// Mamba layer (27 layers a decode step); here one block per (row, group) does it all, reading the
// gate in place from the in_proj output. CUDA through fast::cuda_kernel; everywhere else, MLX ops
// (also the reference: voicechat.kernels.gated_rms_norm).

#include "voicechat/gated_rms_norm.h"

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
  auto inst = [](int c, int g, int w, int offset, const std::string& t = "float") {
    return CudaInstance{{t, t, t},
                        {t},
                        {P{"C", int_arg(c)}, P{"G", int_arg(g)},
                         P{"W", int_arg(w)}, P{"GATE_OFFSET", int_arg(offset)},
                         P{"THREADS", int_arg(kThreads)}, P{"EPS_BITS", int_arg(float_bits(1e-5f))},
                         P{"TY", type_arg(t)}, P{"TG", type_arg(t)},
                         P{"TW", type_arg(t)}, P{"TO", type_arg(t)}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_gated_rms_norm",
      {"y", "gate_src", "weight"},
      {"out"},
      jit::gated_rms_norm::vc_gated_rms_norm_body,
      block_reduce_header(),
      // the published mixer (float32 as the LLM runs, bfloat16 too); a small odd one
      {inst(10240, 8, 22656, 0), inst(10240, 8, 22656, 0, "__nv_bfloat16"), inst(96, 2, 300, 4)},
  });
  return src;
}

mx::array composed(const mx::array& y, const mx::array& gate, const mx::array& weight, int groups, float eps,
                   mx::Stream s) {
  auto h = mx::multiply(y, mx::multiply(gate, mx::sigmoid(gate, s), s), s);
  auto shape = h.shape();
  auto grouped = shape;
  grouped.back() = groups;
  grouped.push_back(shape.back() / groups);
  auto normed = mx::fast::rms_norm(mx::reshape(h, grouped, s), std::nullopt, eps, s);
  return mx::multiply(mx::reshape(normed, shape, s), weight, s);
}

}  // namespace

mx::array gated_rms_norm(const mx::array& y, const mx::array& gate_src, int gate_offset, const mx::array& weight,
                         int groups, float eps, mx::StreamOrDevice s_) {
  if (y.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != y.shape(-1)) {
    throw std::invalid_argument("gated_rms_norm: y [..., C] and weight [C] disagree");
  }
  const int c = y.shape(-1);
  if (groups < 1 || c % groups != 0) {
    throw std::invalid_argument("gated_rms_norm: " + std::to_string(groups) + " groups do not divide " +
                                std::to_string(c) + " channels");
  }
  if (gate_src.ndim() != y.ndim() || gate_offset < 0 || gate_offset + c > gate_src.shape(-1)) {
    throw std::invalid_argument("gated_rms_norm: gate columns [gate_offset, gate_offset + C) lie outside gate_src");
  }
  for (int i = 0; i + 1 < y.ndim(); ++i) {
    if (gate_src.shape(i) != y.shape(i)) {
      throw std::invalid_argument("gated_rms_norm: gate_src and y have different leading shapes");
    }
  }
  auto s = mx::to_stream(s_);
  const int width = gate_src.shape(-1);
  const int rows = static_cast<int>(y.size() / c);
  const bool kernel_path = gpu_stream(s) && cuda_build() && rows > 0 && float_dtype(y.dtype()) &&
                           float_dtype(gate_src.dtype()) && float_dtype(weight.dtype());
  if (!kernel_path) {
    mx::Shape start(gate_src.ndim(), 0), stop = gate_src.shape();
    start.back() = gate_offset;
    stop.back() = gate_offset + c;
    return composed(y, mx::slice(gate_src, start, stop, s), weight, groups, eps, s);
  }
  static auto kernel = make_cuda_kernel(source());
  // The composed ops' result type; the kernel computes in float32 throughout and rounds once.
  const auto out_dtype = mx::promote_types(mx::promote_types(y.dtype(), gate_src.dtype()), weight.dtype());
  // Inputs and output keep the caller's shapes (read and written flat): no reshape nodes.
  auto outs = kernel({y, gate_src, weight},
                     {y.shape()}, {out_dtype}, {rows * groups * kThreads, 1, 1}, {kThreads, 1, 1},
                     {{"C", c}, {"G", groups}, {"W", width}, {"GATE_OFFSET", gate_offset}, {"THREADS", kThreads},
                      {"EPS_BITS", float_bits(eps)},
                      {"TY", y.dtype()}, {"TG", gate_src.dtype()}, {"TW", weight.dtype()}, {"TO", out_dtype}},
                     std::nullopt, false, s);
  return outs[0];
}

VC_CUDA_SOURCES(source);
}  // namespace voicechat
