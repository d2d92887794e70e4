// The two-head argmax on vc_imma::qmv_imma_stream's walk (EPI_ARGMAX): heads a and b, N / 2 rows each
// (the kernel's N is both); keys[(m * 2 + head) * grid + block] gets each block's best argmax key
// (vc_argmax_finish takes them, NB = the grid), logits [2, M, N / 2] the logits where WRITE_LOGITS.
// Template args: K, N, M, WARPS, STAGES, WRITE_LOGITS, and the dtypes TX, TS, TO.
  VC_DYNAMIC_SMEM(vc_smem);
  vc_imma::qmv_imma_stream<K, N, M, WARPS, STAGES, vc_stream::EPI_ARGMAX, false, 0, 1, 1, false>(
      x, weight_a, scales_a, biases_a, static_cast<const TS*>(nullptr), static_cast<const float*>(nullptr),
      static_cast<const float*>(nullptr), 0.0f, WRITE_LOGITS ? logits : static_cast<TO*>(nullptr),
      static_cast<const float*>(nullptr), static_cast<float*>(nullptr), static_cast<float*>(nullptr), vc_smem,
      weight_b, scales_b, biases_b, reinterpret_cast<unsigned long long*>(keys));
