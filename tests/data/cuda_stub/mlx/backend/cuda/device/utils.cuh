// Stand-in for MLX's JIT prelude when compile-checking our kernels with nvcc: only the types
// our kernel bodies may use (they must not rely on the rest of MLX's device utilities).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
#include <cuda/std/limits>
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint32_t;
using cuda::std::uint8_t;
