// Decode-speed matrix-vector products: 1-2 rows of activations against a large weight.
//
//   quantized_matvec : x @ dequant(w).T for MLX's affine 4- / 8-bit packing (group 32/64/128)
//   dense_matvec     : x @ w.T for bfloat16 / float16 / float32 weights
//   two_head_argmax  : argmax of x @ dequant(w_a).T and of x @ dequant(w_b).T (the LLM's lm_head
//                      and function_head) without writing the logits (unless asked to)
//
// CUDA: our kernels (gemv_cuda.h) through fast::cuda_kernel, activations float32 or bfloat16 at
// the same speed, float32 accumulation. Everywhere else, and for shapes the kernels do not
// cover, MLX's own ops (which are also the references).
#include <deque>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "cuda_sources.h"
#include "gemv_cuda.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "mlx_caster.h"
#include "registry.h"

namespace py = pybind11;
namespace mx = mlx::core;

namespace voicechat {
namespace {

// ---------------------------------------------------------------- launch shapes

constexpr int kMaxRows = 2;        // input rows the kernels take (decode: batch 1, or 2)
constexpr int kMaxRowGroups = 64;  // the block layout's row groups a block (quantized_matvec's row_groups)
// quantized_matvec's dp4a: x in 3 or 4 int8 terms (vc_stream::qmv_stream's LEVELS; 1-2 terms, 6 or 13 bits,
// would fall short of float32 products)
constexpr int kMinDp4aLevels = 3, kMaxDp4aLevels = 4;
// Whether dp4a is one quantized_matvec takes: -1 (or below) the pair form, 0 the default, 3 or 4 terms.
bool dp4a_taken(int dp4a) { return dp4a <= 0 || (dp4a >= kMinDp4aLevels && dp4a <= kMaxDp4aLevels); }
// The float streamed layout's default product for one row of x: integer dot products with x in 4 int8
// terms (27 bits below each 32 values' largest |x|, as the integer MMA's expansion), against the
// pair form's 5 instructions a pair of weights. Nsight Compute on the H200 (2026-12-04, f32 x, one
// row; two machines): the MLP down_proj 16.74 -> 15.20 / 15.07 us (3 terms: 15.01), the mamba
// out_proj 13.15 -> 11.78 / 11.68 (3: 11.14). Two rows keep the pair form (not measured).
constexpr int kDefaultDp4aLevels = 4;
constexpr int kSmCount = 132;      // H100 / H200; only steers how many rows a block takes
// Row groups a two-head argmax block walks. 1: each block a matvec block of the plain layout (8
// rows), its loads not waiting on the block sum of the group before (8 groups of 4 rows a block
// streamed the heads at 1.8 TB/s in the H200 step, the plain matvec at 2.4).
constexpr int kArgmaxGroupsPerBlock = 1;
constexpr int kArgmaxRows = 8;

struct Launch {
  int rows;     // output rows per block (block layout) or per warp (warp layout)
  int threads;  // threads per block
  int warps;    // 0: block layout (the block's threads split K); > 0: warp layout, warps per block
  int row_groups = 1;  // block layout: groups of `rows` rows a block, one after the other
};

// The default layout: 0 = block; > 0 = warp layout with that many warps per block. Block: in the
// H200 launch sweep (bench_gemv.py --sweep, float32 x, 2026-11-30) the warp layout won no 4-bit
// LLM shape by more than the run-to-run noise (~10%), and lost most.
constexpr int kWarpLayoutWarps = 0;

// Block layout. Threads: enough to cover a row's 16-byte chunks in ceil(chunks / 256) steps, in
// whole warps (K = 4480 at 4 bits: 140 chunks -> 160 threads, one step). Rows per block: 8 (each
// chunk of x loaded serves 8 weight rows: fewer instructions per weight byte), fewer when that
// would leave under ~2 blocks per SM. Same sweep, 8 rows against 4: in_proj 22656x4480 1404 vs
// 975 GB/s, 15680x4480 1065 vs 889, out_proj 4480x10240 748 vs 676, 5120x4480 497 vs 431; dense
// 65536x1152 2538 vs 2309; 1024x4480 147 (2 rows) vs 95 (1 row, the old default).
// Warp layout (`warps` > 0, or < 0 while kWarpLayoutWarps > 0): each warp takes `rows` rows alone,
// 4 unless that would leave under ~8 warps per SM.
Launch pick_launch(int chunks, int n, int rows_override, int threads_override, int warps_override) {
  if (warps_override < 0) {
    warps_override = kWarpLayoutWarps;
  }
  Launch l{warps_override > 0 ? 4 : 8, 0, warps_override};
  if (l.warps > 0) {
    l.threads = 32 * l.warps;
    while (l.rows > 1 && (n + l.rows - 1) / l.rows < 8 * kSmCount) {
      l.rows /= 2;
    }
  } else {
    const int steps = (chunks + 255) / 256;
    l.threads = 32 * ((chunks + 32 * steps - 1) / (32 * steps));
    while (l.rows > 1 && (n + l.rows - 1) / l.rows < 2 * kSmCount) {
      l.rows /= 2;
    }
    if (threads_override > 0) {
      l.threads = threads_override;
    }
  }
  if (rows_override > 0) {
    l.rows = rows_override;
  }
  if (l.rows != 1 && l.rows != 2 && l.rows != 4 && l.rows != 8) {
    throw std::invalid_argument("gemv: rows_per_block must be 1, 2, 4 or 8");
  }
  if (l.threads % 32 != 0 || l.threads < 32 || l.threads > 512) {
    throw std::invalid_argument("gemv: threads must be a multiple of 32 in [32, 512] (warps in [1, 16])");
  }
  return l;
}

// Blocks of a launch over n output rows.
int blocks_for(const Launch& l, int n) {
  const int rows_per_group = l.warps > 0 ? l.rows * l.warps : l.rows;
  const int groups = (n + rows_per_group - 1) / rows_per_group;
  return (groups + l.row_groups - 1) / l.row_groups;
}

// ---------------------------------------------------------------- CUDA sources

using TemplateArg = std::pair<std::string, std::string>;


// One instance of vc_qmv (split "THREADS": threads per block) or vc_qmv_warp (split "WARPS":
// warps per block). tb: the Linear bias' type, or nullptr for none (the kernel then gets `scales`
// in its place); epi: 0 plain, 1 + residual (of the output's type), 2 squared ReLU
// (vc_gemv::finish); tn (block layout only): the RMSNorm prologue's weight type, or nullptr for
// none (the kernel then gets `scales` for the weight and the eps); np > 0 (with tn "float"): an
// input normalized by its producer, np partial sums in ng groups (NORM 2, vc_gemv::qmv_block); rg
// (block layout only): row groups a block.
CudaInstance qmv_instance(const char* split, const char* tx, const char* ts, const char* to, int bits, int group, int k,
                          int n, int m, int rows, int split_count, const char* tb = nullptr, int epi = 0,
                          const char* tn = nullptr, int np = 0, int ng = 1, int rg = 1) {
  const char* bias_type = tb ? tb : ts;
  const char* residual_type = epi == 1 ? to : ts;
  CudaInstance inst{
      {tx, "uint32_t", ts, ts, bias_type, residual_type},
      {to},
      {TemplateArg{"BITS", int_arg(bits)}, TemplateArg{"GROUP", int_arg(group)}, TemplateArg{"K", int_arg(k)},
       TemplateArg{"N", int_arg(n)}, TemplateArg{"M", int_arg(m)}, TemplateArg{"ROWS", int_arg(rows)},
       TemplateArg{split, int_arg(split_count)}, TemplateArg{"EPI", int_arg(epi)},
       TemplateArg{"HAS_BIAS", tb ? "bool:true" : "bool:false"}, TemplateArg{"TX", type_arg(tx)},
       TemplateArg{"TS", type_arg(ts)}, TemplateArg{"TB", type_arg(bias_type)},
       TemplateArg{"TR", type_arg(residual_type)}, TemplateArg{"TO", type_arg(to)}}};
  if (std::string(split) == "THREADS") {  // the block layout's RMSNorm prologue
    const char* norm_type = tn ? tn : ts;
    inst.input_types.push_back(norm_type);
    inst.template_args.push_back(TemplateArg{"NORM", int_arg(tn ? (np > 0 ? 2 : 1) : 0)});
    inst.template_args.push_back(TemplateArg{"EPS_BITS", int_arg(float_bits(1e-5f))});
    inst.template_args.push_back(TemplateArg{"NP", int_arg(np)});
    inst.template_args.push_back(TemplateArg{"NG", int_arg(ng)});
    inst.template_args.push_back(TemplateArg{"TN", type_arg(norm_type)});
    inst.template_args.push_back(TemplateArg{"RG", int_arg(rg)});
  }
  return inst;
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

// One instance of vc_dense_mv / vc_dense_mv_warp (split as qmv_instance's).
CudaInstance dense_instance(const char* split, const char* tx, const char* tw, const char* tb, const char* to, int k,
                            int n, int m, int rows, int split_count, bool has_bias, int epi = 0, int pro = 0) {
  const char* residual_type = epi == 1 ? to : tw;
  return CudaInstance{
      {tx, tw, tb, residual_type},
      {to},
      {TemplateArg{"K", int_arg(k)}, TemplateArg{"N", int_arg(n)}, TemplateArg{"M", int_arg(m)},
       TemplateArg{"ROWS", int_arg(rows)}, TemplateArg{split, int_arg(split_count)}, TemplateArg{"EPI", int_arg(epi)},
       TemplateArg{"PRO", int_arg(pro)}, TemplateArg{"HAS_BIAS", has_bias ? "bool:true" : "bool:false"},
       TemplateArg{"TX", type_arg(tx)}, TemplateArg{"TW", type_arg(tw)}, TemplateArg{"TB", type_arg(tb)}, TemplateArg{"TR", type_arg(residual_type)},
       TemplateArg{"TO", type_arg(to)}}};
}

// The headers of the kernel families: each only the parts of gemv_cuda.h its kernels use (a
// kernel's whole text costs host time at every launch; see cuda_sources.cpp).
std::string quant_header() {
  return std::string(gemv_cuda::kCommonHeader) + gemv_cuda::kPairHeader + gemv_cuda::kQmvHeader;
}
std::string dense_header() { return std::string(gemv_cuda::kCommonHeader) + gemv_cuda::kDenseHeader; }

const CudaSource& qmv_source() {
  auto inst = [](auto... args) { return qmv_instance("THREADS", args...); };
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w"},
      {"out"},
      gemv_cuda::kQmvSource,
      quant_header(),
      {
          // The Nemotron-H projections (N, K) and the heads, 4-bit group 64, bf16 scales (up_proj
          // 15680 x 4480 and q_proj 5120 x 4480 differ from in_proj only in N).
          inst(f, bf, f, 4, 64, 4480, 22656, 1, 8, 160, nullptr, 0, f),  // mamba in_proj after its RMSNorm
          inst(f, bf, f, 4, 64, 4480, 15680, 1, 8, 160, nullptr, 2, f),  // mlp up_proj: RMSNorm, squared ReLU
          inst(f, bf, f, 4, 64, 4480, 22656, 1, 4, 160),    // mamba in_proj
          inst(bf, bf, bf, 4, 64, 4480, 22656, 2, 4, 160),
          inst(f, bf, f, 4, 64, 10240, 4480, 1, 4, 160, nullptr, 1),  // mamba out_proj (+ residual)
          inst(bf, bf, bf, 4, 64, 15680, 4480, 1, 4, 256),  // mlp down_proj
          inst(f, bf, f, 4, 64, 15680, 4480, 2, 4, 256, nullptr, 1),  // mlp down_proj (+ residual)
          inst(f, bf, f, 4, 64, 4480, 15680, 1, 4, 160, nullptr, 2),  // mlp up_proj (squared ReLU)
          inst(f, bf, f, 4, 64, 4480, 1024, 1, 1, 160),     // attention k_proj / v_proj
          inst(f, bf, f, 4, 64, 5120, 4480, 1, 4, 160),     // attention o_proj
          inst(f, bf, f, 4, 64, 4480, 131072, 1, 4, 160),   // lm_head / function_head
          inst(f, bf, f, 4, 64, 10240, 4480, 1, 8, 160, nullptr, 1),  // mamba out_proj as launched (8 rows)
          // Inputs normalized by their producer (vc_qmv_emit): in_proj and up_proj after a mamba out_proj
          // (560 blocks), q/k/v after an MLP down_proj (two rows).
          inst(f, bf, f, 4, 64, 4480, 22656, 1, 8, 160, nullptr, 0, f, 560),
          inst(f, bf, f, 4, 64, 4480, 15680, 1, 8, 160, nullptr, 2, f, 560),
          inst(f, bf, f, 4, 64, 4480, 7168, 2, 8, 160, nullptr, 0, f, 560),
          // in_proj / up_proj with 2 and 4 row groups a block of 8 rows, in_proj with 4 of 4 rows (row_groups:
          // never faster on the H200, so never the default)
          inst(f, bf, f, 4, 64, 4480, 22656, 1, 8, 160, nullptr, 0, f, 560, 1, 2),
          inst(f, bf, f, 4, 64, 4480, 15680, 1, 8, 160, nullptr, 2, f, 560, 1, 4),
          inst(f, bf, f, 4, 64, 4480, 22656, 1, 4, 160, nullptr, 0, f, 560, 1, 4),
          // The other packings, dtypes and a Linear bias.
          inst(f, bf, f, 8, 64, 4480, 5120, 2, 8, 160),
          inst("__half", "__half", "__half", 4, 32, 4480, 1000, 1, 2, 64),
          inst(bf, f, f, 8, 128, 1152, 1, 2, 1, 96),
          inst(f, bf, f, 4, 64, 4480, 5120, 2, 4, 160, f),
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
      gemv_cuda::kQmvEmitSource,
      quant_header(),
      {
          // mamba out_proj on the conv + scan's gated output (640 partials in 8 groups), MLP down_proj,
          // attention o_proj (two rows); a bfloat16 x and norm weight
          qmv_emit_instance(f, bf, f, 10240, 4480, 1, 8, 320, f, 640, 8),  // as launched: one step a thread
          qmv_emit_instance(f, bf, f, 10240, 4480, 1, 8, 160, f, 640, 8),  // two steps (a threads override)
          qmv_emit_instance(f, bf, f, 15680, 4480, 1, 8, 256, f),
          qmv_emit_instance(f, bf, f, 5120, 4480, 2, 8, 160, f),
          qmv_emit_instance(bf, bf, f, 4480, 1000, 1, 4, 160, bf),
      },
  });
  return src;
}

// One instance of a persistent 4-bit kernel (vc_qmv_stream / vc_qmv_imma; emit: their _emit twin),
// group 64 with bfloat16 scales, a float32 output: `layout` its leading template args (the layout's
// own), np > 0 an input normalized by its producer (np partials in ng groups); epi as qmv_instance's
// (emit: + residual).
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

CudaInstance qmv_stream_instance(bool emit, const char* tx, int k, int n, int m, int rows, int threads, int stages,
                                 int xs, int split, int levels, int epi = 0, int np = 0, int ng = 1) {
  return persistent_instance(emit, tx,
                             {{"GROUP", int_arg(64)}, {"K", int_arg(k)}, {"N", int_arg(n)}, {"M", int_arg(m)},
                              {"ROWS", int_arg(rows)}, {"THREADS", int_arg(threads)}, {"STAGES", int_arg(stages)},
                              {"XS", int_arg(xs)}, {"SPLIT", int_arg(split)}, {"LEVELS", int_arg(levels)}},
                             epi, np, ng);
}

std::string stream_header() {
  return std::string(gemv_cuda::kCommonHeader) + gemv_cuda::kPairHeader + gemv_cuda::kPersistentHeader +
         gemv_cuda::kStreamHeader;
}

const CudaSource& qmv_stream_source() {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_stream",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w"},
      {"out"},
      gemv_cuda::kQmvStreamSource,
      stream_header(),
      {
          // mamba in_proj and mlp up_proj (squared ReLU) on a mamba out_proj's emitted norm input (560
          // partials); plain, two rows of bfloat16 x; q_proj after an MLP down_proj (656 partials: 528
          // tiles', 128 parts'); SPLIT as pick_stream's
          qmv_stream_instance(false, f, 4480, 22656, 1, 8, 160, 4, 0, 1, 0, 0, 560),
          qmv_stream_instance(false, f, 4480, 15680, 1, 8, 160, 4, 2, 1, 0, 2, 560),
          qmv_stream_instance(false, bf, 4480, 22656, 2, 8, 160, 4, 0, 1, 0),
          qmv_stream_instance(false, f, 4480, 5120, 2, 8, 160, 3, 0, 1, 0, 0, 656),
      },
  });
  return src;
}

