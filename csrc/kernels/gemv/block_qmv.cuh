// The block layout's quantized accumulation and matvec.
#ifndef VC_GEMV_QMV
#define VC_GEMV_QMV
namespace vc_gemv {

// One step's loads for ROWS weight rows: a 16-byte chunk of each, and its group's scale and bias.
template <int ROWS>
struct QuantStep {
  uint4 w[ROWS];
  float scale[ROWS], bias[ROWS];
};

template <int CHUNKS, int GROUPS, int CHUNK, int GROUP, int ROWS, typename TS>
__device__ __forceinline__ void load_step(QuantStep<ROWS>& st, const uint4* w4, const TS* scales, const TS* biases,
                                          const int* rows, int c) {
  const int g = (c * CHUNK) / GROUP;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    st.w[r] = __ldcs(w4 + static_cast<size_t>(rows[r]) * CHUNKS + c);
    st.scale[r] = static_cast<float>(scales[static_cast<size_t>(rows[r]) * GROUPS + g]);
    st.bias[r] = static_cast<float>(biases[static_cast<size_t>(rows[r]) * GROUPS + g]);
  }
  // ptxas issues the scale and bias loads just before their use, after the chunk's math: a second
  // trip to memory a block. Tied to the first weight word, they issue with the weights.
  unsigned int loaded = 0u;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) loaded |= __float_as_uint(st.scale[r]) | __float_as_uint(st.bias[r]);
  st.w[0].x = tied(st.w[0].x, loaded, w4);
}

// Word k (VPW values) of chunk c of x's M rows.
template <int K, int M, int VPW, typename TX>
__device__ __forceinline__ void load_x_word(const TX* x, int c, int k, bool vec, float (&xv)[M][VPW]) {
  constexpr int CHUNK = 4 * VPW;
#pragma unroll
  for (int m = 0; m < M; ++m) load_x<VPW>(x + static_cast<size_t>(m) * K + c * CHUNK + k * VPW, xv[m], vec);
}

// acc[r][m] = sum_k x[m, k] * (scale * q[row0 + r, k] + bias) over this thread's chunks, for the
// affine-quantized weight [n_rows, K * BITS / 32] (uint32) with scales / biases [n_rows, K / GROUP].
// A 16-byte chunk holds 128 / BITS values of one group (GROUP >= 32): per chunk and row,
// scale * sum(q x) + bias * sum(x). The next step's loads are issued before this step's math.
//
// SPLIT (a group norm's scales still to come): step it's sums go to split[it] instead of acc, so
// that the caller can scale each by its chunk's group before adding them up (a step's chunk lies in
// one group: (x * r_g * w) . q = sum_g r_g ((x * w)_g . q_g)).
template <int BITS, int GROUP, int K, int M, int ROWS, int THREADS, bool SPLIT = false, typename TX, typename TS>
__device__ __forceinline__ void qmv_accumulate(const TX* x, const unsigned int* weight, const TS* scales,
                                               const TS* biases, int row0, int n_rows, float (&acc)[ROWS][M],
                                               int lane, float (*split)[ROWS][M] = nullptr) {
  constexpr int VPW = 32 / BITS;      // values per word
  constexpr int CHUNK = 4 * VPW;      // values per 16-byte chunk
  constexpr int CHUNKS = K / CHUNK;   // chunks per row
  constexpr int GROUPS = K / GROUP;   // scales per row
  constexpr int ITERS = (CHUNKS + THREADS - 1) / THREADS;
  static_assert(K % GROUP == 0 && GROUP % CHUNK == 0, "a chunk lies inside one group");
  const bool vec = aligned16(x);
  const uint4* w4 = reinterpret_cast<const uint4*>(weight);
  int rows[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    rows[r] = min(row0 + r, n_rows - 1);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
  QuantStep<ROWS> cur{};
  if (lane < CHUNKS) {
    load_step<CHUNKS, GROUPS, CHUNK, GROUP>(cur, w4, scales, biases, rows, lane);
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = it * THREADS + lane;
    QuantStep<ROWS> next{};
    if (it + 1 < ITERS && c + THREADS < CHUNKS) {
      load_step<CHUNKS, GROUPS, CHUNK, GROUP>(next, w4, scales, biases, rows, c + THREADS);
    }
    if (c < CHUNKS) {
      float dot[ROWS][M];
      float xsum[M];
      float hsum[M], lsum[M];  // 4 bits: sum(x_hi), sum(xl) for the pairs' offsets (see pair_word)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        xsum[m] = hsum[m] = lsum[m] = 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) dot[r][m] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float xv[M][VPW];
        load_x_word<K, M, VPW>(x, c, k, vec, xv);
        if constexpr (BITS == 4) {
          float xh[M][4], xl[M][4];
#pragma unroll
          for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int s = 0; s < 4; ++s) {
              xh[m][s] = xv[m][s + 4];
              xl[m][s] = fmaf(-Pair::LO, xv[m][s + 4], xv[m][s]);
              hsum[m] += xh[m][s];
              lsum[m] += xl[m][s];
            }
          }
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const unsigned int v = word(cur.w[r], k);
            pair_fma<0, M>(v, xh, xl, dot[r]);
            pair_fma<1, M>(v, xh, xl, dot[r]);
            pair_fma<2, M>(v, xh, xl, dot[r]);
            pair_fma<3, M>(v, xh, xl, dot[r]);
          }
        } else {
          static_assert(BITS == 8, "4 or 8 bits");
#pragma unroll
          for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int j = 0; j < VPW; ++j) xsum[m] += xv[m][j];
          }
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            float q[VPW];
            unpack8(word(cur.w[r], k), q);
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
              for (int j = 0; j < VPW; ++j) dot[r][m] = fmaf(q[j], xv[m][j], dot[r][m]);
            }
          }
        }
      }
      if constexpr (BITS == 4) {
        // The offsets out: dot - (16 + Pair::C) sum(x_hi) - 16 sum(xl); the x the pairs saw sums to
        // sum(x_hi) (1 + 2^-16) + sum(xl).
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float offset = fmaf(16.0f + Pair::C, hsum[m], 16.0f * lsum[m]);
          xsum[m] = fmaf(1.0f + Pair::LO, hsum[m], lsum[m]);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) dot[r][m] -= offset;
        }
      }
      if constexpr (SPLIT) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
          for (int m = 0; m < M; ++m) split[it][r][m] = fmaf(cur.scale[r], dot[r][m], cur.bias[r] * xsum[m]);
        }
      } else {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
          for (int m = 0; m < M; ++m) acc[r][m] += fmaf(cur.scale[r], dot[r][m], cur.bias[r] * xsum[m]);
        }
      }
    }
    cur = next;
  }
}

