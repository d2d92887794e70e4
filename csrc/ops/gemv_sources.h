// The GEMV family's CUDA sources (csrc/kernels/gemv), each with the instances the model launches:
// what gemv.cpp launches and the compile checks and the CPU emulation read.
#pragma once

#include "cuda/cuda_sources.h"

namespace voicechat::gemv {

// The block layout: 4- / 8-bit (vc_qmv, vc_qmv_emit) and dense (vc_dense_mv, vc_dense_add_norm).
const CudaSource& qmv_source();
const CudaSource& qmv_emit_source();
const CudaSource& dense_source();
const CudaSource& dense_add_norm_source();

// The streamed 4-bit layout on sm_90 (vc_qmv_stream, vc_qmv_stream_emit).
const CudaSource& qmv_stream_source();
const CudaSource& qmv_stream_emit_source();

// The streamed integer-MMA layout on sm_90 (vc_qmv_imma_stream, vc_qmv_imma_stream_emit).
const CudaSource& qmv_imma_stream_source();
const CudaSource& qmv_imma_stream_emit_source();

// The two-head argmax: its integer-MMA walk (vc_two_head_argmax_stream) and its finish
// (vc_argmax_finish).
const CudaSource& imma_stream_argmax_source();
const CudaSource& argmax_finish_source();

}  // namespace voicechat::gemv
