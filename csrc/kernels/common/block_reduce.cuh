// vc_block_sum / vc_block_max<THREADS>(v, scratch): the sum / max of v over the block, in every
// thread (scratch: THREADS / 32 floats, free again on return). Include-guarded: several kernels'
// headers may carry it.
#ifndef VC_BLOCK_REDUCE
#define VC_BLOCK_REDUCE
template <int THREADS>
__device__ __forceinline__ float vc_block_sum(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

template <int THREADS>
__device__ __forceinline__ float vc_block_max(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float best = scratch[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) best = fmaxf(best, scratch[w]);
  __syncthreads();
  return best;
}
#endif
