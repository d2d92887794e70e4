// CUDA sources of the decode-speed matrix-vector kernels (csrc/gemv.cpp launches them through
// mlx::core::fast::cuda_kernel). Included by gemv.cpp only.
//
// Block layout (vc_qmv, vc_dense_mv): one block computes ROWS output rows for the 1..2 input rows
// (M); its THREADS threads split K: thread t reads the 16-byte chunks t, t + THREADS, ... of each of
// the ROWS weight rows (a warp reads 512 contiguous bytes of a row per step), keeps the activations
// of a chunk in registers while it serves all ROWS rows, and accumulates in float32. A block-wide sum
// through shared memory ends the block. Rows past N are clamped onto row N - 1 and not written.
// The persistent 4-bit layouts (vc_qmv_stream, vc_qmv_imma_stream, the two-head argmax): see
// kStreamHeader and kImmaStreamHeader.
#pragma once

namespace voicechat::gemv_cuda {

// Device helpers of the kernel bodies below (the `header` of fast::cuda_kernel), in include-guarded
// parts, so that each kernel carries only what it uses: MLX-CUDA 0.32.4 spends host time on a
// kernel's whole text at every launch (see cuda_sources.cpp). A header is kCommonHeader, then the
// parts its kernel needs in this order: kPairHeader (4-bit pairs), kQmvHeader (the block layout's 4- /
// 8-bit matvec; needs kPairHeader), kDenseHeader (the dense matvecs).

// Loads, reductions and the epilogues every matvec shares.
constexpr const char* kCommonHeader = R"(
#ifndef VC_GEMV_COMMON
#define VC_GEMV_COMMON
namespace vc_gemv {

// A compile-time int as a value (a generic lambda's template argument; no <type_traits> in NVRTC).
template <int V>
struct Int {
  static constexpr int value = V;
};

// Two bfloat16 / float16 values of a word (element 0 in the low half), or one float32.
__device__ __forceinline__ void unpack_dense(unsigned int v, float* q, const __nv_bfloat16*) {
  q[0] = __uint_as_float(v << 16);
  q[1] = __uint_as_float(v & 0xFFFF0000u);
}
__device__ __forceinline__ void unpack_dense(unsigned int v, float* q, const __half*) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v));
  q[0] = f.x;
  q[1] = f.y;
}
__device__ __forceinline__ void unpack_dense(unsigned int v, float* q, const float*) {
  q[0] = __uint_as_float(v);
}

__device__ __forceinline__ unsigned int word(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// N (4 or 8) consecutive activations as float32. `vec`: the activation array is 16-byte aligned,
// so (K being a multiple of 8) every such run can be read with one or two vector loads.
template <int N>
__device__ __forceinline__ void load_x(const float* p, float* out, bool vec) {
  if (vec) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      out[i] = f.x;
      out[i + 1] = f.y;
      out[i + 2] = f.z;
      out[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = p[i];
  }
}

template <int N, typename T16>
__device__ __forceinline__ void load_x16(const T16* p, float* out, bool vec) {
  if (vec) {
    unsigned int u[N / 2];
    if constexpr (N == 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
    } else {
      static_assert(N == 4, "4 or 8 values");
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      u[0] = v.x; u[1] = v.y;
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) unpack_dense(u[i], out + 2 * i, p);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<float>(p[i]);
  }
}

template <int N>
__device__ __forceinline__ void load_x(const __nv_bfloat16* p, float* out, bool vec) {
  load_x16<N>(p, out, vec);
}

template <int N>
__device__ __forceinline__ void load_x(const __half* p, float* out, bool vec) {
  load_x16<N>(p, out, vec);
}

template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

// `word` made to depend on `loaded` through a zero ptxas cannot see (no user-space address reaches
// bit 63 of `p`): the loads behind `loaded` are then issued before `word`'s first use, where ptxas
// would otherwise sink each one down to its own use.
__device__ __forceinline__ unsigned int tied(unsigned int word, unsigned int loaded, const void* p) {
  return word ^ (loaded & static_cast<unsigned int>(reinterpret_cast<unsigned long long>(p) >> 63));
}

// total[o] = sum over the block's threads of vals[o], o < COUNT. part: COUNT * THREADS floats of
// shared memory. Every thread of the block must call it (it synchronizes the block).
template <int COUNT, int THREADS>
__device__ __forceinline__ void block_sum(const float* vals, float* part, float* total) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 0; o < COUNT; ++o) part[o * THREADS + threadIdx.x] = vals[o];
  __syncthreads();
  for (int o = warp; o < COUNT; o += WARPS) {
    float s = 0.0f;
    for (int t = lane; t < THREADS; t += 32) s += part[o * THREADS + t];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) total[o] = s;
  }
  __syncthreads();
}

// What an output's epilogue reads besides its sum: bias[row], residual[m, row], and the next norm's
// weight next_w[row] (an emitting matvec). The block-walking kernels load it before their product:
// loaded after the block's last barrier, it is one more trip to memory on every block's path. Kept
// in the arrays' own types and made float only where the epilogue adds them: a conversion next to
// the loads would wait out their trip to memory ahead of the tile's product.
template <typename TB, typename TR, typename TE>
struct Tail {
  TB bias;
  TR residual;
  TE next_w;
};

template <typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> zero_tail() {
  return Tail<TB, TR, TE>{static_cast<TB>(0.0f), static_cast<TR>(0.0f), static_cast<TE>(0.0f)};
}

template <int EPI, bool HAS_BIAS, typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> load_tail(const TB* bias, const TR* residual, int m, int row, int n,
                                                      const TE* next_w = nullptr) {
  Tail<TB, TR, TE> t = zero_tail<TB, TR, TE>();
  if constexpr (HAS_BIAS) {
    t.bias = bias[row];
  }
  if constexpr (EPI == 1) {
    t.residual = residual[static_cast<size_t>(m) * n + row];
  }
  if (next_w != nullptr) {
    t.next_w = next_w[row];
  }
  return t;
}

// The Tail of the output that slot `slot` stores when ROWS * M slots store rows row0, row0 + 1, ...
// (slot i: row row0 + i / M, input row i % M); zeros for the other slots and past n.
template <int ROWS, int M, int EPI, bool HAS_BIAS, typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> slot_tail(int slot, const TB* bias, const TR* residual, int row0, int n,
                                                      const TE* next_w = nullptr) {
  const int row = row0 + slot / M;
  if (slot < ROWS * M && row < n) {
    return load_tail<EPI, HAS_BIAS>(bias, residual, slot % M, row, n, next_w);
  }
  return zero_tail<TB, TR, TE>();
}

// slot_tail with the block's threads as the slots (its first ROWS * M threads store the rows).
template <int ROWS, int M, int EPI, bool HAS_BIAS, typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> row_tail(const TB* bias, const TR* residual, int row0, int n,
                                                     const TE* next_w = nullptr) {
  return slot_tail<ROWS, M, EPI, HAS_BIAS>(static_cast<int>(threadIdx.x), bias, residual, row0, n, next_w);
}

// The epilogue of every matvec kernel: the output value of row `row`, input row `m`, from its float
// sum v and its Tail. EPI 0: v (+ bias); 1: that + residual[m, row] (a residual stream added in the
// same pass); 2: relu(that)^2 (squared-ReLU activation). All in float32, rounded to TO once. Returns
// the value stored (as float).
template <int EPI, bool HAS_BIAS, typename TO, typename TB, typename TR, typename TE>
__device__ __forceinline__ float finish(float v, const Tail<TB, TR, TE>& t, TO* out, int m, int row, int n) {
  if constexpr (HAS_BIAS) {
    v += static_cast<float>(t.bias);
  }
  if constexpr (EPI == 1) {
    v += static_cast<float>(t.residual);
  } else if constexpr (EPI == 2) {
    v = fmaxf(v, 0.0f);
    v = v * v;
  }
  const TO stored = static_cast<TO>(v);
  out[static_cast<size_t>(m) * n + row] = stored;
  return static_cast<float>(stored);
}

// The same with the Tail loaded now (where no barrier lies between the loads and the product's end).
template <int EPI, bool HAS_BIAS, typename TB, typename TR, typename TO>
__device__ __forceinline__ float finish(float v, const TB* bias, const TR* residual, TO* out, int m, int row, int n) {
  return finish<EPI, HAS_BIAS>(v, load_tail<EPI, HAS_BIAS>(bias, residual, m, row, n), out, m, row, n);
}

// out[m, row0 + r] = finish(total[r * M + m] (* row_scale[m])) for the block's rows inside [0, n):
// the store that ends the block-layout matvec kernels. tail: this thread's (row_tail, loaded before
// the product).
template <int ROWS, int M, int EPI, bool HAS_BIAS, typename TO, typename TL>
__device__ __forceinline__ void store_rows(const float* total, const TL& tail, TO* out, int row0, int n,
                                           const float* row_scale = nullptr) {
  if (threadIdx.x < ROWS * M) {
    const int row = row0 + threadIdx.x / M;
    const int m = threadIdx.x % M;
    if (row < n) {
      const float v = row_scale ? total[threadIdx.x] * row_scale[m] : total[threadIdx.x];
      finish<EPI, HAS_BIAS>(v, tail, out, m, row, n);
    }
  }
}

// (value, index) as one integer whose order is mx.argmax's: a larger value wins, equal values go
// to the smaller index. The value's bits are made monotonic (flip all bits of negatives, the sign
// bit of positives); -0 counts as +0; every NaN counts as larger than +inf, so the first NaN wins
// (what mx.argmax does). 0 is below every key: the empty value.
__device__ __forceinline__ unsigned long long argmax_key(float v, int index) {
  unsigned int b = __float_as_uint(v);
  if (v != v) {
    b = 0x7FFFFFFFu;
  } else if (v == 0.0f) {
    b = 0u;
  }
  const unsigned int ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | static_cast<unsigned long long>(~static_cast<unsigned int>(index));
}

// The end of an emitting matvec's row group, in one warp (all 32 lanes call it): lane t with
// `valid` stores finish(v) for row `row`, input row t % M, and the next norm's input normed = stored *
// next_w[row] (tail: the lane's, with next_w); partials[m * np + p] gets the sum of stored^2 over the
// group's rows.
template <int M, int EPI, bool HAS_BIAS, typename TO, typename TL>
__device__ __forceinline__ void emit_rows(float v, bool valid, int row, const TL& tail, TO* out, int n, float* normed,
                                          float* partials, int p, int np) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int m = lane % M;
  float sq = 0.0f;
  if (valid) {
    const float stored = finish<EPI, HAS_BIAS>(v, tail, out, m, row, n);
    normed[static_cast<size_t>(m) * n + row] = stored * static_cast<float>(tail.next_w);
    sq = stored * stored;
  }
#pragma unroll
  for (int off = 16; off >= M; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
  if (lane < M) partials[static_cast<size_t>(lane) * np + p] = sq;
}

}  // namespace vc_gemv
#endif
)";

// Exact floats from packed fields, and the 4-bit pair form.
constexpr const char* kPairHeader = R"(
#ifndef VC_GEMV_PAIR
#define VC_GEMV_PAIR
namespace vc_gemv {

// The unsigned field of v at bits [SHIFT, SHIFT + WIDTH) (SHIFT + WIDTH <= 23) as an exact float.
// OR-ing it under the exponent of 2^23 gives the float 2^23 + field * 2^SHIFT; one FMA scales that
// by 2^-SHIFT and removes the 2^(23 - SHIFT) offset, both exactly. One LOP3 and one FFMA per value
// instead of a shift, a mask and the slow integer-to-float conversion.
template <unsigned int MASK>
__device__ __forceinline__ unsigned int under_magic(unsigned int v) {
#ifdef __CUDA_ARCH__
  // One LOP3 for (v & MASK) | 0x4B000000 (written as two ops, it becomes two: one immediate each).
  unsigned int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "n"(MASK), "r"(0x4B000000u));
  return r;
#else
  return (v & MASK) | 0x4B000000u;
#endif
}

