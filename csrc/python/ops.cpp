// The kernels' bindings: each op of include/voicechat as the function of the same name, with
// Python's argument names and defaults.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>

#include "python/mlx_caster.h"
#include "python/bindings.h"
#include "voicechat/voicechat.h"

namespace py = pybind11;

namespace voicechat {
namespace {

// stream_launch as a dict, or None.
py::object stream_launch_dict(int k, int n, bool x_float32, int prenorm_groups, int rows) {
  const auto l = stream_launch(k, n, x_float32, prenorm_groups, rows);
  if (!l) {
    return py::none();
  }
  return py::dict(py::arg("threads") = l->threads, py::arg("blocks") = l->blocks, py::arg("smem") = l->smem,
                  py::arg("stage_x") = l->stage_x, py::arg("split") = l->split, py::arg("partials") = l->partials);
}

}  // namespace

void bind_ops(py::module_& m) {
  // rel_pos_attention
  m.def("rel_pos_attention", &voicechat::rel_pos_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("p"),
        py::arg("pos_bias_u"), py::arg("pos_bias_v"), py::arg("scale"), py::arg("left"), py::arg("right"),
        py::arg("pos_first") = 0, py::arg("key_start") = py::none(), py::arg("method") = "auto",
        py::arg("stream") = py::none(),
        "Rel-pos attention with rel_shift and the chunked-limited mask: q, k, v [B, H, L, D], p [H, P, D] = rows "
        "[pos_first, pos_first + P) of the 2L-1 relative-position rows, pos_bias_u / pos_bias_v [H, D], "
        "key_start [B] int32 (batch row b's frames begin at that key) -> [B, H, L, D] in q's dtype.");

  // rnnt_greedy
  m.def("rnnt_greedy", &voicechat::rnnt_greedy, py::arg("enc_proj"), py::arg("embed"), py::arg("lstm"), py::arg("pred_w"),
        py::arg("pred_b"), py::arg("out_w"), py::arg("out_b"), py::arg("blank_id"), py::arg("max_symbols"), py::arg("threads") = 0,
        py::arg("stream") = py::none(),
        "Greedy RNNT decode of every frame: enc_proj [F, J] (the joint's encoder projection), embed [V+1, H], "
        "lstm = [Wx0, Wh0, b0, Wx1, ...], pred_w [J, H], pred_b [J], out_w [V+1, J], out_b [V+1] -> "
        "[F, max_symbols] int32 tokens per frame, -1 padded. Runs on `stream` (a CPU stream; default: the "
        "default CPU stream). `threads`: worker threads (0: by the model's size, up to half the cores); any "
        "count gives the same tokens.");
  m.def("rnnt_greedy_from", &voicechat::rnnt_greedy_from, py::arg("enc_proj"), py::arg("embed"), py::arg("lstm"), py::arg("pred_w"),
        py::arg("pred_b"), py::arg("out_w"), py::arg("out_b"), py::arg("blank_id"), py::arg("max_symbols"),
        py::arg("threads") = 0, py::arg("stream") = py::none(), py::arg("state") = py::none(),
        py::arg("last") = py::none(),
        "rnnt_greedy from a given prediction-network state [2, layers, H] (h, then c; float32) and last emitted "
        "token [1] (blank: none yet); both default to the utterance's start. Returns [table, state, last]: "
        "decoding frames in pieces, each from the state and last token the one before ended with, gives the "
        "tokens of one call over every frame.");
  m.def("rnnt_greedy_streams", &voicechat::rnnt_greedy_streams, py::arg("enc_projs"), py::arg("embed"), py::arg("lstm"),
        py::arg("pred_w"), py::arg("pred_b"), py::arg("out_w"), py::arg("out_b"), py::arg("blank_id"),
        py::arg("max_symbols"), py::arg("threads") = 0, py::arg("stream") = py::none(),
        py::arg("states") = std::vector<mlx::core::array>{}, py::arg("lasts") = std::vector<mlx::core::array>{},
        "rnnt_greedy_from over several streams at once (enc_projs: each stream's [F_i, J]; states, lasts: where "
        "each starts, or none for all at the utterance's start), one weight pass a step for all of them. Returns "
        "[table, state, last] of each stream in turn; each stream gets the tokens it gets alone.");

  // mamba_scan
  m.def("mamba_scan", &voicechat::mamba_scan, py::arg("x"), py::arg("dt"), py::arg("A_log"), py::arg("B"), py::arg("C"),
        py::arg("D"), py::arg("dt_bias"), py::arg("state") = py::none(), py::arg("lo") = 0.0f,
        py::arg("hi") = std::numeric_limits<float>::infinity(), py::arg("method") = "auto", py::arg("stream") = py::none(),
        "Mamba-2 selective scan over L positions from `state` (zeros when None): (y [b, L, H, P] in x's "
        "dtype, final state [b, H, P, N] float32).");
  m.def("mamba_scan_packed", &voicechat::mamba_scan_packed, py::arg("xbc"), py::arg("dt_src"), py::arg("dt_offset"),
        py::arg("A_log"), py::arg("D"), py::arg("dt_bias"), py::arg("state"), py::arg("heads"),
        py::arg("head_dim"), py::arg("groups"), py::arg("state_size"), py::arg("lo") = 0.0f,
        py::arg("hi") = std::numeric_limits<float>::infinity(), py::arg("method") = "auto", py::arg("stream") = py::none(),
        "mamba_scan on the mixer's packed buffers: xbc [b, L, H*P + 2*G*N] (x | B | C) and dt_src [b, L, W] "
        "with dt at columns [dt_offset, dt_offset + H).");
  m.def("mamba_conv_scan_step", &voicechat::mamba_conv_scan_step, py::arg("projected"), py::arg("conv_state"),
        py::arg("x_offset"), py::arg("conv_weight"), py::arg("conv_bias"), py::arg("dt_offset"), py::arg("A_log"),
        py::arg("D"), py::arg("dt_bias"), py::arg("state"), py::arg("heads"), py::arg("head_dim"), py::arg("groups"),
        py::arg("state_size"), py::arg("lo") = 0.0f, py::arg("hi") = std::numeric_limits<float>::infinity(),
        py::arg("gate_weight") = py::none(), py::arg("gate_offset") = 0, py::arg("stream") = py::none(),
        "causal_conv_silu then mamba_scan_packed for one decode position, in one CUDA launch: (y [b, 1, H*P], "
        "ssm state [b, H, P, N], conv state [b, K-1, C]), all float32. With gate_weight [H*P]: the gated group "
        "norm's input y * silu(gate) * gate_weight instead of y (gate at columns gate_offset..), and a fourth "
        "output, partials [b, 1, P'] whose G consecutive runs sum to each group's sum of (y * silu(gate))^2 "
        "(a quantized_matvec's prenormed input). CUDA streams only.");

  // causal_conv
  m.def("causal_conv_silu", &voicechat::causal_conv_silu, py::arg("conv_state"), py::arg("src"), py::arg("offset"),
        py::arg("weight"), py::arg("bias") = py::none(), py::arg("stream") = py::none(),
        "Causal depthwise conv (kernel K) of src[..., offset:offset + C] continuing from conv_state "
        "[b, K-1, C], then SiLU: (y [b, L, C] float32, next conv_state). One CUDA launch on a CUDA stream "
        "(float32 state and weights), MLX ops elsewhere.");

  // gated_rms_norm
  m.def("gated_rms_norm", &voicechat::gated_rms_norm, py::arg("y"), py::arg("gate_src"), py::arg("gate_offset"),
        py::arg("weight"), py::arg("groups"), py::arg("eps"), py::arg("stream") = py::none(),
        "RMSNorm over `groups` channel groups of y * silu(gate), times weight; the gate is read at columns "
        "[gate_offset, gate_offset + C) of gate_src. One CUDA launch (float32 math, float inputs of any "
        "width) on a CUDA stream, MLX ops elsewhere.");

  // gemv
  m.def("quantized_matvec", &voicechat::quantized_matvec, py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("biases"),
        py::arg("bias") = py::none(), py::arg("group_size") = 64, py::arg("bits") = 4,
        py::arg("residual") = py::none(), py::arg("activation") = "", py::arg("prenormed") = py::none(),
        py::arg("prenorm_groups") = 1, py::arg("norm_eps") = 1e-5f, py::arg("stream") = py::none(),
        "x @ dequantize(w).T (+ bias), then relu(.)^2 (activation='relu_squared') or + residual, for 1-2 "
        "rows of x: our CUDA kernel (one launch, the epilogue included) on a CUDA stream, "
        "mx.quantized_matmul and MLX ops elsewhere. prenormed: x is a norm's input already times its weight "
        "and prenormed [..., P] float32 partial sums of its squares (prenorm_groups equal channel groups, "
        "each over P / groups consecutive partials); each group is scaled by rsqrt(sum / group width + "
        "norm_eps) in the same launch.");
  m.def("quantized_matvec_emit_norm", &voicechat::quantized_matvec_emit_norm, py::arg("x"), py::arg("w"), py::arg("scales"),
        py::arg("biases"), py::arg("residual"), py::arg("next_norm"), py::arg("bias") = py::none(),
        py::arg("group_size") = 64, py::arg("bits") = 4, py::arg("prenormed") = py::none(),
        py::arg("prenorm_groups") = 1, py::arg("norm_eps") = 1e-5f, py::arg("stream") = py::none(),
        "[out, normed, partials]: out = x @ dequantize(w).T (+ bias) + residual, and the next RMSNorm's input "
        "left for its matvec: normed = out * next_norm (float32) and partials [..., P] (float32) whose sum "
        "is each row's sum of out^2 (pass both as that matvec's x and prenormed). One CUDA launch; MLX ops "
        "elsewhere (P = 1 there; on CUDA a partial a block or tile: stream_launch's partials where the "
        "streamed layout takes the shape).");
  m.def("dense_matvec", &voicechat::dense_matvec, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none(), py::arg("activation") = "", py::arg("input") = "",
        py::arg("sessions") = 1, py::arg("stream") = py::none(),
        "x @ w.T (+ bias), then the epilogue, for 1-2 rows of x: our CUDA kernel on a CUDA stream, MLX's "
        "matmul elsewhere (epilogue as quantized_matvec's). input='gelu_gate': x is [..., 2K] and "
        "gelu_tanh(x[..., :K]) * x[..., K:] is the product's input (formed as the kernel loads it). "
        "sessions=S: x's rows are S equal groups of 1-2 rows, each group's output the bits it has alone, "
        "in one launch.");
  m.def("dense_add_norm_matvec", &voicechat::dense_add_norm_matvec, py::arg("h"), py::arg("y").none(true), py::arg("post").none(true), py::arg("pre"),
        py::arg("eps"), py::arg("w"), py::arg("bias") = py::none(), py::arg("sessions") = 1,
        py::arg("stream") = py::none(),
        "[out, h'] with h' = h + rms_norm(y) * post and out = (rms_norm(h') * pre) @ w.T (+ bias): the "
        "sandwich-norm seam and the next dense matvec in one CUDA launch for 1-2 float32 rows; MLX ops elsewhere. "
        "post=None: h' = h + y; y=None (and post=None): h' = h, the input norm and the product. sessions=S: the "
        "rows are S equal groups of 1-2 in one launch, each group's bits those of its launch alone.");
  m.def("two_head_argmax", &voicechat::two_head_argmax, py::arg("x"), py::arg("head_a"), py::arg("head_b"),
        py::arg("group_size") = 64, py::arg("bits") = 4, py::arg("return_logits") = false,
        py::arg("stream") = py::none(),
        "argmax over both quantized heads (weight, scales, biases) in one pass: [ids int32 [..., 2]] "
        "or [ids, logits_a, logits_b]. On an sm_90 GPU one launch over both heads' 16-row slabs and a finish; "
        "MLX's ops elsewhere.");
  m.def("stream_launch", &stream_launch_dict, py::arg("k"), py::arg("n"), py::arg("x_float32") = true,
        py::arg("prenorm_groups") = 1, py::arg("rows") = 1,
        "The float streamed layout's launch as quantized_matvec picks it on an sm_90 GPU for `rows` rows of x "
        "(4-bit, group 64, bfloat16 scales): {threads, blocks, smem (dynamic bytes), stage_x, split (the parts "
        "a last-round tile is cut into), partials (the emitting kernel's partial sums a row of x)}; None "
        "where another layout takes the shape.");

  // add_rms_norm
  m.def("add_rms_norm_guided", &voicechat::add_rms_norm_guided, py::arg("h"), py::arg("y"), py::arg("post"), py::arg("pre"),
        py::arg("eps"), py::arg("guidance"), py::arg("stream") = py::none(),
        "The seam over a CFG pair h, y [2, 1, C] (row 0 conditioned), then z0 + guidance * (z0 - z1) of its "
        "normed output z: [1, 1, C]. One CUDA launch (float32, guidance >= 0) on a CUDA stream, MLX ops elsewhere.");
  m.def("add_rms_norm", &voicechat::add_rms_norm, py::arg("h"), py::arg("y"), py::arg("post"), py::arg("pre"), py::arg("eps"),
        py::arg("stream") = py::none(),
        "(h + rms_norm(y) * post, rms_norm(that) * pre) over the last axis: one CUDA launch (float32 h, "
        "post and pre; y of a float type) on a CUDA stream, MLX ops elsewhere.");

  // decode_attention
  m.def("decode_attention", &voicechat::decode_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("offset"),
        py::arg("scale"), py::kw_only(), py::arg("k_new") = py::none(), py::arg("v_new") = py::none(),
        py::arg("slot") = py::none(), py::arg("write_cache") = false, py::arg("chunked") = false,
        py::arg("stream") = py::none(),
        "Attention of one query q [B, H, 1, D] over the slots <= offset ([1] or one a row [B]) of K/V "
        "buffers [B, HK, CAP, D] (grouped heads), slot `slot` (as offset) read from k_new / v_new [B, HK, 1, "
        "D] when given: [B, 1, H * D] float32, in one CUDA launch while CAP <= 1024, two beyond (chunked=True: "
        "two at any CAP, so that a row's result does not depend on CAP); CUDA streams only. write_cache=True "
        "also stores k_new / v_new in `slot` of k and v in place (as decode_attention_qkv's write_cache).");
  m.def("decode_attention_qkv", &voicechat::decode_attention_qkv, py::arg("qkv"), py::arg("q_scale"), py::arg("k_scale"),
        py::arg("inv_freq"), py::arg("eps"), py::arg("k"), py::arg("v"), py::arg("offset"), py::arg("scale"),
        py::arg("slot"), py::arg("heads"), py::kw_only(), py::arg("write_cache") = false,
        py::arg("chunked") = false, py::arg("stream") = py::none(),
        "qkv_heads and decode_attention with a new key in one launch: from the stacked projection qkv "
        "[B, (heads + 2 HK) * D], q and the new key are RMS-normed per head (q_scale / k_scale) and rotated at "
        "`offset`; the new key and value are read in `slot` instead of the buffers k, v [B, HK, CAP, D]. Returns "
        "(out [B, 1, heads * D], k_new, v_new [B, HK, 1, D]) float32; CUDA streams only. write_cache=True also "
        "stores the new key and value in `slot` of k and v in place (they must be row-contiguous views of the "
        "cache's buffers, and nothing may read the slot's old contents later). offset and slot: [1], or [B] (a "
        "position and slot a row); chunked=True: two launches at any CAP.");

  // qkv_heads
  m.def("qkv_heads", &voicechat::qkv_heads, py::arg("qkv"), py::arg("q_scale"), py::arg("k_scale"), py::arg("inv_freq"),
        py::arg("offset"), py::arg("heads"), py::arg("kv_heads"), py::arg("batch"), py::arg("eps"),
        py::arg("stream") = py::none(),
        "(q, k, v) as [B, heads, T, D] float32 from the stacked projection qkv [B * T, (heads + 2 kv_heads) * D]: "
        "q and k RMS-normed per head (times q_scale / k_scale) and rotated (rotate-half RoPE, angle = "
        "(offset + t) * inv_freq[i]). One CUDA launch; CUDA streams only.");

  // code_embedding
  m.def("code_embedding", &voicechat::code_embedding, py::arg("code"), py::arg("table"), py::arg("weight"), py::arg("rows") = 1,
        py::arg("sessions") = 1, py::arg("stream") = py::none(),
        "One frame's code embedding: weight @ sum_q table[q * (K + 1) + code[q]] as [rows, 1, H] (the same row "
        "`rows` times). sessions=S: code [S, Q], a frame a session -> [S * rows, 1, H], each session's rows as "
        "alone. One CUDA launch on a CUDA stream (int32 codes, 1-2 rows), MLX ops elsewhere.");

  // mog_sample
  m.def("mog_sample", &voicechat::mog_sample, py::arg("y"), py::arg("h"), py::arg("u"), py::arg("noise"), py::arg("mus"),
        py::arg("low_mat"), py::arg("top_p"), py::arg("min_log_std"), py::arg("noise_scale"),
        py::arg("sessions") = 1, py::arg("stream") = py::none(),
        "One MoG draw: (z [L] float32, component [1] int32) from y = [logits N | log_std | rest L], the guided "
        "hidden h [H], uniforms u [N], normals noise [L], proj_mus.weight [N * R, H] and low_mat [N, L, R]. "
        "sessions=S: S rows of each, S draws in one launch ((z [S, L], component [S]), each draw as alone). "
        "One CUDA launch; CUDA streams only.");

  // rvq_search
  m.def("rvq_search", &voicechat::rvq_search, py::arg("residual"), py::arg("codebooks"), py::arg("norms"), py::arg("start"),
        py::arg("count"), py::arg("method") = "auto", py::kw_only(), py::arg("into") = py::none(),
        py::arg("stream") = py::none(),
        "Sequential residual quantization over codebooks [start, start + count): (codes [B, count] int32, "
        "residual [B, D] float32); with into [B, Q] (the codes so far), the codes are those rows with "
        "[start, start + count) replaced.");
}

}  // namespace voicechat
