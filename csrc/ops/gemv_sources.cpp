// The GEMV family's CUDA sources: the device code of csrc/kernels/gemv put together for each kernel
// (a header holds only the parts its kernel uses: MLX-CUDA hashes a kernel's whole text at every
// launch), with one instance for each shape and type the model launches.
#include "ops/gemv_sources.h"

#include <string>
#include <utility>
#include <vector>

#include "jit_sources.h"

namespace voicechat::gemv {
namespace {

using TemplateArg = std::pair<std::string, std::string>;

// One instance of vc_qmv. tb: the Linear bias' type, or nullptr for none (the kernel then gets
// `scales` in its place); epi: 0 plain, 1 + residual (of the output's type), 2 squared ReLU
// (vc_gemv::finish); np > 0: an input normalized by its producer, np partial sums in ng groups (NORM
// 2, vc_gemv::qmv_block; the kernel gets `scales` in their place otherwise).
CudaInstance qmv_instance(const char* tx, const char* ts, const char* to, int bits, int group, int k, int n, int m,
                          int rows, int threads, const char* tb = nullptr, int epi = 0, int np = 0, int ng = 1) {
  const char* bias_type = tb ? tb : ts;
  const char* residual_type = epi == 1 ? to : ts;
  const char* norm_type = np > 0 ? "float" : ts;
  return CudaInstance{
      {tx, "uint32_t", ts, ts, bias_type, residual_type, norm_type},
      {to},
      {TemplateArg{"BITS", int_arg(bits)}, TemplateArg{"GROUP", int_arg(group)}, TemplateArg{"K", int_arg(k)},
       TemplateArg{"N", int_arg(n)}, TemplateArg{"M", int_arg(m)}, TemplateArg{"ROWS", int_arg(rows)},
       TemplateArg{"THREADS", int_arg(threads)}, TemplateArg{"EPI", int_arg(epi)},
       TemplateArg{"HAS_BIAS", tb ? "bool:true" : "bool:false"}, TemplateArg{"NORM", int_arg(np > 0 ? 2 : 0)},
       TemplateArg{"EPS_BITS", int_arg(float_bits(1e-5f))}, TemplateArg{"NP", int_arg(np)},
       TemplateArg{"NG", int_arg(ng)}, TemplateArg{"TX", type_arg(tx)}, TemplateArg{"TS", type_arg(ts)},
       TemplateArg{"TB", type_arg(bias_type)}, TemplateArg{"TR", type_arg(residual_type)},
       TemplateArg{"TN", type_arg(norm_type)}, TemplateArg{"TO", type_arg(to)}}};
}

// One instance of vc_qmv_emit: a + residual matvec (of the output's type) that also writes the next
// norm's input with weight type te; its own input plain (np = 0) or normalized by its producer.
CudaInstance qmv_emit_instance(const char* tx, const char* ts, const char* to, int k, int n, int m, int rows,
                               int threads, const char* te, int np = 0, int ng = 1) {
  const char* tn = np > 0 ? "float" : ts;
  return CudaInstance{
      {tx, "uint32_t", ts, ts, ts, to, tn, te},
      {to, "float", "float"},
      {TemplateArg{"BITS", "int:4"}, TemplateArg{"GROUP", "int:64"}, TemplateArg{"K", int_arg(k)},
       TemplateArg{"N", int_arg(n)}, TemplateArg{"M", int_arg(m)}, TemplateArg{"ROWS", int_arg(rows)},
       TemplateArg{"THREADS", int_arg(threads)}, TemplateArg{"HAS_BIAS", "bool:false"},
       TemplateArg{"NORM", int_arg(np > 0 ? 2 : 0)}, TemplateArg{"NP", int_arg(np)}, TemplateArg{"NG", int_arg(ng)},
       TemplateArg{"EPS_BITS", int_arg(float_bits(1e-5f))},
       TemplateArg{"TX", type_arg(tx)}, TemplateArg{"TS", type_arg(ts)}, TemplateArg{"TB", type_arg(ts)},
       TemplateArg{"TR", type_arg(to)}, TemplateArg{"TN", type_arg(tn)}, TemplateArg{"TE", type_arg(te)},
       TemplateArg{"TO", type_arg(to)}}};
}

// One instance of vc_dense_mv (EPI as qmv_instance's; PRO 1: a gated-GELU input).
CudaInstance dense_instance(const char* tx, const char* tw, const char* tb, const char* to, int k,
                            int n, int m, int rows, int threads, bool has_bias, int epi = 0, int pro = 0,
                            int sessions = 1) {
  const char* residual_type = epi == 1 ? to : tw;
  return CudaInstance{
      {tx, tw, tb, residual_type},
      {to},
      {TemplateArg{"K", int_arg(k)}, TemplateArg{"N", int_arg(n)}, TemplateArg{"M", int_arg(m)},
       TemplateArg{"ROWS", int_arg(rows)}, TemplateArg{"THREADS", int_arg(threads)}, TemplateArg{"EPI", int_arg(epi)},
       TemplateArg{"PRO", int_arg(pro)}, TemplateArg{"HAS_BIAS", has_bias ? "bool:true" : "bool:false"},
       TemplateArg{"SESSIONS", int_arg(sessions)},
       TemplateArg{"TX", type_arg(tx)}, TemplateArg{"TW", type_arg(tw)}, TemplateArg{"TB", type_arg(tb)}, TemplateArg{"TR", type_arg(residual_type)},
       TemplateArg{"TO", type_arg(to)}}};
}

// The headers of the kernel families: each only the parts of csrc/kernels/gemv its kernels use (a
// kernel's whole text costs host time at every launch; see cuda_sources.h).
std::string quant_header() {
  return std::string(jit::gemv::common) + jit::gemv::pair + jit::gemv::block_qmv;
}
std::string dense_header() { return std::string(jit::gemv::common) + jit::gemv::block_dense; }
std::string stream_header() {
  return std::string(jit::gemv::common) + jit::gemv::persistent + jit::gemv::stream;
}
std::string imma_stream_header() { return stream_header() + jit::gemv::imma + jit::gemv::imma_stream; }

}  // namespace

const CudaSource& qmv_source() {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w"},
      {"out"},
      jit::gemv::vc_qmv_body,
      quant_header(),
      {
          // The Nemotron-H projections (N, K) and the heads, 4-bit group 64, bf16 scales, as the block
          // layout takes them (two rows of x; one row below the persistent layouts' shapes).
          qmv_instance(f, bf, f, 4, 64, 4480, 22656, 2, 8, 160),                  // mamba in_proj
          qmv_instance(bf, bf, bf, 4, 64, 4480, 22656, 2, 8, 160),
          qmv_instance(f, bf, f, 4, 64, 10240, 4480, 2, 8, 160, nullptr, 1),      // mamba out_proj (+ residual)
          qmv_instance(f, bf, f, 4, 64, 15680, 4480, 2, 8, 256, nullptr, 1),      // mlp down_proj (+ residual)
          qmv_instance(f, bf, f, 4, 64, 4480, 15680, 2, 8, 160, nullptr, 2),      // mlp up_proj (squared ReLU)
          qmv_instance(f, bf, f, 4, 64, 4480, 1024, 1, 2, 160),                   // attention k_proj / v_proj
          qmv_instance(f, bf, f, 4, 64, 5120, 4480, 1, 8, 160),                   // attention o_proj
          qmv_instance(f, bf, f, 4, 64, 4480, 131072, 1, 8, 160),                 // a head
          // Inputs normalized by their producer (vc_qmv_emit, vc_qmv_stream_emit): q/k/v stacked after an
          // MLP down_proj (656 partials), in_proj after a two-row mamba out_proj (560)
          qmv_instance(f, bf, f, 4, 64, 4480, 7168, 1, 8, 160, nullptr, 0, 656),
          qmv_instance(f, bf, f, 4, 64, 4480, 22656, 2, 8, 160, nullptr, 0, 560),
          qmv_instance(f, bf, f, 4, 64, 10240, 4480, 2, 8, 320, nullptr, 1, 640, 8),  // a group-normed input
          // The other packings, dtypes and a Linear bias.
          qmv_instance(f, bf, f, 8, 64, 4480, 5120, 2, 8, 160),
          qmv_instance("__half", "__half", "__half", 4, 32, 4480, 1000, 1, 2, 64),
          qmv_instance(bf, f, f, 8, 128, 1152, 1, 2, 1, 96),
          qmv_instance(f, bf, f, 4, 64, 4480, 5120, 2, 8, 160, f),
      },
  });
  return src;
}

