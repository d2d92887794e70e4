// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for dense bfloat16 / float16 / float32 weights (PRO 1:
// x[m, :] = gelu_tanh(gate) * up from a [M, 2K] x, see dense_accumulate).
// SESSIONS > 1: x is SESSIONS groups of M rows (each session's CFG pair), out and residual likewise;
// block b is session b % SESSIONS of row tile b / SESSIONS, so that the sessions' blocks of one
// weight tile run side by side (the tile then comes from L2 after the first), and each session's
// block does what its launch alone does: its rows have the bits they have alone.
// Template args: K, N, M, ROWS, THREADS, EPI, PRO, HAS_BIAS, SESSIONS, TX, TW, TB, TR, TO.
  __shared__ float part[ROWS * M * THREADS];
  __shared__ float total[ROWS * M];
  const int session = static_cast<int>(blockIdx.x) % SESSIONS;
  const int row0 = static_cast<int>(blockIdx.x) / SESSIONS * ROWS;
  const TX* xs = x + static_cast<size_t>(session) * M * (PRO ? 2 : 1) * K;
  const TR* rs = EPI == 1 ? residual + static_cast<size_t>(session) * M * N : residual;
  TO* os = out + static_cast<size_t>(session) * M * N;
  const auto tail = vc_gemv::row_tail<ROWS, M, EPI, HAS_BIAS>(bias, rs, row0, N);
  float acc[ROWS][M];
  vc_gemv::dense_accumulate<K, M, ROWS, THREADS, PRO>(xs, weight, row0, N, acc, threadIdx.x);
  vc_gemv::block_sum<ROWS * M, THREADS>(&acc[0][0], part, total);
  vc_gemv::store_rows<ROWS, M, EPI, HAS_BIAS>(total, tail, os, row0, N);
