// y = the 4-bit matvec through vc_imma::qmv_imma_stream: NORM 0 or 2, EPI, HAS_BIAS. Template args: K,
// N, M, WARPS, STAGES, EPI, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX, TS, TB, TR, TN, TO.
  VC_DYNAMIC_SMEM(vc_smem);
  const float eps = __int_as_float(EPS_BITS);
  vc_imma::qmv_imma_stream<K, N, M, WARPS, STAGES, EPI, HAS_BIAS, NORM, NP, NG, false>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, static_cast<const float*>(nullptr),
      static_cast<float*>(nullptr), static_cast<float*>(nullptr), vc_smem);