const CudaSource& qmv_stream_emit_source() {
  const char* f = "float";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_stream_emit",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w", "next_w"},
      {"out", "normed", "partials"},
      gemv_cuda::kQmvStreamEmitSource,
      stream_header(),
      {
          // mamba out_proj on the conv + scan's gated output (640 partials in 8 groups), MLP down_proj
          // (one chunk a thread, or two), attention o_proj (two rows); x staged through a stage (the
          // first two) or in its own region
          qmv_stream_instance(true, f, 10240, 4480, 1, 8, 320, 2, 1, 1, 0, 0, 640, 8),
          qmv_stream_instance(true, f, 15680, 4480, 1, 8, 512, 2, 1, 4, 0),
          qmv_stream_instance(true, f, 15680, 4480, 1, 8, 256, 2, 2, 4, 0),
          qmv_stream_instance(true, f, 5120, 4480, 2, 8, 160, 3, 0, 1, 0),
          // the step's MLP down_proj and mamba out_proj with their default integer dot products (dp4a 4)
          qmv_stream_instance(true, f, 15680, 4480, 1, 8, 512, 2, 1, 4, 4),
          qmv_stream_instance(true, f, 10240, 4480, 1, 8, 320, 2, 1, 1, 4, 0, 640, 8),
      },
  });
  return src;
}

const CudaSource& qmv_warp_source() {
  auto inst = [](auto... args) { return qmv_instance("WARPS", args...); };
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_warp",
      {"x", "weight", "scales", "biases", "bias", "residual"},
      {"out"},
      gemv_cuda::kQmvWarpSource,
      quant_header(),
      {
          inst(f, bf, f, 4, 64, 4480, 22656, 1, 4, 4),     // mamba in_proj
          inst(bf, bf, bf, 4, 64, 4480, 22656, 2, 4, 4),
          inst(f, bf, f, 4, 64, 10240, 4480, 1, 4, 4, nullptr, 1),  // mamba out_proj (+ residual)
          inst(f, bf, f, 4, 64, 4480, 15680, 1, 4, 4, nullptr, 2),  // mlp up_proj (squared ReLU)
          inst(f, bf, f, 4, 64, 15680, 4480, 2, 2, 8),     // mlp down_proj
          inst(f, bf, f, 4, 64, 4480, 1024, 1, 1, 4),      // attention k_proj / v_proj
          inst(f, bf, f, 4, 64, 4480, 131072, 1, 4, 4),    // a head
          inst(f, bf, f, 8, 64, 4480, 5120, 2, 8, 2),
          inst("__half", "__half", "__half", 4, 32, 4480, 1000, 1, 2, 2),
          inst(f, bf, f, 4, 64, 4480, 5120, 2, 4, 4, f),
      },
  });
  return src;
}

const CudaSource& dense_warp_source() {
  auto inst = [](auto... args) { return dense_instance("WARPS", args...); };
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_dense_mv_warp",
      {"x", "weight", "bias", "residual"},
      {"out"},
      gemv_cuda::kDenseWarpSource,
      dense_header(),
      {
          inst(f, bf, bf, f, 1152, 1152, 2, 2, 4, false),   // TTS attention
          inst(f, bf, bf, f, 1152, 4608, 2, 4, 4, false),   // TTS mlp gate / up
          inst(f, bf, bf, f, 4608, 1152, 2, 1, 4, false),   // TTS mlp down
          inst(f, bf, bf, f, 4608, 1152, 2, 1, 4, false, 0, 1),  // TTS mlp down on gate / up
          inst(f, bf, bf, f, 1152, 65536, 1, 4, 4, false),  // MoG proj_mus
          inst(f, bf, bf, f, 1152, 1152, 1, 2, 4, true),    // gated fusion (with bias)
          inst("__half", "__half", "__half", "__half", 640, 2560, 2, 2, 2, true),
      },
  });
  return src;
}

const CudaSource& dense_source() {
  auto inst = [](auto... args) { return dense_instance("THREADS", args...); };
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_dense_mv",
      {"x", "weight", "bias", "residual"},
      {"out"},
      gemv_cuda::kDenseSource,
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
      },
  });
  return src;
}

const CudaSource& dense_add_norm_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int k, int n, int m, int rows, int threads, bool has_bias, const char* tw, const char* tb,
                 int seam = 0) {
    return CudaInstance{{"float", "float", "float", "float", tw, tb},
                        {"float", "float"},
                        {P{"K", int_arg(k)}, P{"N", int_arg(n)}, P{"M", int_arg(m)}, P{"ROWS", int_arg(rows)},
                         P{"THREADS", int_arg(threads)}, P{"HAS_BIAS", has_bias ? "bool:true" : "bool:false"},
                         P{"SEAM", int_arg(seam)}, P{"EPS_BITS", int_arg(float_bits(1e-6f))},
                         P{"TW", type_arg(tw)}, P{"TB", type_arg(tb)}, P{"TO", "type:float"}}};
  };
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_dense_add_norm",
      {"h", "y", "post", "pre", "weight", "bias"},
      {"out", "h_out"},
      gemv_cuda::kDenseAddNormSource,
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
      },
  });
  return src;
}

const CudaSource& argmax_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](const char* tx, const char* ts, const char* to, int m, bool logits) {
    return CudaInstance{
        {tx, "uint32_t", ts, ts, "uint32_t", ts, ts},
        {"int64_t", to, to},
        {P{"BITS", "int:4"}, P{"GROUP", "int:64"}, P{"K", "int:4480"}, P{"N", "int:131072"},
         P{"M", int_arg(m)}, P{"ROWS", int_arg(kArgmaxRows)}, P{"THREADS", "int:160"},
         P{"GPB", int_arg(kArgmaxGroupsPerBlock)}, P{"WRITE_LOGITS", logits ? "bool:true" : "bool:false"},
         P{"TX", type_arg(tx)}, P{"TS", type_arg(ts)}, P{"TO", type_arg(to)}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_two_head_argmax",
      {"x", "weight_a", "scales_a", "biases_a", "weight_b", "scales_b", "biases_b"},
      {"keys", "logits_a", "logits_b"},
      gemv_cuda::kArgmaxSource,
      quant_header(),
      {inst("float", "__nv_bfloat16", "float", 1, false), inst("__nv_bfloat16", "__nv_bfloat16", "__nv_bfloat16", 1, true),
       inst("float", "__nv_bfloat16", "float", 2, true)},
  });
  return src;
}

const CudaSource& argmax_finish_source() {
  using P = std::pair<std::string, std::string>;
  static const CudaSource& src = register_cuda_source({
      "vc_argmax_finish",
      {"keys"},
      {"ids"},
      gemv_cuda::kArgmaxFinishSource,
      "",
      {CudaInstance{{"int64_t"}, {"int32_t"}, {P{"NB", "int:16384"}, P{"THREADS", "int:256"}}},
       CudaInstance{{"int64_t"}, {"int32_t"}, {P{"NB", "int:3"}, P{"THREADS", "int:256"}}}},
  });
  return src;
}

const mx::fast::CustomKernelFunction& kernel(const CudaSource& src, int shared_memory = 0) {
  // One kernel function per source and dynamic shared memory size (fixed when the function is made);
  // MLX caches the compiled instances by template args.
  // a deque: a reference handed out stays valid when a later call adds a function
  static std::deque<std::tuple<const CudaSource*, int, mx::fast::CustomKernelFunction>> made;
  for (auto& [s, smem, fn] : made) {
    if (s == &src && smem == shared_memory) {
      return fn;
    }
  }
  made.emplace_back(&src, shared_memory, make_cuda_kernel(src, shared_memory));
  return std::get<2>(made.back());
}

// ---------------------------------------------------------------- checks

int leading_rows(const mx::array& x) { return x.ndim() == 0 ? 0 : static_cast<int>(x.size() / x.shape(-1)); }

mx::Shape out_shape(const mx::array& x, int n) {
  mx::Shape shape(x.shape().begin(), x.shape().end() - 1);
  shape.push_back(n);
  return shape;
}

struct Quantized {
  int n, k;
};