template <int SHIFT, int WIDTH>
__device__ __forceinline__ float field(unsigned int v) {
  constexpr unsigned int mask = ((1u << WIDTH) - 1u) << SHIFT;
  constexpr float unit = 1.0f / static_cast<float>(1u << SHIFT);
  return fmaf(__uint_as_float(under_magic<mask>(v)), unit, -8388608.0f * unit);
}

// The 4 values of one 8-bit packed word, lowest bits first (MLX's affine packing). Fields that
// would reach bit 23 are taken from the word shifted down. (4 bits: pair_word below.)
__device__ __forceinline__ void unpack8(unsigned int v, float* q) {
  const unsigned int hi = v >> 16;
  q[0] = field<0, 8>(v);
  q[1] = field<8, 8>(v);
  q[2] = field<0, 8>(hi);
  q[3] = field<8, 8>(hi);
}

// 4-bit values two at a time (the 4-bit kernels' dequantization: 2.5 instructions a value with its
// product, against 3 for field() + FMA). Pair S of a packed word is its nibbles S (lo) and S + 4
// (hi). Shifted so that they sit at bits 3..6 and 19..22 and OR-ed under 0x41804180 (16.0 as two
// bfloat16), one LOP3 gives a word t whose upper half is bfloat16 16 + q_hi and whose lower half
// is bfloat16 16 + q_lo. Read as float32, t is 16 + q_hi + (lower half) * 2^-19
// = 16 + Pair::C + q_hi + q_lo * 2^-16 (Pair::C = 0x4180 * 2^-19): exact, q_lo's trace included;
// t << 16 is exactly 16 + q_lo. With xl = x_lo - 2^-16 x_hi the two products sum to
//   q_hi x_hi + q_lo (xl + 2^-16 x_hi) + (16 + Pair::C) x_hi + 16 xl,
// so a chunk's dot minus (16 + Pair::C) sum(x_hi) - 16 sum(xl) is its sum of q x (to float32
// rounding of xl; the offsets are ~3x the values, so the cancellation costs ~1.5 bits).
struct Pair {
  static constexpr float C = 16768.0f / 524288.0f;  // 0x4180 * 2^-19
  static constexpr float LO = 1.0f / 65536.0f;      // 2^-16
};

template <int S>
__device__ __forceinline__ unsigned int pair_word(unsigned int v) {
  const unsigned int u = S == 0 ? v << 3 : v >> (4 * S - 3);
#ifdef __CUDA_ARCH__
  unsigned int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(u), "n"(0x00780078u), "r"(0x41804180u));
  return r;
#else
  return (u & 0x00780078u) | 0x41804180u;
#endif
}

// dot[m] += the products of pair S of word v with (xh, xl) (see pair_word), for M input rows.
template <int S, int M>
__device__ __forceinline__ void pair_fma(unsigned int v, const float (*xh)[4], const float (*xl)[4], float* dot) {
  const unsigned int t = pair_word<S>(v);
  const float hi = __uint_as_float(t);
  const float lo = __uint_as_float(t << 16);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    dot[m] = fmaf(hi, xh[m][S], dot[m]);
    dot[m] = fmaf(lo, xl[m][S], dot[m]);
  }
}

}  // namespace vc_gemv
#endif
)";

// The block layout's quantized accumulation and matvec.
constexpr const char* kQmvHeader = R"(
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
)";

// The dense (bfloat16 / float16 / float32 weight) accumulation.
constexpr const char* kDenseHeader = R"(
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
)";

// y[m, n] = x[m, :] . dequant(w)[n, :] (+ bias[n]) for 4- or 8-bit affine weights; NORM 2: x was
// normalized by its producer but for the scale, which norm_w's partial sums give (qmv_block).
// Template args: BITS, GROUP, K, N, M, ROWS, THREADS, EPI, HAS_BIAS, NORM, NP, NG, EPS_BITS (the
// norm's eps as float bits), and the dtypes TX, TS, TB, TR, TN, TO (the kernel name is made of the
// template args only, so every dtype must be one of them).
constexpr const char* kQmvSource = R"(
  const float eps = __int_as_float(EPS_BITS);
  vc_gemv::qmv_block<BITS, GROUP, K, N, M, ROWS, THREADS, EPI, HAS_BIAS, NORM, NP, NG, false>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, static_cast<const float*>(nullptr),
      static_cast<float*>(nullptr), static_cast<float*>(nullptr));
)";

// kQmvSource with EMIT (see vc_gemv::qmv_block): out = product + residual, and the next norm's input
// normed = out * next_w with the block's partial sums of out^2. Template args: BITS, GROUP, K, N,
// M, ROWS, THREADS, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX, TS, TB, TR, TN, TE, TO.
constexpr const char* kQmvEmitSource = R"(
  const float eps = __int_as_float(EPS_BITS);
  vc_gemv::qmv_block<BITS, GROUP, K, N, M, ROWS, THREADS, 1, HAS_BIAS, NORM, NP, NG, true>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, next_w, normed, partials);
)";

// What the persistent 4-bit layouts (vc_qmv_stream, vc_qmv_imma_stream) share: their dynamic shared
// memory, x's int8 terms, the group totals of a producer's norm, a tile's end. Include-guarded; it needs
// kCommonHeader before it.
constexpr const char* kPersistentHeader = R"(
#ifndef VC_PERSISTENT_HEADER
#define VC_PERSISTENT_HEADER
// The kernel body's dynamic shared memory (the emulation has no `extern __shared__`).
#ifdef __CUDA_ARCH__
#define VC_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#else
#define VC_DYNAMIC_SMEM(name) unsigned char* name = cuda_emu::dynamic_smem()
#endif

// x as block floating point (the integer products' input, vc_imma's and the streamed layout's
// dp4a product): values v with |v| <= top as 2^E (p0 + p1 / 128 + p2 / 128^2 + p3 / 128^3), int8 p
// with |p| <= 64 (TERMS terms, 6 + 7 (TERMS - 1) = 27 bits below top: as exact as a float32 product).
namespace vc_levels {

constexpr int TERMS = 4;

// 2^-E (down) and 2^E (up) for values up to `top`: top / 2^E in [32, 64), so the first term's |p| <=
// 64, each next one's too (x 128). (top's biased exponent e: top in [2^(e - 127), 2^(e - 126)), E = e -
// 132; e >= 7 keeps 2^E normal.)
struct Scale {
  float down, up;
};
__device__ __forceinline__ Scale scale_for(float top) {
  const int ebits = max(static_cast<int>(__float_as_uint(top) >> 23), 7);
  return {__uint_as_float(static_cast<unsigned int>(259 - ebits) << 23),
          __uint_as_float(static_cast<unsigned int>(ebits - 5) << 23)};
}

// The LEVELS terms of 8 values v (times `down`) as bytes: lo[l] holds level l of v[0], v[2], v[4],
// v[6] (bytes 0..3), hi[l] of v[1], v[3], v[5], v[7], the order of a packed 4-bit word's nibbles
// v & 0x0F0F0F0F and (v >> 4) & 0x0F0F0F0F. |y| <= 64 at every level: adding 1.5 x 2^23 rounds it
// to the nearest integer (ties to even, as rintf) and leaves that integer's two's complement in the
// sum's low mantissa bits, so its byte is the sum's low byte (rintf and the float-to-int conversion
// run at 16 a cycle an SM on sm_90, an eighth of the FMA's rate: x's expansion would wait on them).
template <int LEVELS>
__device__ __forceinline__ void terms8(const float* v, float down, unsigned int* lo, unsigned int* hi) {
  constexpr float ROUNDER = 12582912.0f;
#pragma unroll
  for (int l = 0; l < LEVELS; ++l) lo[l] = hi[l] = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float y = v[i] * down;
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) {
      const float biased = y + ROUNDER;
      const float r = biased - ROUNDER;
      const unsigned int byte = __float_as_uint(biased) & 0xFFu;
      if (i & 1) {
        hi[l] |= byte << (8 * (i >> 1));
      } else {
        lo[l] |= byte << (8 * (i >> 1));
      }
      y = (y - r) * 128.0f;
    }
  }
}

// c + the dot product of a's four unsigned bytes with b's four signed ones.
__device__ __forceinline__ int dp4a(unsigned int a, unsigned int b, int c) {
#ifdef __CUDA_ARCH__
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  for (int i = 0; i < 4; ++i) {
    c += static_cast<int>((a >> (8 * i)) & 0xFFu) * static_cast<int>(static_cast<signed char>((b >> (8 * i)) & 0xFFu));
  }
  return c;
#endif
}

}  // namespace vc_levels

namespace vc_stream {

// NORM 2's partials as this thread reads them for group_totals (its entries i = threadIdx.x, + THREADS,
// ...; 0 past NP): loaded apart from their sum so that a kernel can have them in flight before it
// asks for anything else.
template <int NP, int M, int THREADS>
struct Partials {
  static constexpr int EACH = (NP + THREADS - 1) / THREADS;
  float v[EACH][M];
};

template <int NP, int M, int THREADS, typename TN>
__device__ __forceinline__ Partials<NP, M, THREADS> load_partials(const TN* norm_w) {
  Partials<NP, M, THREADS> p;
#pragma unroll
  for (int j = 0; j < p.EACH; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * THREADS;
#pragma unroll
    for (int m = 0; m < M; ++m) p.v[j][m] = i < NP ? static_cast<float>(norm_w[m * NP + i]) : 0.0f;
  }
  return p;
}

// NORM 2's group totals: group_total[o * M + m] = the sum of input row m's partials in group o (NP
// partials a row in NG groups of NP / NG; this thread's from load_partials), summed by the block.
// scratch: WARPS rows of `stride` floats (stride >= NG * M). Ends with a block barrier.
template <int NP, int NG, int M, int THREADS>
__device__ __forceinline__ void sum_groups(const Partials<NP, M, THREADS>& p, float* scratch, int stride,
                                           float* group_total) {
  constexpr int NGM = NG * M;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float gs[NGM];
#pragma unroll
  for (int o = 0; o < NGM; ++o) gs[o] = 0.0f;
#pragma unroll
  for (int j = 0; j < p.EACH; ++j) {
    const int g = (static_cast<int>(threadIdx.x) + j * THREADS) / (NP / NG);  // past NP: adds zeros
#pragma unroll
    for (int m = 0; m < M; ++m) {
      // through an empty asm, so that no add is folded next to the partial's load: there it would wait
      // on the load ahead of warp 0's first bulk copies, and the block's copies on it
      float v = p.v[j][m];
#ifdef __CUDA_ARCH__
      asm volatile("" : "+f"(v));
#endif
#pragma unroll
      for (int o = 0; o < NG; ++o) gs[o * M + m] += o == g ? v : 0.0f;
    }
  }
#pragma unroll
  for (int o = 0; o < NGM; ++o) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) gs[o] += __shfl_xor_sync(0xffffffffu, gs[o], off);
    if (lane == 0) scratch[warp * stride + o] = gs[o];
  }
  __syncthreads();
  if (threadIdx.x < NGM) {
    float t = 0.0f;
    for (int w = 0; w < THREADS / 32; ++w) t += scratch[w * stride + threadIdx.x];
    group_total[threadIdx.x] = t;
  }
  __syncthreads();
}

// Lane l < SUMS of one warp: sum l of a tile totalled over the warps' partials (red: WARPS rows of
// `stride` floats); 0 in the other lanes.
template <int SUMS, int WARPS>
__device__ __forceinline__ float tile_total(const float* red, int stride, int lane) {
  float v = 0.0f;
  if (lane < SUMS) {
    for (int w = 0; w < WARPS; ++w) v += red[w * stride + lane];
  }
  return v;
}

// EPI of store_totals for a two-head argmax (vc_imma::qmv_imma_stream's): an item's rows are logits of one of two heads
// of N / 2 rows each, kept as argmax keys (argmax_totals), not stored as outputs.
constexpr int EPI_ARGMAX = 3;

