// The dense (bfloat16 / float16 / float32 weight) accumulation.
#ifndef VC_GEMV_DENSE
#define VC_GEMV_DENSE
namespace vc_gemv {

// gelu with the tanh approximation, as mlx.nn.gelu_approx.
__device__ __forceinline__ float gelu_tanh(float v) {
  return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * (v * v * v))));
}

// acc[r][m] = sum_k x[m, k] * w[row0 + r, k] over this thread's chunks, w dense [n_rows, K]
// (bfloat16, float16 or float32; K a multiple of 8). The next step's loads are issued before this
// step's math. PRO 1 (a gated-GELU input): x is [M, 2K] and the product's input is
// gelu_tanh(x[m, k]) * x[m, K + k], formed as it is loaded (the gate / up halves of one GEMV's output).
template <int K, int M, int ROWS, int THREADS, int PRO, typename TX, typename TW>
__device__ __forceinline__ void dense_accumulate(const TX* x, const TW* weight, int row0, int n_rows,
                                                 float (&acc)[ROWS][M], int lane) {
  constexpr int XS = PRO == 1 ? 2 * K : K;  // x's row stride
  constexpr int CHUNK = 16 / static_cast<int>(sizeof(TW));  // values per 16-byte chunk
  constexpr int VPW = CHUNK / 4;                            // values per word
  constexpr int CHUNKS = K / CHUNK;
  constexpr int ITERS = (CHUNKS + THREADS - 1) / THREADS;
  static_assert(K % 8 == 0, "K is a multiple of 8");
  const bool vec = aligned16(x);
  const uint4* w4 = reinterpret_cast<const uint4*>(weight);
  int rows[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    rows[r] = min(row0 + r, n_rows - 1);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
  uint4 wv[ROWS] = {};
  if (lane < CHUNKS) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wv[r] = __ldcs(w4 + static_cast<size_t>(rows[r]) * CHUNKS + lane);
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = it * THREADS + lane;
    uint4 next[ROWS] = {};
    if (it + 1 < ITERS && c + THREADS < CHUNKS) {  // the next step's loads in flight during this step's math
#pragma unroll
      for (int r = 0; r < ROWS; ++r) next[r] = __ldcs(w4 + static_cast<size_t>(rows[r]) * CHUNKS + c + THREADS);
    }
    if (c < CHUNKS) {
      float xv[M][CHUNK];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        load_x<CHUNK>(x + static_cast<size_t>(m) * XS + c * CHUNK, xv[m], vec);
        if constexpr (PRO == 1) {
          float up[CHUNK];
          load_x<CHUNK>(x + static_cast<size_t>(m) * XS + K + c * CHUNK, up, vec);
#pragma unroll
          for (int j = 0; j < CHUNK; ++j) xv[m][j] = gelu_tanh(xv[m][j]) * up[j];
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float q[VPW];
          unpack_dense(word(wv[r], k), q, weight);
#pragma unroll
          for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int j = 0; j < VPW; ++j) acc[r][m] = fmaf(q[j], xv[m][k * VPW + j], acc[r][m]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wv[r] = next[r];
  }
}

}  // namespace vc_gemv
#endif