// Shapes of an affine-quantized weight; throws on arrays that do not form one.
Quantized check_quantized(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                          int group_size, int bits) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("quantized_matvec: bits must be 4 or 8");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("quantized_matvec: group_size must be 32, 64 or 128");
  }
  if (w.ndim() != 2 || w.dtype() != mx::uint32) {
    throw std::invalid_argument("quantized_matvec: weight must be packed uint32 [N, K * bits / 32]");
  }
  const int n = w.shape(0);
  const int k = w.shape(1) * 32 / bits;
  if (scales.ndim() != 2 || scales.shape(0) != n || scales.shape(1) * group_size != k || biases.shape() != scales.shape()) {
    throw std::invalid_argument("quantized_matvec: scales and biases must be [N, K / group_size]");
  }
  if (x.ndim() < 1 || x.shape(-1) != k) {
    throw std::invalid_argument("quantized_matvec: x [..., K] does not match the weight's K = " + std::to_string(k));
  }
  return {n, k};
}

// ---------------------------------------------------------------- epilogues

// What a matvec does to its sums before storing them (vc_gemv::finish): nothing, add a residual
// stream of the output's shape, or apply the squared ReLU.
struct Epilogue {
  std::optional<mx::array> residual;
  bool relu_squared = false;

  int kind() const { return residual ? 1 : relu_squared ? 2 : 0; }
};

Epilogue make_epilogue(const std::optional<mx::array>& residual, const std::string& activation, int n,
                       const char* who) {
  if (!activation.empty() && activation != "relu_squared") {
    throw std::invalid_argument(std::string(who) + ": activation must be '' or 'relu_squared', not '" + activation + "'");
  }
  if (residual && !activation.empty()) {
    throw std::invalid_argument(std::string(who) + ": a residual and an activation cannot be fused together");
  }
  if (residual && (residual->ndim() < 1 || residual->shape(-1) != n || !float_dtype(residual->dtype()))) {
    throw std::invalid_argument(std::string(who) + ": residual must be a float array [..., N] with N = " +
                                std::to_string(n));
  }
  return {residual, activation == "relu_squared"};
}

// The epilogue in MLX ops, after the product y (the fallback and the reference).
mx::array compose_epilogue(mx::array y, const Epilogue& e, mx::Stream s) {
  if (e.relu_squared) {
    y = mx::square(mx::maximum(y, mx::array(0.0f, y.dtype()), s), s);
  }
  return e.residual ? mx::add(y, *e.residual, s) : y;
}

// The matvec's output dtype: what MLX's ops give x times the weight's scales (or the weight), plus
// the bias and the residual.
mx::Dtype output_dtype(mx::Dtype x, mx::Dtype weight, const std::optional<mx::array>& bias, const Epilogue& epi) {
  auto out = mx::promote_types(x, weight);
  if (bias) {
    out = mx::promote_types(out, bias->dtype());
  }
  return epi.residual ? mx::promote_types(out, epi.residual->dtype()) : out;
}

// Whether the kernel can write the epilogue: the residual covers exactly the output rows.
bool kernel_takes(const Epilogue& e, int m, int n) {
  return !e.residual || static_cast<int>(e.residual->size()) == m * n;
}

// ---------------------------------------------------------------- quantized matvec

// An input normalized by its producer (NORM 2 of vc_gemv::qmv_block): x is a norm's input times its
// weight, `partials` [..., P] float32 partial sums of its squares per row, `groups` equal channel
// groups each summed over P / groups consecutive partials (1: an RMSNorm over all K channels).
struct Prenorm {
  mx::array partials;
  int groups;
};

// x scaled by each group's rsqrt(mean square + eps), in MLX ops (the fallback and the reference).
mx::array apply_prenorm(const mx::array& x, const Prenorm& p, float eps, mx::Stream s) {
  const int k = x.shape(-1), rows = leading_rows(x), g = p.groups;
  auto sums = mx::sum(mx::reshape(mx::astype(p.partials, mx::float32, s), {rows, g, -1}, s), -1, true, s);
  auto r = mx::rsqrt(mx::add(mx::divide(sums, mx::array(static_cast<float>(k / g)), s), mx::array(eps), s), s);
  auto scaled = mx::multiply(mx::reshape(mx::astype(x, mx::float32, s), {rows, g, k / g}, s), r, s);
  return mx::astype(mx::reshape(scaled, x.shape(), s), x.dtype(), s);
}

// Groups a vc_qmv_imma warp has in flight by default (a batch's loads are issued before its MMAs):
// ptxas fits the step's instances in 56-72 registers at 4, 78-94 at 5 (pick_imma's grid assumes 80).
constexpr int kImmaInflight = 4;

// vc_qmv_imma's instances, LEVELS 4, INFLIGHT the default's (see persistent_instance).
CudaInstance qmv_imma_instance(bool emit, const char* tx, int k, int n, int m, int warps, int epi = 0, int np = 0,
                               int ng = 1) {
  return persistent_instance(emit, tx,
                             {{"K", int_arg(k)}, {"N", int_arg(n)}, {"M", int_arg(m)}, {"WARPS", int_arg(warps)},
                              {"LEVELS", int_arg(4)}, {"INFLIGHT", int_arg(kImmaInflight)}},
                             epi, np, ng);
}

std::string imma_header() {
  return std::string(gemv_cuda::kCommonHeader) + gemv_cuda::kPersistentHeader + gemv_cuda::kImmaHeader;
}

const CudaSource& qmv_imma_source() {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_imma",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w"},
      {"out"},
      gemv_cuda::kQmvImmaSource,
      imma_header(),
      {
          // mamba in_proj and mlp up_proj (squared ReLU) on an emitted norm input (280 partials);
          // plain, two rows of bfloat16 x
          qmv_imma_instance(false, f, 4480, 22656, 1, 8, 0, 280),
          qmv_imma_instance(false, f, 4480, 15680, 1, 8, 2, 280),
          qmv_imma_instance(false, bf, 4480, 22656, 2, 8),
      },
  });
  return src;
}

const CudaSource& qmv_imma_emit_source() {
  const char* f = "float";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_imma_emit",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w", "next_w"},
      {"out", "normed", "partials"},
      gemv_cuda::kQmvImmaEmitSource,
      imma_header(),
      {
          // mamba out_proj on the conv + scan's gated output (640 partials in 8 groups), MLP down_proj
          qmv_imma_instance(true, f, 10240, 4480, 1, 8, 0, 640, 8),
          qmv_imma_instance(true, f, 15680, 4480, 1, 8),
      },
  });
  return src;
}

// vc_qmv_imma_stream's instances (persistent_instance's), LEVELS 4.
CudaInstance qmv_imma_stream_instance(bool emit, const char* tx, int k, int n, int m, int warps, int stages,
                                      int slab, int epi = 0, int np = 0, int ng = 1) {
  return persistent_instance(emit, tx,
                             {{"K", int_arg(k)}, {"N", int_arg(n)}, {"M", int_arg(m)}, {"WARPS", int_arg(warps)},
                              {"LEVELS", int_arg(4)}, {"STAGES", int_arg(stages)}, {"SLAB", int_arg(slab)}},
                             epi, np, ng);
}

std::string imma_stream_header() {
  return std::string(gemv_cuda::kCommonHeader) + gemv_cuda::kPairHeader + gemv_cuda::kPersistentHeader +
         gemv_cuda::kStreamHeader + gemv_cuda::kImmaHeader + gemv_cuda::kImmaStreamHeader;
}

const CudaSource& qmv_imma_stream_source() {
  const char* f = "float";
  const char* bf = "__nv_bfloat16";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_imma_stream",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w"},
      {"out"},
      gemv_cuda::kQmvImmaStreamSource,
      imma_stream_header(),
      {
          // mamba in_proj and mlp up_proj (squared ReLU) on an emitted norm input (280 partials);
          // plain, two rows of bfloat16 x; 8-row slabs with a bias (squared ReLU)
          qmv_imma_stream_instance(false, f, 4480, 22656, 1, 8, 2, 16, 0, 280),
          qmv_imma_stream_instance(false, f, 4480, 15680, 1, 8, 2, 16, 2, 280),
          qmv_imma_stream_instance(false, bf, 4480, 22656, 2, 8, 2, 16),
          qmv_imma_stream_instance(false, f, 4480, 15680, 1, 8, 2, 8, 2, 280),
      },
  });
  return src;
}

const CudaSource& qmv_imma_stream_emit_source() {
  const char* f = "float";
  static const CudaSource& src = register_cuda_source({
      "vc_qmv_imma_stream_emit",
      {"x", "weight", "scales", "biases", "bias", "residual", "norm_w", "next_w"},
      {"out", "normed", "partials"},
      gemv_cuda::kQmvImmaStreamEmitSource,
      imma_stream_header(),
      {
          // mamba out_proj on the conv + scan's gated output (640 partials in 8 groups), MLP down_proj
          // (8-row slabs: 16 do not fit its shared memory)
          qmv_imma_stream_instance(true, f, 10240, 4480, 1, 8, 2, 16, 0, 640, 8),
          qmv_imma_stream_instance(true, f, 15680, 4480, 1, 8, 2, 8),
      },
  });
  return src;
}

// The two-head argmax on the streamed integer-MMA walk (kImmaStreamArgmaxSource): the LLM's lm_head and
// function_head (131072 rows each), one or two rows of x, 8 warps, 2 stages.
const CudaSource& imma_stream_argmax_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](const char* tx, const char* to, int m, bool logits) {
    const char* bf = "__nv_bfloat16";
    return CudaInstance{{tx, "uint32_t", bf, bf, "uint32_t", bf, bf},
                        {"int64_t", to},
                        {P{"K", "int:4480"}, P{"N", "int:262144"}, P{"M", int_arg(m)}, P{"WARPS", "int:8"},
                         P{"LEVELS", int_arg(4)}, P{"STAGES", "int:2"},
                         P{"WRITE_LOGITS", logits ? "bool:true" : "bool:false"}, P{"TX", type_arg(tx)},
                         P{"TS", type_arg(bf)}, P{"TO", type_arg(to)}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_two_head_argmax_stream",
      {"x", "weight_a", "scales_a", "biases_a", "weight_b", "scales_b", "biases_b"},
      {"keys", "logits"},
      gemv_cuda::kImmaStreamArgmaxSource,
      imma_stream_header(),
      {inst("float", "float", 1, false), inst("__nv_bfloat16", "__nv_bfloat16", 1, true),
       inst("float", "float", 2, true)},
  });
  return src;
}

// ---------------------------------------------------------------- the streamed layout

constexpr int kSmemPerSm = 232448;      // Hopper: a block's (and an SM's) most dynamic shared memory
constexpr int kStreamStaticSmem = 4096;  // vc_qmv_imma's own __shared__ arrays, at most

// A streamed kernel's own __shared__ arrays (vc_qmv_stream; vc_qmv_imma_stream with 16 rows): a
// tile's sums from every warp for each stage (two at least), two barriers (vc_qmv_stream's row
// groups, VC_ROW_GROUPS) and a count a stage, the norm's group totals (and a margin for alignment).
int stream_static_smem(int stages, int threads, int rows, int m, int groups) {
  return std::max(stages, 2) * (threads / 32) * rows * m * 4 + stages * 20 + groups * m * 4 + 256;
}

// stage_x: how float32 x reaches each lane (vc_stream::StagedX): 0 each lane loads its own chunk,
// 1 loaded coalesced and handed round through the last stages' buffers (the second's at two stages),
// 2 the same through a region of its own past the stages (smem includes it). split: the parts each
// last-round tile is cut into (vc_stream::Walk); partials: the emitting kernel's partial sums a row of
// x (a tile's or a part's); warp_groups: the kernel's WG (stream_warp_groups).
struct StreamLaunch {
  int rows, threads, stages, blocks, smem, stage_x, split, partials, levels, warp_groups;
};

// The float layouts' threads where a call leaves them to the default (threads 0) and x is a
// group-normed input (quantized_matvec_impl says why): one 16-byte chunk of K a thread.
int one_step_threads(int chunks, int prenorm_groups, int threads) {
  return prenorm_groups > 1 && threads <= 0 && chunks <= 512 ? 32 * ((chunks + 31) / 32) : threads;
}

