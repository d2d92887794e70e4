// Template args: B, HQ, HK, D, T (positions per batch row), WARPS (per block), TX (qkv's type),
// EPS_BITS (the head norms' eps as float bits).
  constexpr int HEADS = HQ + 2 * HK;
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (item >= B * T * HEADS) {
    return;
  }
  const int row = item / HEADS;
  const int head = item % HEADS;
  const int b = row / T;
  const int t = row % T;
  const TX* x = qkv + static_cast<size_t>(row) * (HEADS * D) + head * D;
  float* out;
  int h;
  int heads;
  if (head < HQ) {
    out = q_out; h = head; heads = HQ;
  } else if (head < HQ + HK) {
    out = k_out; h = head - HQ; heads = HK;
  } else {
    out = v_out; h = head - HQ - HK; heads = HK;
  }
  float* o = out + ((static_cast<size_t>(b) * heads + h) * T + t) * D;
  if (head >= HQ + HK) {
    for (int d = lane; d < D; d += 32) o[d] = static_cast<float>(x[d]);
    return;
  }
  vc_head_norm_rope<D, TX>(x, head < HQ ? q_scale : k_scale, inv_freq, __int_as_float(EPS_BITS),
                           static_cast<float>(offset[0] + t), o,
                           lane);
