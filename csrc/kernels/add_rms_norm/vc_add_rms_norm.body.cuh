// Template args: C (channels), THREADS, EPS_BITS (eps as float bits), TH, TY, TW (post / pre), TO.
  constexpr int PER = (C + THREADS - 1) / THREADS;
  __shared__ float scratch[THREADS / 32];
  const size_t base = static_cast<size_t>(blockIdx.x) * C;
  float v[PER], z[PER];
  vc_seam_row<C, THREADS, PER>(h + base, y + base, post, pre, __int_as_float(EPS_BITS), scratch, v, z);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    if (c < C) {
      h_out[base + c] = static_cast<TO>(v[i]);
      z_out[base + c] = static_cast<TO>(z[i]);
    }
  }
