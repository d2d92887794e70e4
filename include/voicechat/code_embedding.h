// One frame's code embedding, the EAR-TTS code generation's input.
#pragma once

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// weight @ sum_q table[q * (K + 1) + code[q]], the same row `rows` times: code [Q] int32, table
// [Q * (K + 1), D] float32 (each codebook followed by a zero row, the mask code's), weight [H, D]
// -> [rows, 1, H] float32. sessions > 1: code [sessions, Q], one frame a session, each session's
// rows its own frame's as alone -> [sessions * rows, 1, H]. One CUDA launch on a CUDA stream (1-2
// rows); MLX ops elsewhere.
mlx::core::array code_embedding(const mlx::core::array& code, const mlx::core::array& table,
                                const mlx::core::array& weight, int rows = 1, int sessions = 1,
                                mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
