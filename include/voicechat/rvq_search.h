// Residual vector quantization: the argmin search over a run of codebooks.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// For q in [start, start + count): code[:, q - start] = argmin_k ||e_qk||^2 - 2 r . e_qk (first
// index on ties), then r -= e_{q, code}. residual [B, D], codebooks [Q, K, D], norms [Q, K]
// (||e_qk||^2) -> {codes [B, count] int32, residual [B, D] float32}; with into [B, Q] int32 (the
// codes so far), codes are those rows with [start, start + count) replaced. float32 accumulation.
// method: "auto", "fused" (the CPU loop / the CUDA kernel) or "composed" (MLX ops).
std::vector<mlx::core::array> rvq_search(const mlx::core::array& residual, const mlx::core::array& codebooks,
                                         const mlx::core::array& norms, int start, int count,
                                         const std::string& method = "auto",
                                         const std::optional<mlx::core::array>& into = std::nullopt,
                                         mlx::core::StreamOrDevice s = {});

}  // namespace voicechat
