// The decode step's causal conv + SiLU and scan in one launch (vc_mamba_conv_scan_step), for one
// position read from the in_proj output `projected` [b, 1, W] (x | B | C at columns X_OFF..,
// dt at DT_OFF): causal_conv_silu's and the scan's formulas, operation for operation. A block
// holds RB rows (warps) of one (batch, head); each warp loads its row's state and convolves its x
// channel while the block convolves its group's B and C into shared memory (each block of a group
// recomputes them: 2N channels of K taps, against one launch), then scans its row as mamba_scan
// does. The next conv state is the last K - 1 inputs: x channels written by their row's lane 0, B
// and C by the first block of each group. GATED: y is the gated group norm's input times its
// weight, y * silu(gate) * gate_w (gate at columns GATE_OFF..), and partials [b, H * P / RB] the
// blocks' sums of (y * silu(gate))^2, a group's blocks consecutive. Template args: H, P, G, N, K, W,
// X_OFF, DT_OFF, RB, HAS_BIAS, HAS_STATE, GATED, GATE_OFF, TS (projected's type), LO_BITS,
// HI_BITS, BATCH.
  constexpr int PER_LANE = (N + 31) / 32;
  constexpr int CONV = H * P + 2 * G * N;
  constexpr int CHUNKS = P / RB;
  __shared__ float bc[2 * N];
  constexpr int batch = BATCH;
  const int bi = blockIdx.x / (H * CHUNKS);
  const int h = (blockIdx.x / CHUNKS) % H;
  const int chunk = blockIdx.x % CHUNKS;
  if (bi >= batch) {
    return;
  }
  const int g = h / (H / G);
  const int lane = threadIdx.x & 31;
  const int p = chunk * RB + (threadIdx.x >> 5);
  const TS* src = projected + static_cast<size_t>(bi) * W;
  const float* cs = conv_state + static_cast<size_t>(bi) * (K - 1) * CONV;
  float* ns = new_state + static_cast<size_t>(bi) * (K - 1) * CONV;
  auto conv = [&](int c) -> float {  // causal_conv_silu at the new position
    float v = HAS_BIAS ? static_cast<float>(conv_bias[c]) : 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float w = k < K - 1 ? cs[static_cast<size_t>(k) * CONV + c] : static_cast<float>(src[X_OFF + c]);
      v = v + w * static_cast<float>(conv_weight[c * K + k]);
    }
    return v / (1.0f + expf(-v));
  };
  auto shift = [&](int c) {  // the next conv state of channel c
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
      ns[static_cast<size_t>(j) * CONV + c] =
          j + 1 < K - 1 ? cs[static_cast<size_t>(j + 1) * CONV + c] : static_cast<float>(src[X_OFF + c]);
    }
  };
  // What does not depend on the group's B / C comes first: the row's state, its x channel and its
  // step. Their loads are then in flight together with the B / C convolution's, instead of each
  // waiting for the last (three dependent trips to memory a block).
  const int row = (bi * H + h) * P + p;
  float s0[PER_LANE];
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int n = lane + 32 * j;
    s0[j] = (HAS_STATE && n < N) ? static_cast<float>(state[static_cast<size_t>(row) * N + n]) : 0.0f;
  }
  const int cx = h * P + p;
  const float xv = conv(cx);
  const float lo = __int_as_float(LO_BITS);
  const float hi = __int_as_float(HI_BITS);
  const float A = -expf(static_cast<float>(A_log[h]));
  const float Dh = static_cast<float>(D[h]);
  const float bias = static_cast<float>(dt_bias[h]);
  const float v = static_cast<float>(src[DT_OFF + h]) + bias;
  const float step = fminf(fmaxf(v > 20.0f ? v : log1pf(expf(v)), lo), hi);
  const float decay = expf(step * A);
  const float dx = step * xv;

  const bool group_first = h % (H / G) == 0 && chunk == 0;
  for (int i = threadIdx.x; i < 2 * N; i += RB * 32) {
    const int c = H * P + (i < N ? g * N + i : G * N + g * N + (i - N));
    bc[i] = conv(c);
    if (group_first) shift(c);
  }
  if (lane == 0) shift(cx);
  __syncthreads();

  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int n = lane + 32 * j;
    if (n < N) {
      const float s1 = decay * s0[j] + dx * bc[n];
      acc += s1 * bc[N + n];
      state_out[static_cast<size_t>(row) * N + n] = s1;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    acc += __shfl_xor_sync(0xffffffff, acc, off);
  }
  if constexpr (GATED) {
    // The gated norm's input, times its weight, and the block's share of its group's sum of squares
    // (the rows of one head: one group); the out_proj matvec applies the group scales.
    __shared__ float row_sq[RB];
    if (lane == 0) {
      const float gv = static_cast<float>(src[GATE_OFF + cx]);
      const float hv = (acc + Dh * xv) * (gv / (1.0f + expf(-gv)));
      y[static_cast<size_t>(bi) * H * P + h * P + p] = hv * static_cast<float>(gate_w[cx]);
      row_sq[threadIdx.x >> 5] = hv * hv;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float sq = 0.0f;
      for (int r = 0; r < RB; ++r) sq += row_sq[r];
      partials[(static_cast<size_t>(bi) * H + h) * CHUNKS + chunk] = sq;
    }
  } else if (lane == 0) {
    y[static_cast<size_t>(bi) * H * P + h * P + p] = acc + Dh * xv;
  }
