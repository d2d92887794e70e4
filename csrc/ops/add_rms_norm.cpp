// Gemma's sandwich-norm seam in one launch:
//
//   h'  = h + rms_norm(y) * post          (the branch output, normed, added to the residual stream)
//   z   = rms_norm(h') * pre              (the next sublayer's input norm)
//
// rms_norm(x) = x / sqrt(mean(x^2) + eps). The EAR-TTS backbone meets it twice a layer and its MoG
// head three times a call: composed, each is two of MLX's rms_norm and an add. One block per row
// does both norms here. CUDA through fast::cuda_kernel; everywhere else MLX ops (also the
// reference: voicechat.kernels.add_rms_norm).

#include "voicechat/add_rms_norm.h"

#include <stdexcept>
#include <string>
#include <tuple>

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
  auto inst = [](int c, const std::string& t) {
    return CudaInstance{{"float", t, "float", "float"},
                        {"float", "float"},
                        {P{"C", int_arg(c)}, P{"THREADS", int_arg(kThreads)}, P{"EPS_BITS", int_arg(float_bits(1e-6f))},
                         P{"TH", "type:float"}, P{"TY", type_arg(t)}, P{"TW", "type:float"}, P{"TO", "type:float"}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_add_rms_norm",
      {"h", "y", "post", "pre"},
      {"h_out", "z_out"},
      jit::add_rms_norm::vc_add_rms_norm_body,
      block_reduce_header() + jit::add_rms_norm::seam,
      // the TTS width (float32 as it runs; a bfloat16 branch too); a small odd one
      {inst(1152, "float"), inst(1152, "__nv_bfloat16"), inst(100, "float")},
  });
  return src;
}

const CudaSource& guided_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int c, float g) {
    return CudaInstance{{"float", "float", "float", "float"},
                        {"float"},
                        {P{"C", int_arg(c)}, P{"THREADS", int_arg(kThreads)}, P{"EPS_BITS", int_arg(float_bits(1e-6f))},
                         P{"G_BITS", int_arg(float_bits(g))}, P{"TH", "type:float"}, P{"TY", "type:float"},
                         P{"TW", "type:float"}, P{"TO", "type:float"}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_add_rms_norm_guided",
      {"h", "y", "post", "pre"},
      {"out"},
      jit::add_rms_norm::vc_add_rms_norm_guided_body,
      block_reduce_header() + jit::add_rms_norm::seam,
      {inst(1152, 0.2f), inst(100, 1.5f)},  // the published MoG head (guidance 0.2); a small odd one
  });
  return src;
}

}  // namespace

std::tuple<mx::array, mx::array> add_rms_norm(const mx::array& h, const mx::array& y, const mx::array& post,
                                              const mx::array& pre, float eps, mx::StreamOrDevice s_) {
  if (h.ndim() < 1 || h.shape() != y.shape()) {
    throw std::invalid_argument("add_rms_norm: h and y must have one shape [..., C]");
  }
  const int c = h.shape(-1);
  if (post.shape() != mx::Shape{c} || pre.shape() != mx::Shape{c}) {
    throw std::invalid_argument("add_rms_norm: post and pre must be [C] with C = " + std::to_string(c));
  }
  auto s = mx::to_stream(s_);
  const int rows = static_cast<int>(h.size() / c);
  const bool kernel_path = gpu_stream(s) && cuda_build() && rows > 0 && h.dtype() == mx::float32 &&
                           float_dtype(y.dtype()) && post.dtype() == mx::float32 && pre.dtype() == mx::float32;
  if (!kernel_path) {
    auto out = mx::add(h, mx::fast::rms_norm(y, post, eps, s), s);
    return {out, mx::fast::rms_norm(out, pre, eps, s)};
  }
  static auto kernel = make_cuda_kernel(source());
  // h and y go in and the outputs come out with the caller's shape (read and written flat,
  // row-contiguous as MLX makes every kernel input): no reshape nodes in the graph.
  auto outs = kernel({h, y, post, pre},
                     {h.shape(), h.shape()}, {mx::float32, mx::float32}, {rows * kThreads, 1, 1}, {kThreads, 1, 1},
                     {{"C", c}, {"THREADS", kThreads}, {"EPS_BITS", float_bits(eps)}, {"TH", h.dtype()}, {"TY", y.dtype()}, {"TW", post.dtype()},
                      {"TO", mx::float32}},
                     std::nullopt, false, s);
  return {outs[0], outs[1]};
}

// The seam over a CFG pair h, y [2, 1, C] (row 0 conditioned, row 1 not), then z0 + g * (z0 - z1):
// [1, 1, C]; sessions' pairs [2 S, 1, C] -> [S, 1, C]. One CUDA launch (float32, g >= 0); MLX ops
// elsewhere.
mx::array add_rms_norm_guided(const mx::array& h, const mx::array& y, const mx::array& post, const mx::array& pre,
                              float eps, float guidance, mx::StreamOrDevice s_) {
  if (h.ndim() != 3 || h.shape(0) < 2 || h.shape(0) % 2 != 0 || h.shape(1) != 1 || h.shape() != y.shape()) {
    throw std::invalid_argument("add_rms_norm_guided: h and y must both be [2, 1, C] (the CFG pair), or [2 S, 1, C] "
                                "(S sessions' pairs)");
  }
  const int sessions = h.shape(0) / 2;
  const int c = h.shape(-1);
  if (post.shape() != mx::Shape{c} || pre.shape() != mx::Shape{c}) {
    throw std::invalid_argument("add_rms_norm_guided: post and pre must be [C] with C = " + std::to_string(c));
  }
  auto s = mx::to_stream(s_);
  const bool kernel_path = gpu_stream(s) && cuda_build() && guidance >= 0.0f && h.dtype() == mx::float32 &&
                           y.dtype() == mx::float32 && post.dtype() == mx::float32 && pre.dtype() == mx::float32;
  if (!kernel_path) {
    auto z = mx::fast::rms_norm(mx::add(h, mx::fast::rms_norm(y, post, eps, s), s), pre, eps, s);
    const int n = 2 * sessions;
    auto cond = mx::slice(z, {0, 0, 0}, {n, 1, c}, {2, 1, 1}, s), uncond = mx::slice(z, {1, 0, 0}, {n, 1, c}, {2, 1, 1}, s);
    return mx::add(cond, mx::multiply(mx::array(guidance), mx::subtract(cond, uncond, s), s), s);
  }
  static auto kernel = make_cuda_kernel(guided_source());
  return kernel({h, y, post, pre}, {{sessions, 1, c}}, {mx::float32}, {sessions * kThreads, 1, 1}, {kThreads, 1, 1},
                {{"C", c}, {"THREADS", kThreads}, {"EPS_BITS", float_bits(eps)}, {"G_BITS", float_bits(guidance)},
                 {"TH", mx::float32}, {"TY", mx::float32}, {"TW", mx::float32}, {"TO", mx::float32}},
                std::nullopt, false, s)[0];
}

VC_CUDA_SOURCES(source, guided_source);
}  // namespace voicechat