const CudaSource& qmv_emit_source() {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_emit",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w", "next_w"},
      {"out", "normed", "partials"},
      jit::gemv::vc_qmv_emit_body,
      quant_header(),
      {
          // mamba out_proj on the conv + scan's gated output (640 partials in 8 groups), MLP down_proj,
          // attention o_proj (two rows of x, or one); a bfloat16 x and norm weight
          qmv_emit_instance(f, bf, f, 10240, 4480, 2, 8, 320, f, 640, 8),
          qmv_emit_instance(f, bf, f, 15680, 4480, 2, 8, 256, f),
          qmv_emit_instance(f, bf, f, 5120, 4480, 1, 8, 160, f),
          qmv_emit_instance(bf, bf, f, 4480, 1000, 1, 4, 160, bf),
      },
  });
  return src;
}

namespace {

// One instance of a persistent 4-bit kernel (vc_qmv_stream / vc_qmv_imma_stream; emit: their _emit
// twin), group 64 with bfloat16 scales, a float32 output: `layout` its leading template args (the
// layout's own), np > 0 an input normalized by its producer (np partials in ng groups); epi as
// qmv_instance's (emit: + residual).
CudaInstance persistent_instance(bool emit, const char* tx, std::vector<TemplateArg> layout, int epi, int np, int ng) {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  const char* residual_type = emit || epi == 1 ? f : bf;
  const char* norm_type = np > 0 ? f : bf;
  CudaInstance inst{{tx, "uint32_t", bf, bf, bf, residual_type, norm_type}, {f}, {}};
  std::vector<TemplateArg> args = std::move(layout);
  if (!emit) {
    args.push_back({"EPI", int_arg(epi)});
  }
  args.insert(args.end(), {{"HAS_BIAS", "bool:false"}, {"NORM", int_arg(np > 0 ? 2 : 0)}, {"NP", int_arg(np)},
                           {"NG", int_arg(ng)}, {"EPS_BITS", int_arg(float_bits(1e-5f))}, {"TX", type_arg(tx)},
                           {"TS", type_arg(bf)}, {"TB", type_arg(bf)}, {"TR", type_arg(residual_type)},
                           {"TN", type_arg(norm_type)}});
  if (emit) {
    inst.input_types.push_back(f);
    inst.output_types = {f, f, f};
    args.push_back({"TE", type_arg(f)});
  }
  args.push_back({"TO", type_arg(f)});
  inst.template_args = args;
  return inst;
}

// vc_qmv_stream's instances: one row of x, 8-row tiles, 2 stages (pick_stream's), the threads, x's
// staging (XS) and the last round's parts (SPLIT) as pick_stream picks them at that shape.
CudaInstance qmv_stream_instance(bool emit, const char* tx, int k, int n, int threads, int xs, int split, int epi = 0,
                                 int np = 0, int ng = 1, int m = 1) {
  return persistent_instance(emit, tx,
                             {{"GROUP", int_arg(64)}, {"K", int_arg(k)}, {"N", int_arg(n)}, {"M", int_arg(m)},
                              {"ROWS", int_arg(8)}, {"THREADS", int_arg(threads)}, {"STAGES", int_arg(2)},
                              {"XS", int_arg(xs)}, {"SPLIT", int_arg(split)}},
                             epi, np, ng);
}

}  // namespace

