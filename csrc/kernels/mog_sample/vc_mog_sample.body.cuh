// Template args: N (components), R (low rank), L (latent), H (hidden), THREADS, TW (weights' type).
// TOP_P_BITS, NOISE_BITS: top_p and noise_scale as float bits; MIN_LOG_STD_BITS / MIN_LOG_STD_NEG:
// min_log_std's magnitude as float bits and its sign.
// Block b draws session b's frame: its y, h, u and noise rows, its z row and component (one block
// a session, each the launch of that session alone).
//
// Top-p without comparing every pair (N^2 = 1M steps for one block): with f(t) = the mass of the components above t, keep_i <=> f(p_i) < top_p, and f only
// falls as t grows, so the kept components are those with p_i >= tau, tau the smallest p with
// f(p) < top_p. A bisection over the bits of t (non-negative floats order as their bits) finds it
// in ~30 block sums; each f(t) sums in one fixed order, so it is monotone in t and the bisection
// exact for it. The two products read their weight rows 16 bytes a load, every load of a lane at
// once (h staged in shared memory).
  const float neg_inf = -__uint_as_float(0x7f800000u);  // MLX's CUDA prelude has no `inf`
  constexpr int WARPS = THREADS / 32;
  constexpr int VEC = 16 / static_cast<int>(sizeof(TW));  // weights a 16-byte load
  __shared__ float p[N];
  __shared__ __align__(16) float hs[H];
  __shared__ float low[R];
  __shared__ float scratch[WARPS];
  __shared__ int scratch_i[WARPS];
  const int session = static_cast<int>(blockIdx.x);
  const float* ys = y + static_cast<size_t>(session) * (N + 1 + L);
  const float* hrow = h + static_cast<size_t>(session) * H;
  const float* us = u + static_cast<size_t>(session) * N;
  const float* ns = noise + static_cast<size_t>(session) * L;
  float* zs = z + static_cast<size_t>(session) * L;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const float top_p = __int_as_float(TOP_P_BITS);
  for (int k = tid; k < H; k += THREADS) hs[k] = hrow[k];
  // softmax of the logits
  float m = neg_inf;
  for (int i = tid; i < N; i += THREADS) m = fmaxf(m, ys[i]);
  m = vc_block_max<THREADS>(m, scratch);
  float s = 0.0f;
  for (int i = tid; i < N; i += THREADS) {
    p[i] = expf(ys[i] - m);
    s += p[i];
  }
  s = vc_block_sum<THREADS>(s, scratch);  // (its barrier also publishes p)
  for (int i = tid; i < N; i += THREADS) p[i] = p[i] / s;
  __syncthreads();
  // top-p: the smallest t (as bits, within [0, just above 1]) with f(t) < top_p
  unsigned int lo = 0u, hi = 0x3F800001u;
  while (lo < hi) {  // uniform: every thread has the same block sums
    const unsigned int mid = lo + (hi - lo) / 2u;
    const float t = __uint_as_float(mid);
    float above = 0.0f;
    for (int i = tid; i < N; i += THREADS) above += p[i] > t ? p[i] : 0.0f;
    if (vc_block_sum<THREADS>(above, scratch) < top_p) hi = mid; else lo = mid + 1u;
  }
  const float tau = __uint_as_float(lo);
  // the kept logits' logsumexp
  float kept = 0.0f;
  for (int i = tid; i < N; i += THREADS) {
    if (p[i] >= tau) kept += expf(ys[i] - m);
  }
  const float lse = m + logf(vc_block_sum<THREADS>(kept, scratch));
  // Gumbel-max over the kept components
  float best = neg_inf;
  int best_i = 0;
  for (int i = tid; i < N; i += THREADS) {
    if (p[i] >= tau) {
      const float g = -logf(-logf(us[i] + 1e-8f) + 1e-8f);
      vc_mog::better(best, best_i, (ys[i] - lse) + g, i);
    }
  }
  const int c = vc_mog::block_argmax<THREADS>(best, best_i, scratch, scratch_i);
  if (tid == 0) component[session] = c;
  const bool vec = H % VEC == 0 && R % VEC == 0 &&
                   ((reinterpret_cast<unsigned long long>(mus) | reinterpret_cast<unsigned long long>(low_mat)) & 15ull) == 0ull;
  // low = proj_mus rows of c @ h: a warp per row, lanes over the row (all of a warp's rows at once)
  constexpr int RPW = (R + WARPS - 1) / WARPS;
  float acc[RPW];
#pragma unroll
  for (int j = 0; j < RPW; ++j) acc[j] = 0.0f;
  if (vec) {
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
      const int r = warp + j * WARPS;
      if (r < R) {
        const TW* w = mus + (static_cast<size_t>(c) * R + r) * H;
        for (int v = lane; v < H / VEC; v += 32) {
          TW e[VEC];
          *reinterpret_cast<uint4*>(e) = reinterpret_cast<const uint4*>(w)[v];
#pragma unroll
          for (int q = 0; q < VEC; ++q) acc[j] = fmaf(static_cast<float>(e[q]), hs[v * VEC + q], acc[j]);
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
      const int r = warp + j * WARPS;
      if (r < R) {
        const TW* w = mus + (static_cast<size_t>(c) * R + r) * H;
        for (int k = lane; k < H; k += 32) acc[j] = fmaf(static_cast<float>(w[k]), hs[k], acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
    const int r = warp + j * WARPS;
    if (lane == 0 && r < R) low[r] = acc[j];
  }
  __syncthreads();
  // z = (low_mat[c] @ low) * s + rest + s * noise * noise_scale
  const float min_log_std = MIN_LOG_STD_NEG ? -__int_as_float(MIN_LOG_STD_BITS) : __int_as_float(MIN_LOG_STD_BITS);
  const float scale = expf(fmaxf(ys[N], min_log_std));
  for (int l = tid; l < L; l += THREADS) {
    const TW* lm = low_mat + (static_cast<size_t>(c) * L + l) * R;
    float mu = 0.0f;
    if (vec) {
#pragma unroll
      for (int v = 0; v < R / VEC; ++v) {
        TW e[VEC];
        *reinterpret_cast<uint4*>(e) = reinterpret_cast<const uint4*>(lm)[v];
#pragma unroll
        for (int q = 0; q < VEC; ++q) mu = fmaf(static_cast<float>(e[q]), low[v * VEC + q], mu);
      }
    } else {
      for (int r = 0; r < R; ++r) mu = fmaf(static_cast<float>(lm[r]), low[r], mu);
    }
    zs[l] = (mu * scale + ys[N + 1 + l]) + scale * ns[l] * __int_as_float(NOISE_BITS);
  }
