// Thread i < B * (L + K - 1) * C: row t < L of the output, or row t - L of the new state.
// Template args: B, C, K, L, W (src row width), OFFSET, HAS_BIAS, TS (src type), THREADS.
  const size_t i = static_cast<size_t>(blockIdx.x) * THREADS + threadIdx.x;
  constexpr int ROWS = L + K - 1;
  if (i >= static_cast<size_t>(B) * ROWS * C) {
    return;
  }
  const int c = static_cast<int>(i % C);
  const int t = static_cast<int>((i / C) % ROWS);
  const int b = static_cast<int>(i / (static_cast<size_t>(C) * ROWS));
  // window[p] for p < K - 1 + L: the state first, then x.
  auto window = [&](int p) -> float {
    return p < K - 1 ? conv_state[(static_cast<size_t>(b) * (K - 1) + p) * C + c]
                     : static_cast<float>(src[(static_cast<size_t>(b) * L + (p - (K - 1))) * W + OFFSET + c]);
  };
  if (t < L) {
    float v = HAS_BIAS ? static_cast<float>(bias[c]) : 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      v = v + window(t + k) * static_cast<float>(weight[c * K + k]);
    }
    y[(static_cast<size_t>(b) * L + t) * C + c] = v / (1.0f + expf(-v));
  } else {
    const int j = t - L;  // new state row j = window[L + j]
    new_state[(static_cast<size_t>(b) * (K - 1) + j) * C + c] = window(L + j);
  }
