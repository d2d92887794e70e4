// Template args: D, CH, THREADS; dims = [CAP]. out: [B * H, D] (the step's [B, 1, H * D]).
  const float neg_inf = -__uint_as_float(0x7f800000u);  // MLX's CUDA prelude has no `inf`
  const int NC = (dims[0] + CH - 1) / CH;
  const float* pr = part + static_cast<size_t>(blockIdx.x) * NC * (D + 2);
  float mb = neg_inf;
  for (int c = 0; c < NC; ++c) mb = fmaxf(mb, pr[c * (D + 2)]);
  float lsum = 0.0f;
  for (int c = 0; c < NC; ++c) {
    const float mc = pr[c * (D + 2)];
    if (mc != neg_inf) lsum += expf(mc - mb) * pr[c * (D + 2) + 1];
  }
  for (int d = threadIdx.x; d < D; d += THREADS) {
    float total = 0.0f;
    for (int c = 0; c < NC; ++c) {
      const float mc = pr[c * (D + 2)];
      if (mc != neg_inf) total += expf(mc - mb) * pr[c * (D + 2) + 2 + d];
    }
    out[static_cast<size_t>(blockIdx.x) * D + d] = total / lsum;
  }
