#include <cuda/std/cstdint>
struct VcLayout {
  int ndim;
  long long shape[VC_COPY_MAX_DIMS];
  long long strides[VC_COPY_MAX_DIMS];
};
// element i of a strided view (strides in elements, any sign, 0 for a broadcast axis) to element i
// of its row-contiguous copy
extern "C" __global__ void vc_kernel(const unsigned char* src, unsigned char* dst, VcLayout layout, int bytes,
                                     long long n) {
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    long long rest = i, at = 0;
    for (int d = layout.ndim - 1; d >= 0; --d) {
      at += (rest % layout.shape[d]) * layout.strides[d];
      rest /= layout.shape[d];
    }
    const unsigned char* from = src + at * bytes;
    unsigned char* to = dst + i * bytes;
    switch (bytes) {
      case 2: *(cuda::std::uint16_t*)to = *(const cuda::std::uint16_t*)from; break;
      case 4: *(cuda::std::uint32_t*)to = *(const cuda::std::uint32_t*)from; break;
      case 8: *(cuda::std::uint64_t*)to = *(const cuda::std::uint64_t*)from; break;
      default: for (int b = 0; b < bytes; ++b) to[b] = from[b];
    }
  }
}
