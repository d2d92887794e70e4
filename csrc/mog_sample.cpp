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
// block of 512 threads; the top-p mass above a component is a block sum (no sort, see kSource), so
// a component whose mass lies within float rounding of top_p may be decided differently from the
// sorted scan's. CUDA through fast::cuda_kernel; elsewhere the composed reference.
#include <pybind11/pybind11.h>

#include <cmath>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "cuda_sources.h"
#include "mlx/mlx.h"
#include "mlx_caster.h"
#include "registry.h"

namespace py = pybind11;
namespace mx = mlx::core;

namespace voicechat {
namespace {

constexpr int kThreads = 512;  // (1024 would leave 64 registers a thread)

constexpr const char* kHeader = R"(
namespace vc_mog {

// (value, index) of the largest value, the smallest index among equals; -inf everywhere gives index 0.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

template <int THREADS>
__device__ int block_argmax(float v, int i, float* vs, int* is) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    better(v, i, ov, oi);
  }
  if ((threadIdx.x & 31) == 0) {
    vs[threadIdx.x >> 5] = v;
    is[threadIdx.x >> 5] = i;
  }
  __syncthreads();
  v = vs[0];
  i = is[0];
  for (int w = 1; w < THREADS / 32; ++w) better(v, i, vs[w], is[w]);
  __syncthreads();
  return i;
}

}  // namespace vc_mog
)";

// Template args: N (components), R (low rank), L (latent), H (hidden), THREADS, TW (weights' type).
// TOP_P_BITS, NOISE_BITS: top_p and noise_scale as float bits; MIN_LOG_STD_BITS / MIN_LOG_STD_NEG:
// min_log_std's magnitude as float bits and its sign.
//
// Top-p without comparing every pair (N^2 = 1M steps for one block): with f(t) = the mass of the components above t, keep_i <=> f(p_i) < top_p, and f only
// falls as t grows, so the kept components are those with p_i >= tau, tau the smallest p with
// f(p) < top_p. A bisection over the bits of t (non-negative floats order as their bits) finds it
// in ~30 block sums; each f(t) sums in one fixed order, so it is monotone in t and the bisection
// exact for it. The two products read their weight rows 16 bytes a load, every load of a lane at
// once (h staged in shared memory).
constexpr const char* kSource = R"(
  const float neg_inf = -__uint_as_float(0x7f800000u);  // MLX's CUDA prelude has no `inf`
  constexpr int WARPS = THREADS / 32;
  constexpr int VEC = 16 / static_cast<int>(sizeof(TW));  // weights a 16-byte load
  __shared__ float p[N];
  __shared__ __align__(16) float hs[H];
  __shared__ float low[R];
  __shared__ float scratch[WARPS];
  __shared__ int scratch_i[WARPS];
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const float top_p = __int_as_float(TOP_P_BITS);
  for (int k = tid; k < H; k += THREADS) hs[k] = h[k];
  // softmax of the logits
  float m = neg_inf;
  for (int i = tid; i < N; i += THREADS) m = fmaxf(m, y[i]);
  m = vc_block_max<THREADS>(m, scratch);
  float s = 0.0f;
  for (int i = tid; i < N; i += THREADS) {
    p[i] = expf(y[i] - m);
    s += p[i];
  }
  s = vc_block_sum<THREADS>(s, scratch);  // (its barrier also publishes p)
  for (int i = tid; i < N; i += THREADS) p[i] = p[i] / s;
  __syncthreads();
  // top-p: the smallest t (as bits, within [0, just above 1]) with f(t) < top_p
  unsigned int lo = 0u, hi = 0x3F800001u;
  while (lo < hi) {  // uniform: every thread has the same block sums
    const unsigned int mid = lo + (hi - lo) / 2u;
    const float t = __uint_as_float(mid);
    float above = 0.0f;
    for (int i = tid; i < N; i += THREADS) above += p[i] > t ? p[i] : 0.0f;
    if (vc_block_sum<THREADS>(above, scratch) < top_p) hi = mid; else lo = mid + 1u;
  }
  const float tau = __uint_as_float(lo);
  // the kept logits' logsumexp
  float kept = 0.0f;
  for (int i = tid; i < N; i += THREADS) {
    if (p[i] >= tau) kept += expf(y[i] - m);
  }
  const float lse = m + logf(vc_block_sum<THREADS>(kept, scratch));
  // Gumbel-max over the kept components
  float best = neg_inf;
  int best_i = 0;
  for (int i = tid; i < N; i += THREADS) {
    if (p[i] >= tau) {
      const float g = -logf(-logf(u[i] + 1e-8f) + 1e-8f);
      vc_mog::better(best, best_i, (y[i] - lse) + g, i);
    }
  }
  const int c = vc_mog::block_argmax<THREADS>(best, best_i, scratch, scratch_i);
  if (tid == 0) component[0] = c;
  const bool vec = H % VEC == 0 && R % VEC == 0 &&
                   ((reinterpret_cast<unsigned long long>(mus) | reinterpret_cast<unsigned long long>(low_mat)) & 15ull) == 0ull;
  // low = proj_mus rows of c @ h: a warp per row, lanes over the row (all of a warp's rows at once)
  constexpr int RPW = (R + WARPS - 1) / WARPS;
  float acc[RPW];