// The block-layout quantized matvec, whole: block b computes rows [b * ROWS, b * ROWS + ROWS).
//
// NORM 0: x is the product's input. NORM 2 (an input normalized by its producer): x is a norm's
// input already times the norm weight, and norm_w holds NP partial sums of its squares per input row ([M, NP] float), NG groups of
// NP / NG consecutive ones per row: group g of the K channels (K / NG wide) is scaled by
// rsqrt(its partials' sum / (K / NG) + eps). The partials are loaded with the first weight lines
// and used after the product, so they add no trip to memory: NG = 1 (an RMSNorm) scales the row's
// sums at the end; NG > 1 (a group norm) keeps each step's sums apart (one group a step) until a
// block sum of the partials gives the groups' scales.
//
// EMIT (the next block's norm input, for EPI 1): besides out = product + residual, normed[m, row] =
// out[m, row] * next_w[row] and partials[m, b] = the sum of out[m, row]^2 over the block's rows,
// so that the next matvec can take them with NORM 2 (NP = the blocks of this launch).
template <int BITS, int GROUP, int K, int N, int M, int ROWS, int THREADS, int EPI, bool HAS_BIAS, int NORM, int NP,
          int NG, bool EMIT, typename TX, typename TS, typename TB, typename TR, typename TN, typename TO, typename TE>