const CudaSource& qmv_stream_source() {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_stream",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w"},
      {"out"},
      jit::gemv::vc_qmv_stream_body,
      stream_header(),
      {
          // the MLP down_proj (+ residual; its last round in 4 parts), the mamba out_proj on the conv +
          // scan's gated output (640 partials in 8 groups) with bfloat16 x (not staged)
          qmv_stream_instance(false, f, 15680, 4480, 512, 1, 4, 1),
          qmv_stream_instance(false, bf, 10240, 4480, 320, 0, 1, 0, 640, 8),
      }, /*cluster*/ 1, /*threads_arg*/ "THREADS",
  });
  return src;
}

const CudaSource& qmv_stream_emit_source() {
  const char* f = "float";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_stream_emit",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w", "next_w"},
      {"out", "normed", "partials"},
      jit::gemv::vc_qmv_stream_emit_body,
      stream_header(),
      {
          // the step's mamba out_proj on the conv + scan's gated output (640 partials in 8 groups) and
          // MLP down_proj; the same for sessions stepped together (out_proj at 2 and 4 rows, down_proj
          // at 2: it takes 4 as two launches of 2)
          qmv_stream_instance(true, f, 10240, 4480, 320, 1, 1, 0, 640, 8),
          qmv_stream_instance(true, f, 15680, 4480, 512, 1, 4),
          qmv_stream_instance(true, f, 10240, 4480, 320, 0, 1, 0, 640, 8, 2),
          qmv_stream_instance(true, f, 10240, 4480, 320, 0, 1, 0, 640, 8, 4),
          qmv_stream_instance(true, f, 15680, 4480, 512, 0, 4, 0, 0, 1, 2),
      }, /*cluster*/ 1, /*threads_arg*/ "THREADS",
  });
  return src;
}

