// From the stacked projection instead (vc_decode_attn_qkv_part): warp 0 makes this head's q, warp 1
// the new key of its K/V head (vc_head_norm_rope, as qkv_heads does), warp 2 copies the new value; the
// first chunk of the first query head of each K/V head writes that key and value out for the cache,
// and with WRITE also into the buffers' slot itself (in place: see decode_attention_qkv).
// Template args TX: qkv's type; WRITE; EPS_BITS (the head norms' eps as float bits); ROW_POS as the
// plain kernel's (a row's position rotates its q and new key).
  __shared__ __align__(16) float kns[D];
  __shared__ __align__(16) float vns[D];
  {
    constexpr int ROW = (H + 2 * HK) * D;
    const TX* row = qkv + static_cast<size_t>(b) * ROW;
    if (warp < 2) {
      vc_head_norm_rope<D, TX>(row + (warp == 0 ? h : H + hk) * D, warp == 0 ? q_scale : k_scale, inv_freq,
                               __int_as_float(EPS_BITS),
                               static_cast<float>(offset[ROW_POS ? b : 0]), warp == 0 ? qs : kns, lane);
    } else if (warp == 2) {
      const TX* x = row + (H + HK + hk) * D;
      for (int d = lane; d < D; d += 32) vns[d] = static_cast<float>(x[d]);
    }
  }
  __syncthreads();
  if (chunk == 0 && h % (H / HK) == 0) {
    for (int d = threadIdx.x; d < D; d += THREADS) {
      k_out[(static_cast<size_t>(b) * HK + hk) * D + d] = kns[d];
      v_out[(static_cast<size_t>(b) * HK + hk) * D + d] = vns[d];
    }
    if constexpr (WRITE) {  // no block of this launch reads the slot from the buffers (it reads kns / vns)
      const size_t at = ((static_cast<size_t>(b) * HK + hk) * CAP + slot[ROW_POS ? b : 0]) * D;
      for (int d = threadIdx.x; d < D; d += THREADS) {
        const_cast<float*>(k)[at + d] = kns[d];
        const_cast<float*>(v)[at + d] = vns[d];
      }
    }
  }
  const float* kn = kns;
  const float* vn = vns;