__device__ __forceinline__ void qmv_block(const TX* x, const unsigned int* weight, const TS* scales,
                                          const TS* biases, const TB* bias, const TR* residual, const TN* norm_w,
                                          float eps, TO* out, const TE* next_w, float* normed, float* partials) {
  constexpr bool ROW_NORM = NORM == 2 && NG == 1;  // one scale a row, at the end
  constexpr bool GROUPS = NORM == 2 && NG > 1;
  constexpr int SUMS = ROWS * M + (ROW_NORM ? M : 0);  // the row sums, then each x row's sum of squares
  constexpr int CHUNK = 128 / BITS;                    // values per 16-byte chunk
  constexpr int ITERS = (K / CHUNK + THREADS - 1) / THREADS;
  constexpr int PER = NORM == 2 ? (NP + THREADS - 1) / THREADS : 1;  // partials a thread loads per row
  constexpr int GW = K / (NG > 0 ? NG : 1);                          // a norm group's channels
  static_assert(NORM != 2 || (NG >= 1 && NP % (NG > 0 ? NG : 1) == 0), "NP partials in NG equal groups");
  static_assert(!GROUPS || (GW * NG == K && GW % CHUNK == 0), "a chunk lies inside one norm group");
  static_assert(NORM == 0 || NORM == 2, "no norm, or one its producer applied");
  static_assert(!EMIT || (EPI == 1 && ROWS * M <= 32), "EMIT follows a residual, its rows in one warp");
  __shared__ float part[(SUMS > NG * M ? SUMS : NG * M) * THREADS];
  __shared__ float total[SUMS];
  __shared__ float group_total[GROUPS ? NG * M : 1];
  __shared__ float inv_rms[M];
  float pv[M][PER];  // this thread's partials (NORM 2), loaded now, read after the product
  if constexpr (NORM == 2) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int i = static_cast<int>(threadIdx.x) + j * THREADS;
        pv[m][j] = i < NP ? static_cast<float>(norm_w[m * NP + i]) : 0.0f;
      }
    }
  }
  const int group = static_cast<int>(blockIdx.x);
  const int row0 = group * ROWS;
  const auto tail = row_tail<ROWS, M, EPI, HAS_BIAS>(bias, residual, row0, N, EMIT ? next_w : nullptr);
  float acc[ROWS + 1][M];  // acc[ROWS]: the sums of squares, right after the row sums
  float split[GROUPS ? ITERS : 1][ROWS][M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[ROWS][m] = 0.0f;
  if constexpr (GROUPS) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) split[it][r][m] = 0.0f;
      }
    }
  }
  qmv_accumulate<BITS, GROUP, K, M, ROWS, THREADS, GROUPS>(x, weight, scales, biases, row0, N,
                                                           reinterpret_cast<float (&)[ROWS][M]>(acc), threadIdx.x,
                                                           split);
  if constexpr (NORM == 2 && NG == 1) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 0; j < PER; ++j) acc[ROWS][m] += pv[m][j];
    }
  }
  if constexpr (GROUPS) {
    // The groups' sums of squares (each thread adds its partials to their groups'), then each step's
    // sums scaled by its chunk's group.
    float gs[NG * M];
#pragma unroll
    for (int o = 0; o < NG * M; ++o) gs[o] = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = static_cast<int>(threadIdx.x) + j * THREADS;
      const int g = min(i, NP - 1) / (NP / NG);
#pragma unroll
      for (int o = 0; o < NG; ++o) {
#pragma unroll
        for (int m = 0; m < M; ++m) gs[o * M + m] += o == g ? pv[m][j] : 0.0f;
      }
    }
    block_sum<NG * M, THREADS>(gs, part, group_total);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * THREADS + static_cast<int>(threadIdx.x);
      const int g = min(c * CHUNK, K - 1) / GW;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float r_g = rsqrtf(group_total[g * M + m] / static_cast<float>(GW) + eps);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r][m] = fmaf(r_g, split[it][r][m], acc[r][m]);
      }
    }
  }
  block_sum<SUMS, THREADS>(&acc[0][0], part, total);
  const float* row_scale = nullptr;
  if constexpr (ROW_NORM) {
    if (threadIdx.x < M) {
      inv_rms[threadIdx.x] = rsqrtf(total[ROWS * M + threadIdx.x] / static_cast<float>(K) + eps);
    }
    __syncthreads();
    row_scale = inv_rms;
  }
  if constexpr (EMIT) {
    if (threadIdx.x < 32) {
      const int row = row0 + static_cast<int>(threadIdx.x) / M;
      const int m = static_cast<int>(threadIdx.x) % M;
      const bool valid = threadIdx.x < ROWS * M && row < N;
      const float v = !valid ? 0.0f : row_scale ? total[threadIdx.x] * row_scale[m] : total[threadIdx.x];
      emit_rows<M, EPI, HAS_BIAS>(v, valid, row, tail, out, N, normed, partials, group, (N + ROWS - 1) / ROWS);
    }
  } else {
    store_rows<ROWS, M, EPI, HAS_BIAS>(total, tail, out, row0, N, row_scale);
  }
}

}  // namespace vc_gemv
#endif
