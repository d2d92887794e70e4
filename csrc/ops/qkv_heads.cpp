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

#include "voicechat/qkv_heads.h"

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

constexpr int kWarpsPerBlock = 4;

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
      jit::qkv_heads::vc_qkv_heads_body,
      head_norm_rope_header(),
      // the TTS backbone: a step and the 37-frame warmup; grouped heads and D over 64, bfloat16
      {inst(2, 16, 16, 72, 1, "float"), inst(2, 16, 16, 72, 37, "float"), inst(1, 4, 2, 80, 3, "__nv_bfloat16")},
  });
  return src;
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("qkv_heads: " + what);
}

}  // namespace

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

VC_CUDA_SOURCES(source);
}  // namespace voicechat
