// Decode-speed matrix-vector products: 1-2 rows of activations against a large weight, with the
// epilogue (a bias, a residual, squared ReLU, the next RMSNorm's input) and a producer's norm as
// prologue fused in. On CUDA our kernels (the block layout; on sm_90 for one row the streamed and
// the integer-MMA layouts); elsewhere, and at shapes the kernels do not take, MLX's ops.
//
// Shared arguments: x [..., K] with 1-2 leading rows (float32, bfloat16 or float16); a quantized
// weight is MLX's affine packing: w [N, K * bits / 32] uint32, scales / biases [N, K / group_size];
// residual [..., N]; activation "" or "relu_squared". prenormed: x is a norm's input already times
// its weight and prenormed [..., P] float32 partial sums of its squares (prenorm_groups equal channel
// groups, each over P / prenorm_groups consecutive partials); each group is scaled by
// rsqrt(sum / group width + norm_eps) in the same launch.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// x @ dequantize(w).T (+ bias), then relu(.)^2 or + residual -> [..., N] of the promoted type of x,
// scales, bias and residual.
mlx::core::array quantized_matvec(const mlx::core::array& x, const mlx::core::array& w,
                                  const mlx::core::array& scales, const mlx::core::array& biases,
                                  const std::optional<mlx::core::array>& bias = std::nullopt, int group_size = 64,
                                  int bits = 4, const std::optional<mlx::core::array>& residual = std::nullopt,
                                  const std::string& activation = "",
                                  const std::optional<mlx::core::array>& prenormed = std::nullopt,
                                  int prenorm_groups = 1, float norm_eps = 1e-5f, mlx::core::StreamOrDevice s = {});

// {out, normed, partials}: out = x @ dequantize(w).T (+ bias) + residual, and the next RMSNorm's
// input left for its matvec: normed = out * next_norm [N] (float32) and partials [..., P] float32
// whose sum is each row's sum of out^2 (that matvec's x and prenormed). One CUDA launch.
std::vector<mlx::core::array> quantized_matvec_emit_norm(
    const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& scales,
    const mlx::core::array& biases, const mlx::core::array& residual, const mlx::core::array& next_norm,
    const std::optional<mlx::core::array>& bias = std::nullopt, int group_size = 64, int bits = 4,
    const std::optional<mlx::core::array>& prenormed = std::nullopt, int prenorm_groups = 1, float norm_eps = 1e-5f,
    mlx::core::StreamOrDevice s = {});

// x @ w.T (+ bias), then the epilogue as quantized_matvec's, for a bfloat16 / float16 / float32 w
// [N, K]. input "gelu_gate": x is [..., 2K] and gelu_tanh(x[..., :K]) * x[..., K:] is the product's
// input (formed as the kernel loads it). sessions: x's rows are that many equal groups (1-2 rows
// each, e.g. a session's CFG pair), each group's output the bits of its product alone, in one launch.
mlx::core::array dense_matvec(const mlx::core::array& x, const mlx::core::array& w,
                              const std::optional<mlx::core::array>& bias = std::nullopt,
                              const std::optional<mlx::core::array>& residual = std::nullopt,
                              const std::string& activation = "", const std::string& input = "",
                              int sessions = 1, mlx::core::StreamOrDevice s = {});

// {out, h'}: h' = h + rms_norm(y) * post and out = (rms_norm(h') * pre) @ w.T (+ bias), for 1-2
// float32 rows h, y [..., C]. post none: h' = h + y; y none (and post none): h' = h. sessions: the
// rows are that many equal groups of 1-2, in one launch, each group's bits those of its launch alone.
std::vector<mlx::core::array> dense_add_norm_matvec(const mlx::core::array& h, const std::optional<mlx::core::array>& y,
                                                    const std::optional<mlx::core::array>& post,
                                                    const mlx::core::array& pre, float eps, const mlx::core::array& w,
                                                    const std::optional<mlx::core::array>& bias = std::nullopt,
                                                    int sessions = 1, mlx::core::StreamOrDevice s = {});

// argmax over both quantized heads, head = {weight, scales, biases}, in one pass: {ids [..., 2]
// int32} or, with return_logits, {ids, logits_a, logits_b}. On an sm_90 GPU one launch over both
// heads' 16-row slabs and a finish.
std::vector<mlx::core::array> two_head_argmax(const mlx::core::array& x, const std::vector<mlx::core::array>& head_a,
                                              const std::vector<mlx::core::array>& head_b, int group_size = 64,
                                              int bits = 4, bool return_logits = false,
                                              mlx::core::StreamOrDevice s = {});

// The float streamed layout's launch as quantized_matvec picks it on an sm_90 GPU for `rows` rows of
// x (1, 2 or 4; 4-bit, group 64, bfloat16 scales): smem is its dynamic shared memory in bytes,
// stage_x how x reaches the lanes, split the parts a last-round tile is cut into, partials the
// emitting kernel's partial sums a row of x.
struct GemvStreamLaunch {
  int threads, blocks, smem, stage_x, split, partials;
};

// stream_launch's at [N, K], or none where another layout takes the shape.
std::optional<GemvStreamLaunch> stream_launch(int k, int n, bool x_float32 = true, int prenorm_groups = 1,
                                              int rows = 1);

}  // namespace voicechat
