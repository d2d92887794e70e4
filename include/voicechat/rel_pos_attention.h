// FastConformer relative-position self-attention with the chunked-limited mask.
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// scores[i, j] = (q_i + u) . k_j * scale + (q_i + v_bias) . p[L - 1 - i + j - pos_first] * scale for
// j in frame i's context, out_i = softmax_j(scores[i, :]) @ v. k, v [B, H, L, D]; q [B, H, n, D], the
// queries of the last n <= L frames (a stream's new frames after its cached ones: n < L); p [H, P, D]:
// rows [pos_first, pos_first + P) of the 2L - 1 relative-position rows; pos_bias_u / pos_bias_v
// [H, D]. Context: chunks of right + 1 frames, a frame sees its own chunk and the left / (right + 1)
// chunks before it (left < 0: all). Returns [B, H, n, D] in q's dtype; float32 accumulation. Each
// output row is computed on its own: row i of n < L queries equals row L - n + i of all L.
// key_start [B] int32 (optional): batch row b's frames begin at key key_start[b], the keys before are
// not frames (a stream's cache kept at one length while it fills): its windows count from there and
// its rows equal those of its keys from key_start[b] on alone (bit for bit on the CPU and CUDA paths);
// a query before its frames gets zeros.
// method: "auto" / "fused" (the CPU loop or the CUDA kernel) or "composed" (MLX ops).
mlx::core::array rel_pos_attention(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                   const mlx::core::array& p, const mlx::core::array& pos_bias_u,
                                   const mlx::core::array& pos_bias_v, float scale, int left, int right,
                                   int pos_first = 0, const std::optional<mlx::core::array>& key_start = std::nullopt,
                                   const std::string& method = "auto",
                                   mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