// The end of a two-head argmax item (EPI_ARGMAX), in one warp (all 32 lanes calling): lane l's total v
// is row row0 + l / M of the two heads' rows (head b's from NH on; an item lies in one head), input row
// l % M, for lanes l < ROWS x M. Its value as the logits are stored (TO) goes to logits[head, m, row]
// where logits is not null, and its key (vc_gemv::argmax_key, the row's index in its head) into
// best[head x M + m] (the block's, in shared memory, zero before its first item) by atomicMax.
template <int M, int ROWS, int NH, typename TO>
__device__ __forceinline__ void argmax_totals(float v, int lane, int row0, TO* logits, unsigned long long* best) {
  const int head = row0 >= NH ? 1 : 0;
  const int row = row0 - head * NH + lane / M, m = lane % M;
  unsigned long long key = 0ull;
  if (lane < ROWS * M) {
    const TO stored = static_cast<TO>(v);
    if (logits != nullptr) {
      logits[(static_cast<size_t>(head) * M + m) * NH + row] = stored;
    }
    key = vc_gemv::argmax_key(static_cast<float>(stored), row);
  }
#pragma unroll
  for (int off = 16; off >= M; off >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
    key = other > key ? other : key;
  }
  if (lane < M) {
    atomicMax(&best[head * M + lane], key);
  }
}

// The totals of ROWS rows from row0 on (a tile, or a part of one) stored by one warp, all 32 lanes
// calling: lane l's total v is row row0 + l / M, input row l % M, stored through vc_gemv::finish's
// epilogue, or with EMIT as vc_gemv::emit_rows (their partial is p of np). tail: the lane's
// vc_gemv::Tail for that row.
template <int M, int ROWS, int EPI, bool HAS_BIAS, bool EMIT, int N, typename TO, typename TL>
__device__ __forceinline__ void store_totals(float v, int lane, int row0, int p, int np, const TL& tail, TO* out,
                                             float* normed, float* partials, unsigned long long* best = nullptr) {
  constexpr int SUMS = ROWS * M;
  const int row = row0 + lane / M;
  if constexpr (EPI == EPI_ARGMAX) {
    argmax_totals<M, ROWS, N / 2>(v, lane, row0, out, best);
  } else if constexpr (EMIT) {
    vc_gemv::emit_rows<M, EPI, HAS_BIAS>(v, lane < SUMS, row, tail, out, N, normed, partials, p, np);
  } else if (lane < SUMS) {
    vc_gemv::finish<EPI, HAS_BIAS>(v, tail, out, lane % M, row, N);
  }
}

// The end of a persistent kernel's tile (or part of one: ROWS rows from row0, partial p of np) in
// warp 0: tile_total, then store_totals. tail: the thread's vc_gemv::row_tail for those rows, loaded
// before their product.
template <int M, int ROWS, int WARPS, int EPI, bool HAS_BIAS, bool EMIT, int N, typename TO, typename TL>
__device__ __forceinline__ void store_tile(const float* red, int stride, int row0, int p, int np, const TL& tail,
                                           TO* out, float* normed, float* partials,
                                           unsigned long long* best = nullptr) {
  if (threadIdx.x >= 32) {
    return;
  }
  const int lane = static_cast<int>(threadIdx.x);
  store_totals<M, ROWS, EPI, HAS_BIAS, EMIT, N>(tile_total<ROWS * M, WARPS>(red, stride, lane), lane, row0, p, np,
                                                tail, out, normed, partials, best);
}

}  // namespace vc_stream
#endif
)";

// The streamed 4-bit matvec (vc_qmv_stream): the weight bytes moved by the copy engine instead of
// the threads' loads. In the block layout each thread makes one trip to memory and then does its
// math and the block sum with nothing in flight. Here a block stays on its SM and walks tiles (ROWS
// consecutive rows, whole K): a warp asks for the next STAGES tiles' weights, scales and biases with
// cp.async.bulk into shared memory (an mbarrier a stage counts their bytes), so the bytes in flight
// do not cost registers; every thread keeps its chunks of x in registers for all tiles (loaded once,
// already as int8 terms, the input norm's scale folded in), and reads each tile's weights from shared
// memory. A warp goes on to its next tile without waiting for the others; the last one done with a
// tile stores it and asks for the tile STAGES ahead into its stage (walk_tiles). Include-guarded; it
// needs kCommonHeader and kPersistentHeader before it.
constexpr const char* kStreamHeader = R"(
#ifndef VC_STREAM_HEADER
#define VC_STREAM_HEADER
namespace vc_stream {

#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arms the barrier's current phase for `bytes` of copies, then copies [src, src + bytes) into dst.
__device__ __forceinline__ void bar_expect(unsigned long long* bar, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// The block's threads are done reading a stage (they passed a barrier): order those reads before
// the copy engine's writes into it.
__device__ __forceinline__ void reads_before_copies() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void bar_wait(unsigned long long* bar, unsigned int parity) {
  unsigned int done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  }
}
#else  // the CPU emulation (tests/data/cuda_emu/cuda_emu.h): a copy lands when its phase is waited for
inline void bar_init(unsigned long long* bar) { cuda_emu::mbarrier_init(bar); }
inline void bar_expect(unsigned long long* bar, unsigned int bytes) { cuda_emu::mbarrier_expect_tx(bar, bytes); }
inline void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  cuda_emu::bulk_copy(dst, src, bytes, bar);
}
inline void reads_before_copies() { cuda_emu::fence_proxy_async(); }
inline void bar_wait(unsigned long long* bar, unsigned int parity) { cuda_emu::mbarrier_wait(bar, parity); }
#endif

// The sums over a warp of N values (N a power of two <= 32) in 2N - 1 + (5 - log2 N) shuffles
// instead of 5N: at each halving step lanes with bit O set keep the upper half of their values and
// send the lower half across, the others the reverse. Returns, in every lane, the total of value
// (lane >> (5 - log2 N)) & (N - 1). v is overwritten.
template <int N, int O>
__device__ __forceinline__ float fold_sums(float* v, int lane) {
  if constexpr (O == 0) {
    return v[0];
  } else if constexpr (N > 1) {
    constexpr int H = N / 2;
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const float send = up ? v[i] : v[i + H];
      const float keep = up ? v[i + H] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    return fold_sums<H, O / 2>(v, lane);
  } else {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
    return fold_sums<1, O / 2>(v, lane);
  }
}

// Whether this warp is the last of the block's WARPS done with round `round` of a stage (every lane
// gets the answer; the count is never reset: round r's last warp sees r * WARPS + WARPS - 1). The
// warp's reads of the stage and its writes before the call are ordered before its count, and for
// the last warp the others' before what it does next.
template <int WARPS>
__device__ __forceinline__ bool last_warp(unsigned int* arrived, int round, int lane) {
  __syncwarp();
  unsigned int last = 0u;
  if (lane == 0) {
    __threadfence_block();
    last = atomicAdd(arrived, 1u) == static_cast<unsigned int>(round * WARPS + WARPS - 1);
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last) {
    __threadfence_block();
  }
  return last != 0u;
}

// A stage's layout: ROWS weight rows of ROW_BYTES each, ROW_STRIDE apart (a stride past ROW_BYTES
// pads the rows, so that a warp reading across rows misses its own shared-memory banks), then the
// tile's scales and its biases: S_BYTES each in global memory (ROWS rows of S_ROW_BYTES), laid out
// in the stage S_ROW_STRIDE apart a row (S_ROW_BYTES: as they come, one copy each).
template <int ROWS_, int ROW_BYTES_, int ROW_STRIDE_, int S_BYTES_, int S_ROW_STRIDE_ = S_BYTES_ / ROWS_>
struct Stage {
  static constexpr int ROWS = ROWS_, ROW_BYTES = ROW_BYTES_, ROW_STRIDE = ROW_STRIDE_, S_BYTES = S_BYTES_;
  static constexpr int S_ROW_BYTES = S_BYTES / ROWS, S_ROW_STRIDE = S_ROW_STRIDE_;
  static constexpr bool W_PADDED = ROW_STRIDE != ROW_BYTES, S_PADDED = S_ROW_STRIDE != S_ROW_BYTES;
  static constexpr int W_BYTES = ROWS * ROW_BYTES;  // the weight bytes of a tile
  static constexpr int SCALES = ROWS * ROW_STRIDE;  // where its scales start
  static constexpr int BIASES = SCALES + ROWS * S_ROW_STRIDE;
  static constexpr int BYTES = BIASES + ROWS * S_ROW_STRIDE;
  static_assert(ROW_STRIDE >= ROW_BYTES && ROW_STRIDE % 16 == 0 && ROW_BYTES % 16 == 0 && S_BYTES % 16 == 0,
                "bulk copies move multiples of 16 bytes to 16-byte aligned places");
  static_assert(S_BYTES % ROWS == 0 && S_ROW_STRIDE >= S_ROW_BYTES && (!S_PADDED || (S_ROW_BYTES % 16 == 0 &&
                S_ROW_STRIDE % 16 == 0)), "padded scale rows are bulk copied a row at a time");
};

// Bulk copy c of tile `tile` into stage st (laid out as S): the weight rows (one copy, or one a row
// where they are padded), then the scales, then the biases (likewise). COPIES of them.
template <typename S>
struct TileCopies {
  static constexpr int W = S::W_PADDED ? S::ROWS : 1;
  static constexpr int SCALE = S::S_PADDED ? S::ROWS : 1;  // each for the scales and the biases
  static constexpr int COPIES = W + 2 * SCALE;

  static __device__ __forceinline__ void copy(int c, unsigned char* st, const unsigned char* w,
                                              const unsigned char* s, const unsigned char* b, int tile,
                                              unsigned long long* bar) {
    if (c < W) {
      const unsigned char* wt = w + static_cast<size_t>(tile) * S::W_BYTES;
      if constexpr (W == 1) {
        bulk_copy(st, wt, S::W_BYTES, bar);
      } else {
        bulk_copy(st + c * S::ROW_STRIDE, wt + c * S::ROW_BYTES, S::ROW_BYTES, bar);
      }
      return;
    }
    const int j = c - W, r = j % SCALE;
    const bool biases = j >= SCALE;
    const unsigned char* src = (biases ? b : s) + static_cast<size_t>(tile) * S::S_BYTES + r * S::S_ROW_BYTES;
    bulk_copy(st + (biases ? S::BIASES : S::SCALES) + r * S::S_ROW_STRIDE, src, SCALE == 1 ? S::S_BYTES : S::S_ROW_BYTES,
              bar);
  }
};

// Tile `tile`'s bulk copies into stage st, spread over the lanes of one warp (all 32 calling): lane 0
// arms the barrier for the tile's bytes, then lane l issues copies l, l + 32, ... (one thread issuing
// a padded slab's dozens of copies would hold its warp, and with it the tile's store).
template <typename S>
__device__ __forceinline__ void fetch_bulk(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                           const unsigned char* b, int tile, unsigned long long* bar, int lane) {
  if (lane == 0) {
    bar_expect(bar, S::W_BYTES + 2 * S::S_BYTES);
  }
  __syncwarp();
  for (int c = lane; c < TileCopies<S>::COPIES; c += 32) TileCopies<S>::copy(c, st, w, s, b, tile, bar);
}

// The bulk copies of part q of tile `tile` (its weight rows q x PART_ROWS on, into their place in
// stage st, and the whole tile's scales and biases: their rows need not be whole 16 bytes), spread
// over the lanes of one warp as fetch_bulk's.
template <typename S, int PART_ROWS>
__device__ __forceinline__ void fetch_part(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                           const unsigned char* b, int tile, int q, unsigned long long* bar, int lane) {
  static_assert(!S::W_PADDED, "a part's weight rows in one copy");
  constexpr int BYTES = PART_ROWS * S::ROW_BYTES;
  if (lane == 0) {
    bar_expect(bar, BYTES + 2 * S::S_BYTES);
  }
  __syncwarp();
  for (int c = lane; c < TileCopies<S>::COPIES; c += 32) {
    if (c == 0) {
      bulk_copy(st + q * BYTES, w + static_cast<size_t>(tile) * S::W_BYTES + q * BYTES, BYTES, bar);
    } else {
      TileCopies<S>::copy(c, st, w, s, b, tile, bar);
    }
  }
}

