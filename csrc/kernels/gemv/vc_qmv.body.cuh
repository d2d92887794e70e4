// y[m, n] = x[m, :] . dequant(w)[n, :] (+ bias[n]) for 4- or 8-bit affine weights; NORM 2: x was
// normalized by its producer but for the scale, which norm_w's partial sums give (qmv_block).
// Template args: BITS, GROUP, K, N, M, ROWS, THREADS, EPI, HAS_BIAS, NORM, NP, NG, EPS_BITS (the
// norm's eps as float bits), and the dtypes TX, TS, TB, TR, TN, TO (the kernel name is made of the
// template args only, so every dtype must be one of them).
  const float eps = __int_as_float(EPS_BITS);
  vc_gemv::qmv_block<BITS, GROUP, K, N, M, ROWS, THREADS, EPI, HAS_BIAS, NORM, NP, NG, false>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, static_cast<const float*>(nullptr),
      static_cast<float*>(nullptr), static_cast<float*>(nullptr));
