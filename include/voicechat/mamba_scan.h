// The Mamba-2 selective scan: a decode step or a multi-token prefix from a given state.
#pragma once

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// For t in [0, L), head h of group g = h / (H / G):
//   dt = clip(softplus(dt_raw[t, h] + dt_bias[h]), lo, hi)
//   s  = exp(dt * A[h]) * s + dt * x[t, h, p] * B[t, g, :]       A = -exp(A_log)
//   y[t, h, p] = s . C[t, g, :] + D[h] * x[t, h, p]
// x [b, L, H, P], dt [b, L, H], A_log / D / dt_bias [H], B / C [b, L, G, N], state [b, H, P, N]
// (none: zeros) -> {y [b, L, H, P] in x's dtype, the final state [b, H, P, N] float32}; float32
// accumulation. method: "auto" / "fused" (the CPU loop or the CUDA kernel) or "composed" (MLX ops).
std::vector<mlx::core::array> mamba_scan(const mlx::core::array& x, mlx::core::array dt,
                                         const mlx::core::array& A_log, mlx::core::array B, mlx::core::array C,
                                         const mlx::core::array& D, const mlx::core::array& dt_bias,
                                         std::optional<mlx::core::array> state = std::nullopt, float lo = 0.0f,
                                         float hi = std::numeric_limits<float>::infinity(),
                                         const std::string& method = "auto", mlx::core::StreamOrDevice s = {});

// mamba_scan on the mixer's packed buffers: xbc [b, L, heads * head_dim + 2 * groups * state_size]
// (x | B | C) and dt_src [b, L, W] with dt at columns [dt_offset, dt_offset + heads).
std::vector<mlx::core::array> mamba_scan_packed(const mlx::core::array& xbc, const mlx::core::array& dt_src,
                                                int dt_offset, const mlx::core::array& A_log,
                                                const mlx::core::array& D, const mlx::core::array& dt_bias,
                                                std::optional<mlx::core::array> state, int heads, int head_dim,
                                                int groups, int state_size, float lo = 0.0f,
                                                float hi = std::numeric_limits<float>::infinity(),
                                                const std::string& method = "auto",
                                                mlx::core::StreamOrDevice s = {});

// causal_conv_silu then mamba_scan_packed for one decode position in one CUDA launch: projected
// [b, 1, W] (the in_proj output, x | B | C at x_offset, dt at dt_offset), conv_state [b, K-1, C],
// conv_weight [C, K] -> {y [b, 1, H * P], ssm state [b, H, P, N], conv state [b, K-1, C]}, float32.
// With gate_weight [H * P]: y * silu(gate) * gate_weight instead of y (the gate at columns
// gate_offset..), and a fourth output, partials [b, 1, P'] whose G consecutive runs sum to each
// group's sum of (y * silu(gate))^2 (a quantized_matvec's prenormed input). CUDA streams only.
std::vector<mlx::core::array> mamba_conv_scan_step(
    const mlx::core::array& projected, const mlx::core::array& conv_state, int x_offset,
    const mlx::core::array& conv_weight, const std::optional<mlx::core::array>& conv_bias, int dt_offset,
    const mlx::core::array& A_log, const mlx::core::array& D, const mlx::core::array& dt_bias,
    std::optional<mlx::core::array> state, int heads, int head_dim, int groups, int state_size, float lo = 0.0f,
    float hi = std::numeric_limits<float>::infinity(),
    const std::optional<mlx::core::array>& gate_weight = std::nullopt, int gate_offset = 0,
    mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