// An A/B switch of the streamed launch (set on the GPU without a rebuild): the index of environment
// variable `name`'s value among `choices`, -1 where it is unset, empty or "auto", -2 for anything else.
int ab_switch(const char* name, std::initializer_list<const char*> choices) {
  const char* value = std::getenv(name);
  const std::string v(value ? value : "");
  if (v.empty() || v == "auto") {
    return -1;
  }
  int index = 0;
  for (const char* choice : choices) {
    if (v == choice) {
      return index;
    }
    ++index;
  }
  return -2;
}

// A switch's reading (ab_switch), refused with one line at every launch that asks where it was bad.
int checked_switch(int mode, const char* name, const char* expected) {
  if (mode == -2) {
    throw std::invalid_argument(std::string(name) + " must be " + expected);
  }
  return mode;
}

// VOICECHAT_QMV_STAGE_X: pick_stream's stage_x: -1 (auto) its own pick, 0, 1 or 2 that mode wherever
// the kernel can take it (2 may cost an SM a block). Read once.
int stage_x_setting() {
  static const int mode = ab_switch("VOICECHAT_QMV_STAGE_X", {"0", "1", "2"});
  return checked_switch(mode, "VOICECHAT_QMV_STAGE_X", "auto, 0, 1 or 2");
}

// VOICECHAT_QMV_SPLIT: "1" keeps the last round's tiles whole; "any" splits them at any blocks an SM
// (split_last_round's pick as at one); auto: split_last_round's pick. Read once.
int split_setting() {
  static const int mode = ab_switch("VOICECHAT_QMV_SPLIT", {"1", "any"});
  return checked_switch(mode, "VOICECHAT_QMV_SPLIT", "auto, 1 or any");
}

// The parts each of the last round's tiles is cut into (vc_stream::Walk), for `tiles` tiles of `rows`
// rows over `blocks` blocks, where `splits` (one block an SM, or VOICECHAT_QMV_SPLIT=any): the most (a
// power of two, rows / parts rows at least one) that leave every part a block of its own. The walk's
// time is its longest block's: at the MLP down_proj (560 8-row tiles, 132 blocks) 32 blocks took a
// fifth tile while 100 waited; cut in 4, 128 blocks take a quarter tile each. Nsight Compute on the
// H200 (2026-12-04, f32 x, one row): down_proj 17.73 -> 17.09 us; the mamba out_proj (264 blocks, two
// an SM, where a block left alone on its SM has all its issue slots) 13.09 -> 13.28 with 8 one-row
// parts: whole there; again with the first round asked for at once (VOICECHAT_QMV_SPLIT=any, one
// machine, alternating): 12.16 / 12.13 against 12.03 / 11.87 whole (the parts, asked for as a stage
// frees, landed at 8.44 us p50 against the 32 whole tiles' 7.83 in the timelines).
int split_last_round(int tiles, int blocks, int rows, bool splits) {
  const int left = tiles % blocks;
  int split = 1;
  while (splits && left > 0 && rows % (2 * split) == 0 && left * 2 * split <= blocks) {
    split *= 2;
  }
  return split;
}

// vc_qmv_stream's warp groups (its WG): where a block of `threads` has a whole multiple, two or more, of
// the warps that K's `chunks` take at a chunk a thread, each group of those takes `rows` / WG rows of
// every tile (and of every part, `rows` / split), so that one block an SM puts all its warps on each
// tile; else 1. The kernel derives its own (vc_stream::WarpGroups, from the launch's split too):
// test_gemv_cuda_emulated's test_the_hosts_warp_groups_are_the_kernels holds the two equal.
int stream_warp_groups(int chunks, int threads, int rows) {
  const int kw = (chunks + 31) / 32, warps = threads / 32;
  return warps >= 2 * kw && warps % kw == 0 && rows % (warps / kw) == 0 ? warps / kw : 1;
}

// The default for `stages` = 0: how many tiles a vc_qmv_stream block keeps in flight at this
// shape, or 0 for the block layout (vc_qmv). Nsight Compute on the H200, the step's instances, float32
// x, one row, block layout against the streamed launch (2 stages): 2026-12-01, out_proj 4480x10240
// 26.6 -> 22.8 us, down_proj 4480x15680 34.2 -> 26.7 us; 2026-12-03, once its warps stopped meeting
// at a barrier every tile and its prologue's loads went ahead of the bulk copies, in_proj 22656x4480
// 29.47 -> 25.41 us, up_proj 15680x4480 22.66 -> 21.54 us (3 stages 26.75 / 21.79, 4 rows x 4
// stages 28.58, 16 rows 28.80 at in_proj). Two rows (128 registers a thread) and the smaller
// shapes not measured: the block layout there.
int default_stream_stages(int k, int n, int m) { return m == 1 && (k >= 8192 || n >= 8192) ? 2 : 0; }

// The GPU's compute capability (major), asked once of the first device a call runs on (one GPU a
// process here); 0 where MLX does not say.
int compute_capability(int device_index) {
  static const int major = [device_index] {
    const auto& info = mx::gpu::device_info(device_index);
    const auto it = info.find("compute_capability_major");
    return it != info.end() && std::holds_alternative<size_t>(it->second) ? static_cast<int>(std::get<size_t>(it->second))
                                                                          : 0;
  }();
  return major;
}

// Whether the GPU has the copy engine's bulk copies and mbarrier transaction counts (sm_90 on):
// the streamed layout's PTX does not compile for older GPUs, which keep the block layout.
bool bulk_copies(int device_index) { return compute_capability(device_index) >= 9; }

// The streamed launch at this shape, or nothing (the block layout then). stages: < 0 never; 0 the
// default; > 0 that many tiles in flight (refused with a reason where the kernel cannot take it).
// rows / threads / blocks_per_sm: overrides (0 = auto); stage_x: -1 auto, else that mode where it
// applies (float32 x; 1 where x's slices fit in a stage); dp4a: the product's int8 terms of x
// (vc_stream::qmv_stream's LEVELS: 1-4, quantized_matvec takes 3 or 4), 0 the default's
// (kDefaultDp4aLevels for one row of x, else the pair form), < 0 the pair form; bulk: the GPU has bulk
// copies.
std::optional<StreamLaunch> pick_stream(int k, int n, int m, int group_size, int bits, int scale_bytes,
                                        bool x_float32, bool takes_norm, int prenorm_groups, int rows, int threads,
                                        int stages, int blocks_per_sm, int stage_x, int dp4a, bool bulk,
                                        const char* who) {
  const bool forced = stages > 0;
  if (stages == 0) {
    stages = default_stream_stages(k, n, m);
  }
  if (stages <= 0) {
    return std::nullopt;
  }
  rows = rows > 0 ? rows : 8;
  const int chunks = k / 32;
  if (threads <= 0) {
    threads = chunks <= 512 ? 32 * ((chunks + 31) / 32) : 32 * ((chunks + 63) / 64);
  }
  const int stage = rows * k / 2 + 2 * rows * (k / group_size) * scale_bytes;
  const int wg = threads % 32 == 0 ? stream_warp_groups(chunks, threads, rows) : 1;
  const int cpt = (chunks + threads / wg - 1) / (threads / wg);  // chunks a thread
  // its own arrays, and every warp's share of the norm's group totals (apart from a tile's sums)
  const int own = stream_static_smem(stages, threads, rows, m, prenorm_groups) + (threads / 32) * prenorm_groups * m * 4;
  const char* why = !bulk                                       ? "a GPU with bulk copies (sm_90 or newer)"
                    : bits != 4                                 ? "4-bit weights only"
                    : !takes_norm                               ? "no RMSNorm prologue (norm_weight)"
                    : group_size % 32 != 0                      ? "a group of whole 16-byte chunks"
                    : n % rows != 0 || rows * m > 32            ? "N a multiple of rows_per_block, rows x M <= 32"
                    : (rows * (k / group_size) * scale_bytes) % 16 != 0 ? "a tile's scales in whole 16 bytes"
                    : threads % 32 != 0 || threads > (wg > 1 ? 1024 : 512) || cpt > 2
                        ? "threads a multiple of 32 up to 512 (1024 in warp groups), two chunks of K a thread at "
                          "most"
                    : stages < 2 || stages * stage + own > kSmemPerSm
                        ? "2 stages at least, their tiles inside 227 KB of shared memory"
                        : nullptr;
  if (why) {
    if (forced) {
      throw std::invalid_argument(std::string(who) + ": the streamed layout takes " + why);
    }
    return std::nullopt;
  }
  int smem = stages * stage;
  // past 512 threads (warp groups) one block an SM: two would need 64 registers a thread at most, and
  // the kernel takes 72-96
  auto fit = [&](int bytes) {
    return std::max(1, std::min(threads > 512 ? 1 : 2048 / threads, kSmemPerSm / (bytes + own)));
  };
  int per_sm = blocks_per_sm > 0 ? blocks_per_sm : fit(smem);
  // x staged (vc_stream::StagedX: a warp's 4 KB slices for each of its chunk rounds and rows): by
  // default through the last stages' buffers where the slices fit in one stage, or for one row of x
  // in all but the first (whose tiles are then asked for at the start, the others after x's spread),
  // else in their own region where that leaves the SM its blocks, else not; a mode asked for where it
  // does not fit: not staged.
  // Nsight Compute on the H200, 2026-12-04, f32 x, one row: the mamba out_proj 15.10 -> 13.34 us (8
  // rows, 1), the MLP down_proj 19.68 / 20.64 -> 17.57 / 17.76 (1; 17.95 with 2). 4-row tiles with x
  // in its own region at out_proj (two blocks an SM): 13.09 / 13.31, within 2%: not taken.
  const int x_bytes = threads / 32 * cpt * m * 4096;
  const bool own_fits = (smem + x_bytes + own) * (stage_x == 2 ? 1 : per_sm) <= kSmemPerSm;
  // as the kernel's STAGE_X: in one stage, or for one row of x in all but the first (two rows' slices
  // held across stages took the 2-row down_proj launch at 3 stages to 154-168 registers, 2026-12-04)
  const bool in_stages = x_bytes <= stage || (m == 1 && x_bytes <= (stages - 1) * stage);
  if (!x_float32) {
    stage_x = 0;
  } else if (stage_x < 0) {
    stage_x = in_stages ? 1 : own_fits ? 2 : 0;
  } else if ((stage_x == 1 && !in_stages) || (stage_x == 2 && !own_fits)) {
    stage_x = 0;
  }
  if (stage_x == 2) {
    smem += x_bytes;
    per_sm = blocks_per_sm > 0 ? blocks_per_sm : fit(smem);
  }
  const int tiles = n / rows, blocks = std::min(tiles, kSmCount * per_sm);
  const int split_mode = split_setting();
  // parts of whole rows for each warp group
  const int split = split_last_round(tiles, blocks, rows / wg, split_mode == 1 || (split_mode < 0 && per_sm == 1));
  const int partials = tiles / blocks * blocks + tiles % blocks * split;  // the whole rounds' tiles, then the parts
  const int levels = dp4a > 0 ? dp4a : dp4a == 0 && m == 1 ? kDefaultDp4aLevels : 0;
  return StreamLaunch{rows, threads, stages, blocks, smem, stage_x, split, partials, levels, wg};
}

// A persistent 4-bit kernel's launch from quantized_matvec_impl (its checks done): `layout` its
// leading template args, `plain` / `emitting` its two sources, `partial_count` the emitting kernel's
// partials a row of x, `blocks` x `threads` the grid, `smem` its dynamic shared memory. [out] or [out,
// normed, partials].
std::vector<mx::array> launch_persistent(const CudaSource& plain, const CudaSource& emitting,
                                         std::vector<std::pair<std::string, mx::fast::TemplateArg>> layout,
                                         int partial_count, int blocks, int threads, int smem, const mx::array& x,
                                         const mx::array& w, const mx::array& scales, const mx::array& biases,
                                         const std::optional<mx::array>& bias, const Epilogue& epi,
                                         const std::optional<Prenorm>& prenorm,
                                         const std::optional<mx::array>& next_norm, float norm_eps,
                                         mx::Dtype out_dtype, mx::Stream s) {
  const int n = w.shape(0);
  std::vector<mx::array> inputs = {x, w, scales, biases, bias ? *bias : scales, epi.residual ? *epi.residual : scales,
                                   prenorm ? prenorm->partials : scales};
  auto args = std::move(layout);
  if (!next_norm) {
    args.emplace_back("EPI", epi.kind());
  }
  args.insert(args.end(), {{"HAS_BIAS", bias.has_value()}, {"NORM", prenorm ? 2 : 0},
                           {"NP", prenorm ? static_cast<int>(prenorm->partials.shape(-1)) : 0},
                           {"NG", prenorm ? prenorm->groups : 1}, {"EPS_BITS", prenorm ? float_bits(norm_eps) : 0},
                           {"TX", x.dtype()}, {"TS", scales.dtype()}, {"TB", bias ? bias->dtype() : scales.dtype()},
                           {"TR", epi.residual ? epi.residual->dtype() : scales.dtype()}, {"TN", inputs[6].dtype()}});
  const std::tuple<int, int, int> grid{blocks * threads, 1, 1}, block{threads, 1, 1};
  if (!next_norm) {
    args.emplace_back("TO", out_dtype);
    return kernel(plain, smem)(inputs, {out_shape(x, n)}, {out_dtype}, grid, block, args, std::nullopt, false, s);
  }
  inputs.push_back(*next_norm);
  args.emplace_back("TE", next_norm->dtype());
  args.emplace_back("TO", out_dtype);
  return kernel(emitting, smem)(inputs, {out_shape(x, n), out_shape(x, n), out_shape(x, partial_count)},
                                {out_dtype, mx::float32, mx::float32}, grid, block, args, std::nullopt, false, s);
}

