// Template args: C, G, W (gate_src row width), GATE_OFFSET, THREADS, EPS_BITS (eps as float bits),
// TY, TG, TW, TO.
  constexpr int CG = C / G;
  constexpr int PER = (CG + THREADS - 1) / THREADS;
  __shared__ float warp_sums[THREADS / 32];
  const int row = blockIdx.x / G;
  const int g = blockIdx.x % G;
  const TY* yr = y + static_cast<size_t>(row) * C + g * CG;
  const TG* gr = gate_src + static_cast<size_t>(row) * W + GATE_OFFSET + g * CG;
  float h[PER];
  float w[PER];  // loaded with y and the gate, not after the sum: one trip to memory, not two
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    float v = 0.0f;
    w[i] = 0.0f;
    if (c < CG) {
      const float gv = static_cast<float>(gr[c]);
      v = static_cast<float>(yr[c]) * (gv / (1.0f + expf(-gv)));
      w[i] = static_cast<float>(weight[g * CG + c]);
    }
    h[i] = v;
    ss += v * v;
  }
  const float r = rsqrtf(vc_block_sum<THREADS>(ss, warp_sums) / static_cast<float>(CG) + __int_as_float(EPS_BITS));
  TO* o = out + static_cast<size_t>(row) * C + g * CG;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    if (c < CG) {
      o[c] = static_cast<TO>(h[i] * r * w[i]);
    }
  }
