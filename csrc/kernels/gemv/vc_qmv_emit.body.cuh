// vc_qmv with EMIT (see vc_gemv::qmv_block): out = product + residual, and the next norm's input
// normed = out * next_w with the block's partial sums of out^2. Template args: BITS, GROUP, K, N,
// M, ROWS, THREADS, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX, TS, TB, TR, TN, TE, TO.
  const float eps = __int_as_float(EPS_BITS);
  vc_gemv::qmv_block<BITS, GROUP, K, N, M, ROWS, THREADS, 1, HAS_BIAS, NORM, NP, NG, true>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, next_w, normed, partials);
