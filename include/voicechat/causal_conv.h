// The Mamba-2 mixer's causal depthwise convolution with SiLU, continuing from a conv state.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// Causal depthwise conv (kernel K) of src[..., offset:offset + C] continuing from conv_state, then
// SiLU. conv_state [b, K-1, C] float32, src [b, L, W] (any float type; read in place), weight [C, K]
// (or [C, K, 1]) float32, bias [C] float32 -> {y [b, L, C] float32, the next conv_state [b, K-1, C]}.
// One CUDA launch on a CUDA stream; MLX ops elsewhere.
std::vector<mlx::core::array> causal_conv_silu(const mlx::core::array& conv_state, const mlx::core::array& src,
                                               int offset, const mlx::core::array& weight,
                                               const std::optional<mlx::core::array>& bias = std::nullopt,
                                               mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