namespace {

// vc_qmv_imma_stream's instances: 8 warps, 2 stages (pick_imma_stream's at K = 4480).
CudaInstance qmv_imma_stream_instance(bool emit, const char* tx, int k, int n, int m, int epi = 0, int np = 0,
                                      int ng = 1) {
  return persistent_instance(emit, tx,
                             {{"K", int_arg(k)}, {"N", int_arg(n)}, {"M", int_arg(m)}, {"WARPS", int_arg(8)},
                              {"STAGES", int_arg(2)}},
                             epi, np, ng);
}

}  // namespace

const CudaSource& qmv_imma_stream_source() {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_imma_stream",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w"},
      {"out"},
      jit::gemv::vc_qmv_imma_stream_body,
      imma_stream_header(),
      {
          // mamba in_proj and mlp up_proj (squared ReLU) on a streamed out_proj's emitted norm input (560
          // partials); plain bfloat16 x
          qmv_imma_stream_instance(false, f, 4480, 22656, 1, 0, 560),
          qmv_imma_stream_instance(false, f, 4480, 15680, 1, 2, 560),
          qmv_imma_stream_instance(false, bf, 4480, 22656, 1),
          // the up_proj for 4 sessions stepped together (two MMAs a group, the slab's end in two turns)
          qmv_imma_stream_instance(false, f, 4480, 15680, 4, 2, 560),
      }, /*cluster*/ 1, /*threads_arg*/ "WARPS", /*threads_scale*/ 32,
  });
  return src;
}

const CudaSource& qmv_imma_stream_emit_source() {
  const char* f = "float";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_imma_stream_emit",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w", "next_w"},
      {"out", "normed", "partials"},
      jit::gemv::vc_qmv_imma_stream_emit_body,
      imma_stream_header(),
      {qmv_imma_stream_instance(true, f, 4480, 22656, 1, 0, 560)}, /*cluster*/ 1, /*threads_arg*/ "WARPS", /*threads_scale*/ 32,
  });
  return src;
}

namespace {

// The two-head argmax on the streamed integer-MMA walk (kImmaStreamArgmaxSource): the LLM's lm_head and
// function_head (131072 rows each), 1, 2 or 4 rows of x, 8 warps, 2 stages.
}  // namespace

const CudaSource& imma_stream_argmax_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](const char* tx, const char* to, int m, bool logits) {
    const char* bf = "__nv_bfloat16";
    return CudaInstance{{tx, "uint32_t", bf, bf, "uint32_t", bf, bf},
                        {"int64_t", to},
                        {P{"K", "int:4480"}, P{"N", "int:262144"}, P{"M", int_arg(m)}, P{"WARPS", "int:8"},
                         P{"STAGES", "int:2"}, P{"WRITE_LOGITS", logits ? "bool:true" : "bool:false"},
                         P{"TX", type_arg(tx)}, P{"TS", type_arg(bf)}, P{"TO", type_arg(to)}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_two_head_argmax_stream",
      {"x", "weight_a", "scales_a", "biases_a", "weight_b", "scales_b", "biases_b"},
      {"keys", "logits"},
      jit::gemv::vc_two_head_argmax_stream_body,
      imma_stream_header(),
      {inst("float", "float", 1, false), inst("__nv_bfloat16", "__nv_bfloat16", 1, true),
       inst("float", "float", 2, true), inst("float", "float", 4, false)}, /*cluster*/ 1, /*threads_arg*/ "WARPS", /*threads_scale*/ 32,
  });
  return src;
}

