// The Mamba-2 mixer's gated group RMSNorm.
#pragma once

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// RMSNorm over `groups` channel groups of y * silu(gate), times weight: y [..., C], the gate read at
// columns [gate_offset, gate_offset + C) of gate_src [..., W], weight [C] -> [..., C] float32.
// One CUDA launch (float inputs of any width, float32 math) on a CUDA stream; MLX ops elsewhere.
mlx::core::array gated_rms_norm(const mlx::core::array& y, const mlx::core::array& gate_src, int gate_offset,
                                const mlx::core::array& weight, int groups, float eps,
                                mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
