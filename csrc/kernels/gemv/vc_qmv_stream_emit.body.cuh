// vc_qmv_stream with EMIT (as vc_qmv_emit: out = product + residual, normed = out * next_w, and
// each tile's (and part's) partial sum of out^2). Template args: GROUP, K, N, M, ROWS, THREADS, STAGES,
// XS, SPLIT, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX, TS, TB, TR, TN, TE, TO.
  VC_DYNAMIC_SMEM(vc_stages);
  const float eps = __int_as_float(EPS_BITS);
  vc_stream::qmv_stream<GROUP, K, N, M, ROWS, THREADS, STAGES, XS, SPLIT, 1, HAS_BIAS, NORM, NP, NG, true>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, next_w, normed, partials, vc_stages);
