// Device helpers of vc_mog_sample.
namespace vc_mog {

// (value, index) of the largest value, the smallest index among equals; -inf everywhere gives index 0.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

template <int THREADS>
__device__ int block_argmax(float v, int i, float* vs, int* is) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    better(v, i, ov, oi);
  }
  if ((threadIdx.x & 31) == 0) {
    vs[threadIdx.x >> 5] = v;
    is[threadIdx.x >> 5] = i;
  }
  __syncthreads();
  v = vs[0];
  i = is[0];
  for (int w = 1; w < THREADS / 32; ++w) better(v, i, vs[w], is[w]);
  __syncthreads();
  return i;
}

}  // namespace vc_mog
