// The sandwich-norm seam feeding a dense matvec, in one launch (the TTS's Gemma blocks):
//   h'[m] = h[m] + rms_norm(y[m]) * post,   x[m] = rms_norm(h'[m]) * pre,   out[m, n] = x[m] . w[n] (+ bias)
// and h' is written too (by block 0): the residual stream the next seam adds to. SEAM 1 adds y as it
// is (h' = h + y: the MoG head's input, hidden states plus the code embedding); SEAM 2 has no y
// (h' = h: a plain input norm before the product; y and post are not read). Every block forms x (M
// rows of K floats) in shared memory from h and y (K floats each: small beside its weight rows), then
// runs the block-layout product over it. eps from EPS_BITS (float bits).
// SESSIONS > 1: h, y, out and h' are SESSIONS groups of M rows; block b is session b % SESSIONS of
// row tile b / SESSIONS (each session's block what its launch alone does), and the first tile's
// block of each session writes its h'.
// Template args: K, N, M, ROWS, THREADS, HAS_BIAS, SEAM, EPS_BITS, TW, TB, TO, SESSIONS (h, y, post,
// pre: float). Its header is block_reduce_header() + dense_header().
  __shared__ __align__(16) float xs[M * K];
  __shared__ float red[THREADS / 32];
  __shared__ float part[ROWS * M * THREADS];
  __shared__ float total[ROWS * M];
  const float eps = __int_as_float(EPS_BITS);
  const int session = static_cast<int>(blockIdx.x) % SESSIONS;
  const int tile = static_cast<int>(blockIdx.x) / SESSIONS;
  const size_t first_row = static_cast<size_t>(session) * M;
  for (int m = 0; m < M; ++m) {
    const float* ym = y + (first_row + m) * K;
    const float* hm = h + (first_row + m) * K;
    float ss = 0.0f;
    float r_post = 1.0f;
    if constexpr (SEAM == 0) {
      for (int k = threadIdx.x; k < K; k += THREADS) ss = fmaf(ym[k], ym[k], ss);
      r_post = rsqrtf(vc_block_sum<THREADS>(ss, red) / static_cast<float>(K) + eps);
      ss = 0.0f;
    }
    for (int k = threadIdx.x; k < K; k += THREADS) {
      float v = hm[k];
      if constexpr (SEAM == 0) v += ym[k] * r_post * post[k];
      if constexpr (SEAM == 1) v += ym[k];
      xs[m * K + k] = v;
      ss = fmaf(v, v, ss);
    }
    const float r_pre = rsqrtf(vc_block_sum<THREADS>(ss, red) / static_cast<float>(K) + eps);
    for (int k = threadIdx.x; k < K; k += THREADS) {
      if (tile == 0) h_out[(first_row + m) * K + k] = xs[m * K + k];
      xs[m * K + k] = xs[m * K + k] * r_pre * pre[k];
    }
  }
  __syncthreads();
  const int row0 = tile * ROWS;
  const auto tail = vc_gemv::row_tail<ROWS, M, 0, HAS_BIAS>(bias, bias, row0, N);
  float acc[ROWS][M];
  vc_gemv::dense_accumulate<K, M, ROWS, THREADS, 0>(static_cast<const float*>(xs), weight, row0, N, acc, threadIdx.x);
  vc_gemv::block_sum<ROWS * M, THREADS>(&acc[0][0], part, total);
  vc_gemv::store_rows<ROWS, M, 0, HAS_BIAS>(total, tail, out + first_row * N, row0, N);
