// Stand-in for {fmt}, which MLX-CUDA's internal headers include (mlx/backend/cuda/lru_cache.h, for
// an error message) but the mlx wheel does not ship. Our own launch includes those headers and
// never reaches that message; this keeps them compiling. Used by CUDA builds only (CMakeLists.txt).
#pragma once
#include <string>

namespace fmt {
template <typename... Args>
std::string format(const char* pattern, Args&&...) {
  return pattern;
}
}  // namespace fmt