// Tile `tile`'s bulk copies into stage st in GROUPS row groups (see Walk), spread over the lanes of
// one warp as fetch_bulk's: the scales and biases first, then each group's rows in one copy, so that
// the copy engine brings the first rows in first. bars: the stage's GROUPS barriers.
template <typename S, int GROUPS>
__device__ __forceinline__ void fetch_row_groups(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                                 const unsigned char* b, int tile, unsigned long long* bars, int lane) {
  static_assert(!S::W_PADDED && !S::S_PADDED && S::ROWS % GROUPS == 0, "whole rows a group, one copy each");
  constexpr int BYTES = S::ROWS / GROUPS * S::ROW_BYTES;  // a group's weight bytes
  if (lane == 0) {
    for (int g = 0; g < GROUPS; ++g) bar_expect(&bars[g], BYTES + (g == 0 ? 2 * S::S_BYTES : 0));
  }
  __syncwarp();
  for (int c = lane; c < 2 + GROUPS; c += 32) {
    if (c < 2) {
      const unsigned char* src = (c == 0 ? s : b) + static_cast<size_t>(tile) * S::S_BYTES;
      bulk_copy(st + (c == 0 ? S::SCALES : S::BIASES), src, S::S_BYTES, &bars[0]);
    } else {
      const int g = c - 2;
      bulk_copy(st + g * BYTES, w + static_cast<size_t>(tile) * S::W_BYTES + g * BYTES, BYTES, &bars[g]);
    }
  }
}

// Tile `tile`'s weight rows, scales and biases into stage `st` by the block's threads, word by word
// (the pointers not 16-byte aligned for bulk copies), laid out as S.
template <typename S, int THREADS>
__device__ __forceinline__ void fetch_words(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                            const unsigned char* b, int tile) {
  const unsigned char* wt = w + static_cast<size_t>(tile) * S::W_BYTES;
  const unsigned char* st_src = s + static_cast<size_t>(tile) * S::S_BYTES;
  const unsigned char* bt_src = b + static_cast<size_t>(tile) * S::S_BYTES;
  // scales and biases are 2-byte types at least; the weight words 4 bytes
  for (int o = 2 * static_cast<int>(threadIdx.x); o < S::W_BYTES; o += 2 * THREADS) {
    const int to = S::W_PADDED ? o / S::ROW_BYTES * S::ROW_STRIDE + o % S::ROW_BYTES : o;
    *reinterpret_cast<unsigned short*>(st + to) = *reinterpret_cast<const unsigned short*>(wt + o);
  }
  for (int o = 2 * static_cast<int>(threadIdx.x); o < S::S_BYTES; o += 2 * THREADS) {
    const int to = o / S::S_ROW_BYTES * S::S_ROW_STRIDE + o % S::S_ROW_BYTES;
    *reinterpret_cast<unsigned short*>(st + S::SCALES + to) = *reinterpret_cast<const unsigned short*>(st_src + o);
    *reinterpret_cast<unsigned short*>(st + S::BIASES + to) = *reinterpret_cast<const unsigned short*>(bt_src + o);
  }
}

// The items a persistent block walks (tiles of S::ROWS rows, TILES of them): whole rounds (tile
// blockIdx.x + i x gridDim.x, i < rounds), then the `left` tiles of the last round. With SPLIT 1
// each of those goes whole to one of the first `left` blocks; with SPLIT > 1 each is cut into SPLIT
// parts of PART_ROWS rows, one for each of the first left x SPLIT blocks, so that the round costs
// those blocks a part instead of a tile while the others wait (gemv.cpp's split_last_round picks it).
// An item's totals are partial p of np when emitting: the tiles', then the parts', in row order.
//
// BARS > 1 (whole tiles only): each tile's weight rows come in BARS row groups, each with an
// mbarrier of its own (the first also counting the scales and biases, asked for ahead of the
// weights: fetch_row_groups); a stage's barriers are BARS consecutive ones, and walk_tiles waits for
// the first before an item's product, which waits for the others as it gets to their rows.
template <typename S, int TILES, int SPLIT_, int BARS_ = 1>
struct Walk {
  static constexpr int ROWS = S::ROWS, SPLIT = SPLIT_, PART_ROWS = ROWS / SPLIT_, BARS = BARS_;
  static_assert(SPLIT_ >= 1 && ROWS % SPLIT_ == 0, "a tile cut into parts of whole rows");
  static_assert(BARS_ == 1 || (SPLIT_ == 1 && ROWS % BARS_ == 0), "row groups of whole tiles");
  int b, g, rounds, left, count;

  __device__ __forceinline__ Walk()
      : b(static_cast<int>(blockIdx.x)), g(static_cast<int>(gridDim.x)), rounds(TILES / g), left(TILES - rounds * g),
        count(rounds + (b < left * SPLIT ? 1 : 0)) {}
  __device__ __forceinline__ bool part(int i) const { return SPLIT > 1 && i >= rounds; }
  __device__ __forceinline__ int tile(int i) const { return i < rounds ? b + i * g : rounds * g + b / SPLIT; }
  __device__ __forceinline__ int q() const { return b % SPLIT; }  // the block's part of its last tile
  __device__ __forceinline__ int row0(int i) const {
    return part(i) ? rounds * g * ROWS + b * PART_ROWS : tile(i) * ROWS;
  }
  __device__ __forceinline__ int p(int i) const { return i < rounds ? tile(i) : rounds * g + b; }
  __device__ __forceinline__ int np() const { return rounds * g + left * SPLIT; }
  // Item i's bulk copies into stage st (one warp, all its lanes); bar: the stage's first barrier.
  __device__ __forceinline__ void fetch(int i, unsigned char* st, const unsigned char* wb, const unsigned char* sb,
                                        const unsigned char* bb, unsigned long long* bar, int lane) const {
    if constexpr (BARS > 1) {
      fetch_row_groups<S, BARS>(st, wb, sb, bb, tile(i), bar, lane);
      return;
    }
    if constexpr (SPLIT > 1) {
      if (part(i)) {
        fetch_part<S, PART_ROWS>(st, wb, sb, bb, tile(i), q(), bar, lane);
        return;
      }
    }
    fetch_bulk<S>(st, wb, sb, bb, tile(i), bar, lane);
  }
  // Item i's whole tile copied into stage st by the block's threads (the pointers not 16-byte aligned).
  template <int THREADS>
  __device__ __forceinline__ void copy_words(int i, unsigned char* st, const unsigned char* wb,
                                             const unsigned char* sb, const unsigned char* bb) const {
    fetch_words<S, THREADS>(st, wb, sb, bb, tile(i));
  }
};

// The walk of a two-head argmax: the tiles of two heads of one shape (TILES a head) as one list, head
// a's then head b's, each head's bytes from its own arrays (the walk's, not walk_tiles' pointers), as
// Walk's whole rounds and last round of whole tiles (so row0 counts head b's rows from TILES x ROWS on).
template <typename S, int TILES>
struct HeadsWalk {
  static constexpr int ROWS = S::ROWS, SPLIT = 1, PART_ROWS = ROWS, BARS = 1;
  // each head's arrays apart, picked by a select (an array indexed at run time went to local memory)
  const unsigned char *wa, *sa, *ba, *wb, *sb, *bb;
  int blk, g, count;

  __device__ __forceinline__ HeadsWalk(const unsigned char* wa_, const unsigned char* sa_, const unsigned char* ba_,
                                       const unsigned char* wb_, const unsigned char* sb_, const unsigned char* bb_)
      : wa(wa_), sa(sa_), ba(ba_), wb(wb_), sb(sb_), bb(bb_), blk(static_cast<int>(blockIdx.x)),
        g(static_cast<int>(gridDim.x)), count((2 * TILES - blk + g - 1) / g) {}
  __device__ __forceinline__ bool part(int) const { return false; }
  __device__ __forceinline__ int tile(int i) const { return blk + i * g; }
  __device__ __forceinline__ int q() const { return 0; }
  __device__ __forceinline__ int row0(int i) const { return tile(i) * ROWS; }
  __device__ __forceinline__ int p(int i) const { return tile(i); }
  __device__ __forceinline__ int np() const { return 2 * TILES; }
  // item i's tile in its head's arrays
  struct HeadTile {
    const unsigned char *w, *s, *b;
    int tile;
  };
  __device__ __forceinline__ HeadTile head_tile(int i) const {
    const int t = tile(i);
    return t >= TILES ? HeadTile{wb, sb, bb, t - TILES} : HeadTile{wa, sa, ba, t};
  }
  __device__ __forceinline__ void fetch(int i, unsigned char* st, const unsigned char*, const unsigned char*,
                                        const unsigned char*, unsigned long long* bar, int lane) const {
    const HeadTile h = head_tile(i);
    fetch_bulk<S>(st, h.w, h.s, h.b, h.tile, bar, lane);
  }
  template <int THREADS>
  __device__ __forceinline__ void copy_words(int i, unsigned char* st, const unsigned char*, const unsigned char*,
                                             const unsigned char*) const {
    const HeadTile h = head_tile(i);
    fetch_words<S, THREADS>(st, h.w, h.s, h.b, h.tile);
  }
};

// One warp (all its lanes): the bulk copies of the block's items [from, to) (of its Walk, the first
// round: item s into stage s) asked for.
template <typename S, typename W>
__device__ __forceinline__ void ask_for_items(const W& walk, int from, int to, unsigned long long* bars,
                                              unsigned char* stages, const unsigned char* wb,
                                              const unsigned char* sb, const unsigned char* bb, int lane) {
  for (int s = from; s < to && s < walk.count; ++s) {
    walk.fetch(s, stages + s * S::BYTES, wb, sb, bb, &bars[s * W::BARS], lane);
  }
}

// Warp 0 of a block on the bulk path (all its lanes): the stages' barriers and counts set up, and the
// block's first `first` items (of its Walk) asked for (the kernel, or walk_tiles's ramp_tiles, asks
// for the others: all STAGES at once, their bytes would hold up the prologue's loads). The block's
// other threads see the barriers after its next barrier.
template <int STAGES, typename S, typename W>
__device__ __forceinline__ void start_tiles(const W& walk, unsigned long long* bars, unsigned int* arrived,
                                            unsigned char* stages, const unsigned char* wb, const unsigned char* sb,
                                            const unsigned char* bb, int lane, int first = 1) {
  if (lane == 0) {
    for (int s = 0; s < STAGES; ++s) {
      for (int k = 0; k < W::BARS; ++k) bar_init(&bars[s * W::BARS + k]);
      arrived[s] = 0u;
    }
  }
  __syncwarp();
  ask_for_items<S>(walk, 0, first, bars, stages, wb, sb, bb, lane);
}

// Warp 0 (all its lanes) once round i's tile is in: round i + 1's first tile asked for,
// while the first round lasts, from round `from` on (the kernel asked for the ones before).
template <int STAGES, typename S, typename W>
__device__ __forceinline__ void ramp_tiles(int i, const W& walk, unsigned long long* bars, unsigned char* stages,
                                           const unsigned char* wb, const unsigned char* sb, const unsigned char* bb,
                                           int lane, int from = 1) {
  if (threadIdx.x < 32 && i + 1 >= from && i + 1 < STAGES && i + 1 < walk.count) {
    walk.fetch(i + 1, stages + (i + 1) * S::BYTES, wb, sb, bb, &bars[(i + 1) * W::BARS], lane);
  }
}

