// The plain kernel: q [B, H, 1, D] and the new key / value (k_new, v_new, slot) as inputs; with
// WRITE the first chunk of the first query head of each K/V head also stores them in the buffers'
// slot itself (in place, as the qkv kernel's WRITE: no block reads the slot from the buffers).
// Template arg WRITE.
  for (int d = threadIdx.x; d < D; d += THREADS) qs[d] = q[static_cast<size_t>(bh) * D + d];
  __syncthreads();
  const float* kn = k_new + (static_cast<size_t>(b) * HK + hk) * D;
  const float* vn = v_new + (static_cast<size_t>(b) * HK + hk) * D;
  if constexpr (WRITE) {
    const int at_slot = slot[ROW_POS ? b : 0];
    if (chunk == 0 && h % (H / HK) == 0 && at_slot >= 0) {
      const size_t at = ((static_cast<size_t>(b) * HK + hk) * CAP + at_slot) * D;
      for (int d = threadIdx.x; d < D; d += THREADS) {
        const_cast<float*>(k)[at + d] = kn[d];
        const_cast<float*>(v)[at + d] = vn[d];
      }
    }
  }
