// The TTS attention's head preparation in one launch, read in place from the stacked q/k/v
// projection `qkv [B * T, (HQ + 2 HK) * D]`:
//
//   q = rope(rms_norm(q_head) * q_scale),  k = rope(rms_norm(k_head) * k_scale),  v = v_head
//
// each written as [B, heads, T, D] float32 (the attention / cache layout). rms_norm is over one
// head's D values; rope is the rotate-half form at position offset + t, angle = position *
// inv_freq[i] in float32 (pairs i, i + D/2). Composed, this is three layout copies, two of MLX's
// rms_norm and two rope launches per layer. One warp per (row, head). CUDA through
// fast::cuda_kernel; elsewhere MLX ops (the reference: voicechat.kernels.qkv_heads).
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

const std::string& head_norm_rope_header() {
  static const std::string text = R"(
#ifndef VC_HEAD_NORM_ROPE
#define VC_HEAD_NORM_ROPE
// One head of D values at x, by one warp (lane-strided pairs i, i + D/2): RMS norm over the head
// times scale, then rotate-half RoPE at `position` (angle = position * inv_freq[i]), into o.
template <int D, typename TX>
__device__ __forceinline__ void vc_head_norm_rope(const TX* x, const float* scale, const float* inv_freq, float eps,
                                                  float position, float* o, int lane) {
  constexpr int HALF = D / 2;
  constexpr int PAIRS = (HALF + 31) / 32;
  // The scales and frequencies load with x (not after the reduction: one memory round trip fewer).
  float lo[PAIRS], hi[PAIRS], s_lo[PAIRS], s_hi[PAIRS], freq[PAIRS];
  float ss = 0.0f;
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int i = lane + 32 * p;
    lo[p] = i < HALF ? static_cast<float>(x[i]) : 0.0f;
    hi[p] = i < HALF ? static_cast<float>(x[i + HALF]) : 0.0f;
    s_lo[p] = i < HALF ? scale[i] : 0.0f;
    s_hi[p] = i < HALF ? scale[i + HALF] : 0.0f;
    freq[p] = i < HALF ? inv_freq[i] : 0.0f;
    ss += lo[p] * lo[p] + hi[p] * hi[p];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float r = rsqrtf(ss / static_cast<float>(D) + eps);
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int i = lane + 32 * p;
    if (i < HALF) {
      const float a = lo[p] * r * s_lo[p];
      const float c = hi[p] * r * s_hi[p];
      const float angle = position * freq[p];
      const float cs = cosf(angle);
      const float sn = sinf(angle);
      o[i] = a * cs - c * sn;
      o[i + HALF] = c * cs + a * sn;
    }
  }
}
#endif
)";
  return text;
}

namespace {

constexpr int kWarpsPerBlock = 4;

// Template args: B, HQ, HK, D, T (positions per batch row), WARPS (per block), TX (qkv's type),
// EPS_BITS (the head norms' eps as float bits).
constexpr const char* kSource = R"(
  constexpr int HEADS = HQ + 2 * HK;
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (item >= B * T * HEADS) {
    return;
  }
  const int row = item / HEADS;
  const int head = item % HEADS;
  const int b = row / T;
  const int t = row % T;
  const TX* x = qkv + static_cast<size_t>(row) * (HEADS * D) + head * D;
  float* out;
  int h;
  int heads;
  if (head < HQ) {
    out = q_out; h = head; heads = HQ;
  } else if (head < HQ + HK) {
    out = k_out; h = head - HQ; heads = HK;
  } else {
    out = v_out; h = head - HQ - HK; heads = HK;
  }
  float* o = out + ((static_cast<size_t>(b) * heads + h) * T + t) * D;
  if (head >= HQ + HK) {
    for (int d = lane; d < D; d += 32) o[d] = static_cast<float>(x[d]);
    return;
  }
  vc_head_norm_rope<D, TX>(x, head < HQ ? q_scale : k_scale, inv_freq, __int_as_float(EPS_BITS),
                           static_cast<float>(offset[0] + t), o,
                           lane);
)";