// f(vc_gemv::Int<R>{}) with R the rows of item i of a Walk: PART_ROWS for a part, ROWS for a tile.
template <typename W, typename F>
__device__ __forceinline__ auto with_rows(const W& walk, int i, F f) {
  if constexpr (W::SPLIT > 1) {
    if (walk.part(i)) {
      return f(vc_gemv::Int<W::PART_ROWS>{});
    }
  }
  return f(vc_gemv::Int<W::ROWS>{});
}

// The Tail that lane `lane` stores for item i of this block's Walk (its output row when its warp
// stores the item): zeros past the block's items and for lanes past the item's sums.
template <int M, int EPI, bool HAS_BIAS, bool EMIT, int N, typename W, typename TB, typename TR, typename TE>
__device__ __forceinline__ vc_gemv::Tail<TB, TR, TE> stream_tail(const W& walk, int i, int lane, const TB* bias,
                                                                const TR* residual, const TE* next_w) {
  if (i >= walk.count) {
    return vc_gemv::zero_tail<TB, TR, TE>();
  }
  return with_rows(walk, i, [&](auto rows) {
    return vc_gemv::slot_tail<decltype(rows)::value, M, EPI, HAS_BIAS>(lane, bias, residual, walk.row0(i), N,
                                                                      EMIT ? next_w : nullptr);
  });
}

// A streamed kernel's walk over its block's items (`walk`, a Walk: tiles of S::ROWS rows, whole K,
// laid out as S in shared memory, and with SPLIT > 1 a part of a last-round tile). `sums(rows, st, b,
// r0)` computes this thread's share of the item's R rows (rows: vc_gemv::Int<R>, R = ROWS or
// PART_ROWS) in stage st, the tile's rows r0 on, and leaves its warp's R x M sums in red buffer b
// (red: buffers of WARPS x ROWS x M floats, one a stage, two at least). Bulk (start_tiles asked for
// the first items, ramp_tiles asks for the rest of the first round): no block barrier an item; a warp
// waits only for its item's mbarrier, and the last warp done with an item (last_warp) totals it,
// asks for the item STAGES ahead into the stage and stores it. Otherwise (pointers not 16-byte
// aligned) the block copies each item's whole tile itself into stage 0, behind barriers, and warp 0
// stores it. first_tail: stream_tail(walk, 0, ...), which the kernel asks for with x, before its
// first tiles. ramp_from: the first round's tiles from it on are asked for by ramp_tiles (the kernel
// asked for the ones before). best: EPI_ARGMAX's keys (store_totals).
template <int M, int WARPS, int STAGES, typename S, int EPI, bool HAS_BIAS, bool EMIT, int N, typename W, typename TB,
          typename TR, typename TE, typename TO, typename Sums>
__device__ __forceinline__ void walk_tiles(bool bulk, const W& walk, unsigned long long* bars, unsigned int* arrived,
                                           float* red, unsigned char* stages, const unsigned char* wb,
                                           const unsigned char* sb, const unsigned char* bb, const TB* bias,
                                           const TR* residual, const TE* next_w, TO* out, float* normed,
                                           float* partials, const vc_gemv::Tail<TB, TR, TE>& first_tail,
                                           Sums sums, int ramp_from = 1, unsigned long long* best = nullptr) {
  constexpr int SUMS = S::ROWS * M;
  constexpr int THREADS = WARPS * 32;
  const int lane = threadIdx.x & 31;
  if (bulk) {
    // This lane's Tail of item i, asked for an item ahead so that its trip to memory overlaps an
    // item's product. Item 0's comes with x: asked for here, behind the first tiles' bulk copies, it
    // would come in after them and hold every warp until then.
    auto next_tail = first_tail;
    for (int i = 0; i < walk.count; ++i) {
      const int s = i % STAGES;
      const auto tail = next_tail;
      next_tail = stream_tail<M, EPI, HAS_BIAS, EMIT, N>(walk, i + 1, lane, bias, residual, next_w);
      bar_wait(&bars[s * W::BARS], (i / STAGES) & 1);
      ramp_tiles<STAGES, S>(i, walk, bars, stages, wb, sb, bb, lane, ramp_from);
      with_rows(walk, i, [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        // row group g's barrier (the first passed above), for an item's product
        const auto ready = [&](int g) { bar_wait(&bars[s * W::BARS + g], (i / STAGES) & 1); };
        sums(rows, stages + s * S::BYTES, s, walk.part(i) ? walk.q() * R : 0, ready);
        if (last_warp<WARPS>(&arrived[s], i / STAGES, lane)) {
          const float v = tile_total<R * M, WARPS>(red + s * WARPS * SUMS, SUMS, lane);
          __syncwarp();  // every lane has its total (red[s] read) before the stage and red[s] can be used again
          if (i + STAGES < walk.count) {
            reads_before_copies();  // each lane, before its copies
            walk.fetch(i + STAGES, stages + s * S::BYTES, wb, sb, bb, &bars[s * W::BARS], lane);
          }
          store_totals<M, R, EPI, HAS_BIAS, EMIT, N>(v, lane, walk.row0(i), walk.p(i), walk.np(), tail, out, normed,
                                                     partials, best);
        }
      });
    }
    return;
  }
  for (int i = 0; i < walk.count; ++i) {
    with_rows(walk, i, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      const int row0 = walk.row0(i);
      const auto tail = vc_gemv::row_tail<R, M, EPI, HAS_BIAS>(bias, residual, row0, N, EMIT ? next_w : nullptr);
      walk.template copy_words<THREADS>(i, stages, wb, sb, bb);
      __syncthreads();
      // red double-buffered: a warp may write the next item's before warp 0 reads this one's
      sums(rows, stages, i & 1, walk.part(i) ? walk.q() * R : 0, [](int) {});
      __syncthreads();  // the stage read and the sums written by every thread
      store_tile<M, R, WARPS, EPI, HAS_BIAS, EMIT, N>(red + (i & 1) * WARPS * SUMS, SUMS, row0, walk.p(i),
                                                          walk.np(), tail, out, normed, partials, best);
    });
  }
}

// Float32 x's chunks (32 values each; lane l of warp w takes chunk w x 32 + l + j x THREADS, j <
// CPT) loaded coalesced: the warp's 32 chunks of round j are 4 KB of x, float4 i x 32 + lane of them
// a lane's i-th load (4 cache lines an instruction, against 32 when each lane reads its own chunk).
// `spread` then hands them round through shared memory (the warp's 4 KB slices at `region`,
// float4 slots swizzled so that neither the writes nor the reads share banks) into the lane's own
// chunks. Loaded before the first tiles are asked for, spread after.
template <typename T>
struct IsFloat {
  static constexpr bool value = false;
};
template <>
struct IsFloat<float> {
  static constexpr bool value = true;
};

template <int K, int M, int CPT, int THREADS>
struct StagedX {
  static constexpr int CHUNKS = K / 32;
  static constexpr int BYTES = THREADS / 32 * CPT * M * 4096;  // the block's slices (every warp's)
  float4 raw[CPT][M][8];

  static __device__ __forceinline__ int slot(int chunk, int q) { return chunk * 8 + (q ^ (chunk & 7)); }

  __device__ __forceinline__ void load(const float* x, int lane, int warp) {
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int first = warp * 32 + j * THREADS;  // the warp's first chunk of round j
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4* src = reinterpret_cast<const float4*>(x + static_cast<size_t>(m) * K) + first * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int f = i * 32 + lane;
          raw[j][m][i] = first + (f >> 3) < CHUNKS ? src[f] : float4{0.0f, 0.0f, 0.0f, 0.0f};
        }
      }
    }
  }

  // xv[j][m][k][0..7]: the lane's chunk j, row m, values 8k..8k + 7, as vc_gemv::load_x<8> leaves them.
  __device__ __forceinline__ void spread(float4* region, int lane, int warp, float (&xv)[CPT][M][4][8]) const {
    float4* mine = region + warp * CPT * M * 256;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float4* slice = mine + (j * M + m) * 256;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int f = i * 32 + lane;
          slice[slot(f >> 3, f & 7)] = raw[j][m][i];
        }
        __syncwarp();
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float4 v = slice[slot(lane, q)];
          float* out = &xv[j][m][q >> 1][(q & 1) * 4];
          out[0] = v.x;
          out[1] = v.y;
          out[2] = v.z;
          out[3] = v.w;
        }
      }
    }
  }
};

// out[m, row] for the streamed matvec's tiles: NORM 0 (x as it is) or 2 (x normalized by its
// producer: norm_w holds NP partial sums of squares an input row in NG groups, see vc_gemv::qmv_block),
// the epilogue of vc_gemv::finish, and with EMIT the next norm's input as vc_qmv_emit writes it
// (partials: one a tile, and one a part of a split last-round tile). N a multiple of ROWS. SPLIT: the
// parts a last-round tile is cut into (Walk). The dynamic shared memory `smem` holds STAGES tiles
// (and with XS 2, x's slices past them). The products are integer dot products (dp4a: four weights an
// instruction a term) with each thread's chunk of x as vc_levels::TERMS int8 terms, each row's integer
// sums of a chunk then scaled in float32 (5 float instructions a pair of weights cost more).
template <int GROUP, int K, int N, int M, int ROWS, int THREADS, int STAGES, int XS, int SPLIT, int EPI,
          bool HAS_BIAS, int NORM, int NP, int NG, bool EMIT, typename TX, typename TS, typename TB, typename TR,
          typename TN, typename TO, typename TE>
