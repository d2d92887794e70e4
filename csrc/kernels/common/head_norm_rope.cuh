// vc_head_norm_rope<D, TX>(x, scale, inv_freq, eps, position, o, lane), one warp: one attention
// head's RMS norm (times scale) and rotate-half RoPE, the TTS's head preparation (qkv_heads,
// decode_attention_qkv). Include-guarded.
#ifndef VC_HEAD_NORM_ROPE
#define VC_HEAD_NORM_ROPE
// One head of D values at x, by one warp (lane-strided pairs i, i + D/2): RMS norm over the head
// times scale, then rotate-half RoPE at `position` (angle = position * inv_freq[i]), into o.
template <int D, typename TX>
__device__ __forceinline__ void vc_head_norm_rope(const TX* x, const float* scale, const float* inv_freq, float eps,
                                                  float position, float* o, int lane) {
  constexpr int HALF = D / 2;
  constexpr int PAIRS = (HALF + 31) / 32;
  // The scales and frequencies load with x (not after the reduction: one memory round trip fewer).
  float lo[PAIRS], hi[PAIRS], s_lo[PAIRS], s_hi[PAIRS], freq[PAIRS];
  float ss = 0.0f;
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int i = lane + 32 * p;
    lo[p] = i < HALF ? static_cast<float>(x[i]) : 0.0f;
    hi[p] = i < HALF ? static_cast<float>(x[i + HALF]) : 0.0f;
    s_lo[p] = i < HALF ? scale[i] : 0.0f;
    s_hi[p] = i < HALF ? scale[i + HALF] : 0.0f;
    freq[p] = i < HALF ? inv_freq[i] : 0.0f;
    ss += lo[p] * lo[p] + hi[p] * hi[p];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float r = rsqrtf(ss / static_cast<float>(D) + eps);
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int i = lane + 32 * p;
    if (i < HALF) {
      const float a = lo[p] * r * s_lo[p];
      const float c = hi[p] * r * s_hi[p];
      const float angle = position * freq[p];
      const float cs = cosf(angle);
      const float sn = sinf(angle);
      o[i] = a * cs - c * sn;
      o[i + HALF] = c * cs + a * sn;
    }
  }
}
#endif