const CudaSource& source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int b, int hq, int hk, int d, int t, const std::string& tx) {
    return CudaInstance{{tx, "float", "float", "float", "int32_t"},
                        {"float", "float", "float"},
                        {P{"B", int_arg(b)}, P{"HQ", int_arg(hq)}, P{"HK", int_arg(hk)},
                         P{"D", int_arg(d)}, P{"T", int_arg(t)},
                         P{"WARPS", int_arg(kWarpsPerBlock)}, P{"TX", type_arg(tx)},
                         P{"EPS_BITS", int_arg(float_bits(1e-6f))}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_qkv_heads",
      {"qkv", "q_scale", "k_scale", "inv_freq", "offset"},
      {"q_out", "k_out", "v_out"},
      kSource,
      head_norm_rope_header(),
      // the TTS backbone: a step and the 37-frame warmup; grouped heads and D over 64, bfloat16
      {inst(2, 16, 16, 72, 1, "float"), inst(2, 16, 16, 72, 37, "float"), inst(1, 4, 2, 80, 3, "__nv_bfloat16")},
  });
  return src;
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("qkv_heads: " + what);
}

std::tuple<mx::array, mx::array, mx::array> qkv_heads(const mx::array& qkv, const mx::array& q_scale,
                                                      const mx::array& k_scale, const mx::array& inv_freq,
                                                      const mx::array& offset, int heads, int kv_heads, int batch,
                                                      float eps, mx::StreamOrDevice s_) {
  expect(q_scale.ndim() == 1 && k_scale.shape() == q_scale.shape(), "q_scale and k_scale must be [D]");
  const int d = q_scale.shape(0);
  expect(d % 2 == 0 && inv_freq.shape() == mx::Shape{d / 2}, "D must be even and inv_freq [D / 2]");
  expect(heads >= 1 && kv_heads >= 1 && batch >= 1, "heads, kv_heads and batch must be positive");
  expect(qkv.ndim() >= 1 && qkv.shape(-1) == (heads + 2 * kv_heads) * d,
         "qkv [..., (heads + 2 kv_heads) * D] does not match heads and D");
  expect(offset.size() == 1, "offset must hold one position");
  const int rows = static_cast<int>(qkv.size() / qkv.shape(-1));
  expect(rows % batch == 0, "the rows of qkv are not a multiple of batch");
  const int t = rows / batch;
  auto s = mx::to_stream(s_);
  const bool kernel_path = gpu_stream(s) && cuda_build() && rows > 0 &&
                           float_dtype(qkv.dtype()) &&
                           q_scale.dtype() == mx::float32 && k_scale.dtype() == mx::float32 &&
                           inv_freq.dtype() == mx::float32;
  if (!kernel_path) {
    throw std::invalid_argument("qkv_heads: runs on a CUDA stream (float32 scales and inv_freq); elsewhere use "
                                "voicechat.kernels.qkv_heads, which composes MLX ops");
  }
  static auto kernel = make_cuda_kernel(source());
  const int items = rows * (heads + 2 * kv_heads);
  const int blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  // qkv read flat and the offset as its one value, whatever their shapes: no reshape nodes.
  auto outs = kernel({qkv, q_scale, k_scale, inv_freq, mx::astype(offset, mx::int32, s)},
                     {{batch, heads, t, d}, {batch, kv_heads, t, d}, {batch, kv_heads, t, d}},
                     {mx::float32, mx::float32, mx::float32}, {blocks * 32 * kWarpsPerBlock, 1, 1},
                     {32 * kWarpsPerBlock, 1, 1},
                     {{"B", batch}, {"HQ", heads}, {"HK", kv_heads}, {"D", d}, {"T", t}, {"WARPS", kWarpsPerBlock}, {"TX", qkv.dtype()},
                      {"EPS_BITS", float_bits(eps)}},
                     std::nullopt, false, s);
  return {outs[0], outs[1], outs[2]};
}

void bind(py::module_& m) {
  source();  // registered at import, so the compile checks see it
  m.def("qkv_heads", &qkv_heads, py::arg("qkv"), py::arg("q_scale"), py::arg("k_scale"), py::arg("inv_freq"),
        py::arg("offset"), py::arg("heads"), py::arg("kv_heads"), py::arg("batch"), py::arg("eps"),
        py::arg("stream") = py::none(),
        "(q, k, v) as [B, heads, T, D] float32 from the stacked projection qkv [B * T, (heads + 2 kv_heads) * D]: "
        "q and k RMS-normed per head (times q_scale / k_scale) and rotated (rotate-half RoPE, angle = "
        "(offset + t) * inv_freq[i]). One CUDA launch; CUDA streams only.");
}

}  // namespace
VC_REGISTER(bind);
}  // namespace voicechat
