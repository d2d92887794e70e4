// The 4-bit product on the tensor cores' integer MMA (mma.sync m16n8k32, u8 x s8 -> s32): the
// weights' nibbles are the u8 A operand as they stand (v & 0x0F0F0F0F: two instructions for eight
// values, against the float path's five a pair), and x the s8 B operand as a block floating point
// expansion built once a block in shared memory: each group of 64 inputs is 2^E (p0 + p1 / 128 + p2 /
// 128^2 ...) with int8 p (LEVELS terms, 6 + 7 (LEVELS - 1) bits below the group's largest |x|), one
// term a B column, so one MMA takes every term of two rows of x at once. Integer sums are exact;
// each group's are scaled in float32: s * 2^E * sum(q p) + b * sum(x).
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

// One lane's side of a slab's products (lane 4g + t), for input rows taken two at a time (pair q: rows
// 2q, 2q + 1; one MMA a pair, so that a row's integer sums and their float steps are the same at every
// M): its B column g is term (level g / 2, row 2q + g % 2) of the expansion or none, its C columns 2t,
// 2t + 1 are level t of the pair's rows, weighed 128^-t.
template <int K, int M, int LEVELS>
struct LaneTerms {
  using L = Layout<K, M, LEVELS>;
  static constexpr int PAIRS = (M + 1) / 2;
  const uint2* terms;
  const float* factors;
  const float* sums;
  int t, term;  // term: pair 0's (pair q's is term + 2q)
  int level;    // the lane's B level, LEVELS past the expansion
  float level_weight;

  __device__ LaneTerms(const unsigned char* smem, int lane)
      : terms(reinterpret_cast<const uint2*>(smem + L::TERMS)),
        factors(reinterpret_cast<const float*>(smem + L::FACTORS)),
        sums(reinterpret_cast<const float*>(smem + L::SUMS)),
        t(lane & 3),
        term((lane >> 3) * M + ((lane >> 2) & 1)),
        level(lane >> 3),
        level_weight((lane & 3) < LEVELS ? __uint_as_float(static_cast<unsigned int>(127 - 7 * (lane & 3)) << 23)
                                         : 0.0f) {}

  // Whether the lane's B column holds a term of pair q (its row inside M, its level inside LEVELS).
  __device__ __forceinline__ bool has_term(int q) const {
    return 2 * q + (term - level * M) < M && level < LEVELS;
  }

  // acc[0][m] / acc[1][m] (rows g and g + 8) += 64-wide group grp's product with input row m: wl / wh
  // the rows' words 2t, 2t + 1 of the group, s* / b* their scales and biases.
  __device__ __forceinline__ void add_group(float (&acc)[2][M], uint2 wl, uint2 wh, int grp, float s0, float s1,
                                            float b0, float b1) const {
    constexpr unsigned int NIBBLES = 0x0F0F0F0Fu;
#pragma unroll
    for (int q = 0; q < PAIRS; ++q) {
      int c[4] = {0, 0, 0, 0};
      const bool has = has_term(q);
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const unsigned int vl = step ? wl.y : wl.x, vh = step ? wh.y : wh.x;
        const unsigned int a[4] = {vl & NIBBLES, vh & NIBBLES, (vl >> 4) & NIBBLES, (vh >> 4) & NIBBLES};
        const uint2 bt = has ? terms[((grp * 2 + step) * 4 + t) * L::P + term + 2 * q] : uint2{0u, 0u};
        const unsigned int b[2] = {bt.x, bt.y};
        mma(c, a, b);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int m = 2 * q + i;
        if (m < M) {
          const float f = factors[grp * M + m] * level_weight;
          const float xs = sums[(grp * 4 + t) * M + m];
          acc[0][m] = fmaf(s0 * f, small_int_float(c[i]), fmaf(b0, xs, acc[0][m]));
          acc[1][m] = fmaf(s1 * f, small_int_float(c[2 + i]), fmaf(b1, xs, acc[1][m]));
        }
      }
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