__device__ __forceinline__ void qmv_stream(const TX* x, const unsigned int* weight, const TS* scales,
                                           const TS* biases, const TB* bias, const TR* residual, const TN* norm_w,
                                           float eps, TO* out, const TE* next_w, float* normed, float* partials,
                                           unsigned char* smem) {
  constexpr int CHUNK = 32;  // 4-bit values in a 16-byte chunk
  constexpr int CHUNKS = K / CHUNK;
  constexpr int WARPS = THREADS / 32;
  constexpr int CPT = (CHUNKS + THREADS - 1) / THREADS;  // chunks a thread
  constexpr int GROUPS = K / GROUP;
  constexpr int TILES = N / ROWS;
  constexpr int LV = vc_levels::TERMS;
  // the rows unpadded: a warp reads consecutive chunks of one row
  using S = Stage<ROWS, K / 2, K / 2, ROWS * GROUPS * static_cast<int>(sizeof(TS))>;
  constexpr int SUMS = ROWS * M;
  constexpr int NGM = (NORM == 2 ? NG : 1) * M;
  static_assert(N % ROWS == 0 && K % GROUP == 0 && GROUP % CHUNK == 0, "whole tiles; a chunk inside a group");
  static_assert(STAGES >= 2 && SUMS <= 32 && THREADS % 32 == 0, "two stages at least; a tile's sums in one warp");
  static_assert(NORM == 0 || NORM == 2, "no norm, or one its producer applied");
  static_assert(NORM == 0 || (NP % NG == 0 && K % NG == 0 && (K / NG) % CHUNK == 0), "NP partials in NG groups");
  // Whole tiles come in two row groups, a bulk copy and an mbarrier each (Walk), so that a warp's
  // product of the first rows overlaps the arrival of the rest.
  constexpr int BARS = ROWS % 2 == 0 && SPLIT == 1 ? 2 : 1;
  __shared__ unsigned long long bars[STAGES * BARS];
  // Bulk path: arrived[s] counts the warps done with stage s's tiles (never reset: round r's last
  // warp sees r * WARPS + WARPS - 1), red[s] holds their sums of its tile.
  __shared__ unsigned int arrived[STAGES];
  constexpr int RED = STAGES > 2 ? STAGES : 2;
  __shared__ float red[RED][WARPS][SUMS];
  // the warps' group sums apart from red: a tile may have fewer rows than the norm has groups
  __shared__ float group_scratch[NORM == 2 ? WARPS : 1][NGM];
  __shared__ float group_total[NGM];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kt = static_cast<int>(threadIdx.x);
  const Walk<S, TILES, SPLIT, BARS> walk;
  const bool bulk = vc_gemv::aligned16(weight) && vc_gemv::aligned16(scales) && vc_gemv::aligned16(biases);
  const unsigned char* wb = reinterpret_cast<const unsigned char*>(weight);
  const unsigned char* sb = reinterpret_cast<const unsigned char*>(scales);
  const unsigned char* bb = reinterpret_cast<const unsigned char*>(biases);
  // This thread's chunks of x and the input norm's partials, loaded before the first tiles are asked
  // for: behind every block's bulk copies they would wait for the copies' bytes.
  float xv[CPT][M][4][8];
  const bool vec = vc_gemv::aligned16(x);
  // XS (gemv.cpp's pick_stream): float32 x loaded coalesced and handed to each lane through shared
  // memory (StagedX): 1 through the last X_STAGES stages' buffers, where the block's slices fit in one
  // stage, or for one row of x in all but the first (the bulk path asks for those stages' tiles only
  // after x's spread, the others at the start; the block's own copies use the first stage alone), 2
  // through a region of its own past the stages.
  using SX = StagedX<K, M, CPT, THREADS>;
  constexpr int X_STAGES = (SX::BYTES + S::BYTES - 1) / S::BYTES;
  constexpr bool STAGE_X =
      IsFloat<TX>::value && (XS == 2 || (XS == 1 && X_STAGES < STAGES && (X_STAGES == 1 || M == 1)));
  const bool staged = STAGE_X && vec;
  // the first items asked for at the start: the stages x does not pass through
  const int first = staged && XS == 1 ? STAGES - X_STAGES : 1;
  SX sx;
  if (staged) {
    sx.load(reinterpret_cast<const float*>(x), lane, warp);
  } else {
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int c = min(kt + j * THREADS, CHUNKS - 1);
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          vc_gemv::load_x<8>(x + static_cast<size_t>(m) * K + c * CHUNK + k * 8, xv[j][m][k], vec);
        }
      }
    }
  }
  Partials<NORM == 2 ? NP : 1, M, THREADS> norm_partials;
  if constexpr (NORM == 2) {
    norm_partials = load_partials<NP, M, THREADS>(norm_w);
  }
  const auto first_tail = stream_tail<M, EPI, HAS_BIAS, EMIT, N>(walk, 0, lane, bias, residual, next_w);
  __syncthreads();  // every thread's loads issued
  if (threadIdx.x < 32 && bulk) {
    start_tiles<STAGES, S>(walk, bars, arrived, smem, wb, sb, bb, lane, first);
  }
  // The input norm's scales (NORM 2): each group's partials summed by the block.
  if constexpr (NORM == 2) {
    sum_groups<NP, NG, M, THREADS>(norm_partials, &group_scratch[0][0], NGM, group_total);
  }
  if (staged) {
    unsigned char* region = smem + (XS == 2 ? STAGES : STAGES - X_STAGES) * S::BYTES;
    sx.spread(reinterpret_cast<float4*>(region), lane, warp, xv);
    // each thread's accesses to the staged x ordered before the copy engine's writes into the stage
    // (after the barrier)
    if constexpr (XS == 1) {
      reads_before_copies();
      __syncthreads();
    }
  }
  // The rest of the first round's tiles are asked for here, once the prologue's loads are in (and x's
  // staged slices out of their stage): asked for at the start, their bytes would hold up the
  // prologue's loads.
  if (bulk && threadIdx.x < 32) {
    ask_for_items<S>(walk, first, STAGES, bars, smem, wb, sb, bb, lane);
  }
  // x's terms (word k's lo / hi of vc_levels::terms8, a level each), and per chunk 2^E / 128 times
  // the norm's scale (xup) and the sum of the scaled x.
  float xsum[CPT][M], xup[CPT][M];
  unsigned int tlo[CPT][M][LV][4], thi[CPT][M][LV][4];
#pragma unroll
  for (int j = 0; j < CPT; ++j) {
    const int c = min(kt + j * THREADS, CHUNKS - 1);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float r = 1.0f;
      if constexpr (NORM == 2) {
        r = rsqrtf(group_total[(c * CHUNK / (K / NG)) * M + m] / static_cast<float>(K / NG) + eps);
      }
      float top = 0.0f, sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          top = fmaxf(top, fabsf(xv[j][m][k][i]));
          sum += xv[j][m][k][i];
        }
      }
      const vc_levels::Scale two_e = vc_levels::scale_for(top);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        unsigned int lo[LV], hi[LV];
        vc_levels::terms8<LV>(xv[j][m][k], two_e.down, lo, hi);
#pragma unroll
        for (int l = 0; l < LV; ++l) {
          tlo[j][m][l][k] = lo[l];
          thi[j][m][l][k] = hi[l];
        }
      }
      xup[j][m] = two_e.up * (1.0f / 128.0f) * r;
      xsum[j][m] = sum * r;
    }
  }
  __syncthreads();  // the barriers' init seen by every thread
  // This warp's sums of the R rows in stage st, the tile's rows r0 on (each thread's, folded over the
  // warp: see fold_sums), into red[b][warp]. ready(g): waits for row group g of the stage (BARS > 1;
  // the first is in before the call).
  auto row_sums = [&](auto rows, const unsigned char* st, int b, int r0, auto ready) {
    constexpr int R = decltype(rows)::value;
    constexpr int RM = R * M;
    constexpr int LOG = RM >= 32 ? 5 : RM >= 16 ? 4 : RM >= 8 ? 3 : RM >= 4 ? 2 : RM >= 2 ? 1 : 0;
    static_assert(RM == 1 << LOG, "a tile's (and a part's) rows x M a power of two");
    float acc[R][M];
    const uint4* w4 = reinterpret_cast<const uint4*>(st);
    const TS* tscale = reinterpret_cast<const TS*>(st + S::SCALES);
    const TS* tbias = reinterpret_cast<const TS*>(st + S::BIASES);
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int c = kt + j * THREADS;
      if (c < CHUNKS) {
        const int g = c * CHUNK / GROUP;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if constexpr (BARS > 1) {
            if (r > 0 && r % (ROWS / BARS) == 0) ready(r / (ROWS / BARS));
          }
          const uint4 wv = w4[(r0 + r) * CHUNKS + c];
          const float scale = static_cast<float>(tscale[(r0 + r) * GROUPS + g]);
          const float bias_g = static_cast<float>(tbias[(r0 + r) * GROUPS + g]);
          // each level's integer sum over the chunk (|sum| <= 15 x 64 x 32 < 2^15), then two levels
          // a word: 128 s0 + s1 and 128 s2 + s3 (< 2^22: exact as floats); the chunk's q . x is
          // 2^E / 128 ((128 s0 + s1) + (128 s2 + s3) / 2^14)
          int sums[M][LV];
#pragma unroll
          for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int l = 0; l < LV; ++l) sums[m][l] = 0;
          }
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const unsigned int v = vc_gemv::word(wv, k);
            const unsigned int lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
              for (int l = 0; l < LV; ++l) {
                sums[m][l] = vc_levels::dp4a(lo, tlo[j][m][l][k], sums[m][l]);
                sums[m][l] = vc_levels::dp4a(hi, thi[j][m][l][k], sums[m][l]);
              }
            }
          }
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const int high = sums[m][0] * 128 + sums[m][1], low = sums[m][2] * 128 + sums[m][3];
            const float q = fmaf(static_cast<float>(low), 1.0f / 16384.0f, static_cast<float>(high));
            acc[r][m] += fmaf(scale * xup[j][m], q, bias_g * xsum[j][m]);
          }
        }
      }
    }
    const float v = fold_sums<RM, 16>(&acc[0][0], lane);
    if ((lane & ((1 << (5 - LOG)) - 1)) == 0) {
      red[b][warp][(lane >> (5 - LOG)) & (RM - 1)] = v;
    }
  };
  // No block barrier a tile on the bulk path (it would hold every warp to the slowest): see walk_tiles.
  walk_tiles<M, WARPS, STAGES, S, EPI, HAS_BIAS, EMIT, N>(bulk, walk, bars, arrived, &red[0][0][0], smem, wb, sb, bb,
                                                         bias, residual, next_w, out, normed, partials, first_tail,
                                                         row_sums, STAGES);
}

}  // namespace vc_stream
#endif
)";

// The 4-bit product on the tensor cores' integer MMA (mma.sync m16n8k32, u8 x s8 -> s32): the
// weights' nibbles are the u8 A operand as they stand (v & 0x0F0F0F0F: two instructions for eight
// values, against the float path's five a pair), and x the s8 B operand as a block floating point
// expansion built once a block in shared memory: each group of 64 inputs is 2^E (p0 + p1 / 128 + p2 /
// 128^2 ...) with int8 p (LEVELS terms, 6 + 7 (LEVELS - 1) bits below the group's largest |x|), one
// term a B column, so one MMA takes every term (and both rows of x) at once. Integer sums are exact;
// each group's are scaled in float32: s * 2^E * sum(q p) + b * sum(x).
constexpr const char* kImmaHeader = R"(
#ifndef VC_IMMA_HEADER
#define VC_IMMA_HEADER
namespace vc_imma {

#ifdef __CUDA_ARCH__
// d += a . b for the warp: a the 16x32 u8 tile (lane 4g + t: rows g and g + 8, columns 4t..4t+3 and
// 16 + 4t..16 + 4t+3), b the 32x8 s8 tile (column g, the same rows as the lane's a columns).
__device__ __forceinline__ void mma(int* d, const unsigned int* a, const unsigned int* b) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
inline void mma(int* d, const unsigned int* a, const unsigned int* b) { cuda_emu::mma_m16n8k32_u8s8(d, a, b); }
#endif

// An int of magnitude below 2^22 as a float, in two full-rate instructions (no I2F).
__device__ __forceinline__ float small_int_float(int v) { return __int_as_float(v + 0x4B400000) - 12582912.0f; }

// x's expansion in shared memory, for group G (64 inputs), step S (0, 1: 32 inputs each), lane column
// T and term (level l, row m: p = l * M + m): the B fragment's two words (bytes: inputs
// 8 (2T + S) + {0, 2, 4, 6} and + 1, the nibbles v & 0x0F0F0F0F and (v >> 4) & 0x0F0F0F0F of word
// 2T + S of the group). Then a float a (group, row): 2^E times the input norm's scale; and a float a
// (group, lane column, row): the sum of the scaled inputs of the lane column's 16 (words 2T, 2T + 1).
template <int K, int M, int LEVELS>
struct Layout {
  static constexpr int GROUPS = K / 64;
  static constexpr int P = LEVELS * M;
  static constexpr int TERMS = 0;
  static constexpr int FACTORS = GROUPS * 2 * 4 * P * 8;  // byte offsets
  static constexpr int SUMS = FACTORS + GROUPS * M * 4;
  static constexpr int BYTES = SUMS + GROUPS * 4 * M * 4;
};

// One lane's side of a slab's products (lane 4g + t): its B column g is term (level g / 2, row g %
// 2) of the expansion or none, its C columns 2t, 2t + 1 are level t of rows 0 and 1, weighed 128^-t.
template <int K, int M, int LEVELS>
struct LaneTerms {
  using L = Layout<K, M, LEVELS>;
  const uint2* terms;
  const float* factors;
  const float* sums;
  int t, term;
  bool has_term;
  float level_weight;

  __device__ LaneTerms(const unsigned char* smem, int lane)
      : terms(reinterpret_cast<const uint2*>(smem + L::TERMS)),
        factors(reinterpret_cast<const float*>(smem + L::FACTORS)),
        sums(reinterpret_cast<const float*>(smem + L::SUMS)),
        t(lane & 3),
        term((lane >> 3) * M + ((lane >> 2) & 1)),
        has_term(((lane >> 2) & 1) < M && (lane >> 3) < LEVELS),
        level_weight((lane & 3) < LEVELS ? __uint_as_float(static_cast<unsigned int>(127 - 7 * (lane & 3)) << 23)
                                         : 0.0f) {}

