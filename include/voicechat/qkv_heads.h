// The TTS attention's head preparation: head norms, RoPE and the attention layout.
#pragma once

#include <tuple>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// (q, k, v) as [batch, heads, T, D] float32 from the stacked projection qkv [batch * T, (heads + 2
// kv_heads) * D]: q and k RMS-normed per head (times q_scale / k_scale [D]) and rotated (rotate-half
// RoPE, angle = (offset + t) * inv_freq[i]; offset [1] int32, inv_freq [D / 2]). One CUDA launch;
// CUDA streams only.
std::tuple<mlx::core::array, mlx::core::array, mlx::core::array> qkv_heads(
    const mlx::core::array& qkv, const mlx::core::array& q_scale, const mlx::core::array& k_scale,
    const mlx::core::array& inv_freq, const mlx::core::array& offset, int heads, int kv_heads, int batch, float eps,
    mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
