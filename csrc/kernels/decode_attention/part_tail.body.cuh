// Both prologues leave qs (this head's query) in shared memory and kn / vn (the new key and value,
// read in slot `slot`; -1: none); the body reads the buffers around them. Three phases over the
// chunk's n valid slots, every warp busy in each, each lane's loads independent of one another:
// scores (G = 4 lanes a slot, each a strided share of the key row's float4s, two shuffles join
// them; 8 slots a warp at a time) into shared memory with the block's max; the softmax weights and
// their sum; the weighted values (a slot a warp at a time, lanes over d), summed over the warps.
// (One slot a lane would leave a 40-slot step with 2 of 8 warps working and ~10 dependent memory
// round trips.)
  const float sc = __int_as_float(SCALE_BITS);
  const int cur = slot[ROW_POS ? b : 0];
  const int last = min(offset[ROW_POS ? b : 0], CAP - 1);  // the highest valid slot
  const float* kb = k + (static_cast<size_t>(b) * HK + hk) * CAP * D;
  const float* vb = v + (static_cast<size_t>(b) * HK + hk) * CAP * D;
  const int start = chunk * CH;
  const int n = max(0, min(CH, last + 1 - start));  // this chunk's valid slots
  constexpr int G = 4;          // lanes a slot while scoring
  constexpr int SPW = 32 / G;   // slots a warp at a time
  const int g = lane % G;
  float local_max = neg_inf;
  for (int base = warp * SPW; base < n; base += WARPS * SPW) {  // warp-uniform: the shuffles see all lanes
    const int t = base + lane / G;
    float dot = 0.0f;
    if (t < n) {
      const int s = start + t;
      const float* ks = s == cur ? kn : kb + static_cast<size_t>(s) * D;
      if (D % 4 == 0 && (reinterpret_cast<unsigned long long>(ks) & 15ull) == 0ull) {
        const float4* k4 = reinterpret_cast<const float4*>(ks);
        const float4* q4 = reinterpret_cast<const float4*>(qs);
#pragma unroll
        for (int j = 0; j < (D / 4 + G - 1) / G; ++j) {  // a constant count: every load goes out at once
          const int i = g + j * G;
          if (i < D / 4) {
            const float4 kv = k4[i];
            const float4 qv = q4[i];
            dot = fmaf(qv.x, kv.x, dot);
            dot = fmaf(qv.y, kv.y, dot);
            dot = fmaf(qv.z, kv.z, dot);
            dot = fmaf(qv.w, kv.w, dot);
          }
        }
      } else {
        for (int d = g; d < D; d += G) dot = fmaf(qs[d], ks[d], dot);
      }
    }
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    dot += __shfl_xor_sync(0xffffffffu, dot, 2);
    if (t < n && g == 0) {
      ws[t] = dot * sc;
      local_max = fmaxf(local_max, dot * sc);
    }
  }
  const float mb = vc_block_max<THREADS>(local_max, red);  // -inf for a chunk with no valid slot
  float lsum = 0.0f;
  for (int t = threadIdx.x; t < n; t += THREADS) {
    const float w = expf(ws[t] - mb);
    ws[t] = w;
    lsum += w;
  }
  const float l = vc_block_sum<THREADS>(lsum, red);  // its barrier also publishes the weights
  float acc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
#pragma unroll 4
  for (int t = warp; t < n; t += WARPS) {
    const float w = ws[t];
    const int s = start + t;
    const float* vs = s == cur ? vn : vb + static_cast<size_t>(s) * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane + 32 * i;
      if (d < D) acc[i] = fmaf(w, vs[d], acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int d = lane + 32 * i;
    if (d < D) wacc[warp][d] = acc[i];
  }
  __syncthreads();
  if constexpr (SINGLE) {  // one chunk holds every slot: normalize and write the result itself
    for (int d = threadIdx.x; d < D; d += THREADS) {
      float total = 0.0f;
      for (int w = 0; w < WARPS; ++w) total += wacc[w][d];
      part[static_cast<size_t>(blockIdx.x) * D + d] = total / l;
    }
    return;
  }
  float* out = part + static_cast<size_t>(blockIdx.x) * (D + 2);
  for (int d = threadIdx.x; d < D + 2; d += THREADS) {
    if (d < D) {
      float total = 0.0f;
      for (int w = 0; w < WARPS; ++w) total += wacc[w][d];
      out[d + 2] = total;
    } else if (d == D) {
      out[1] = l;   // the sum
    } else {
      out[0] = mb;  // the max
    }
  }
