// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for dense bfloat16 / float16 / float32 weights (PRO 1:
// x[m, :] = gelu_tanh(gate) * up from a [M, 2K] x, see dense_accumulate).
// Template args: K, N, M, ROWS, THREADS, EPI, PRO, HAS_BIAS, TX, TW, TB, TR, TO.
  __shared__ float part[ROWS * M * THREADS];
  __shared__ float total[ROWS * M];
  const int row0 = blockIdx.x * ROWS;
  const auto tail = vc_gemv::row_tail<ROWS, M, EPI, HAS_BIAS>(bias, residual, row0, N);
  float acc[ROWS][M];
  vc_gemv::dense_accumulate<K, M, ROWS, THREADS, PRO>(x, weight, row0, N, acc, threadIdx.x);
  vc_gemv::block_sum<ROWS * M, THREADS>(&acc[0][0], part, total);
  vc_gemv::store_rows<ROWS, M, EPI, HAS_BIAS>(total, tail, out, row0, N);