  // acc[0][m] / acc[1][m] (rows g and g + 8) += 64-wide group grp's product with input row m: wl / wh
  // the rows' words 2t, 2t + 1 of the group, s* / b* their scales and biases.
  __device__ __forceinline__ void add_group(float (&acc)[2][M], uint2 wl, uint2 wh, int grp, float s0, float s1,
                                            float b0, float b1) const {
    constexpr unsigned int NIBBLES = 0x0F0F0F0Fu;
    int c[4] = {0, 0, 0, 0};
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const unsigned int vl = step ? wl.y : wl.x, vh = step ? wh.y : wh.x;
      const unsigned int a[4] = {vl & NIBBLES, vh & NIBBLES, (vl >> 4) & NIBBLES, (vh >> 4) & NIBBLES};
      const uint2 bt = has_term ? terms[((grp * 2 + step) * 4 + t) * L::P + term] : uint2{0u, 0u};
      const unsigned int b[2] = {bt.x, bt.y};
      mma(c, a, b);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float f = factors[grp * M + m] * level_weight;
      const float xs = sums[(grp * 4 + t) * M + m];
      acc[0][m] = fmaf(s0 * f, small_int_float(c[m]), fmaf(b0, xs, acc[0][m]));
      acc[1][m] = fmaf(s1 * f, small_int_float(c[2 + m]), fmaf(b1, xs, acc[1][m]));
    }
  }
};

// This thread's items of x's expansion (eight lanes a group of 64, one word of 8 inputs each, the
// block's threads walking GROUPS x M x 8 items): loaded apart from their expansion so that a kernel
// can have them in flight before it asks for anything else.
template <int K, int M, int THREADS>
struct XItems {
  static constexpr int ITEMS = K / 64 * M * 8;
  static constexpr int EACH = (ITEMS + THREADS - 1) / THREADS;
  float v[EACH][8];
};

template <int K, int M, int THREADS, typename TX>
__device__ __forceinline__ XItems<K, M, THREADS> load_x_items(const TX* x) {
  using I = XItems<K, M, THREADS>;
  I items;
  const bool vec = vc_gemv::aligned16(x);
#pragma unroll
  for (int j = 0; j < I::EACH; ++j) {
    // a warp's lanes past ITEMS load the last item again (and store nothing)
    const int e = min((static_cast<int>(threadIdx.x) & ~31) + j * THREADS + static_cast<int>(threadIdx.x & 31),
                      I::ITEMS - 1);
    const int word = e & 7, gm = e >> 3;
    vc_gemv::load_x<8>(x + static_cast<size_t>(gm % M) * K + gm / M * 64 + word * 8, items.v[j], vec);
  }
  return items;
}

// Builds the expansion of x (this thread's items from load_x_items, scaled by `scale(group, m)`, the
// input norm's) into smem: the group's largest |x| by three shuffles among its eight lanes.
template <int K, int M, int LEVELS, int THREADS, typename Scale>
__device__ __forceinline__ void expand_items(const XItems<K, M, THREADS>& items, unsigned char* smem, Scale scale) {
  using L = Layout<K, M, LEVELS>;
  using I = XItems<K, M, THREADS>;
  uint2* terms = reinterpret_cast<uint2*>(smem + L::TERMS);
  float* factors = reinterpret_cast<float*>(smem + L::FACTORS);
  float* sums = reinterpret_cast<float*>(smem + L::SUMS);
#pragma unroll
  for (int j = 0; j < I::EACH; ++j) {
    const int base = (static_cast<int>(threadIdx.x) & ~31) + j * THREADS;
    if (base >= I::ITEMS) {
      break;  // the whole warp: its shuffles stay among lanes that all run them
    }
    const int e = base + static_cast<int>(threadIdx.x & 31);
    const bool valid = e < I::ITEMS;
    const int word = e & 7, gm = min(e >> 3, L::GROUPS * M - 1);
    const int grp = gm / M, m = gm % M;
    const float* v = items.v[j];
    float top = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      top = fmaxf(top, fabsf(v[i]));
      sum += v[i];
    }
    top = valid ? top : 0.0f;
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    const vc_levels::Scale two_e = vc_levels::scale_for(top);
    unsigned int lo[LEVELS], hi[LEVELS];
    vc_levels::terms8<LEVELS>(v, two_e.down, lo, hi);
    const float s = scale(grp, m);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // words 2T, 2T + 1
    if (valid) {
      const int t = word >> 1, step = word & 1;
#pragma unroll
      for (int l = 0; l < LEVELS; ++l) terms[((grp * 2 + step) * 4 + t) * L::P + l * M + m] = uint2{lo[l], hi[l]};
      if (word == 0) factors[grp * M + m] = two_e.up * s;
      if (step == 0) sums[(grp * 4 + t) * M + m] = sum * s;
    }
  }
}

}  // namespace vc_imma
#endif
)";

// The integer-MMA product on the streamed layout's tiles (vc_qmv_imma_stream): 16-row slabs come
// by bulk copies into shared memory (as vc_qmv_stream's tiles: warp 0 asks for the next ones),
// x's expansion is built once a block (vc_imma's Layout), and each warp takes its groups of a slab
// (w, w + WARPS, ...) from shared memory: no global load, no address math a group beyond an offset.
// No block barrier a slab: the last warp done with one totals it, refills its stage and stores it.
// The weights' nibbles are the MMA's A operand as they stand, so a 64-wide group of 16 rows costs a
// warp ~36 instructions against ~80 for the pair form's float math. Include-guarded; it needs
// kStreamHeader and kImmaHeader before it.
constexpr const char* kImmaStreamHeader = R"(
#ifndef VC_IMMA_STREAM_HEADER
#define VC_IMMA_STREAM_HEADER
namespace vc_imma {

// out[m, row] for the 16-row slabs a block walks (b, b + grid, ...), STAGES of them in flight;
// NORM 0 / 2, the epilogue of vc_gemv::finish, EMIT as vc_qmv_stream's (a partial a slab). The
// dynamic shared memory holds x's expansion (Layout::BYTES, rounded up to 128) and then the STAGES
// slabs, the weights the MMA's A operand (LaneTerms).
// EPI_ARGMAX (16-row slabs, no norm, no bias): the two-head argmax. weight / scales / biases are head a's,
// weight_b / scales_b / biases_b head b's (N / 2 rows each); out, where not null, gets both heads' logits
// [2, M, N / 2], and keys[(m x 2 + head) x grid + block] the block's best argmax key of each.
template <int K, int N, int M, int WARPS, int STAGES, int EPI, bool HAS_BIAS, int NORM, int NP, int NG, bool EMIT,
          typename TX, typename TS, typename TB, typename TR, typename TN, typename TO, typename TE>
__device__ __forceinline__ void qmv_imma_stream(const TX* x, const unsigned int* weight, const TS* scales,
                                                const TS* biases, const TB* bias, const TR* residual, const TN* norm_w,
                                                float eps, TO* out, const TE* next_w, float* normed, float* partials,
                                                unsigned char* smem, const unsigned int* weight_b = nullptr,
                                                const TS* scales_b = nullptr, const TS* biases_b = nullptr,
                                                unsigned long long* keys = nullptr) {
  constexpr bool ARGMAX = EPI == vc_stream::EPI_ARGMAX;
  constexpr int LEVELS = vc_levels::TERMS;
  constexpr int SLAB = 16;
  using L = Layout<K, M, LEVELS>;
  constexpr int THREADS = WARPS * 32;
  constexpr int GROUPS = L::GROUPS;
  constexpr int TILES = N / SLAB;
  constexpr int SUMS = SLAB * M;
  // A warp reads 8 bytes a lane from rows g and g + 8 (g = lane / 4) at once: rows 4 words of banks apart in a half warp (a stride of 8 words mod 16) keep those reads
  // conflict-free; K / 8 words a row that are a multiple of 16 (K a multiple of 128) would put 2 or 4
  // of those rows on the same banks, so they are padded by 8 words. The lanes' scale and bias loads read one row each (8 rows,
  // 4 lanes a row): rows a multiple of 8 words apart would share 4 banks (4-way conflicts on 4 loads a
  // group, half the slab product's shared-memory traffic at out_proj, K = 10240), so those are padded
  // by 4 words.
  constexpr int ROW_BYTES = K / 2;
  constexpr int S_ROW_BYTES = GROUPS * static_cast<int>(sizeof(TS));
  using S = vc_stream::Stage<SLAB, ROW_BYTES, (ROW_BYTES / 4) % 16 == 0 ? ROW_BYTES + 32 : ROW_BYTES,
                             SLAB * S_ROW_BYTES, S_ROW_BYTES % 32 == 0 ? S_ROW_BYTES + 16 : S_ROW_BYTES>;
  constexpr int SROW = S::S_ROW_STRIDE / static_cast<int>(sizeof(TS));  // a scale row's stride in TS
  constexpr int FIRST = (L::BYTES + 127) / 128 * 128;
  constexpr int NGM = (NORM == 2 ? NG : 1) * M;
  static_assert(K % 64 == 0 && N % SLAB == 0 && M <= 2, "slabs of 64-wide groups");
  static_assert(WARPS <= GROUPS, "a group at least for every warp: a warp without one would idle");
  static_assert(STAGES >= 2, "two stages at least");
  static_assert(NORM == 0 || (NORM == 2 && NP % NG == 0 && (K / NG) % 64 == 0), "no norm, or one its producer applied");
  static_assert(NGM <= SUMS, "the norm's group totals fit a slab's sums");
  static_assert(!ARGMAX || (NORM == 0 && !HAS_BIAS && !EMIT && (N / 2) % SLAB == 0),
                "a two-head argmax: 16-row slabs, each head whole slabs, no norm or bias");
  __shared__ unsigned long long bars[STAGES];
  __shared__ unsigned int arrived[STAGES];  // as vc_qmv_stream's: never reset
  __shared__ float red[STAGES][WARPS][SUMS];
  __shared__ float group_total[NGM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const unsigned char* wb = reinterpret_cast<const unsigned char*>(weight);
  const unsigned char* sb = reinterpret_cast<const unsigned char*>(scales);
  const unsigned char* bb = reinterpret_cast<const unsigned char*>(biases);
  const auto slabs = [&] {
    if constexpr (ARGMAX) {
      return vc_stream::HeadsWalk<S, TILES / 2>(wb, sb, bb, reinterpret_cast<const unsigned char*>(weight_b),
                                                reinterpret_cast<const unsigned char*>(scales_b),
                                                reinterpret_cast<const unsigned char*>(biases_b));
    } else {
      return vc_stream::Walk<S, TILES, 1>();
    }
  }();
  bool bulk = vc_gemv::aligned16(weight) && vc_gemv::aligned16(scales) && vc_gemv::aligned16(biases);
  unsigned long long* best = nullptr;  // (ARGMAX) the block's best key of each head and row of x
  if constexpr (ARGMAX) {
    bulk = bulk && vc_gemv::aligned16(weight_b) && vc_gemv::aligned16(scales_b) && vc_gemv::aligned16(biases_b);
    __shared__ unsigned long long best_keys[2 * M];
    if (threadIdx.x < 2 * M) {
      best_keys[threadIdx.x] = 0ull;  // seen by every warp after the barrier below, before any item ends
    }
    best = best_keys;
  }
  unsigned char* stages = smem + FIRST;
  // x and the norm's partials in flight before the first slabs are asked for (see vc_qmv_stream)
  const XItems<K, M, THREADS> items = load_x_items<K, M, THREADS>(x);
  vc_stream::Partials<NORM == 2 ? NP : 1, M, THREADS> norm_partials;
  if constexpr (NORM == 2) {
    norm_partials = vc_stream::load_partials<NP, M, THREADS>(norm_w);
  }
  const auto first_tail =
      vc_stream::stream_tail<M, EPI, HAS_BIAS, EMIT, N>(slabs, 0, lane, bias, residual, next_w);
  __syncthreads();  // every thread's loads issued
  if (threadIdx.x < 32 && bulk) {
    vc_stream::start_tiles<STAGES, S>(slabs, bars, arrived, stages, wb, sb, bb, lane);
  }
  if constexpr (NORM == 2) {
    vc_stream::sum_groups<NP, NG, M, THREADS>(norm_partials, &red[1][0][0], SUMS, group_total);
  }
  expand_items<K, M, LEVELS, THREADS>(items, smem, [&](int grp, int m) {
    if constexpr (NORM == 2) {
      constexpr int W = K / NG;
      return rsqrtf(group_total[(grp * 64 / W) * M + m] / static_cast<float>(W) + eps);
    } else {
      return 1.0f;
    }
  });
  __syncthreads();  // the expansion and the barriers' init seen by every thread
  auto walk = [&](auto slab_sums) {
    vc_stream::walk_tiles<M, WARPS, STAGES, S, EPI, HAS_BIAS, EMIT, N>(
        bulk, slabs, bars, arrived, &red[0][0][0], stages, wb, sb, bb, bias, residual, next_w, out, normed, partials,
        first_tail, [&](auto, const unsigned char* st, int b, int, auto) { slab_sums(st, b); },  // whole slabs only
        1, best);
    if constexpr (ARGMAX) {
      __syncthreads();  // every item's key in
      if (threadIdx.x < 2 * M) {
        const int h = static_cast<int>(threadIdx.x) / M, m = static_cast<int>(threadIdx.x) % M;
        keys[(static_cast<size_t>(m) * 2 + h) * gridDim.x + blockIdx.x] = best[threadIdx.x];
      }
    }
  };
  const LaneTerms<K, M, LEVELS> lt(smem, lane);
  // This warp's sums of the slab in stage st, rows g and g + 8 (totalled by the quad), into red[b].
  walk([&](const unsigned char* st, int b) {
    float acc[2][M];
    const unsigned char* w_lo = st + g * S::ROW_STRIDE + t * 8;  // row g: the lane's 8 bytes of a group's 32
    const unsigned char* w_hi = w_lo + 8 * S::ROW_STRIDE;         // row g + 8
    const TS* ts = reinterpret_cast<const TS*>(st + S::SCALES);
    const TS* tb = reinterpret_cast<const TS*>(st + S::BIASES);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = 0.0f;
#pragma unroll 3
    for (int grp = warp; grp < GROUPS; grp += WARPS) {
      const uint2 wl = *reinterpret_cast<const uint2*>(w_lo + grp * 32);
      const uint2 wh = *reinterpret_cast<const uint2*>(w_hi + grp * 32);
      lt.add_group(acc, wl, wh, grp, static_cast<float>(ts[g * SROW + grp]),
                   static_cast<float>(ts[(g + 8) * SROW + grp]), static_cast<float>(tb[g * SROW + grp]),
                   static_cast<float>(tb[(g + 8) * SROW + grp]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[h][m] += __shfl_xor_sync(0xffffffffu, acc[h][m], 1);
        acc[h][m] += __shfl_xor_sync(0xffffffffu, acc[h][m], 2);
        if (t == 0) red[b][warp][(g + 8 * h) * M + m] = acc[h][m];
      }
    }
  });
}

}  // namespace vc_imma
#endif
)";

// y = the 4-bit matvec through vc_imma::qmv_imma_stream: NORM 0 or 2, EPI, HAS_BIAS. Template args: K,
// N, M, WARPS, STAGES, EPI, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX, TS, TB, TR, TN, TO.
constexpr const char* kQmvImmaStreamSource = R"(
  VC_DYNAMIC_SMEM(vc_smem);
  const float eps = __int_as_float(EPS_BITS);
  vc_imma::qmv_imma_stream<K, N, M, WARPS, STAGES, EPI, HAS_BIAS, NORM, NP, NG, false>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, static_cast<const float*>(nullptr),
      static_cast<float*>(nullptr), static_cast<float*>(nullptr), vc_smem);
)";

