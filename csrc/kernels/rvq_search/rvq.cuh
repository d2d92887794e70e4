// CUDA: a key orders (distance, index) as mx.argmin does: smaller distance, then the smaller index.
#ifndef VC_RVQ_HEADER
#define VC_RVQ_HEADER
namespace vc_rvq {

__device__ __forceinline__ unsigned long long key(float dist, int index) {
  const unsigned int b = __float_as_uint(dist);
  const unsigned int ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | static_cast<unsigned int>(index);
}

// The best key (the smallest) of codewords [k0, k1) of one codebook `book` ([K, D]; `norms` its
// ||e_k||^2) against r (D floats in shared memory), in thread 0: a warp a codeword, lanes over D.
// warp_best: WARPS slots.
template <typename T, int D, int WARPS>
__device__ __forceinline__ unsigned long long block_best(const T* book, const float* norms, const float* r, int k0,
                                                         int k1, unsigned long long* warp_best) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  unsigned long long mine = ~0ull;
  for (int k = k0 + warp; k < k1; k += WARPS) {
    const T* e = book + static_cast<size_t>(k) * D;
    float dot = 0.0f;
    for (int d = lane; d < D; d += 32) dot += r[d] * static_cast<float>(e[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const unsigned long long kk = key(norms[k] - 2.0f * dot, k);
    mine = kk < mine ? kk : mine;
  }
  if (lane == 0) warp_best[warp] = mine;
  __syncthreads();
  unsigned long long best = warp_best[0];
  if (threadIdx.x == 0) {
    for (int w = 1; w < WARPS; ++w) best = warp_best[w] < best ? warp_best[w] : best;
  }
  return best;
}

}  // namespace vc_rvq
#endif