// ---------------------------------------------------------------- the integer-MMA layout

constexpr int kImmaLevels = 4;  // x's block floating point terms: 6 + 7 + 7 + 7 bits below a group's largest

struct ImmaLaunch {
  int warps, blocks, smem, inflight;
};

// Whether the GPU has the integer MMA (sm_80 on).
bool integer_mma(int device_index) { return compute_capability(device_index) >= 8; }

// What the integer-MMA layouts (vc_qmv_imma, vc_qmv_imma_stream) cannot take at this shape, or
// nullptr: 16-row slabs of 64-wide 4-bit groups, a warp at least a group.
const char* imma_shape_refusal(int k, int n, int m, int group_size, int bits, bool takes_norm, int prenorm_groups,
                               int threads, int warps) {
  return bits != 4 || group_size != 64             ? "4-bit weights in groups of 64"
         : !takes_norm                             ? "no RMSNorm prologue (norm_weight)"
         : k % 64 != 0 || n % 16 != 0 || m > 2     ? "K a multiple of 64, N of 16, 1-2 rows"
         : (k / prenorm_groups) % 64 != 0          ? "prenorm groups of whole 64-wide groups"
         : threads % 32 != 0 || warps < 1 || warps > 32 || warps > k / 64
             ? "threads a multiple of 32 up to 1024, a 64-wide group at least a warp"
             : nullptr;
}

// The integer-MMA launch at this shape, or nothing. imma: <= 0 never; > 0 always (refused with a
// reason where the kernel cannot take it), 1 with kImmaInflight groups in flight a warp, more: that
// many (up to 16). threads / blocks_per_sm: overrides (0 = auto). Not the
// default anywhere: on the H200 (2026-12-01) its kernel beat the block layout at the mamba in_proj and
// MLP up_proj under Nsight Compute (32.6 against 34.6 us, 24.9 against 26.3; f32 x, one row), but the
// LLM step taking it there was slower in every alternating A/B run on two machines (waited 4.04 - 6.29
// against 3.73 - 5.09 ms), likely for its longer text (see cuda_sources.cpp); docs/developing.md.
std::optional<ImmaLaunch> pick_imma(int k, int n, int m, int group_size, int bits, bool takes_norm,
                                    int prenorm_groups, int threads, int imma, int blocks_per_sm, int device_index,
                                    const char* who) {
  if (imma <= 0) {
    return std::nullopt;
  }
  // 8 warps a block, fewer where K has fewer 64-wide groups (each warp takes one at least)
  const int warps = threads > 0 ? threads / 32 : std::max(1, std::min(8, k / 64));
  const int groups = k / 64;
  const int smem = groups * (64 * kImmaLevels * m + 20 * m);
  const char* why = !integer_mma(device_index) ? "a GPU with integer MMA (sm_80 or newer)"
                    : imma_shape_refusal(k, n, m, group_size, bits, takes_norm, prenorm_groups, threads, warps);
  if (!why) {
    why = smem + kStreamStaticSmem > kSmemPerSm ? "x's expansion inside 227 KB of shared memory"
          : imma > 16                           ? "at most 16 groups in flight a warp"
                                                : nullptr;
  }
  if (why) {
    throw std::invalid_argument(std::string(who) + ": the integer-MMA layout takes " + why);
  }
  // a persistent grid must be resident at once: 80 registers a thread (ptxas: 72-80) bound it too
  const int per_sm = blocks_per_sm > 0 ? blocks_per_sm
                                       : std::max(1, std::min({2048 / (32 * warps), 65536 / (80 * 32 * warps),
                                                               kSmemPerSm / (smem + kStreamStaticSmem)}));
  return ImmaLaunch{warps, std::min(n / 16, kSmCount * per_sm), smem, imma > 1 ? imma : kImmaInflight};
}

// vc_qmv_imma_stream's launch: 8 warps a block (fewer where K has fewer 64-wide groups), the
// expansion and `stages` 16-row slabs in shared memory. forced (`imma` > 0 with `stages` > 0): refused
// with a reason where the kernel cannot take it; else (the default's pick) nothing there.
struct ImmaStreamLaunch {
  int warps, blocks, smem, stages, slab;
};

// Whether the default (`stages` and `imma` 0) takes vc_qmv_imma_stream (2 stages): one row, the wide
// outputs of a 4480-wide input (the mamba in_proj, the MLP up_proj). Nsight Compute on the H200,
// 2026-12-03, f32 x, one launch, against the float streamed layout (2 stages): in_proj 22656x4480
// 26.05 -> 21.50 us (warp instructions 12.5 M -> 7.8 M; 3 stages 22.59, 16 warps 23.10), up_proj
// 15680x4480 20.90 -> 16.48 us. out_proj's K = 10240 leaves one block an SM (its slabs and x's
// expansion in 226.9 of 227 KiB): there it lost on 2026-12-04 too, with its scale rows padded and
// both walks ramped (qmv_timeline.py on one machine: the last slab stored at 14.7 us with 12 warps
// against the float layout's 12.1; ncu with 10 warps 17.73 against 15.39). down_proj's K = 15680 does
// not fit: the float one there.
bool default_imma_stream(int k, int n, int m) { return m == 1 && n >= 8192 && k < 8192; }

// rows: a slab's (0 = 16; 8, for one row of x, takes the weights as the MMA's B operand: not the
// default anywhere until measured on a GPU).
std::optional<ImmaStreamLaunch> pick_imma_stream(int k, int n, int m, int group_size, int bits, int scale_bytes,
                                                 bool takes_norm, int prenorm_groups, int rows, int threads,
                                                 int stages, int blocks_per_sm, bool forced, bool imma_and_bulk,
                                                 const char* who) {
  const int warps = threads > 0 ? threads / 32 : std::max(1, std::min(8, k / 64));
  const int groups = k / 64;
  const int slab_rows = rows > 0 ? rows : 16;
  const int expansion = (groups * (64 * kImmaLevels * m + 20 * m) + 127) / 128 * 128;
  const int row_stride = (k / 8) % 16 == 0 ? k / 2 + 32 : k / 2;  // padded as the kernel's Stage
  const int scale_row = groups * scale_bytes;
  const int slab = slab_rows * row_stride + 2 * slab_rows * (scale_row % 32 == 0 ? scale_row + 16 : scale_row);
  const int smem = expansion + stages * slab;
  // its own arrays, as the float one's
  const int own = stream_static_smem(stages, 32 * warps, slab_rows, m, prenorm_groups);
  const char* why = !imma_and_bulk ? "a GPU with integer MMA and bulk copies (sm_90 or newer)"
                        : imma_shape_refusal(k, n, m, group_size, bits, takes_norm, prenorm_groups, threads, warps);
  if (!why) {
    why = slab_rows != 16 && (slab_rows != 8 || m != 1) ? "slabs of 16 rows, or of 8 for one row of x"
          : prenorm_groups > slab_rows ? "as many prenorm groups as a slab's rows at most (they hold their totals)"
          : stages < 2 || smem + own > kSmemPerSm ? "2 stages at least, inside 227 KB of shared memory"
                                                  : nullptr;
  }
  if (why) {
    if (!forced) {
      return std::nullopt;
    }
    throw std::invalid_argument(std::string(who) + ": the streamed integer-MMA layout takes " + why);
  }
  // a persistent grid must be resident at once: registers (assumed 96 a thread) bound it too
  const int per_sm = blocks_per_sm > 0 ? blocks_per_sm
                                       : std::max(1, std::min({2048 / (32 * warps), 65536 / (96 * 32 * warps),
                                                               kSmemPerSm / (smem + own)}));
  return ImmaStreamLaunch{warps, std::min(n / slab_rows, kSmCount * per_sm), smem, stages, slab_rows};
}

// The block layout's row groups a block where a call leaves them to the default (row_groups 0):
// VOICECHAT_QMV_ROW_GROUPS, 1 to kMaxRowGroups, read once (an A/B on the GPU without a rebuild),
// else 1. A bad value is an error at every call, on every backend.
int default_row_groups() {
  static const int groups = [] {
    const char* value = std::getenv("VOICECHAT_QMV_ROW_GROUPS");
    if (value == nullptr || *value == '\0') {
      return 1;
    }
    char* end = nullptr;
    const long n = std::strtol(value, &end, 10);
    return *end == '\0' && n >= 1 && n <= kMaxRowGroups ? static_cast<int>(n) : -1;
  }();
  if (groups < 0) {
    throw std::invalid_argument("VOICECHAT_QMV_ROW_GROUPS must be an integer in [1, " +
                                std::to_string(kMaxRowGroups) + "]");
  }
  return groups;
}

