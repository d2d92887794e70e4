// Gemma's sandwich-norm seam in one launch:
//
//   h'  = h + rms_norm(y) * post          (the branch output, normed, added to the residual stream)
//   z   = rms_norm(h') * pre              (the next sublayer's input norm)
//
// rms_norm(x) = x / sqrt(mean(x^2) + eps). The EAR-TTS backbone meets it twice a layer and its MoG
// head three times a call: composed, each is two of MLX's rms_norm and an add. One block per row
// does both norms here. CUDA through fast::cuda_kernel; everywhere else MLX ops (also the
// reference: voicechat.kernels.add_rms_norm).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "cuda_sources.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "mlx_caster.h"
#include "registry.h"

namespace py = pybind11;
namespace mx = mlx::core;

namespace voicechat {
namespace {

constexpr int kThreads = 256;

// The seam for one row, both kernels' body: thread t holds channels t, t + THREADS, ... of h' in
// v and of z = rms_norm(h') * pre in z (zero past C). Included after block_reduce_header().
constexpr const char* kSeamHeader = R"(
#ifndef VC_SEAM_ROW
#define VC_SEAM_ROW
template <int C, int THREADS, int PER, typename TH, typename TY, typename TW>
__device__ __forceinline__ void vc_seam_row(const TH* h, const TY* y, const TW* post, const TW* pre, float eps,
                                            float* scratch, float (&v)[PER], float (&z)[PER]) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    v[i] = c < C ? static_cast<float>(y[c]) : 0.0f;
    ss += v[i] * v[i];
  }
  const float r_post = rsqrtf(vc_block_sum<THREADS>(ss, scratch) / static_cast<float>(C) + eps);
  ss = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    v[i] = c < C ? static_cast<float>(h[c]) + v[i] * r_post * static_cast<float>(post[c]) : 0.0f;
    ss += v[i] * v[i];
  }
  const float r_pre = rsqrtf(vc_block_sum<THREADS>(ss, scratch) / static_cast<float>(C) + eps);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    z[i] = c < C ? v[i] * r_pre * static_cast<float>(pre[c]) : 0.0f;
  }
}
#endif
)";

// Template args: C (channels), THREADS, EPS_BITS (eps as float bits), TH, TY, TW (post / pre), TO.
constexpr const char* kSource = R"(
  constexpr int PER = (C + THREADS - 1) / THREADS;
  __shared__ float scratch[THREADS / 32];
  const size_t base = static_cast<size_t>(blockIdx.x) * C;
  float v[PER], z[PER];
  vc_seam_row<C, THREADS, PER>(h + base, y + base, post, pre, __int_as_float(EPS_BITS), scratch, v, z);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    if (c < C) {
      h_out[base + c] = static_cast<TO>(v[i]);
      z_out[base + c] = static_cast<TO>(z[i]);
    }
  }
)";

// The same seam over a classifier-free-guidance pair, the MoG head's last: rows 0 (conditioned) and 1
// (not) of h, y [2, C] in one block, and out [C] = z0 + g * (z0 - z1), the guided input of the head's
// projections (composed: the seam, then a launch for the guidance). Template args as kSource's and
// G_BITS (the guidance scale as float bits).
constexpr const char* kGuidedSource = R"(
  constexpr int PER = (C + THREADS - 1) / THREADS;
  __shared__ float scratch[THREADS / 32];
  float v[PER], z0[PER], z1[PER];
  vc_seam_row<C, THREADS, PER>(h, y, post, pre, __int_as_float(EPS_BITS), scratch, v, z0);
  vc_seam_row<C, THREADS, PER>(h + C, y + C, post, pre, __int_as_float(EPS_BITS), scratch, v, z1);
  const float g = __int_as_float(G_BITS);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    if (c < C) out[c] = static_cast<TO>(z0[i] + g * (z0[i] - z1[i]));
  }
)";

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
      kSource,
      block_reduce_header() + kSeamHeader,
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
      kGuidedSource,
      block_reduce_header() + kSeamHeader,
      {inst(1152, 0.2f), inst(100, 1.5f)},  // the published MoG head (guidance 0.2); a small odd one
  });
  return src;
}

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
// [1, 1, C]. One CUDA launch (float32, g >= 0); MLX ops elsewhere.
mx::array add_rms_norm_guided(const mx::array& h, const mx::array& y, const mx::array& post, const mx::array& pre,
                              float eps, float guidance, mx::StreamOrDevice s_) {
  if (h.ndim() != 3 || h.shape(0) != 2 || h.shape(1) != 1 || h.shape() != y.shape()) {
    throw std::invalid_argument("add_rms_norm_guided: h and y must both be [2, 1, C] (the CFG pair)");
  }
  const int c = h.shape(-1);
  if (post.shape() != mx::Shape{c} || pre.shape() != mx::Shape{c}) {
    throw std::invalid_argument("add_rms_norm_guided: post and pre must be [C] with C = " + std::to_string(c));
  }
  auto s = mx::to_stream(s_);
  const bool kernel_path = gpu_stream(s) && cuda_build() && guidance >= 0.0f && h.dtype() == mx::float32 &&
                           y.dtype() == mx::float32 && post.dtype() == mx::float32 && pre.dtype() == mx::float32;
  if (!kernel_path) {
    auto z = mx::fast::rms_norm(mx::add(h, mx::fast::rms_norm(y, post, eps, s), s), pre, eps, s);
    auto cond = mx::slice(z, {0, 0, 0}, {1, 1, c}, s), uncond = mx::slice(z, {1, 0, 0}, {2, 1, c}, s);
    return mx::add(cond, mx::multiply(mx::array(guidance), mx::subtract(cond, uncond, s), s), s);
  }
  static auto kernel = make_cuda_kernel(guided_source());
  return kernel({h, y, post, pre}, {{1, 1, c}}, {mx::float32}, {kThreads, 1, 1}, {kThreads, 1, 1},
                {{"C", c}, {"THREADS", kThreads}, {"EPS_BITS", float_bits(eps)}, {"G_BITS", float_bits(guidance)},
                 {"TH", mx::float32}, {"TY", mx::float32}, {"TW", mx::float32}, {"TO", mx::float32}},
                std::nullopt, false, s)[0];
}

void bind(py::module_& m) {
  source();  // registered at import, so the compile checks see them
  guided_source();
  m.def("add_rms_norm_guided", &add_rms_norm_guided, py::arg("h"), py::arg("y"), py::arg("post"), py::arg("pre"),
        py::arg("eps"), py::arg("guidance"), py::arg("stream") = py::none(),
        "The seam over a CFG pair h, y [2, 1, C] (row 0 conditioned), then z0 + guidance * (z0 - z1) of its "
        "normed output z: [1, 1, C]. One CUDA launch (float32, guidance >= 0) on a CUDA stream, MLX ops elsewhere.");
  m.def("add_rms_norm", &add_rms_norm, py::arg("h"), py::arg("y"), py::arg("post"), py::arg("pre"), py::arg("eps"),
        py::arg("stream") = py::none(),
        "(h + rms_norm(y) * post, rms_norm(that) * pre) over the last axis: one CUDA launch (float32 h, "
        "post and pre; y of a float type) on a CUDA stream, MLX ops elsewhere.");
}

}  // namespace
VC_REGISTER(bind);
}  // namespace voicechat
