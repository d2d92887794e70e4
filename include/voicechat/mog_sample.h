// EAR-TTS's mixture-of-Gaussians draw for one frame.
#pragma once

#include <tuple>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// One MoG draw: top-p over the N components, a Gumbel-max component, its low-rank mean and the
// noise. y = [logits N | log_std 1 | rest L] float32, the guided hidden h [H], uniforms u [N],
// normals noise [L], proj_mus.weight mus [N * R, H], low_mat [N, L, R] -> (z [L] float32,
// component [1] int32). sessions > 1: y, h, u and noise hold that many rows, one draw each, in one
// launch (each draw's bits as alone) -> (z [sessions, L], component [sessions]). One CUDA launch;
// CUDA streams only.
std::tuple<mlx::core::array, mlx::core::array> mog_sample(const mlx::core::array& y, const mlx::core::array& h,
                                                          const mlx::core::array& u, const mlx::core::array& noise,
                                                          const mlx::core::array& mus, const mlx::core::array& low_mat,
                                                          float top_p, float min_log_std, float noise_scale,
                                                          int sessions = 1, mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