// What quantized_matvec and quantized_matvec_emit_norm share: [out] or, with next_norm, [out,
// normed, partials] (normed = out * next_norm, partials [..., P] whose sum is each row's sum of out^2).
std::vector<mx::array> quantized_matvec_impl(const mx::array& x, const mx::array& w, const mx::array& scales,
                                             const mx::array& biases, const std::optional<mx::array>& bias,
                                             int group_size, int bits, int rows_per_block, int threads, int warps,
                                             const std::optional<mx::array>& residual, const std::string& activation,
                                             const std::optional<mx::array>& norm_weight, float norm_eps,
                                             const std::optional<Prenorm>& prenorm,
                                             const std::optional<mx::array>& next_norm, int stages,
                                             int blocks_per_sm, int imma, int row_groups, int dp4a, mx::Stream s) {
  const char* who = next_norm ? "quantized_matvec_emit_norm" : "quantized_matvec";
  const auto [n, k] = check_quantized(x, w, scales, biases, group_size, bits);
  const Epilogue epi = make_epilogue(residual, activation, n, who);
  auto fail = [who](const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); };
  const int auto_row_groups = default_row_groups();
  if (row_groups < 0 || row_groups > kMaxRowGroups) {
    fail("row_groups must be in [0, " + std::to_string(kMaxRowGroups) + "] (0 = auto)");
  }
  if (row_groups > 1 && (warps > 0 || stages > 0 || imma > 0)) {
    fail("row_groups > 1 takes the block layout (warps 0 or -1, no stages, no imma)");
  }
  if (!dp4a_taken(dp4a) || (dp4a > 0 && (warps > 0 || imma > 0 || row_groups > 1 || stages < 0))) {
    fail("dp4a must be -1, 0, 3 or 4 and takes the float streamed layout (no warps, imma or row_groups; "
         "stages >= 0)");
  }
  if (norm_weight && (norm_weight->ndim() != 1 || norm_weight->shape(0) != k || !float_dtype(norm_weight->dtype()))) {
    fail("norm_weight must be a float array [K] with K = " + std::to_string(k));
  }
  const int m = leading_rows(x);
  if (prenorm) {
    const auto& p = prenorm->partials;
    if (norm_weight) fail("norm_weight and prenormed partials cannot be combined");
    if (prenorm->groups < 1 || k % prenorm->groups != 0) fail("prenorm groups must divide K = " + std::to_string(k));
    if (!float_dtype(p.dtype()) || p.ndim() != x.ndim() || m == 0 || p.shape(-1) % prenorm->groups != 0 ||
        static_cast<int>(p.size()) != m * p.shape(-1)) {
      fail("partials must be a float array [..., P] with x's leading shape and P a multiple of the groups");
    }
  }
  if (next_norm) {
    if (!epi.residual) fail("the next norm's input is emitted after a residual: pass residual");
    if (next_norm->ndim() != 1 || next_norm->shape(0) != n || !float_dtype(next_norm->dtype())) {
      fail("next_norm must be a float array [N] with N = " + std::to_string(n));
    }
  }
  const int chunk = 128 / bits;  // values per 16-byte chunk: a group's scale must cover whole chunks
  const bool prenorm_fits = !prenorm || ((k / prenorm->groups) % chunk == 0 && prenorm->partials.dtype() == mx::float32);
  const bool kernel_path = gpu_stream(s) && cuda_build() && m >= 1 && m <= kMaxRows && float_dtype(x.dtype()) &&
                           float_dtype(scales.dtype()) && biases.dtype() == scales.dtype() &&
                           (!bias || (bias->ndim() == 1 && bias->shape(0) == n && float_dtype(bias->dtype()))) &&
                           kernel_takes(epi, m, n) && prenorm_fits;
  if (!kernel_path) {
    // The prologues composed: MLX's rms_norm or the producer's scales, then the product.
    auto in = norm_weight ? mx::fast::rms_norm(x, *norm_weight, norm_eps, s)
              : prenorm   ? apply_prenorm(x, *prenorm, norm_eps, s)
                          : x;
    auto y = mx::quantized_matmul(in, w, scales, biases, true, group_size, bits, "affine", s);
    auto out = compose_epilogue(bias ? mx::add(y, *bias, s) : y, epi, s);
    if (!next_norm) {
      return {out};
    }
    auto out32 = mx::astype(out, mx::float32, s);
    auto normed = mx::multiply(out32, mx::astype(*next_norm, mx::float32, s), s);
    return {out, normed, mx::sum(mx::square(out32, s), -1, true, s)};
  }
  const auto out_dtype = output_dtype(x.dtype(), scales.dtype(), bias, epi);
  // The norm prologues and the emitted norm input are the block layout's: they take it whatever the default.
  const bool block_only = norm_weight || prenorm || next_norm;
  // A group-norm prologue keeps each step's sums apart until the groups' scales are known: with
  // several steps a thread that costs registers (the Mamba out_proj, 4480x10240 with 8 groups: 168
  // registers at 160 threads, 2 steps each, against 80 at 320 threads, one step each: 29.6 against
  // 27.0 us under Nsight Compute on the H200). So such a launch takes one step a thread: the float
  // layouts' threads (float_threads); the integer-MMA layouts keep their own warps (given 320
  // threads at out_proj, 10 warps against their 8, until 2026-12-04).
  const int chunks = k * bits / 128;
  const int float_threads = one_step_threads(chunks, prenorm ? prenorm->groups : 1, threads);
  const bool grouped = row_groups > 1;  // the block layout, asked for by its row groups
  const bool forced_imma_stream = imma > 0 && stages > 0 && warps <= 0 && !grouped;
  const bool default_layout = imma == 0 && stages == 0 && warps <= 0 && rows_per_block <= 0 && !grouped && dp4a <= 0;
  const auto imma_streamed =
      forced_imma_stream || (default_layout && default_imma_stream(k, n, m))
          ? pick_imma_stream(k, n, m, group_size, bits, static_cast<int>(scales.itemsize()), !norm_weight,
                             prenorm ? prenorm->groups : 1, forced_imma_stream ? rows_per_block : 0, threads,
                             forced_imma_stream ? stages : 2, blocks_per_sm,
                             forced_imma_stream, integer_mma(s.device.index) && bulk_copies(s.device.index), who)
          : std::nullopt;
  if (imma_streamed) {
    const ImmaStreamLaunch& l = *imma_streamed;
    return launch_persistent(qmv_imma_stream_source(), qmv_imma_stream_emit_source(),
                             {{"K", k}, {"N", n}, {"M", m}, {"WARPS", l.warps}, {"LEVELS", kImmaLevels},
                              {"STAGES", l.stages}, {"SLAB", l.slab}},
                             n / l.slab, l.blocks, 32 * l.warps, l.smem, x, w, scales, biases, bias, epi, prenorm,
                             next_norm, norm_eps, out_dtype, s);
  }
  const auto mma = warps > 0 || grouped || dp4a > 0 ? std::nullopt
                             : pick_imma(k, n, m, group_size, bits, !norm_weight, prenorm ? prenorm->groups : 1,
                                         threads, imma, blocks_per_sm, s.device.index, who);
  if (mma) {
    return launch_persistent(qmv_imma_source(), qmv_imma_emit_source(),
                             {{"K", k}, {"N", n}, {"M", m}, {"WARPS", mma->warps}, {"LEVELS", kImmaLevels},
                              {"INFLIGHT", mma->inflight}},
                             n / 16, mma->blocks, 32 * mma->warps, mma->smem, x, w, scales, biases, bias, epi, prenorm,
                             next_norm, norm_eps, out_dtype, s);
  }
  const auto streamed = warps > 0 || grouped ? std::nullopt
                                  : pick_stream(k, n, m, group_size, bits, static_cast<int>(scales.itemsize()),
                                                x.dtype() == mx::float32, !norm_weight, prenorm ? prenorm->groups : 1,
                                                rows_per_block, float_threads, dp4a > 0 && stages == 0 ? 2 : stages,
                                                blocks_per_sm, stage_x_setting(), dp4a,
                                                bulk_copies(s.device.index), who);
  if (dp4a > 0 && !streamed) {
    fail("dp4a takes the float streamed layout, which this GPU or call does not");
  }
  if (streamed) {
    const StreamLaunch& l = *streamed;
    return launch_persistent(qmv_stream_source(), qmv_stream_emit_source(),
                             {{"GROUP", group_size}, {"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows},
                              {"THREADS", l.threads}, {"STAGES", l.stages}, {"XS", l.stage_x}, {"SPLIT", l.split},
                              {"LEVELS", l.levels}},
                             l.partials, l.blocks, l.threads, l.smem, x, w, scales, biases, bias, epi, prenorm, next_norm,
                             norm_eps, out_dtype, s);
  }
  Launch l = pick_launch(chunks, n, rows_per_block, float_threads, block_only || grouped ? 0 : warps);
  l.row_groups = grouped ? row_groups : l.warps == 0 && !next_norm ? auto_row_groups : 1;
  const bool warp = l.warps > 0;
  // x and the residual go in with their own shapes (the kernel reads them flat, row-contiguous as
  // MLX makes every kernel input) and the output comes out shaped: no reshape nodes in the graph.
  std::vector<mx::array> inputs = {x, w, scales, biases, bias ? *bias : scales, epi.residual ? *epi.residual : scales};
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> args = {
      {"BITS", bits}, {"GROUP", group_size}, {"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows},
      {warp ? "WARPS" : "THREADS", warp ? l.warps : l.threads}, {"HAS_BIAS", bias.has_value()},
      {"TX", x.dtype()}, {"TS", scales.dtype()}, {"TB", bias ? bias->dtype() : scales.dtype()},
      {"TR", epi.residual ? epi.residual->dtype() : scales.dtype()}, {"TO", out_dtype}};
  if (!next_norm) {
    args.emplace_back("EPI", epi.kind());
  }
  if (!warp) {
    const int np = prenorm ? prenorm->partials.shape(-1) : 0;
    inputs.push_back(norm_weight ? *norm_weight : prenorm ? prenorm->partials : scales);
    args.emplace_back("NORM", norm_weight ? 1 : prenorm ? 2 : 0);
    args.emplace_back("EPS_BITS", norm_weight || prenorm ? float_bits(norm_eps) : 0);
    args.emplace_back("NP", np);
    args.emplace_back("NG", prenorm ? prenorm->groups : 1);
    args.emplace_back("TN", inputs[6].dtype());
    if (!next_norm) {
      args.emplace_back("RG", l.row_groups);
    }
  }
  const int blocks = blocks_for(l, n);
  if (!next_norm) {
    return kernel(warp ? qmv_warp_source() : qmv_source())(inputs, {out_shape(x, n)}, {out_dtype},
                                                           {blocks * l.threads, 1, 1}, {l.threads, 1, 1}, args,
                                                           std::nullopt, false, s);
  }
  inputs.push_back(*next_norm);
  args.emplace_back("TE", next_norm->dtype());
  return kernel(qmv_emit_source())(inputs, {out_shape(x, n), out_shape(x, n), out_shape(x, blocks)},
                                   {out_dtype, mx::float32, mx::float32}, {blocks * l.threads, 1, 1},
                                   {l.threads, 1, 1}, args, std::nullopt, false, s);
}

std::optional<Prenorm> make_prenorm(const std::optional<mx::array>& partials, int groups) {
  if (!partials) {
    return std::nullopt;
  }
  return Prenorm{*partials, groups};
}

mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           const std::optional<mx::array>& bias, int group_size, int bits, int rows_per_block,
                           int threads, int warps, const std::optional<mx::array>& residual,
                           const std::string& activation, const std::optional<mx::array>& norm_weight, float norm_eps,
                           const std::optional<mx::array>& prenormed, int prenorm_groups, int stages,
                           int blocks_per_sm, int imma, int row_groups, int dp4a, mx::StreamOrDevice s) {
  return quantized_matvec_impl(x, w, scales, biases, bias, group_size, bits, rows_per_block, threads, warps, residual,
                               activation, norm_weight, norm_eps, make_prenorm(prenormed, prenorm_groups),
                               std::nullopt, stages, blocks_per_sm, imma, row_groups, dp4a, mx::to_stream(s))[0];
}

std::vector<mx::array> quantized_matvec_emit_norm(const mx::array& x, const mx::array& w, const mx::array& scales,
                                                  const mx::array& biases, const mx::array& residual,
                                                  const mx::array& next_norm, const std::optional<mx::array>& bias,
                                                  int group_size, int bits, const std::optional<mx::array>& prenormed,
                                                  int prenorm_groups, float norm_eps, int rows_per_block, int threads,
                                                  int stages, int blocks_per_sm, int imma, int dp4a,
                                                  mx::StreamOrDevice s) {
  return quantized_matvec_impl(x, w, scales, biases, bias, group_size, bits, rows_per_block, threads, 0, residual, "",
                               std::nullopt, norm_eps, make_prenorm(prenormed, prenorm_groups), next_norm, stages,
                               blocks_per_sm, imma, 1, dp4a, mx::to_stream(s));
}

// ---------------------------------------------------------------- dense matvec

// gelu_tanh(x[..., :K]) * x[..., K:], in the ops of mlx.nn.gelu_approx.
mx::array gelu_gate_composed(const mx::array& x, int k, mx::Stream s) {
  mx::Shape start(x.ndim(), 0), mid = x.shape(), stop = x.shape();
  mid.back() = k;
  start.back() = k;
  auto g = mx::slice(x, mx::Shape(x.ndim(), 0), mid, s);
  auto up = mx::slice(x, start, stop, s);
  auto cube = mx::power(g, mx::array(3.0f, g.dtype()), s);
  auto inner = mx::multiply(mx::array(0.7978845608028654f, g.dtype()),
                            mx::add(g, mx::multiply(mx::array(0.044715f, g.dtype()), cube, s), s), s);
  auto gelu = mx::multiply(mx::multiply(mx::array(0.5f, g.dtype()), g, s),
                           mx::add(mx::array(1.0f, g.dtype()), mx::tanh(inner, s), s), s);
  return mx::multiply(gelu, up, s);
}

