// One block per query row (b, h, r): frame i = q_first + r of the L key frames (q holds the last
// L - q_first frames' queries). Warps stride over the frame's context window, lanes over the head
// dimension; each warp keeps an online softmax (running max, sum, and its share of the weighted
// sum of values), and the warps are merged at the end. `dims` = [L, H, left, right, pos_first, P,
// q_first], `scale` = [s]: runtime values, so one compiled kernel serves every length. With STARTS,
// batch row b's frames begin at key starts[b] (a stream's cache not yet filled: the keys before are
// not frames): its window and its warps' keys count from there, so the frames' outputs are those of
// the keys from starts[b] on alone, bit for bit.
  constexpr int WARPS = THREADS / 32;
  constexpr int PER_LANE = (D + 31) / 32;
  __shared__ float qu[D];
  __shared__ float qv[D];
  __shared__ float warp_max[WARPS];
  __shared__ float warp_sum[WARPS];
  __shared__ float warp_acc[WARPS][D];
  const float neg_inf = -__int_as_float(0x7f800000);
  const int L = dims[0], H = dims[1], left = dims[2], right = dims[3], first = dims[4], P = dims[5];
  const int q_first = dims[6], n = L - q_first;
  const float s = scale[0];
  const int row = blockIdx.x;  // (b * H + h) * n + r
  const int i = q_first + row % n;
  const int bh = row / n;
  const int h = bh % H;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int chunk = right + 1;
  const int start = STARTS ? starts[bh / H] : 0;
  const int fi = i - start;  // the frame's index among the frames (a query before them sees no key)
  const int lo = start + (left < 0 ? 0 : max(0, (fi / chunk - left / chunk) * chunk));
  const int hi = fi < 0 ? lo : start + min(L - start, (fi / chunk + 1) * chunk);
  for (int d = threadIdx.x; d < D; d += THREADS) {
    const float x = static_cast<float>(q[(size_t)row * D + d]);
    qu[d] = x + pos_bias_u[h * D + d];
    qv[d] = x + pos_bias_v[h * D + d];
  }
  __syncthreads();
  const T* kb = k + (size_t)bh * L * D;
  const T* vbase = v + (size_t)bh * L * D;
  const T* pb = p + (size_t)h * P * D;
  float m = neg_inf, l = 0.0f;
  float acc[PER_LANE];
  for (int c = 0; c < PER_LANE; ++c) acc[c] = 0.0f;
  for (int j = lo + warp; j < hi; j += WARPS) {
    const T* kr = kb + (size_t)j * D;
    const T* pr = pb + (size_t)(L - 1 - i + j - first) * D;
    float ac = 0.0f, bd = 0.0f;
    for (int d = lane; d < D; d += 32) {
      ac += qu[d] * static_cast<float>(kr[d]);
      bd += qv[d] * static_cast<float>(pr[d]);
    }
    for (int off = 16; off > 0; off >>= 1) {
      ac += __shfl_xor_sync(0xffffffff, ac, off);
      bd += __shfl_xor_sync(0xffffffff, bd, off);
    }
    const float score = ac * s + bd * s;
    const float m_new = fmaxf(m, score);
    const float keep = expf(m - m_new);  // 0 on the first key (m = -inf)
    const float e = expf(score - m_new);
    l = l * keep + e;
    const T* vr = vbase + (size_t)j * D;
    for (int c = 0; c < PER_LANE; ++c) {
      const int d = lane + 32 * c;
      if (d < D) acc[c] = acc[c] * keep + e * static_cast<float>(vr[d]);
    }
    m = m_new;
  }
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum[warp] = l;
  }
  for (int c = 0; c < PER_LANE; ++c) {
    const int d = lane + 32 * c;
    if (d < D) warp_acc[warp][d] = acc[c];
  }
  __syncthreads();
  float top = neg_inf;
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_max[w]);
  for (int d = threadIdx.x; d < D; d += THREADS) {
    float num = 0.0f, den = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      if (warp_max[w] == neg_inf) continue;  // a warp that saw no key
      const float f = expf(warp_max[w] - top);
      num += warp_acc[w][d] * f;
      den += warp_sum[w] * f;
    }
    out[(size_t)row * D + d] = den > 0.0f ? num / den : 0.0f;
  }
