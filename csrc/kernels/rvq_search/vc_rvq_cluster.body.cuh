// Template args: T, D, K, CB (blocks a cluster: the source's cluster), THREADS, INTO (codes_in holds
// the row's codes so far; else the other columns are -1). q: [start, count, the run's first column
// in the code row, the row's width W]. Dynamic shared memory: 8 (WARPS + 3) + 4 D bytes.
  constexpr int KB = (K + CB - 1) / CB;
  constexpr int WARPS = THREADS / 32;
  VC_CLUSTER_SMEM(smem);
  unsigned long long* slot = reinterpret_cast<unsigned long long*>(smem);
  unsigned long long* warp_best = slot + 2;
  int* chosen = reinterpret_cast<int*>(warp_best + WARPS);
  float* r = reinterpret_cast<float*>(smem + 8 * (WARPS + 3));
  const unsigned int rank = vc_cluster::rank();
  const int row = blockIdx.x / CB;
  const int start = q[0], count = q[1], col0 = q[2], width = q[3];
  const int k0 = static_cast<int>(rank) * KB, k1 = min(K, k0 + KB);
  if constexpr (K % CB == 0 && (KB * D * sizeof(T)) % 16 == 0) {
    if ((reinterpret_cast<size_t>(codebooks) & 15) == 0) {
      for (int i = threadIdx.x; i < count; i += THREADS) {
        vc_cluster::prefetch_l2(codebooks + (static_cast<size_t>(start + i) * K + k0) * D, KB * D * sizeof(T));
      }
    }
  }
  for (int d = threadIdx.x; d < D; d += THREADS) r[d] = r_in[static_cast<size_t>(row) * D + d];
  if (rank == 0) {
    for (int c = threadIdx.x; c < width; c += THREADS) {
      codes_out[static_cast<size_t>(row) * width + c] = INTO ? codes_in[static_cast<size_t>(row) * width + c] : -1;
    }
  }
  __syncthreads();
  for (int i = 0; i < count; ++i) {
    const int qi = start + i;
    const T* book = codebooks + static_cast<size_t>(qi) * K * D;
    const unsigned long long mine =
        vc_rvq::block_best<T, D, WARPS>(book, norms + static_cast<size_t>(qi) * K, r, k0, k1, warp_best);
    if (threadIdx.x == 0) slot[i & 1] = mine;
    vc_cluster::sync();
    if (threadIdx.x == 0) {
      unsigned long long best = ~0ull;
      for (int b = 0; b < CB; ++b) {
        const unsigned long long v = vc_cluster::load_remote(slot + (i & 1), b);
        best = v < best ? v : best;
      }
      *chosen = static_cast<int>(best & 0xFFFFFFFFull);
      if (rank == 0) codes_out[static_cast<size_t>(row) * width + col0 + i] = *chosen;
    }
    __syncthreads();
    const T* e = book + static_cast<size_t>(*chosen) * D;
    for (int d = threadIdx.x; d < D; d += THREADS) r[d] -= static_cast<float>(e[d]);
    __syncthreads();
  }
  if (rank == 0) {
    for (int d = threadIdx.x; d < D; d += THREADS) residual_out[static_cast<size_t>(row) * D + d] = r[d];
  }
  vc_cluster::sync();
