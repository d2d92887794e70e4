// One frame's code embedding, the EAR-TTS code generation's input at every unmasking iteration:
//
//   out[b] = W @ sum_q table[q * KP + code[q]]        (the same for each of the B rows asked for)
//
// table [Q * KP, D] float32 is the codebooks with a zero row after each (KP = K + 1 rows a codebook;
// the mask code K adds nothing), W [H, D] is `embed_code`. Composed, that is an index add, a gather,
// a sum and the matvec: four launches an iteration. Here one: every block forms the depth
// sum (31 rows of 512 floats from L2) and its warps take ROWS output rows each. CUDA through
// fast::cuda_kernel; everywhere else the composed MLX ops (also the reference:
// voicechat.kernels.code_embedding).

#include "voicechat/code_embedding.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_sources.h"
#include "jit_sources.h"
#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace voicechat {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerWarp = 4;

const CudaSource& source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int d, int h, int q, int kp, int b, const std::string& tw, int sessions = 1) {
    return CudaInstance{{"int32_t", "float", tw},
                        {"float"},
                        {P{"D", int_arg(d)}, P{"H", int_arg(h)}, P{"Q", int_arg(q)}, P{"KP", int_arg(kp)},
                         P{"B", int_arg(b)}, P{"ROWS", int_arg(kRowsPerWarp)}, P{"THREADS", int_arg(kThreads)},
                         P{"TW", type_arg(tw)}, P{"SESSIONS", int_arg(sessions)}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_code_embedding",
      {"code", "table", "weight"},
      {"out"},
      jit::code_embedding::vc_code_embedding_body,
      "",
      // the published TTS (bfloat16 or float32 weights; for the CFG pair, and one row); a small odd one
      {inst(512, 1152, 31, 1025, 2, "__nv_bfloat16"), inst(512, 1152, 31, 1025, 1, "__nv_bfloat16"),
       inst(512, 1152, 31, 1025, 2, "float"), inst(24, 70, 5, 9, 2, "float"),
       inst(512, 1152, 31, 1025, 2, "__nv_bfloat16", 8)},  // sessions' frames in one launch
  });
  return src;
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("code_embedding: " + what);
}

// The composed ops (every backend but the CUDA kernel): each session's frame on its own, as alone.
mx::array composed(const mx::array& code, const mx::array& table, const mx::array& weight, int rows, int q, int kp,
                   int sessions, mx::Stream s) {
  const int h = weight.shape(0);
  auto codes = mx::reshape(mx::astype(code, mx::int32, s), {sessions, q}, s);
  std::vector<mx::array> frames;
  for (int i = 0; i < sessions; ++i) {
    auto one = mx::reshape(mx::slice(codes, {i, 0}, {i + 1, q}, s), {q}, s);
    auto index = mx::add(one, mx::multiply(mx::arange(q, mx::int32, s), mx::array(kp, mx::int32), s), s);
    auto depth = mx::sum(mx::take(table, index, 0, s), 0, true, s);                        // [1, D]
    auto out = mx::matmul(depth, mx::transpose(mx::astype(weight, mx::float32, s), s), s);  // [1, H]
    frames.push_back(mx::broadcast_to(mx::reshape(out, {1, 1, h}, s), {rows, 1, h}, s));
  }
  return sessions == 1 ? frames[0] : mx::concatenate(frames, 0, s);
}

}  // namespace

// code: one frame's Q codes (any shape of Q values; K = the mask); table [Q * KP, D] float32; weight
// [H, D]. Returns W @ depth sum as [rows, 1, H] (the same row `rows` times).
mx::array code_embedding(const mx::array& code, const mx::array& table, const mx::array& weight, int rows,
                         int sessions, mx::StreamOrDevice s_) {
  expect(code.ndim() >= 1 && mx::issubdtype(code.dtype(), mx::integer), "code must be integer codes");
  expect(sessions >= 1, "sessions must be at least 1");
  const int q = code.shape(-1);
  expect(static_cast<int>(code.size()) == sessions * q,
         "code must hold one frame a session (its codes in the last axis, " + std::to_string(sessions) +
             " frames in all)");
  expect(table.ndim() == 2 && table.dtype() == mx::float32 && table.shape(0) % q == 0,
         "table must be float32 [Q * (K + 1), D] for Q = " + std::to_string(q) + " codes");
  expect(weight.ndim() == 2 && weight.shape(1) == table.shape(1) && float_dtype(weight.dtype()),
         "weight must be [H, D] (D = " + std::to_string(table.shape(1)) + ") of a float type");
  expect(rows >= 1, "rows must be at least 1");
  const int kp = table.shape(0) / q, d = table.shape(1), h = weight.shape(0);
  auto s = mx::to_stream(s_);
  if (!(gpu_stream(s) && cuda_build() && code.dtype() == mx::int32 && rows <= 2)) {
    return composed(code, table, weight, rows, q, kp, sessions, s);
  }
  static auto kernel = make_cuda_kernel(source());
  const int rows_per_block = (kThreads / 32) * kRowsPerWarp;
  const int blocks = (h + rows_per_block - 1) / rows_per_block;
  return kernel({code, table, weight}, {{sessions * rows, 1, h}}, {mx::float32},
                {sessions * blocks * kThreads, 1, 1}, {kThreads, 1, 1},
                {{"D", d}, {"H", h}, {"Q", q}, {"KP", kp}, {"B", rows}, {"ROWS", kRowsPerWarp}, {"THREADS", kThreads},
                 {"TW", weight.dtype()}, {"SESSIONS", sessions}},
                std::nullopt, false, s)[0];
}

VC_CUDA_SOURCES(source);
}  // namespace voicechat
