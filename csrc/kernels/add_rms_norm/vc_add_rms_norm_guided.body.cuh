// The same seam over a classifier-free-guidance pair, the MoG head's last: rows 0 (conditioned) and 1
// (not) of h, y [2, C] in one block, and out [C] = z0 + g * (z0 - z1), the guided input of the head's
// projections (composed: the seam, then a launch for the guidance). Block b takes session b's pair
// (rows 2b, 2b + 1; out row b): sessions' pairs in one launch, each block its pair's launch alone.
// Template args as vc_add_rms_norm's and G_BITS (the guidance scale as float bits).
  constexpr int PER = (C + THREADS - 1) / THREADS;
  __shared__ float scratch[THREADS / 32];
  float v[PER], z0[PER], z1[PER];
  const size_t pair = static_cast<size_t>(blockIdx.x) * 2 * C;
  vc_seam_row<C, THREADS, PER>(h + pair, y + pair, post, pre, __int_as_float(EPS_BITS), scratch, v, z0);
  vc_seam_row<C, THREADS, PER>(h + pair + C, y + pair + C, post, pre, __int_as_float(EPS_BITS), scratch, v, z1);
  const float g = __int_as_float(G_BITS);
  TO* row = out + static_cast<size_t>(blockIdx.x) * C;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    if (c < C) row[c] = static_cast<TO>(z0[i] + g * (z0[i] - z1[i]));
  }