mx::array dense_matvec(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                       int rows_per_block, int threads, int warps, const std::optional<mx::array>& residual,
                       const std::string& activation, const std::string& input, mx::StreamOrDevice s_) {
  if (w.ndim() != 2) {
    throw std::invalid_argument("dense_matvec: weight must be [N, K]");
  }
  const int n = w.shape(0), k = w.shape(1);
  const Epilogue epi = make_epilogue(residual, activation, n, "dense_matvec");
  if (!input.empty() && input != "gelu_gate") {
    throw std::invalid_argument("dense_matvec: input must be '' or 'gelu_gate', not '" + input + "'");
  }
  const bool gated = input == "gelu_gate";  // x [..., 2K]: gelu(gate) * up feeds the product
  if (x.ndim() < 1 || x.shape(-1) != (gated ? 2 * k : k)) {
    throw std::invalid_argument(gated ? "dense_matvec: x [..., 2K] (gate, up) does not match the weight's K = " +
                                            std::to_string(k)
                                      : "dense_matvec: x [..., K] does not match the weight's K = " + std::to_string(k));
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != n)) {
    throw std::invalid_argument("dense_matvec: bias must be [N]");
  }
  auto s = mx::to_stream(s_);
  const int m = leading_rows(x);
  const bool kernel_path = gpu_stream(s) && cuda_build() && m >= 1 && m <= kMaxRows && k % 8 == 0 &&
                           float_dtype(x.dtype()) && float_dtype(w.dtype()) && (!bias || float_dtype(bias->dtype())) &&
                           kernel_takes(epi, m, n);
  if (!kernel_path) {
    auto in = gated ? gelu_gate_composed(x, k, s) : x;
    auto y = bias ? mx::addmm(*bias, in, mx::transpose(w, s), 1.0f, 1.0f, s) : mx::matmul(in, mx::transpose(w, s), s);
    return compose_epilogue(y, epi, s);
  }
  const auto out_dtype = output_dtype(x.dtype(), w.dtype(), bias, epi);
  const Launch l = pick_launch(k * static_cast<int>(w.itemsize()) / 16, n, rows_per_block, threads, warps);
  const bool warp = l.warps > 0;
  auto outs = kernel(warp ? dense_warp_source() : dense_source())(
      {x, w, bias ? *bias : w, epi.residual ? *epi.residual : w},  // flat, as in quantized_matvec
      {out_shape(x, n)}, {out_dtype}, {blocks_for(l, n) * l.threads, 1, 1}, {l.threads, 1, 1},
      {{"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows}, {warp ? "WARPS" : "THREADS", warp ? l.warps : l.threads},
       {"EPI", epi.kind()}, {"PRO", gated ? 1 : 0}, {"HAS_BIAS", bias.has_value()}, {"TX", x.dtype()}, {"TW", w.dtype()},
       {"TB", bias ? bias->dtype() : w.dtype()}, {"TR", epi.residual ? epi.residual->dtype() : w.dtype()},
       {"TO", out_dtype}},
      std::nullopt, false, s);
  return outs[0];
}

// ---------------------------------------------------------------- sandwich-norm seam + dense matvec

// (out, h') with h' = h + rms_norm(y) * post and out = (rms_norm(h') * pre) @ w.T (+ bias): one launch
// on a CUDA stream for 1-2 float32 rows; MLX ops elsewhere. Without post, h' = h + y; without y (and
// post), h' = h: an input norm and the product.
std::vector<mx::array> dense_add_norm_matvec(const mx::array& h, const std::optional<mx::array>& y,
                                             const std::optional<mx::array>& post, const mx::array& pre, float eps,
                                             const mx::array& w, const std::optional<mx::array>& bias,
                                             mx::StreamOrDevice s_) {
  if (w.ndim() != 2) {
    throw std::invalid_argument("dense_add_norm_matvec: weight must be [N, K]");
  }
  const int n = w.shape(0), k = w.shape(1);
  if (h.ndim() < 1 || h.shape(-1) != k || (y && y->shape() != h.shape())) {
    throw std::invalid_argument("dense_add_norm_matvec: h and y must be [..., K] alike with K = " + std::to_string(k));
  }
  if (post && !y) {
    throw std::invalid_argument("dense_add_norm_matvec: post needs y (the branch it norms)");
  }
  if ((post && post->shape() != mx::Shape{k}) || pre.shape() != mx::Shape{k}) {
    throw std::invalid_argument("dense_add_norm_matvec: post and pre must be [K]");
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != n)) {
    throw std::invalid_argument("dense_add_norm_matvec: bias must be [N]");
  }
  auto s = mx::to_stream(s_);
  const int m = leading_rows(h);
  const int seam = post ? 0 : y ? 1 : 2;
  const bool f32 = h.dtype() == mx::float32 && (!y || y->dtype() == mx::float32) &&
                   (!post || post->dtype() == mx::float32) && pre.dtype() == mx::float32;
  const bool kernel_path = gpu_stream(s) && cuda_build() && m >= 1 && m <= kMaxRows && k % 8 == 0 && k <= 4096 &&
                           f32 && float_dtype(w.dtype()) && (!bias || float_dtype(bias->dtype()));
  if (!kernel_path) {
    auto h2 = seam == 0 ? mx::add(h, mx::fast::rms_norm(*y, *post, eps, s), s) : seam == 1 ? mx::add(h, *y, s) : h;
    auto z = mx::fast::rms_norm(h2, pre, eps, s);
    auto out = bias ? mx::addmm(*bias, z, mx::transpose(w, s), 1.0f, 1.0f, s) : mx::matmul(z, mx::transpose(w, s), s);
    return {out, h2};
  }
  const Launch l = pick_launch(k * static_cast<int>(w.itemsize()) / 16, n, 0, 0, 0);
  auto outs = kernel(dense_add_norm_source())(
      {h, y ? *y : h, post ? *post : pre, pre, w, bias ? *bias : w},  // flat, as in quantized_matvec
      {out_shape(h, n), h.shape()}, {mx::float32, mx::float32}, {blocks_for(l, n) * l.threads, 1, 1}, {l.threads, 1, 1},
      {{"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows}, {"THREADS", l.threads}, {"HAS_BIAS", bias.has_value()},
       {"SEAM", seam}, {"EPS_BITS", float_bits(eps)}, {"TW", w.dtype()}, {"TB", bias ? bias->dtype() : w.dtype()},
       {"TO", mx::float32}},
      std::nullopt, false, s);
  return {outs[0], seam == 2 ? h : outs[1]};
}

// ---------------------------------------------------------------- two-head argmax

std::vector<mx::array> two_head_argmax_composed(const mx::array& x, const std::vector<mx::array>& a,
                                                const std::vector<mx::array>& b, int group_size, int bits,
                                                bool return_logits, mx::Stream s) {
  auto la = mx::quantized_matmul(x, a[0], a[1], a[2], true, group_size, bits, "affine", s);
  auto lb = mx::quantized_matmul(x, b[0], b[1], b[2], true, group_size, bits, "affine", s);
  auto ids = mx::astype(mx::stack({mx::argmax(la, -1, false, s), mx::argmax(lb, -1, false, s)}, -1, s), mx::int32, s);
  if (return_logits) {
    return {ids, la, lb};
  }
  return {ids};
}

// VOICECHAT_ARGMAX_STREAMED: "1" (or unset: the default) takes the streamed integer-MMA walk
// (vc_two_head_argmax_stream) for the two-head argmax wherever its shape allows, "0" the block layout (an
// A/B without a rebuild). Measured on an H100 (forty-third session, ncu, published heads): 222.5-223.2 us
// against the block layout's 260-264 (f32 x) and 225-226 (bf16 x), and its finish over 264 blocks' keys
// 3.4-3.7 us against 7.4-8.3. Read once.
int argmax_streamed_setting() {
  static const int mode = ab_switch("VOICECHAT_ARGMAX_STREAMED", {"0", "1"});
  return checked_switch(mode, "VOICECHAT_ARGMAX_STREAMED", "auto, 0 or 1");
}

// The streamed two-head argmax's keys and logits: both heads walked as one list of 16-row slabs
// (vc_stream::HeadsWalk), the streamed integer-MMA product, each block's best key a head and row of x
// (the finish kernel takes them). Nothing where the launch does not fit and `forced` is false.
std::optional<std::pair<std::vector<mx::array>, int>> streamed_argmax_keys(
    const mx::array& x, const std::vector<mx::array>& head_a, const std::vector<mx::array>& head_b, int n, int k,
    int m, int group_size, int bits, bool return_logits, mx::Dtype out_dtype, bool forced, mx::Stream s) {
  const auto l = pick_imma_stream(k, 2 * n, m, group_size, bits, static_cast<int>(head_a[1].itemsize()), true, 1, 0,
                                  0, 2, 0, forced, integer_mma(s.device.index) && bulk_copies(s.device.index),
                                  "two_head_argmax");
  if (!l) {
    return std::nullopt;
  }
  if (n % l->slab != 0) {
    if (!forced) {
      return std::nullopt;
    }
    throw std::invalid_argument("two_head_argmax: the streamed layout takes heads of whole 16-row slabs");
  }
  auto outs = kernel(imma_stream_argmax_source(), l->smem)(
      {x, head_a[0], head_a[1], head_a[2], head_b[0], head_b[1], head_b[2]},
      {{m, 2, l->blocks}, return_logits ? mx::Shape{2, m, n} : mx::Shape{1}}, {mx::int64, out_dtype},
      {l->blocks * 32 * l->warps, 1, 1}, {32 * l->warps, 1, 1},
      {{"K", k}, {"N", 2 * n}, {"M", m}, {"WARPS", l->warps}, {"LEVELS", kImmaLevels}, {"STAGES", l->stages},
       {"WRITE_LOGITS", return_logits}, {"TX", x.dtype()}, {"TS", head_a[1].dtype()}, {"TO", out_dtype}},
      std::nullopt, false, s);
  return std::make_pair(std::move(outs), l->blocks);
}

