// Decode-speed matrix-vector products: 1-2 rows of activations against a large weight.
//
//   quantized_matvec : x @ dequant(w).T for MLX's affine 4- / 8-bit packing (group 32/64/128)
//   dense_matvec     : x @ w.T for bfloat16 / float16 / float32 weights
//   two_head_argmax  : argmax of x @ dequant(w_a).T and of x @ dequant(w_b).T (the LLM's lm_head
//                      and function_head) without writing the logits (unless asked to)
//
// CUDA: our kernels (csrc/kernels/gemv, put together in gemv_sources.cpp) through
// fast::cuda_kernel, activations float32 or bfloat16 at the same speed, float32 accumulation. Everywhere else, and for shapes the kernels do not
// cover, MLX's own ops (which are also the references). Each shape has one launch: the block
// layout, or on sm_90 for one row of x at the wide shapes a persistent layout (pick_stream,
// pick_imma_stream).
#include "voicechat/gemv.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "cuda/cuda_sources.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "ops/gemv_sources.h"

namespace mx = mlx::core;

namespace voicechat {
namespace {

using gemv::argmax_finish_source;
using gemv::dense_add_norm_source;
using gemv::dense_source;
using gemv::imma_stream_argmax_source;
using gemv::qmv_emit_source;
using gemv::qmv_imma_stream_emit_source;
using gemv::qmv_imma_stream_source;
using gemv::qmv_source;
using gemv::qmv_stream_emit_source;
using gemv::qmv_stream_source;

// ---------------------------------------------------------------- launch shapes

constexpr int kMaxRows = 2;    // input rows the dense kernels take (decode: batch 1, or 2)

// Input rows the 4-bit kernels take: 1, 2 or 4 (the persistent layouts' sums a tile are a power of two).
// Each shape takes one layout and one launch at every row count, so that a row's output has the same
// bits whichever rows come with it (a session's step alone or in a batch).
bool quantized_rows(int m) { return m == 1 || m == 2 || m == 4; }
constexpr int kSmCount = 132;  // the SMs of the sm_90 parts the grids are sized for

// The block layout's launch: `rows` output rows a block, `threads` splitting K.
struct Launch {
  int rows;
  int threads;
};

// Threads: enough to cover a row's 16-byte chunks in ceil(chunks / 256) steps, in whole warps (K =
// 4480 at 4 bits: 140 chunks -> 160 threads, one step), unless `threads` > 0 asks for a count. Rows
// per block: 8 (each chunk of x loaded serves 8 weight rows: fewer instructions per weight byte), fewer
// where that would leave under ~2 blocks per SM.
Launch pick_launch(int chunks, int n, int threads = 0) {
  Launch l{8, threads};
  if (l.threads <= 0) {
    const int steps = (chunks + 255) / 256;
    l.threads = 32 * ((chunks + 32 * steps - 1) / (32 * steps));
  }
  while (l.rows > 1 && (n + l.rows - 1) / l.rows < 2 * kSmCount) {
    l.rows /= 2;
  }
  return l;
}

int blocks_for(const Launch& l, int n) { return (n + l.rows - 1) / l.rows; }

// The float layouts' threads for a group-normed input (prenorm groups > 1): one 16-byte chunk of K a
// thread, as a group norm keeps each step's sums apart until the groups' scales are known (several
// steps a thread cost registers); 0 (the layout's own pick) otherwise.
int one_step_threads(int chunks, int prenorm_groups) {
  return prenorm_groups > 1 && chunks <= 512 ? 32 * ((chunks + 31) / 32) : 0;
}


// ---------------------------------------------------------------- CUDA kernels

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

// A session's rows: op's input `name` holds `rows`, split into `sessions` equal groups.
int session_rows(int rows, int sessions, const std::string& op, const std::string& name) {
  if (sessions < 1) {
    throw std::invalid_argument(op + ": sessions must be at least 1");
  }
  if (rows % sessions != 0) {
    throw std::invalid_argument(op + ": " + name + "'s " + std::to_string(rows) + " rows are not " +
                                std::to_string(sessions) + " equal groups (sessions)");
  }
  return rows / sessions;
}

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

// ---------------------------------------------------------------- quantized matvec inputs

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

// ---------------------------------------------------------------- the persistent layouts

constexpr int kSmemPerSm = 232448;  // sm_90: a block's (and an SM's) most dynamic shared memory
constexpr int kStages = 2;          // tiles (slabs) a persistent block keeps in flight
constexpr int kStreamRows = 8;      // vc_qmv_stream's tile rows
constexpr int kSlabRows = 16;       // vc_qmv_imma_stream's slab rows (the MMA's A tile)

// A streamed kernel's own __shared__ arrays: a tile's sums from every warp for each stage (two at
// least), two barriers and a count a stage, the norm's group totals (and a margin for alignment).
int stream_static_smem(int stages, int threads, int rows, int m, int groups) {
  return std::max(stages, 2) * (threads / 32) * rows * m * 4 + stages * 20 + groups * m * 4 + 256;
}

// stage_x: how float32 x reaches each lane (vc_stream::StagedX): 0 each lane loads its own chunk,
// 1 loaded coalesced and handed round through the last stage's buffer, 2 the same through a region
// of its own past the stages (smem includes it). split: the parts each last-round tile is cut into
// (vc_stream::Walk); partials: the emitting kernel's partial sums a row of x (a tile's or a part's).
struct StreamLaunch {
  int threads, blocks, smem, stage_x, split, partials;
};

// The parts each of the last round's tiles is cut into (vc_stream::Walk), for `tiles` tiles of `rows`
// rows over `blocks` blocks, where `splits` (one block an SM): the most (a power of two, rows / parts
// rows at least one) that leave every part a block of its own. The walk's time is its longest block's:
// at the MLP down_proj (560 8-row tiles, 132 blocks) 32 blocks would take a fifth tile while 100 wait;
// cut in 4, 128 blocks take a quarter tile each. (At two blocks an SM a block left alone on its SM has
// all its issue slots: whole tiles there.)
int split_last_round(int tiles, int blocks, int rows, bool splits) {
  const int left = tiles % blocks;
  int split = 1;
  while (splits && left > 0 && rows % (2 * split) == 0 && left * 2 * split <= blocks) {
    split *= 2;
  }
  return split;
}

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

// Whether the GPU has the copy engine's bulk copies and mbarrier transaction counts (sm_90 on), and
// with them the integer MMA: the persistent layouts' PTX does not compile for older GPUs, which keep
// the block layout (and the two-head argmax MLX's ops).
bool persistent_layouts(int device_index) { return compute_capability(device_index) >= 9; }

// vc_qmv_stream's launch at this shape, or nothing (the block layout then): where K or N is 8192 or
// more (the block layout's one trip to memory a thread leaves the bytes in flight short there), 8-row
// tiles, 2 stages, `threads` (0: a thread for one or two chunks of K). Whether it takes the shape, its
// threads and last-round split are those of one row of x at every m, and so are its blocks where
// the split cuts tiles (each output's sum and the emitted partials then add up in the same order:
// with whole tiles a tile's sums do not depend on which block walks it). m sets the shared memory,
// how x is staged, and for 2-4 rows one block an SM: x's terms then take more registers a thread
// (ptxas: 128-168 at 320-512 threads, against 93-126 for one row) than two blocks an SM leave.
std::optional<StreamLaunch> pick_stream(int k, int n, int m, int group_size, int bits, int scale_bytes,
                                        bool x_float32, int prenorm_groups, int threads, bool bulk) {
  if (!bulk || !quantized_rows(m) || (k < 8192 && n < 8192)) {
    return std::nullopt;
  }
  const int rows = kStreamRows, stages = kStages;
  const int chunks = k / 32;
  if (threads <= 0) {
    threads = chunks <= 512 ? 32 * ((chunks + 31) / 32) : 32 * ((chunks + 63) / 64);
  }
  const int stage = rows * k / 2 + 2 * rows * (k / group_size) * scale_bytes;
  const int cpt = (chunks + threads - 1) / threads;  // chunks a thread
  // its own arrays, and every warp's share of the norm's group totals (apart from a tile's sums)
  auto own_for = [&](int rows_of_x) {
    return stream_static_smem(stages, threads, rows, rows_of_x, prenorm_groups) +
           (threads / 32) * prenorm_groups * rows_of_x * 4;
  };
  const int own = own_for(m);
  const bool takes = bits == 4 && group_size % 32 == 0 && n % rows == 0 &&
                     (rows * (k / group_size) * scale_bytes) % 16 == 0 && threads <= 512 && cpt <= 2 &&
                     stages * stage + own_for(1) <= kSmemPerSm;
  if (!takes) {
    return std::nullopt;
  }
  if (stages * stage + own > kSmemPerSm) {
    throw std::runtime_error("quantized_matvec: " + std::to_string(m) + " rows of x at [" + std::to_string(n) + ", " +
                             std::to_string(k) + "] do not fit the streamed layout's shared memory");
  }
  auto fit = [&](int bytes, int own_bytes) {
    return std::max(1, std::min(2048 / threads, kSmemPerSm / (bytes + own_bytes)));
  };
  // x staged (vc_stream::StagedX: a warp's 4 KB slices for each of its chunk rounds): through the
  // last stage's buffer where the slices fit in one stage, else in their own region where that leaves
  // the SM its blocks, else not (bfloat16 x is never staged). Returns the dynamic shared memory.
  auto staging = [&](int rows_of_x, int own_bytes, int& stage_x) {
    int smem = stages * stage;
    const int per_sm = fit(smem, own_bytes);
    const int x_bytes = threads / 32 * cpt * rows_of_x * 4096;
    const bool own_fits = (smem + x_bytes + own_bytes) * per_sm <= kSmemPerSm;
    const bool in_stages = x_bytes <= stage || (rows_of_x == 1 && x_bytes <= (stages - 1) * stage);
    stage_x = !x_float32 ? 0 : in_stages ? 1 : own_fits ? 2 : 0;
    return stage_x == 2 ? smem + x_bytes : smem;
  };
  int stage_x_one = 0, stage_x = 0;
  const int per_sm_one = fit(staging(1, own_for(1), stage_x_one), own_for(1));  // one row of x's grid
  const int smem = staging(m, own, stage_x);
  const int tiles = n / rows, blocks_one = std::min(tiles, kSmCount * per_sm_one);
  const int split = split_last_round(tiles, blocks_one, rows, per_sm_one == 1);
  // (a split grid has one block an SM already: split_last_round splits only there)
  const int blocks = m == 1 ? blocks_one : std::min(tiles, kSmCount);
  const int partials = tiles / blocks * blocks + tiles % blocks * split;  // the whole rounds' tiles, then the parts
  return StreamLaunch{threads, blocks, smem, stage_x, split, partials};
}

struct ImmaStreamLaunch {
  int warps, blocks, smem;
};

// vc_qmv_imma_stream's launch (and the two-head argmax's), or nothing: 16-row slabs of 64-wide 4-bit
// groups, 8 warps a block (fewer where K has fewer 64-wide groups), x's expansion and 2 stages of slabs
// in shared memory, 1, 2 or 4 rows of x (the MMA takes two rows at a time).
std::optional<ImmaStreamLaunch> pick_imma_stream(int k, int n, int m, int group_size, int bits, int scale_bytes,
                                                 int prenorm_groups, bool persistent) {
  const int warps = std::max(1, std::min(8, k / 64));
  const int groups = k / 64, levels = 4;  // vc_levels::TERMS
  const int expansion = (groups * (64 * levels * m + 20 * m) + 127) / 128 * 128;
  const int row_stride = (k / 8) % 16 == 0 ? k / 2 + 32 : k / 2;  // padded as the kernel's Stage
  const int scale_row = groups * scale_bytes;
  const int slab = kSlabRows * row_stride + 2 * kSlabRows * (scale_row % 32 == 0 ? scale_row + 16 : scale_row);
  const int smem = expansion + kStages * slab;
  const int own = stream_static_smem(kStages, 32 * warps, kSlabRows, m, prenorm_groups);
  const bool takes = persistent && bits == 4 && group_size == 64 && k % 64 == 0 && n % kSlabRows == 0 &&
                     quantized_rows(m) &&
                     (k / prenorm_groups) % 64 == 0 && prenorm_groups <= kSlabRows && smem + own <= kSmemPerSm;
  if (!takes) {
    return std::nullopt;
  }
  // a persistent grid must be resident at once: registers (assumed 96 a thread) bound it too
  const int per_sm = std::max(1, std::min({2048 / (32 * warps), 65536 / (96 * 32 * warps), kSmemPerSm / (smem + own)}));
  return ImmaStreamLaunch{warps, std::min(n / kSlabRows, kSmCount * per_sm), smem};
}

// Where the integer MMA is the product: the wide outputs of a narrow input (K < 8192, N >= 8192: the
// mamba in_proj, the MLP up_proj), at every row count. Where K >= 8192 its x expansion and 16-row
// slabs leave one block an SM, or do not fit shared memory: the float streamed layout there.
bool imma_stream_shape(int k, int n) { return n >= 8192 && k < 8192; }

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

// The streamed layout's most threads a block at which 4 rows of x take one launch: beyond, their x
// terms take more registers a thread than the block leaves (ptxas for sm_90: 168 at 320 threads).
constexpr int kStreamFourRowThreads = 384;

// fn on rows 0-1 and on rows 2-3 of 4-row x (the residual's and the prenorm partials' rows with
// them), its outputs put back together in x's leading shape.
template <typename Fn>
std::vector<mx::array> in_pairs(const mx::array& x, const std::optional<mx::array>& residual,
                                const std::optional<Prenorm>& prenorm, Fn fn, mx::Stream s) {
  auto rows = [&](const mx::array& a, int first) {
    auto flat = mx::reshape(a, {4, a.shape(-1)}, s);
    return mx::slice(flat, {first, 0}, {first + 2, a.shape(-1)}, s);
  };
  std::vector<std::vector<mx::array>> halves;
  for (int first : {0, 2}) {
    std::optional<mx::array> r = residual ? std::optional<mx::array>(rows(*residual, first)) : std::nullopt;
    std::optional<Prenorm> p = prenorm ? std::optional<Prenorm>(Prenorm{rows(prenorm->partials, first), prenorm->groups})
                                       : std::nullopt;
    halves.push_back(fn(rows(x, first), r, p));
  }
  std::vector<mx::array> out;
  for (size_t i = 0; i < halves[0].size(); ++i) {
    auto joined = mx::concatenate({halves[0][i], halves[1][i]}, 0, s);
    out.push_back(mx::reshape(joined, out_shape(x, joined.shape(-1)), s));
  }
  return out;
}

// What quantized_matvec and quantized_matvec_emit_norm share: [out] or, with next_norm, [out,
// normed, partials] (normed = out * next_norm, partials [..., P] whose sum is each row's sum of out^2).
std::vector<mx::array> quantized_matvec_impl(const mx::array& x, const mx::array& w, const mx::array& scales,
                                             const mx::array& biases, const std::optional<mx::array>& bias,
                                             int group_size, int bits, const std::optional<mx::array>& residual,
                                             const std::string& activation, const std::optional<Prenorm>& prenorm,
                                             const std::optional<mx::array>& next_norm, float norm_eps, mx::Stream s) {
  const char* who = next_norm ? "quantized_matvec_emit_norm" : "quantized_matvec";
  const auto [n, k] = check_quantized(x, w, scales, biases, group_size, bits);
  const Epilogue epi = make_epilogue(residual, activation, n, who);
  auto fail = [who](const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); };
  const int m = leading_rows(x);
  if (prenorm) {
    const auto& p = prenorm->partials;
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
  const bool kernel_path = gpu_stream(s) && cuda_build() && quantized_rows(m) && float_dtype(x.dtype()) &&
                           float_dtype(scales.dtype()) && biases.dtype() == scales.dtype() &&
                           (!bias || (bias->ndim() == 1 && bias->shape(0) == n && float_dtype(bias->dtype()))) &&
                           kernel_takes(epi, m, n) && prenorm_fits;
  if (!kernel_path) {
    // The prologue composed (the producer's scales), then the product.
    auto in = prenorm ? apply_prenorm(x, *prenorm, norm_eps, s) : x;
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
  const int groups = prenorm ? prenorm->groups : 1;
  const int chunks = k * bits / 128;
  const int threads = one_step_threads(chunks, groups);
  const int scale_bytes = static_cast<int>(scales.itemsize());
  const bool persistent = persistent_layouts(s.device.index);
  const auto imma = imma_stream_shape(k, n)
                        ? pick_imma_stream(k, n, m, group_size, bits, scale_bytes, groups, persistent)
                        : std::nullopt;
  if (imma) {
    return launch_persistent(qmv_imma_stream_source(), qmv_imma_stream_emit_source(),
                             {{"K", k}, {"N", n}, {"M", m}, {"WARPS", imma->warps}, {"STAGES", kStages}},
                             n / kSlabRows, imma->blocks, 32 * imma->warps, imma->smem, x, w, scales, biases, bias, epi,
                             prenorm, next_norm, norm_eps, out_dtype, s);
  }
  if (const auto l = pick_stream(k, n, m, group_size, bits, scale_bytes, x.dtype() == mx::float32, groups, threads,
                                 persistent)) {
    if (m == 4 && l->threads > kStreamFourRowThreads) {
      // Two launches of two rows: four rows' x terms would spill (128 registers a thread at 512
      // threads); each row's bits are the same either way.
      return in_pairs(x, residual, prenorm, [&](const mx::array& xh, const std::optional<mx::array>& rh,
                                                const std::optional<Prenorm>& ph) {
        return quantized_matvec_impl(xh, w, scales, biases, bias, group_size, bits, rh, activation, ph, next_norm,
                                     norm_eps, s);
      }, s);
    }
    return launch_persistent(qmv_stream_source(), qmv_stream_emit_source(),
                             {{"GROUP", group_size}, {"K", k}, {"N", n}, {"M", m}, {"ROWS", kStreamRows},
                              {"THREADS", l->threads}, {"STAGES", kStages}, {"XS", l->stage_x}, {"SPLIT", l->split}},
                             l->partials, l->blocks, l->threads, l->smem, x, w, scales, biases, bias, epi, prenorm,
                             next_norm, norm_eps, out_dtype, s);
  }
  const Launch l = pick_launch(chunks, n, threads);
  // x and the residual go in with their own shapes (the kernel reads them flat, row-contiguous as
  // MLX makes every kernel input) and the output comes out shaped: no reshape nodes in the graph.
  std::vector<mx::array> inputs = {x, w, scales, biases, bias ? *bias : scales, epi.residual ? *epi.residual : scales,
                                   prenorm ? prenorm->partials : scales};
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> args = {
      {"BITS", bits}, {"GROUP", group_size}, {"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows},
      {"THREADS", l.threads}, {"HAS_BIAS", bias.has_value()},
      {"TX", x.dtype()}, {"TS", scales.dtype()}, {"TB", bias ? bias->dtype() : scales.dtype()},
      {"TR", epi.residual ? epi.residual->dtype() : scales.dtype()}, {"TO", out_dtype}};
  if (!next_norm) {
    args.emplace_back("EPI", epi.kind());
  }
  args.emplace_back("NORM", prenorm ? 2 : 0);
  args.emplace_back("EPS_BITS", prenorm ? float_bits(norm_eps) : 0);
  args.emplace_back("NP", prenorm ? static_cast<int>(prenorm->partials.shape(-1)) : 0);
  args.emplace_back("NG", groups);
  args.emplace_back("TN", inputs[6].dtype());
  const int blocks = blocks_for(l, n);
  if (!next_norm) {
    return kernel(qmv_source())(inputs, {out_shape(x, n)}, {out_dtype}, {blocks * l.threads, 1, 1}, {l.threads, 1, 1},
                                args, std::nullopt, false, s);
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

}  // namespace

mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           const std::optional<mx::array>& bias, int group_size, int bits,
                           const std::optional<mx::array>& residual, const std::string& activation,
                           const std::optional<mx::array>& prenormed, int prenorm_groups, float norm_eps,
                           mx::StreamOrDevice s) {
  return quantized_matvec_impl(x, w, scales, biases, bias, group_size, bits, residual, activation,
                               make_prenorm(prenormed, prenorm_groups), std::nullopt, norm_eps, mx::to_stream(s))[0];
}

std::vector<mx::array> quantized_matvec_emit_norm(const mx::array& x, const mx::array& w, const mx::array& scales,
                                                  const mx::array& biases, const mx::array& residual,
                                                  const mx::array& next_norm, const std::optional<mx::array>& bias,
                                                  int group_size, int bits, const std::optional<mx::array>& prenormed,
                                                  int prenorm_groups, float norm_eps, mx::StreamOrDevice s) {
  return quantized_matvec_impl(x, w, scales, biases, bias, group_size, bits, residual, "",
                               make_prenorm(prenormed, prenorm_groups), next_norm, norm_eps, mx::to_stream(s));
}

namespace {

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

}  // namespace

mx::array dense_matvec(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                       const std::optional<mx::array>& residual, const std::string& activation,
                       const std::string& input, int sessions, mx::StreamOrDevice s_) {
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
  const int rows = leading_rows(x);
  const int m = session_rows(rows, sessions, "dense_matvec", "x");
  const bool kernel_path = gpu_stream(s) && cuda_build() && m >= 1 && m <= kMaxRows && k % 8 == 0 &&
                           float_dtype(x.dtype()) && float_dtype(w.dtype()) && (!bias || float_dtype(bias->dtype())) &&
                           kernel_takes(epi, rows, n);
  if (!kernel_path) {
    auto in = gated ? gelu_gate_composed(x, k, s) : x;
    auto y = bias ? mx::addmm(*bias, in, mx::transpose(w, s), 1.0f, 1.0f, s) : mx::matmul(in, mx::transpose(w, s), s);
    return compose_epilogue(y, epi, s);
  }
  const auto out_dtype = output_dtype(x.dtype(), w.dtype(), bias, epi);
  const Launch l = pick_launch(k * static_cast<int>(w.itemsize()) / 16, n);
  auto outs = kernel(dense_source())(
      {x, w, bias ? *bias : w, epi.residual ? *epi.residual : w},  // flat, as in quantized_matvec
      {out_shape(x, n)}, {out_dtype}, {sessions * blocks_for(l, n) * l.threads, 1, 1}, {l.threads, 1, 1},
      {{"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows}, {"THREADS", l.threads},
       {"EPI", epi.kind()}, {"PRO", gated ? 1 : 0}, {"HAS_BIAS", bias.has_value()}, {"SESSIONS", sessions},
       {"TX", x.dtype()}, {"TW", w.dtype()},
       {"TB", bias ? bias->dtype() : w.dtype()}, {"TR", epi.residual ? epi.residual->dtype() : w.dtype()},
       {"TO", out_dtype}},
      std::nullopt, false, s);
  return outs[0];
}

namespace {

// ---------------------------------------------------------------- sandwich-norm seam + dense matvec

}  // namespace

// (out, h') with h' = h + rms_norm(y) * post and out = (rms_norm(h') * pre) @ w.T (+ bias): one launch
// on a CUDA stream for 1-2 float32 rows; MLX ops elsewhere. Without post, h' = h + y; without y (and
// post), h' = h: an input norm and the product.
std::vector<mx::array> dense_add_norm_matvec(const mx::array& h, const std::optional<mx::array>& y,
                                             const std::optional<mx::array>& post, const mx::array& pre, float eps,
                                             const mx::array& w, const std::optional<mx::array>& bias,
                                             int sessions, mx::StreamOrDevice s_) {
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
  const int m = session_rows(leading_rows(h), sessions, "dense_add_norm_matvec", "h");
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
  const Launch l = pick_launch(k * static_cast<int>(w.itemsize()) / 16, n);
  auto outs = kernel(dense_add_norm_source())(
      {h, y ? *y : h, post ? *post : pre, pre, w, bias ? *bias : w},  // flat, as in quantized_matvec
      {out_shape(h, n), h.shape()}, {mx::float32, mx::float32}, {sessions * blocks_for(l, n) * l.threads, 1, 1},
      {l.threads, 1, 1},
      {{"K", k}, {"N", n}, {"M", m}, {"ROWS", l.rows}, {"THREADS", l.threads}, {"HAS_BIAS", bias.has_value()},
       {"SEAM", seam}, {"EPS_BITS", float_bits(eps)}, {"TW", w.dtype()}, {"TB", bias ? bias->dtype() : w.dtype()},
       {"TO", mx::float32}, {"SESSIONS", sessions}},
      std::nullopt, false, s);
  return {outs[0], seam == 2 ? h : outs[1]};
}

namespace {

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

}  // namespace

// head_a / head_b: (weight, scales, biases) of two quantized heads of one shape. Returns [ids] or
// [ids, logits_a, logits_b]; ids int32 [..., 2] (head a, head b). On CUDA (sm_90) both heads walked as
// one list of 16-row slabs (vc_stream::HeadsWalk) on the streamed integer-MMA product, each block's
// best key a head and row of x, then the finish kernel over the blocks' keys; heads that are not whole
// 16-row slabs, and other GPUs, take MLX's ops.
std::vector<mx::array> two_head_argmax(const mx::array& x, const std::vector<mx::array>& head_a,
                                       const std::vector<mx::array>& head_b, int group_size, int bits,
                                       bool return_logits, mx::StreamOrDevice s_) {
  if (head_a.size() != 3 || head_b.size() != 3) {
    throw std::invalid_argument("two_head_argmax: each head is (weight, scales, biases)");
  }
  const auto [n, k] = check_quantized(x, head_a[0], head_a[1], head_a[2], group_size, bits);
  for (int i = 0; i < 3; ++i) {
    if (head_b[i].shape() != head_a[i].shape() || head_b[i].dtype() != head_a[i].dtype()) {
      throw std::invalid_argument("two_head_argmax: the two heads must have the same shapes and dtypes");
    }
  }
  auto s = mx::to_stream(s_);
  const int m = leading_rows(x);
  const bool kernel_path = gpu_stream(s) && cuda_build() && quantized_rows(m) && float_dtype(x.dtype()) &&
                           float_dtype(head_a[1].dtype()) && head_a[2].dtype() == head_a[1].dtype() &&
                           n % kSlabRows == 0;
  const auto l = kernel_path ? pick_imma_stream(k, 2 * n, m, group_size, bits, static_cast<int>(head_a[1].itemsize()),
                                                1, persistent_layouts(s.device.index))
                             : std::nullopt;
  if (!l) {
    return two_head_argmax_composed(x, head_a, head_b, group_size, bits, return_logits, s);
  }
  const auto out_dtype = mx::promote_types(x.dtype(), head_a[1].dtype());
  auto outs = kernel(imma_stream_argmax_source(), l->smem)(
      {x, head_a[0], head_a[1], head_a[2], head_b[0], head_b[1], head_b[2]},  // flat, as in quantized_matvec
      {{m, 2, l->blocks}, return_logits ? mx::Shape{2, m, n} : mx::Shape{1}}, {mx::int64, out_dtype},
      {l->blocks * 32 * l->warps, 1, 1}, {32 * l->warps, 1, 1},
      {{"K", k}, {"N", 2 * n}, {"M", m}, {"WARPS", l->warps}, {"STAGES", kStages}, {"WRITE_LOGITS", return_logits},
       {"TX", x.dtype()}, {"TS", head_a[1].dtype()}, {"TO", out_dtype}},
      std::nullopt, false, s);
  constexpr int kFinishThreads = 256;
  auto ids = kernel(argmax_finish_source())({outs[0]}, {out_shape(x, 2)}, {mx::int32}, {2 * m * kFinishThreads, 1, 1},
                                            {kFinishThreads, 1, 1}, {{"NB", l->blocks}, {"THREADS", kFinishThreads}},
                                            std::nullopt, false, s)[0];
  if (!return_logits) {
    return {ids};
  }
  auto logits = [&](int head) {
    return mx::reshape(mx::slice(outs[1], {head, 0, 0}, {head + 1, m, n}, s), out_shape(x, n), s);
  };
  return {ids, logits(0), logits(1)};
}

std::optional<GemvStreamLaunch> stream_launch(int k, int n, bool x_float32, int prenorm_groups, int rows) {
  if (imma_stream_shape(k, n) && pick_imma_stream(k, n, rows, 64, 4, 2, prenorm_groups, true)) {
    return std::nullopt;
  }
  const auto l = pick_stream(k, n, rows, 64, 4, 2, x_float32, prenorm_groups,
                             one_step_threads(k / 32, prenorm_groups), true);
  if (!l) {
    return std::nullopt;
  }
  return GemvStreamLaunch{l->threads, l->blocks, l->smem, l->stage_x, l->split, l->partials};
}

}  // namespace voicechat