// kQmvImmaStreamSource with EMIT (out = product + residual, normed = out * next_w, a partial sum of
// out^2 a slab). Template args: K, N, M, WARPS, STAGES, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes
// TX, TS, TB, TR, TN, TE, TO.
constexpr const char* kQmvImmaStreamEmitSource = R"(
  VC_DYNAMIC_SMEM(vc_smem);
  const float eps = __int_as_float(EPS_BITS);
  vc_imma::qmv_imma_stream<K, N, M, WARPS, STAGES, 1, HAS_BIAS, NORM, NP, NG, true>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, next_w, normed, partials, vc_smem);
)";

// The two-head argmax on vc_imma::qmv_imma_stream's walk (EPI_ARGMAX): heads a and b, N / 2 rows each
// (the kernel's N is both); keys[(m * 2 + head) * grid + block] gets each block's best argmax key
// (kArgmaxFinishSource takes them, NB = the grid), logits [2, M, N / 2] the logits where WRITE_LOGITS.
// Template args: K, N, M, WARPS, STAGES, WRITE_LOGITS, and the dtypes TX, TS, TO.
constexpr const char* kImmaStreamArgmaxSource = R"(
  VC_DYNAMIC_SMEM(vc_smem);
  vc_imma::qmv_imma_stream<K, N, M, WARPS, STAGES, vc_stream::EPI_ARGMAX, false, 0, 1, 1, false>(
      x, weight_a, scales_a, biases_a, static_cast<const TS*>(nullptr), static_cast<const float*>(nullptr),
      static_cast<const float*>(nullptr), 0.0f, WRITE_LOGITS ? logits : static_cast<TO*>(nullptr),
      static_cast<const float*>(nullptr), static_cast<float*>(nullptr), static_cast<float*>(nullptr), vc_smem,
      weight_b, scales_b, biases_b, reinterpret_cast<unsigned long long*>(keys));
)";

// y = the 4-bit matvec of kQmvSource (NORM 0 or 2, EPI, HAS_BIAS) through vc_stream::qmv_stream: a
// persistent grid, STAGES tiles of ROWS rows in flight a block by bulk copies (dynamic shared memory:
// STAGES * the tile's bytes, + x's slices with XS 2). Template args: GROUP, K, N, M, ROWS, THREADS,
// STAGES, XS, SPLIT (vc_stream::qmv_stream), EPI, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX,
// TS, TB, TR, TN, TO.
constexpr const char* kQmvStreamSource = R"(
  VC_DYNAMIC_SMEM(vc_stages);
  const float eps = __int_as_float(EPS_BITS);
  vc_stream::qmv_stream<GROUP, K, N, M, ROWS, THREADS, STAGES, XS, SPLIT, EPI, HAS_BIAS, NORM, NP, NG, false>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, static_cast<const float*>(nullptr),
      static_cast<float*>(nullptr), static_cast<float*>(nullptr), vc_stages);
)";

// kQmvStreamSource with EMIT (as kQmvEmitSource: out = product + residual, normed = out * next_w, and
// each tile's (and part's) partial sum of out^2). Template args: GROUP, K, N, M, ROWS, THREADS, STAGES,
// XS, SPLIT, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX, TS, TB, TR, TN, TE, TO.
constexpr const char* kQmvStreamEmitSource = R"(
  VC_DYNAMIC_SMEM(vc_stages);
  const float eps = __int_as_float(EPS_BITS);
  vc_stream::qmv_stream<GROUP, K, N, M, ROWS, THREADS, STAGES, XS, SPLIT, 1, HAS_BIAS, NORM, NP, NG, true>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, next_w, normed, partials, vc_stages);
)";

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for dense bfloat16 / float16 / float32 weights (PRO 1:
// x[m, :] = gelu_tanh(gate) * up from a [M, 2K] x, see dense_accumulate).
// Template args: K, N, M, ROWS, THREADS, EPI, PRO, HAS_BIAS, TX, TW, TB, TR, TO.
constexpr const char* kDenseSource = R"(
  __shared__ float part[ROWS * M * THREADS];
  __shared__ float total[ROWS * M];
  const int row0 = blockIdx.x * ROWS;
  const auto tail = vc_gemv::row_tail<ROWS, M, EPI, HAS_BIAS>(bias, residual, row0, N);
  float acc[ROWS][M];
  vc_gemv::dense_accumulate<K, M, ROWS, THREADS, PRO>(x, weight, row0, N, acc, threadIdx.x);
  vc_gemv::block_sum<ROWS * M, THREADS>(&acc[0][0], part, total);
  vc_gemv::store_rows<ROWS, M, EPI, HAS_BIAS>(total, tail, out, row0, N);
)";

// The sandwich-norm seam feeding a dense matvec, in one launch (the TTS's Gemma blocks):
//   h'[m] = h[m] + rms_norm(y[m]) * post,   x[m] = rms_norm(h'[m]) * pre,   out[m, n] = x[m] . w[n] (+ bias)
// and h' is written too (by block 0): the residual stream the next seam adds to. SEAM 1 adds y as it
// is (h' = h + y: the MoG head's input, hidden states plus the code embedding); SEAM 2 has no y
// (h' = h: a plain input norm before the product; y and post are not read). Every block forms x (M
// rows of K floats) in shared memory from h and y (K floats each: small beside its weight rows), then
// runs the block-layout product over it. eps from EPS_BITS (float bits).
// Template args: K, N, M, ROWS, THREADS, HAS_BIAS, SEAM, EPS_BITS, TW, TB, TO (h, y, post, pre: float).
// Its header is block_reduce_header() + dense_header().
constexpr const char* kDenseAddNormSource = R"(
  __shared__ __align__(16) float xs[M * K];
  __shared__ float red[THREADS / 32];
  __shared__ float part[ROWS * M * THREADS];
  __shared__ float total[ROWS * M];
  const float eps = __int_as_float(EPS_BITS);
  for (int m = 0; m < M; ++m) {
    const float* ym = y + static_cast<size_t>(m) * K;
    const float* hm = h + static_cast<size_t>(m) * K;
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
      if (blockIdx.x == 0) h_out[static_cast<size_t>(m) * K + k] = xs[m * K + k];
      xs[m * K + k] = xs[m * K + k] * r_pre * pre[k];
    }
  }
  __syncthreads();
  const int row0 = blockIdx.x * ROWS;
  const auto tail = vc_gemv::row_tail<ROWS, M, 0, HAS_BIAS>(bias, bias, row0, N);
  float acc[ROWS][M];
  vc_gemv::dense_accumulate<K, M, ROWS, THREADS, 0>(static_cast<const float*>(xs), weight, row0, N, acc, threadIdx.x);
  vc_gemv::block_sum<ROWS * M, THREADS>(&acc[0][0], part, total);
  vc_gemv::store_rows<ROWS, M, 0, HAS_BIAS>(total, tail, out, row0, N);
)";

// ids[j] = the index in the best of keys[j * NB, (j + 1) * NB), one block per j.
// Template args: NB, THREADS.
constexpr const char* kArgmaxFinishSource = R"(
  __shared__ unsigned long long warp_best[THREADS / 32];
  const unsigned long long* k = reinterpret_cast<const unsigned long long*>(keys) + static_cast<size_t>(blockIdx.x) * NB;
  unsigned long long best = 0ull;
  for (int i = threadIdx.x; i < NB; i += THREADS) {
    best = k[i] > best ? k[i] : best;
  }
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, off);
    best = other > best ? other : best;
  }
  if ((threadIdx.x & 31) == 0) {
    warp_best[threadIdx.x >> 5] = best;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < THREADS / 32; ++w) {
      best = warp_best[w] > best ? warp_best[w] : best;
    }
    ids[blockIdx.x] = static_cast<int>(~static_cast<unsigned int>(best & 0xFFFFFFFFull));
  }
)";

}  // namespace voicechat::gemv_cuda
