// Template args: D (latent), H (out rows), Q (codebooks), KP (table rows a codebook), B (copies of the
// result: the CFG pair's rows), ROWS (output rows a warp), THREADS, TW (W's type), SESSIONS (frames:
// block b is session b % SESSIONS of tile b / SESSIONS, reading its Q codes and writing its B rows,
// each session's block what its launch alone does).
  constexpr int WARPS = THREADS / 32;
  __shared__ float depth[D];
  __shared__ int chosen[Q];
  const int session = static_cast<int>(blockIdx.x) % SESSIONS;
  const int tile = static_cast<int>(blockIdx.x) / SESSIONS;
  for (int i = threadIdx.x; i < Q; i += THREADS) chosen[i] = code[static_cast<size_t>(session) * Q + i];
  __syncthreads();
  // The depth sum, codebook by codebook in order (each block forms all of it: 31 x 2 KB from L2).
  for (int j = threadIdx.x; j < D; j += THREADS) {
    float acc = 0.0f;
    for (int q = 0; q < Q; ++q) acc += table[(static_cast<size_t>(q) * KP + chosen[q]) * D + j];
    depth[j] = acc;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first = (tile * WARPS + warp) * ROWS;
  float dot[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) dot[r] = 0.0f;
  for (int j = lane; j < D; j += 32) {
    const float x = depth[j];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (first + r < H) dot[r] = fmaf(static_cast<float>(weight[static_cast<size_t>(first + r) * D + j]), x, dot[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], off);
    const int n = first + r;
    if (lane == 0 && n < H) {
#pragma unroll
      for (int b = 0; b < B; ++b) out[(static_cast<size_t>(session) * B + b) * H + n] = dot[r];
    }
  }
