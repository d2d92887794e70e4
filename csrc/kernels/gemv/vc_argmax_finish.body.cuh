// ids[j] = the index in the best of keys[j * NB, (j + 1) * NB), one block per j.
// Template args: NB, THREADS.
  __shared__ unsigned long long warp_best[THREADS / 32];
  const unsigned long long* k = reinterpret_cast<const unsigned long long*>(keys) + static_cast<size_t>(blockIdx.x) * NB;
  unsigned long long best = 0ull;
  for (int i = threadIdx.x; i < NB; i += THREADS) {
    best = k[i] > best ? k[i] : best;
  }
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, off);
    best = other > best ? other : best;
  }
  if ((threadIdx.x & 31) == 0) {
    warp_best[threadIdx.x >> 5] = best;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < THREADS / 32; ++w) {
      best = warp_best[w] > best ? warp_best[w] : best;
    }
    ids[blockIdx.x] = static_cast<int>(~static_cast<unsigned int>(best & 0xFFFFFFFFull));
  }