#pragma unroll
  for (int j = 0; j < RPW; ++j) acc[j] = 0.0f;
  if (vec) {
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
      const int r = warp + j * WARPS;
      if (r < R) {
        const TW* w = mus + (static_cast<size_t>(c) * R + r) * H;
        for (int v = lane; v < H / VEC; v += 32) {
          TW e[VEC];
          *reinterpret_cast<uint4*>(e) = reinterpret_cast<const uint4*>(w)[v];
#pragma unroll
          for (int q = 0; q < VEC; ++q) acc[j] = fmaf(static_cast<float>(e[q]), hs[v * VEC + q], acc[j]);
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
      const int r = warp + j * WARPS;
      if (r < R) {
        const TW* w = mus + (static_cast<size_t>(c) * R + r) * H;
        for (int k = lane; k < H; k += 32) acc[j] = fmaf(static_cast<float>(w[k]), hs[k], acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
    const int r = warp + j * WARPS;
    if (lane == 0 && r < R) low[r] = acc[j];
  }
  __syncthreads();
  // z = (low_mat[c] @ low) * s + rest + s * noise * noise_scale
  const float min_log_std = MIN_LOG_STD_NEG ? -__int_as_float(MIN_LOG_STD_BITS) : __int_as_float(MIN_LOG_STD_BITS);
  const float scale = expf(fmaxf(y[N], min_log_std));
  for (int l = tid; l < L; l += THREADS) {
    const TW* lm = low_mat + (static_cast<size_t>(c) * L + l) * R;
    float mu = 0.0f;
    if (vec) {
#pragma unroll
      for (int v = 0; v < R / VEC; ++v) {
        TW e[VEC];
        *reinterpret_cast<uint4*>(e) = reinterpret_cast<const uint4*>(lm)[v];
#pragma unroll
        for (int q = 0; q < VEC; ++q) mu = fmaf(static_cast<float>(e[q]), low[v * VEC + q], mu);
      }
    } else {
      for (int r = 0; r < R; ++r) mu = fmaf(static_cast<float>(lm[r]), low[r], mu);
    }
    z[l] = (mu * scale + y[N + 1 + l]) + scale * noise[l] * __int_as_float(NOISE_BITS);
  }
)";

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
      kSource,
      block_reduce_header() + kHeader,
      // the published head (bf16 weights); a small float32 one
      {inst(1024, 64, 512, 1152, "__nv_bfloat16"), inst(24, 4, 40, 48, "float")},
  });
  return src;
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("mog_sample: " + what);
}

std::tuple<mx::array, mx::array> mog_sample(const mx::array& y, const mx::array& h, const mx::array& u,
                                            const mx::array& noise, const mx::array& mus, const mx::array& low_mat,
                                            float top_p, float min_log_std, float noise_scale, mx::StreamOrDevice s_) {
  expect(low_mat.ndim() == 3, "low_mat must be [N, L, R]");
  const int n = low_mat.shape(0), l = low_mat.shape(1), r = low_mat.shape(2);
  expect(h.ndim() >= 1, "h must be [..., H]");
  const int hidden = h.shape(-1);
  expect(static_cast<int>(h.size()) == hidden, "h must hold one row");
  expect(static_cast<int>(y.size()) == n + 1 + l, "y must hold N + 1 + L values (logits, log-std, rest)");
  expect(static_cast<int>(u.size()) == n, "u must hold N uniforms");
  expect(static_cast<int>(noise.size()) == l, "noise must hold L normals");
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
  auto outs = kernel({y, h, u, noise, mus, low_mat}, {{l}, {1}},
                     {mx::float32, mx::int32}, {kThreads, 1, 1}, {kThreads, 1, 1},
                     {{"N", n}, {"R", r}, {"L", l}, {"H", hidden}, {"THREADS", kThreads}, {"TW", mus.dtype()},
                      {"TOP_P_BITS", float_bits(top_p)}, {"MIN_LOG_STD_BITS", float_bits(std::fabs(min_log_std))},
                      {"MIN_LOG_STD_NEG", std::signbit(min_log_std)},
                      {"NOISE_BITS", float_bits(noise_scale)}},
                     std::nullopt, false, s);
  return {outs[0], outs[1]};
}

void bind(py::module_& m) {
  source();  // registered at import, so the compile checks see it
  m.def("mog_sample", &mog_sample, py::arg("y"), py::arg("h"), py::arg("u"), py::arg("noise"), py::arg("mus"),
        py::arg("low_mat"), py::arg("top_p"), py::arg("min_log_std"), py::arg("noise_scale"),
        py::arg("stream") = py::none(),
        "One MoG draw: (z [L] float32, component [1] int32) from y = [logits N | log_std | rest L], the guided "
        "hidden h [H], uniforms u [N], normals noise [L], proj_mus.weight [N * R, H] and low_mat [N, L, R]. "
        "One CUDA launch; CUDA streams only.");
}

}  // namespace
VC_REGISTER(bind);
}  // namespace voicechat
