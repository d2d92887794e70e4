// EAR-TTS's MoG draw for one frame in one launch, from the stacked projections of the guided
// hidden state `y = [logits (N) | log_std (1) | rest (L)]`:
//
//   keep_i    = (mass of the components strictly more likely than i) < top_p     (top-p; ties kept together)
//   c         = argmax_i over kept of (logits_i - logsumexp(kept logits)) + gumbel(u_i)   (first index on ties)
//   low       = proj_mus.weight[c * R : (c + 1) * R] @ h                         [R]
//   mu        = low_mat[c] @ low                                                 [L]
//   s         = exp(max(log_std, min_log_std))
//   z         = (mu * s + rest) + s * noise * noise_scale                         [L]
//
// gumbel(u) = -log(-log(u + 1e-8) + 1e-8). Composed (voicechat.tts.mog_head), that is a softmax, a
// sort, a scan, the masking, a logsumexp, the Gumbel argmax, two gathers and two matmuls. Here one
// block of 512 threads; the top-p mass above a component is a block sum (no sort, see
// csrc/kernels/mog_sample/vc_mog_sample.body.cuh), so a component whose mass lies within float
// rounding of top_p may be decided differently from the sorted scan's. CUDA through
// fast::cuda_kernel; elsewhere the composed reference.

#include "voicechat/mog_sample.h"

#include <cmath>

#include <stdexcept>
#include <string>
#include <tuple>

#include "cuda/cuda_sources.h"
#include "jit_sources.h"
#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace voicechat {
namespace {

constexpr int kThreads = 512;  // (1024 would leave 64 registers a thread)

const CudaSource& source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int n, int r, int l, int h, const std::string& tw) {
    return CudaInstance{{"float", "float", "float", "float", tw, tw},
                        {"float", "int32_t"},
                        {P{"N", int_arg(n)}, P{"R", int_arg(r)},
                         P{"L", int_arg(l)}, P{"H", int_arg(h)},
                         P{"THREADS", int_arg(kThreads)}, P{"TW", type_arg(tw)},
                         P{"TOP_P_BITS", int_arg(float_bits(0.95f))}, P{"MIN_LOG_STD_BITS", int_arg(float_bits(7.0f))},
                         P{"MIN_LOG_STD_NEG", "bool:true"},
                         P{"NOISE_BITS", int_arg(float_bits(0.001f))}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_mog_sample",
      {"y", "h", "u", "noise", "mus", "low_mat"},
      {"z", "component"},
      jit::mog_sample::vc_mog_sample_body,
      block_reduce_header() + jit::mog_sample::mog,
      // the published head (bf16 weights); a small float32 one
      {inst(1024, 64, 512, 1152, "__nv_bfloat16"), inst(24, 4, 40, 48, "float")},
  });
  return src;
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("mog_sample: " + what);
}

}  // namespace

std::tuple<mx::array, mx::array> mog_sample(const mx::array& y, const mx::array& h, const mx::array& u,
                                            const mx::array& noise, const mx::array& mus, const mx::array& low_mat,
                                            float top_p, float min_log_std, float noise_scale, int sessions,
                                            mx::StreamOrDevice s_) {
  expect(low_mat.ndim() == 3, "low_mat must be [N, L, R]");
  expect(sessions >= 1, "sessions must be at least 1");
  const int n = low_mat.shape(0), l = low_mat.shape(1), r = low_mat.shape(2);
  expect(h.ndim() >= 1, "h must be [..., H]");
  const int hidden = h.shape(-1);
  const auto per = [&](const mx::array& a, size_t each) { return a.size() == each * static_cast<size_t>(sessions); };
  expect(per(h, hidden), "h must hold one row a session");
  expect(per(y, n + 1 + l), "y must hold N + 1 + L values (logits, log-std, rest) a session");
  expect(per(u, n), "u must hold N uniforms a session");
  expect(per(noise, l), "noise must hold L normals a session");
  expect(mus.shape() == mx::Shape{n * r, hidden}, "mus (proj_mus.weight) must be [N * R, H]");
  auto s = mx::to_stream(s_);
  const bool kernel_path = gpu_stream(s) && cuda_build() && n <= 4096 && y.dtype() == mx::float32 &&
                           h.dtype() == mx::float32 && u.dtype() == mx::float32 && noise.dtype() == mx::float32 &&
                           mus.dtype() == low_mat.dtype() &&
                           float_dtype(mus.dtype());
  expect(kernel_path, "runs on a CUDA stream (float32 y, h, u, noise; N <= 4096); elsewhere use "
                      "voicechat.kernels.mog_sample, which composes MLX ops");
  static auto kernel = make_cuda_kernel(source());
  // y, h, u and noise are read flat (row-contiguous, as MLX makes every kernel input): no reshapes.
  const bool one = sessions == 1;
  auto outs = kernel({y, h, u, noise, mus, low_mat}, {one ? mx::Shape{l} : mx::Shape{sessions, l},
                                                       one ? mx::Shape{1} : mx::Shape{sessions}},
                     {mx::float32, mx::int32}, {sessions * kThreads, 1, 1}, {kThreads, 1, 1},
                     {{"N", n}, {"R", r}, {"L", l}, {"H", hidden}, {"THREADS", kThreads}, {"TW", mus.dtype()},
                      {"TOP_P_BITS", float_bits(top_p)}, {"MIN_LOG_STD_BITS", float_bits(std::fabs(min_log_std))},
                      {"MIN_LOG_STD_NEG", std::signbit(min_log_std)},
                      {"NOISE_BITS", float_bits(noise_scale)}},
                     std::nullopt, false, s);
  return {outs[0], outs[1]};
}

VC_CUDA_SOURCES(source);
}  // namespace voicechat
