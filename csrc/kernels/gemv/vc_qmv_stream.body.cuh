// y = the 4-bit matvec of vc_qmv (NORM 0 or 2, EPI, HAS_BIAS) through vc_stream::qmv_stream: a
// persistent grid, STAGES tiles of ROWS rows in flight a block by bulk copies (dynamic shared memory:
// STAGES * the tile's bytes, + x's slices with XS 2). Template args: GROUP, K, N, M, ROWS, THREADS,
// STAGES, XS, SPLIT (vc_stream::qmv_stream), EPI, HAS_BIAS, NORM, NP, NG, EPS_BITS, and the dtypes TX,
// TS, TB, TR, TN, TO.
  VC_DYNAMIC_SMEM(vc_stages);
  const float eps = __int_as_float(EPS_BITS);
  vc_stream::qmv_stream<GROUP, K, N, M, ROWS, THREADS, STAGES, XS, SPLIT, EPI, HAS_BIAS, NORM, NP, NG, false>(
      x, weight, scales, biases, bias, residual, norm_w, eps, out, static_cast<const float*>(nullptr),
      static_cast<float*>(nullptr), static_cast<float*>(nullptr), vc_stages);