// head_a / head_b: (weight, scales, biases) of two quantized heads of one shape. Returns
// [ids] or [ids, logits_a, logits_b]; ids int32 [..., 2] (head a, head b). streamed: 1 the streamed
// integer-MMA walk (refused with a reason where the shape does not allow it), 0 the block layout, -1
// VOICECHAT_ARGMAX_STREAMED's pick (unset: the streamed walk; the block layout where it does not fit).
std::vector<mx::array> two_head_argmax(const mx::array& x, const std::vector<mx::array>& head_a,
                                       const std::vector<mx::array>& head_b, int group_size, int bits,
                                       bool return_logits, int rows_per_block, int threads, int streamed,
                                       mx::StreamOrDevice s_) {
  if (head_a.size() != 3 || head_b.size() != 3) {
    throw std::invalid_argument("two_head_argmax: each head is (weight, scales, biases)");
  }
  if (streamed < -1 || streamed > 1) {
    throw std::invalid_argument("two_head_argmax: streamed is -1 (the default's pick), 0 or 1");
  }
  const auto [n, k] = check_quantized(x, head_a[0], head_a[1], head_a[2], group_size, bits);
  for (int i = 0; i < 3; ++i) {
    if (head_b[i].shape() != head_a[i].shape() || head_b[i].dtype() != head_a[i].dtype()) {
      throw std::invalid_argument("two_head_argmax: the two heads must have the same shapes and dtypes");
    }
  }
  auto s = mx::to_stream(s_);
  const int m = leading_rows(x);
  const bool kernel_path = gpu_stream(s) && cuda_build() && m >= 1 && m <= kMaxRows && float_dtype(x.dtype()) &&
                           float_dtype(head_a[1].dtype()) && head_a[2].dtype() == head_a[1].dtype();
  if (!kernel_path) {
    return two_head_argmax_composed(x, head_a, head_b, group_size, bits, return_logits, s);
  }
  const auto out_dtype = mx::promote_types(x.dtype(), head_a[1].dtype());
  constexpr int kFinishThreads = 256;
  auto finish = [&](const mx::array& keys, int nb) {
    return kernel(argmax_finish_source())({keys}, {out_shape(x, 2)}, {mx::int32}, {2 * m * kFinishThreads, 1, 1},
                                          {kFinishThreads, 1, 1}, {{"NB", nb}, {"THREADS", kFinishThreads}},
                                          std::nullopt, false, s)[0];
  };
  if (streamed == 1 || (streamed == -1 && argmax_streamed_setting() != 0)) {
    if (auto keyed = streamed_argmax_keys(x, head_a, head_b, n, k, m, group_size, bits, return_logits, out_dtype,
                                          streamed == 1, s)) {
      auto& [outs, nb] = *keyed;
      auto ids = finish(outs[0], nb);
      if (!return_logits) {
        return {ids};
      }
      auto logits = [&](int head) {
        return mx::reshape(mx::slice(outs[1], {head, 0, 0}, {head + 1, m, n}, s), out_shape(x, n), s);
      };
      return {ids, logits(0), logits(1)};
    }
  }
  Launch l = pick_launch(k * bits / 128, n, rows_per_block, threads, 0);
  if (rows_per_block <= 0) {
    l.rows = kArgmaxRows;
  }
  const int row_groups = (n + l.rows - 1) / l.rows;
  const int nb = (row_groups + kArgmaxGroupsPerBlock - 1) / kArgmaxGroupsPerBlock;
  const mx::Shape logits_shape = return_logits ? out_shape(x, n) : mx::Shape{1};
  auto outs = kernel(argmax_source())(
      {x, head_a[0], head_a[1], head_a[2], head_b[0], head_b[1], head_b[2]},  // flat, as in quantized_matvec
      {{m, 2, nb}, logits_shape, logits_shape}, {mx::int64, out_dtype, out_dtype}, {2 * nb * l.threads, 1, 1},
      {l.threads, 1, 1},
      {{"BITS", bits}, {"GROUP", group_size}, {"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows}, {"THREADS", l.threads},
       {"GPB", kArgmaxGroupsPerBlock}, {"WRITE_LOGITS", return_logits}, {"TX", x.dtype()},
       {"TS", head_a[1].dtype()}, {"TO", out_dtype}},
      std::nullopt, false, s);
  auto ids = finish(outs[0], nb);
  if (!return_logits) {
    return {ids};
  }
  return {ids, outs[1], outs[2]};
}

// ---------------------------------------------------------------- bindings

// The streamed layouts' launches as quantized_matvec picks them on an sm_90 GPU (4-bit, group 64,
// bfloat16 scales, no RMSNorm weight), for the tools and tests that launch or size those kernels
// themselves: a dict of the launch, None where the default keeps another layout (stream_launch with
// stages 0), ValueError where the kernel cannot take a forced launch.
py::object stream_launch(int k, int n, int m, bool x_float32, int prenorm_groups, int rows, int threads, int stages,
                         int blocks_per_sm, int stage_x, int dp4a) {
  if (!dp4a_taken(dp4a)) {
    throw std::invalid_argument("stream_launch: dp4a must be -1, 0, 3 or 4");
  }
  const auto l = pick_stream(k, n, m, 64, 4, 2, x_float32, true, prenorm_groups, rows,
                             one_step_threads(k / 32, prenorm_groups, threads), stages, blocks_per_sm,
                             stage_x < 0 ? stage_x_setting() : stage_x, dp4a, true, "stream_launch");
  if (!l) {
    return py::none();
  }
  return py::dict(py::arg("rows") = l->rows, py::arg("threads") = l->threads, py::arg("stages") = l->stages,
                  py::arg("blocks") = l->blocks, py::arg("smem") = l->smem, py::arg("stage_x") = l->stage_x,
                  py::arg("split") = l->split, py::arg("partials") = l->partials, py::arg("levels") = l->levels,
                  py::arg("warp_groups") = l->warp_groups);
}

py::dict imma_stream_launch(int k, int n, int m, int prenorm_groups, int threads, int stages, int blocks_per_sm,
                            int rows) {
  const auto l = pick_imma_stream(k, n, m, 64, 4, 2, true, prenorm_groups, rows, threads, stages, blocks_per_sm, true,
                                  true, "imma_stream_launch");
  return py::dict(py::arg("warps") = l->warps, py::arg("blocks") = l->blocks, py::arg("smem") = l->smem,
                  py::arg("stages") = l->stages, py::arg("rows") = l->slab);
}

py::tuple launch_config(const std::string& kind, int k, int n, int bits, int itemsize) {
  const int chunks = kind == "dense" ? k * itemsize / 16 : k * bits / 128;
  Launch l = pick_launch(chunks, n, 0, 0, kind == "argmax" ? 0 : -1);
  if (kind == "argmax") {
    l.rows = kArgmaxRows;
  }
  return py::make_tuple(l.rows, l.threads, l.warps);
}

void bind(py::module_& m) {
  qmv_source();  // registered at import, so the compile check sees them
  qmv_emit_source();
  qmv_stream_source();
  qmv_stream_emit_source();
  qmv_imma_source();
  qmv_imma_emit_source();
  qmv_imma_stream_source();
  qmv_imma_stream_emit_source();
  qmv_warp_source();
  dense_source();
  dense_add_norm_source();
  dense_warp_source();
  argmax_source();
  imma_stream_argmax_source();
  argmax_finish_source();
  m.def("quantized_matvec", &quantized_matvec, py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("biases"),
        py::arg("bias") = py::none(), py::arg("group_size") = 64, py::arg("bits") = 4, py::arg("rows_per_block") = 0,
        py::arg("threads") = 0, py::arg("warps") = -1, py::arg("residual") = py::none(),
        py::arg("activation") = "", py::arg("norm_weight") = py::none(), py::arg("norm_eps") = 1e-5f,
        py::arg("prenormed") = py::none(), py::arg("prenorm_groups") = 1, py::arg("stages") = 0,
        py::arg("blocks_per_sm") = 0, py::arg("imma") = 0, py::arg("row_groups") = 0, py::arg("dp4a") = 0,
        py::arg("stream") = py::none(),
        "x @ dequantize(w).T (+ bias), then relu(.)^2 (activation='relu_squared') or + residual, for 1-2 "
        "rows of x: our CUDA kernel (one launch, the epilogue included) on a CUDA stream, "
        "mx.quantized_matmul and MLX ops elsewhere. Launch overrides: rows_per_block / threads (0 = auto), "
        "warps (-1 = auto, 0 = block layout, > 0 = warp layout with that many warps per block). norm_weight: "
        "an RMSNorm of x first (rms_norm(x, norm_weight, norm_eps)), formed in the same launch. prenormed: "
        "x is a norm's input already times its weight and prenormed [..., P] float32 partial sums of its "
        "squares (prenorm_groups equal channel groups, each over P / groups consecutive partials); each "
        "group is scaled by rsqrt(sum / group width + norm_eps) in the same launch. stages: the streamed "
        "layout (4-bit; a persistent grid, each block `stages` tiles of rows_per_block rows in flight through "
        "bulk copies into shared memory, blocks_per_sm blocks an SM): -1 never, 0 where the default picks it, "
        "> 0 always (an error where it cannot take the call). imma: the integer-MMA layout (4-bit group 64; "
        "16-row slabs on the tensor cores, x as a block floating point expansion; threads and blocks_per_sm "
        "steer it): -1 never, > 0 always (an error where it cannot take the call); 1 with the default number of "
        "64-wide groups in flight a warp, 2-16 that many; with stages > 0 as well, on the streamed layout's "
        "tiles (rows_per_block 0 / 16: 16-row slabs; 8, for one row of x: 8-row slabs with the weights as the "
        "MMA's other operand, which fit where 16 rows do not). 0 (with stages and rows_per_block 0): the default picks, the streamed integer MMA for one "
        "row where K < 8192 and N >= 8192. row_groups (block layout): each "
        "block computes that many groups of rows_per_block rows one after the other (0 / 1: one; > 1 takes the "
        "block layout, the streamed and integer-MMA ones never). dp4a (3 or 4): the float streamed layout with its "
        "products as integer dot products (dp4a), each thread's 32 values of x as that many int8 terms (6 + 7 "
        "(dp4a - 1) bits below their largest |x|); -1: the float pair form (5 instructions a pair of weights); 0: "
        "the default, dp4a 4 for one row of x, else the pair form.");
  m.def("quantized_matvec_emit_norm", &quantized_matvec_emit_norm, py::arg("x"), py::arg("w"), py::arg("scales"),
        py::arg("biases"), py::arg("residual"), py::arg("next_norm"), py::arg("bias") = py::none(),
        py::arg("group_size") = 64, py::arg("bits") = 4, py::arg("prenormed") = py::none(),
        py::arg("prenorm_groups") = 1, py::arg("norm_eps") = 1e-5f, py::arg("rows_per_block") = 0,
        py::arg("threads") = 0, py::arg("stages") = 0, py::arg("blocks_per_sm") = 0, py::arg("imma") = 0,
        py::arg("dp4a") = 0, py::arg("stream") = py::none(),
        "[out, normed, partials]: out = x @ dequantize(w).T (+ bias) + residual, and the next RMSNorm's input "
        "left for its matvec: normed = out * next_norm (float32) and partials [..., P] (float32) whose sum "
        "is each row's sum of out^2 (pass both as that matvec's x and prenormed). One CUDA launch; MLX ops "
        "elsewhere (P = 1 there; P = N / rows_per_block in the streamed layout, see quantized_matvec's stages, "
        "N / 16 with imma, N / 8 with its 8-row slabs; the float streamed layout's last round cut in parts adds a "
        "partial a part: stream_launch's partials).");
  m.def("dense_matvec", &dense_matvec, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::arg("rows_per_block") = 0, py::arg("threads") = 0, py::arg("warps") = -1,
        py::arg("residual") = py::none(), py::arg("activation") = "", py::arg("input") = "",
        py::arg("stream") = py::none(),
        "x @ w.T (+ bias), then the epilogue, for 1-2 rows of x: our CUDA kernel on a CUDA stream, MLX's "
        "matmul elsewhere (epilogue and launch overrides as quantized_matvec's). input='gelu_gate': x is "
        "[..., 2K] and gelu_tanh(x[..., :K]) * x[..., K:] is the product's input (formed as the kernel loads it).");
  m.def("dense_add_norm_matvec", &dense_add_norm_matvec, py::arg("h"), py::arg("y").none(true), py::arg("post").none(true), py::arg("pre"),
        py::arg("eps"), py::arg("w"), py::arg("bias") = py::none(), py::arg("stream") = py::none(),
        "[out, h'] with h' = h + rms_norm(y) * post and out = (rms_norm(h') * pre) @ w.T (+ bias): the "
        "sandwich-norm seam and the next dense matvec in one CUDA launch for 1-2 float32 rows; MLX ops elsewhere. "
        "post=None: h' = h + y; y=None (and post=None): h' = h, the input norm and the product.");
  m.def("two_head_argmax", &two_head_argmax, py::arg("x"), py::arg("head_a"), py::arg("head_b"),
        py::arg("group_size") = 64, py::arg("bits") = 4, py::arg("return_logits") = false,
        py::arg("rows_per_block") = 0, py::arg("threads") = 0, py::arg("streamed") = -1,
        py::arg("stream") = py::none(),
        "argmax over both quantized heads (weight, scales, biases) in one pass: [ids int32 [..., 2]] "
        "or [ids, logits_a, logits_b]. streamed (CUDA, sm_90): 1 the streamed integer-MMA walk over both "
        "heads, 0 the block layout, -1 VOICECHAT_ARGMAX_STREAMED's pick (unset: streamed where it fits).");
  m.def("gemv_launch_config", &launch_config, py::arg("kind"), py::arg("k"), py::arg("n"), py::arg("bits") = 4,
        py::arg("itemsize") = 2, "(rows per block or per warp, threads per block, warps per block (0: block layout)) the kernels "
        "pick for a shape.");
  m.def("stream_launch", &stream_launch, py::arg("k"), py::arg("n"), py::arg("m") = 1, py::arg("x_float32") = true,
        py::arg("prenorm_groups") = 1, py::arg("rows") = 0, py::arg("threads") = 0, py::arg("stages") = 0,
        py::arg("blocks_per_sm") = 0, py::arg("stage_x") = -1, py::arg("dp4a") = 0,
        "The float streamed layout's launch as quantized_matvec picks it on an sm_90 GPU (4-bit, group 64, "
        "bfloat16 scales): {rows, threads, stages, blocks, smem (dynamic bytes), stage_x, split (the parts a "
        "last-round tile is cut into), partials (the emitting kernel's partial sums a row of x)}. stages 0: the "
        "float layouts' default, None where that is the block layout; ValueError where a forced launch "
        "cannot be taken. stage_x -1: as quantized_matvec (VOICECHAT_QMV_STAGE_X, else the default's "
        "pick), 0 / 1 / 2 that mode where the kernel takes it. split follows VOICECHAT_QMV_SPLIT (auto, 1 or any). "
        "levels: the product's int8 terms of x (quantized_matvec's dp4a; 0: the pair form). warp_groups: "
        "the groups of warps a tile's rows are shared among (threads a whole multiple, two or more, of the "
        "32 x ceil(K / 1024) that K takes), else 1.");
  m.def("imma_stream_launch", &imma_stream_launch, py::arg("k"), py::arg("n"), py::arg("m") = 1,
        py::arg("prenorm_groups") = 1, py::arg("threads") = 0, py::arg("stages") = 2, py::arg("blocks_per_sm") = 0,
        py::arg("rows") = 0,
        "The streamed integer-MMA layout's launch (quantized_matvec(..., imma=1, stages=..., rows_per_block=rows)) "
        "on an sm_90 GPU: {warps, blocks, smem, stages, rows (a slab's: 16, or 8 for one row of x)}; ValueError "
        "where the kernel cannot take it.");
}

}  // namespace
VC_REGISTER(bind);
}  // namespace voicechat
