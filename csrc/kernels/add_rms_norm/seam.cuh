// The seam for one row, both kernels' body: thread t holds channels t, t + THREADS, ... of h' in
// v and of z = rms_norm(h') * pre in z (zero past C). Included after block_reduce_header().
#ifndef VC_SEAM_ROW
#define VC_SEAM_ROW
template <int C, int THREADS, int PER, typename TH, typename TY, typename TW>
__device__ __forceinline__ void vc_seam_row(const TH* h, const TY* y, const TW* post, const TW* pre, float eps,
                                            float* scratch, float (&v)[PER], float (&z)[PER]) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    v[i] = c < C ? static_cast<float>(y[c]) : 0.0f;
    ss += v[i] * v[i];
  }
  const float r_post = rsqrtf(vc_block_sum<THREADS>(ss, scratch) / static_cast<float>(C) + eps);
  ss = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    v[i] = c < C ? static_cast<float>(h[c]) + v[i] * r_post * static_cast<float>(post[c]) : 0.0f;
    ss += v[i] * v[i];
  }
  const float r_pre = rsqrtf(vc_block_sum<THREADS>(ss, scratch) / static_cast<float>(C) + eps);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * THREADS;
    z[i] = c < C ? v[i] * r_pre * static_cast<float>(pre[c]) : 0.0f;
  }
}
#endif
