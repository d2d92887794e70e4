// Attention of one query position over fixed-size K/V buffers (a decode step's cache).
#pragma once

#include <optional>
#include <tuple>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// Attention of one query q [B, H, 1, D] over the slots <= offset (int32, [1] for every row or [B]
// one a row) of the buffers k, v [B, HK, CAP, D] (grouped heads, H a multiple of HK), slot `slot`
// ([1] or [B] int32, as offset) read from k_new / v_new [B, HK, 1, D] when given -> [B, 1, H * D]
// float32. One CUDA launch while CAP <= 1024, two beyond, or with `chunked` two at any CAP (a row's
// result then does not depend on CAP). write_cache also stores k_new / v_new in `slot` of k and v in
// place. CUDA streams only.
mlx::core::array decode_attention(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                  const mlx::core::array& offset, float scale,
                                  const std::optional<mlx::core::array>& k_new = std::nullopt,
                                  const std::optional<mlx::core::array>& v_new = std::nullopt,
                                  const std::optional<mlx::core::array>& slot = std::nullopt, bool write_cache = false,
                                  bool chunked = false, mlx::core::StreamOrDevice s = {});

// qkv_heads and decode_attention with the new key in one launch: from the stacked projection qkv
// [B, (heads + 2 HK) * D], q and the new key are RMS-normed per head (q_scale / k_scale [D]) and
// rotated (inv_freq [D / 2]) at `offset`; the new key and value are read in `slot` instead of the
// buffers k, v [B, HK, CAP, D]. Returns (out [B, 1, heads * D], k_new, v_new [B, HK, 1, D]), float32.
// write_cache also stores the new key and value in `slot` of k and v in place (row-contiguous views
// of the cache's buffers). offset and slot: [1], or [B] (a position and slot a row). chunked: two
// launches at any CAP (a row's result then does not depend on CAP). CUDA streams only.
std::tuple<mlx::core::array, mlx::core::array, mlx::core::array> decode_attention_qkv(
    const mlx::core::array& qkv, const mlx::core::array& q_scale, const mlx::core::array& k_scale,
    const mlx::core::array& inv_freq, float eps, const mlx::core::array& k, const mlx::core::array& v,
    const mlx::core::array& offset, float scale, const mlx::core::array& slot, int heads, bool write_cache = false,
    bool chunked = false, mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
