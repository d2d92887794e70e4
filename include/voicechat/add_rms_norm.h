// Gemma's sandwich-norm seam (the EAR-TTS backbone and MoG head), in one launch on CUDA.
#pragma once

#include <tuple>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// (h', z) with h' = h + rms_norm(y) * post and z = rms_norm(h') * pre over the last axis.
// h, y [..., C] (h float32, y any float type), post, pre [C] float32 -> h', z [..., C] float32.
// One CUDA launch on a CUDA stream; MLX ops elsewhere.
std::tuple<mlx::core::array, mlx::core::array> add_rms_norm(const mlx::core::array& h, const mlx::core::array& y,
                                                            const mlx::core::array& post, const mlx::core::array& pre,
                                                            float eps, mlx::core::StreamOrDevice s = {});

// The seam over a classifier-free-guidance pair h, y [2, 1, C] (row 0 conditioned), then
// z0 + guidance * (z0 - z1) of its normed output z: [1, 1, C] float32. One CUDA launch (float32,
// guidance >= 0) on a CUDA stream; MLX ops elsewhere.
mlx::core::array add_rms_norm_guided(const mlx::core::array& h, const mlx::core::array& y,
                                     const mlx::core::array& post, const mlx::core::array& pre, float eps,
                                     float guidance, mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
