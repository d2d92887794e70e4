// Exact floats from packed fields, and the 4-bit pair form.
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