const CudaSource& dense_source() {
  auto inst = [](auto... args) { return dense_instance(args...); };
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_dense_mv",
      {"x", "weight", "bias", "residual"},
      {"out"},
      jit::gemv::vc_dense_mv_body,
      dense_header(),
      {
          // TTS backbone (batch 2: the two CFG rows), MoG head, codec-side projections.
          inst(f, bf, bf, f, 1152, 1152, 2, 2, 160, false),   // attention q/k/v/o
          inst(f, bf, bf, f, 1152, 1152, 2, 2, 160, false, 1),  // attention o (+ residual)
          inst(f, bf, bf, f, 1152, 4608, 2, 4, 160, false, 2),  // squared ReLU
          inst(f, bf, bf, f, 1152, 4608, 2, 4, 160, false),   // mlp gate / up
          inst(f, bf, bf, f, 4608, 1152, 2, 2, 192, false),   // mlp down
          inst(f, bf, bf, f, 4608, 1152, 2, 4, 192, false, 0, 1),  // mlp down on gate / up (gated GELU)
          inst(bf, bf, bf, bf, 4608, 1152, 1, 2, 192, false),
          inst(f, bf, bf, f, 1152, 65536, 1, 4, 160, false),  // MoG proj_mus
          inst(f, bf, bf, f, 1152, 1, 2, 1, 160, false),      // MoG proj_logs (N = 1)
          inst(f, bf, bf, f, 1152, 1152, 1, 2, 160, true),    // gated fusion (with bias)
          inst(f, f, f, f, 1024, 4480, 1, 4, 256, true),      // float32 weights
          inst("__half", "__half", "__half", "__half", 640, 2560, 2, 2, 96, true),
          // sessions' CFG pairs in one launch: attention o (+ residual), mlp down on gate / up
          inst(f, bf, bf, f, 1152, 1152, 2, 2, 160, false, 1, 0, 8),
          inst(f, bf, bf, f, 4608, 1152, 2, 4, 192, false, 0, 1, 8),
      },
  });
  return src;
}

const CudaSource& dense_add_norm_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int k, int n, int m, int rows, int threads, bool has_bias, const char* tw, const char* tb,
                 int seam = 0, int sessions = 1) {
    return CudaInstance{{"float", "float", "float", "float", tw, tb},
                        {"float", "float"},
                        {P{"K", int_arg(k)}, P{"N", int_arg(n)}, P{"M", int_arg(m)}, P{"ROWS", int_arg(rows)},
                         P{"THREADS", int_arg(threads)}, P{"HAS_BIAS", has_bias ? "bool:true" : "bool:false"},
                         P{"SEAM", int_arg(seam)}, P{"EPS_BITS", int_arg(float_bits(1e-6f))},
                         P{"TW", type_arg(tw)}, P{"TB", type_arg(tb)}, P{"TO", "type:float"},
                         P{"SESSIONS", int_arg(sessions)}}};
  };
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_dense_add_norm",
      {"h", "y", "post", "pre", "weight", "bias"},
      {"out", "h_out"},
      jit::gemv::vc_dense_add_norm_body,
      block_reduce_header() + dense_header(),
      {
          // The TTS (CFG batch 2): into gate/up (backbone and MoG) and into the next layer's q/k/v.
          inst(1152, 9216, 2, 8, 160, false, bf, bf),
          inst(1152, 3456, 2, 8, 160, false, bf, bf),
          inst(200, 24, 1, 4, 32, true, "float", "float"),
          // the MoG head's first gate/up on hidden + code embedding (or the hidden states alone), and
          // the backbone's first q/k/v behind its input norm
          inst(1152, 9216, 2, 8, 160, false, bf, bf, 1),
          inst(1152, 9216, 2, 8, 160, false, bf, bf, 2),
          inst(1152, 3456, 2, 8, 160, false, bf, bf, 2),
          // sessions' CFG pairs in one launch
          inst(1152, 9216, 2, 8, 160, false, bf, bf, 0, 8),
      },
  });
  return src;
}

const CudaSource& argmax_finish_source() {
  using P = std::pair<std::string, std::string>;
  static const CudaSource& src = register_cuda_source({
      "vc_argmax_finish",
      {"keys"},
      {"ids"},
      jit::gemv::vc_argmax_finish_body,
      "",
      {CudaInstance{{"int64_t"}, {"int32_t"}, {P{"NB", "int:16384"}, P{"THREADS", "int:256"}}},
       CudaInstance{{"int64_t"}, {"int32_t"}, {P{"NB", "int:3"}, P{"THREADS", "int:256"}}}},
  });
  return src;
}

VC_CUDA_SOURCES(qmv_source,
                qmv_emit_source,
                qmv_stream_source,
                qmv_stream_emit_source,
                qmv_imma_stream_source,
                qmv_imma_stream_emit_source,
                imma_stream_argmax_source,
                argmax_finish_source,
                dense_source,
                dense_add_norm_source);

}  // namespace voicechat::gemv
