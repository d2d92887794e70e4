// vc_qmv_imma_stream with EMIT (out = product + residual, normed = out * next_w, a partial sum of
// out^2 a slab). Template args: K, N, M, WARPS, STAGES, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes
// TX, TS, TB, TR, TN, TE, TO.
  VC_DYNAMIC_SMEM(vc_smem);
  const float eps = __int_as_float(EPS_BITS);
  vc_imma::qmv_imma_stream<K, N, M, WARPS, STAGES, 1, HAS_BIAS, NORM, NP, NG, true>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, next_w, normed, partials, vc_smem);
