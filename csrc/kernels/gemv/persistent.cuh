// What the persistent 4-bit layouts (vc_qmv_stream, vc_qmv_imma_stream) share: their dynamic shared
// memory, x's int8 terms, the group totals of a producer's norm, a tile's end. Include-guarded; it needs
// common.cuh before it.
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

// Input rows a tile's end takes at a time: all M where a warp's lanes hold every row's sum (ROWS x M
// <= 32), else 32 / ROWS (the tile then ends in M / MC turns, turn c the input rows c x MC on).
template <int ROWS, int M>
struct EndTurns {
  static constexpr int MC = ROWS * M <= 32 ? M : 32 / ROWS;
  static constexpr int TURNS = M / MC;
  static_assert(MC >= 1 && M % MC == 0, "whole turns of input rows");
};

// tile_total for turn c of EndTurns: lane l < R x MC gets the sum of row l / MC, input row c x MC + l %
// MC (the warps' sums laid out as R x M, row-major); 0 in the other lanes.
template <int R, int M, int MC, int WARPS>
__device__ __forceinline__ float turn_total(const float* red, int stride, int lane, int c) {
  float v = 0.0f;
  if (lane < R * MC) {
    const int at = lane / MC * M + c * MC + lane % MC;
    for (int w = 0; w < WARPS; ++w) v += red[w * stride + at];
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
// With MC < M the lanes hold input rows m0 .. m0 + MC - 1 (row row0 + l / MC, input row m0 + l % MC).
template <int M, int ROWS, int NH, int MC = M, typename TO>
__device__ __forceinline__ void argmax_totals(float v, int lane, int row0, TO* logits, unsigned long long* best,
                                              int m0 = 0) {
  const int head = row0 >= NH ? 1 : 0;
  const int row = row0 - head * NH + lane / MC, m = m0 + lane % MC;
  unsigned long long key = 0ull;
  if (lane < ROWS * MC) {
    const TO stored = static_cast<TO>(v);
    if (logits != nullptr) {
      logits[(static_cast<size_t>(head) * M + m) * NH + row] = stored;
    }
    key = vc_gemv::argmax_key(static_cast<float>(stored), row);
  }
#pragma unroll
  for (int off = 16; off >= MC; off >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
    key = other > key ? other : key;
  }
  if (lane < MC) {
    atomicMax(&best[head * M + m0 + lane], key);
  }
}

// The totals of ROWS rows from row0 on (a tile, or a part of one) stored by one warp, all 32 lanes
// calling: lane l's total v is row row0 + l / MC, input row m0 + l % MC (MC = M: every input row),
// stored through vc_gemv::finish's epilogue, or with EMIT as vc_gemv::emit_rows (their partial is p of
// np). tail: the lane's vc_gemv::Tail for that row.
template <int M, int ROWS, int EPI, bool HAS_BIAS, bool EMIT, int N, int MC = M, typename TO, typename TL>
__device__ __forceinline__ void store_totals(float v, int lane, int row0, int p, int np, const TL& tail, TO* out,
                                             float* normed, float* partials, unsigned long long* best = nullptr,
                                             int m0 = 0) {
  constexpr int SUMS = ROWS * MC;
  const int row = row0 + lane / MC;
  if constexpr (EPI == EPI_ARGMAX) {
    argmax_totals<M, ROWS, N / 2, MC>(v, lane, row0, out, best, m0);
  } else if constexpr (EMIT) {
    vc_gemv::emit_rows<M, EPI, HAS_BIAS, MC>(v, lane < SUMS, row, tail, out, N, normed, partials, p, np, m0);
  } else if (lane < SUMS) {
    vc_gemv::finish<EPI, HAS_BIAS>(v, tail, out, m0 + lane % MC, row, N);
  }
}

// The end of an item whose R x M sums take more lanes than a warp has (EndTurns' TURNS > 1), in one
// warp (all 32 lanes calling): every turn's totals first (turn_totals: red read before the stage is
// used again), then turn by turn each lane's Tail loaded and the store (store_turns).
template <int R, int M, int WARPS>
__device__ __forceinline__ void turn_totals(const float* red, int stride, int lane,
                                            float (&v)[EndTurns<R, M>::TURNS]) {
  using E = EndTurns<R, M>;
#pragma unroll
  for (int c = 0; c < E::TURNS; ++c) v[c] = turn_total<R, M, E::MC, WARPS>(red, stride, lane, c);
}

template <int M, int R, int EPI, bool HAS_BIAS, bool EMIT, int N, typename TB, typename TR, typename TE, typename TO>
__device__ __forceinline__ void store_turns(const float (&v)[EndTurns<R, M>::TURNS], int lane, int row0, int p, int np,
                                            const TB* bias, const TR* residual, const TE* next_w, TO* out,
                                            float* normed, float* partials, unsigned long long* best) {
  using E = EndTurns<R, M>;
#pragma unroll
  for (int c = 0; c < E::TURNS; ++c) {
    const auto tail = vc_gemv::slot_tail<R, M, EPI, HAS_BIAS, E::MC>(lane, bias, residual, row0, N,
                                                                     EMIT ? next_w : nullptr, c * E::MC);
    store_totals<M, R, EPI, HAS_BIAS, EMIT, N, E::MC>(v[c], lane, row0, p, np, tail, out, normed, partials, best,
                                                      c * E::MC);
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
