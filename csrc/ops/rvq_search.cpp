// RVQ argmin search: sequential residual quantization over a run of codebooks in one call.
//
//   for q in [start, start + count):
//     code[:, q - start] = argmin_k ||e_qk||^2 - 2 r . e_qk      (first index on ties)
//     r -= e_{q, code}
//
// Used by the TTS step (one row, 1..22 codebooks per call) and the codec encoder (all 31
// codebooks over many frames). Everything accumulates in float32; the residual comes back as
// float32. Paths: CUDA (the whole run in one launch of thread-block clusters, for few rows, where our
// own launch runs), CPU (a C++ loop for few rows, BLAS-backed composed ops for many), anything else
// (MLX's launch, many rows) the composed ops.

#include "voicechat/rvq_search.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_sources.h"
#include "jit_sources.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace voicechat {
namespace {

// ---------------------------------------------------------------- composed ops (any backend)

std::vector<mx::array> rvq_search_composed(
    mx::array residual, const mx::array& codebooks, const mx::array& norms, int start, int count,
    mx::StreamOrDevice s) {
  residual = mx::astype(residual, mx::float32, s);
  std::vector<mx::array> codes;
  for (int q = start; q < start + count; ++q) {
    auto book = mx::astype(mx::take(codebooks, q, 0, s), mx::float32, s);  // [K, D]
    auto dist = mx::subtract(
        mx::take(norms, q, 0, s), mx::multiply(mx::array(2.0f), mx::matmul(residual, mx::transpose(book, s), s), s),
        s);  // [B, K]
    auto code = mx::astype(mx::argmin(dist, -1, false, s), mx::int32, s);
    residual = mx::subtract(residual, mx::take(book, code, 0, s), s);
    codes.push_back(code);
  }
  return {mx::stack(codes, 1, s), residual};
}

// ---------------------------------------------------------------- CPU: a fused primitive

class RvqSearch : public mx::Primitive {
 public:
  RvqSearch(mx::Stream stream, int start, int count) : mx::Primitive(stream), start_(start), count_(count) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& residual = inputs[0];
    const auto& books = inputs[1];
    const auto& norms = inputs[2];
    auto& codes = outputs[0];
    auto& out = outputs[1];
    codes.set_data(mx::allocator::malloc(codes.nbytes()));
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(residual);
    enc.set_input_array(books);
    enc.set_input_array(norms);
    enc.set_output_array(codes);
    enc.set_output_array(out);
    const int rows = residual.shape(0), dim = residual.shape(1), size = books.shape(1);
    if (books.dtype() == mx::bfloat16) {
      dispatch<mx::bfloat16_t>(enc, residual, books, norms, codes, out, rows, dim, size);
    } else if (books.dtype() == mx::float16) {
      dispatch<mx::float16_t>(enc, residual, books, norms, codes, out, rows, dim, size);
    } else {
      dispatch<float>(enc, residual, books, norms, codes, out, rows, dim, size);
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("RvqSearch runs on the CPU stream only (GPU: the cluster kernel).");
  }

  const char* name() const override { return "RvqSearch"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RvqSearch&>(other);
    return start_ == o.start_ && count_ == o.count_;
  }

 private:
  template <typename T>
  void dispatch(mx::cpu::CommandEncoder& enc, const mx::array& residual, const mx::array& books,
                const mx::array& norms, mx::array& codes, mx::array& out, int rows, int dim, int size) {
    enc.dispatch([r_in = residual.data<float>(), e = books.data<T>(), n = norms.data<float>(),
                  c = codes.data<int32_t>(), r = out.data<float>(), rows, dim, size, start = start_,
                  count = count_]() {
      for (int b = 0; b < rows; ++b) {
        float* rb = r + static_cast<size_t>(b) * dim;
        for (int d = 0; d < dim; ++d) rb[d] = r_in[static_cast<size_t>(b) * dim + d];
        for (int q = start; q < start + count; ++q) {
          const T* book = e + static_cast<size_t>(q) * size * dim;
          const float* norm = n + static_cast<size_t>(q) * size;
          float best = std::numeric_limits<float>::infinity();
          int best_k = 0;
          for (int k = 0; k < size; ++k) {
            const T* row = book + static_cast<size_t>(k) * dim;
            float dot = 0.0f;
            for (int d = 0; d < dim; ++d) dot += rb[d] * static_cast<float>(row[d]);
            const float dist = norm[k] - 2.0f * dot;
            if (dist < best) {
              best = dist;
              best_k = k;
            }
          }
          c[static_cast<size_t>(b) * count + (q - start)] = best_k;
          const T* chosen = book + static_cast<size_t>(best_k) * dim;
          for (int d = 0; d < dim; ++d) rb[d] -= static_cast<float>(chosen[d]);
        }
      }
    });
  }

  int start_, count_;
};

// ---------------------------------------------------------------- CUDA

constexpr int kClusterBlocks = 8;        // portable cluster size: 8 SMs a row, 128 codewords each at K = 1024
constexpr int kClusterMaxThreads = 1024;
constexpr int kClusterMaxDim = 4096;     // the dynamic shared memory asked for holds r of this many
constexpr int kClusterSmem = 8 * (kClusterMaxThreads / 32 + 3) + 4 * kClusterMaxDim;

const CudaSource& cuda_cluster_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](const std::string& t, int d, int k, int threads, bool into) {
    return CudaInstance{{"float", t, "float", "int32_t", "int32_t"},
                        {"float", "int32_t"},
                        {P{"T", type_arg(t)}, P{"D", int_arg(d)}, P{"K", int_arg(k)}, P{"CB", int_arg(kClusterBlocks)},
                         P{"THREADS", int_arg(threads)}, P{"INTO", into ? "bool:true" : "bool:false"}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_rvq_cluster",
      {"r_in", "codebooks", "norms", "q", "codes_in"},
      {"residual_out", "codes_out"},
      jit::rvq_search::vc_rvq_cluster_body,
      std::string(jit::rvq_search::rvq) + jit::rvq_search::cluster,
      {inst("__nv_bfloat16", 512, 1024, 1024, true), inst("__nv_bfloat16", 512, 1024, 1024, false),
       inst("float", 40, 52, 64, false)},
      kClusterBlocks,
  });
  return src;
}

// The cluster kernel's block: a warp for each of a block's K / CB codewords, at most 1024 threads.
int cluster_threads(int k) {
  const int per_block = (k + kClusterBlocks - 1) / kClusterBlocks;
  return std::min(kClusterMaxThreads, 32 * per_block);
}

// The cluster kernel, where it can run: a CUDA stream, our own launch, r fitting its shared memory.
bool cluster_runs(const mx::array& residual, mx::Stream s) {
  return gpu_stream(s) && cuda_build() && own_launch_active() && residual.shape(1) <= kClusterMaxDim;
}

std::vector<mx::array> rvq_search_cluster(const mx::array& residual, const mx::array& codebooks,
                                          const mx::array& norms, int start, int count,
                                          const std::optional<mx::array>& into, mx::Stream s) {
  static auto cluster = make_cuda_kernel(cuda_cluster_source(), kClusterSmem);
  const int rows = residual.shape(0), dim = residual.shape(1), size = codebooks.shape(1);
  const int threads = cluster_threads(size);
  const int width = into ? codebooks.shape(0) : count, col0 = into ? start : 0;
  mx::array codes_in = into ? mx::astype(*into, mx::int32, s) : kept_ints({-1});  // (not read without into)
  auto outs = cluster({mx::astype(residual, mx::float32, s), codebooks, norms, kept_ints({start, count, col0, width}),
                       codes_in},
                      {{rows, dim}, {rows, width}}, {mx::float32, mx::int32},
                      {rows * kClusterBlocks * threads, 1, 1}, {threads, 1, 1},
                      {{"T", codebooks.dtype()}, {"D", dim}, {"K", size}, {"CB", kClusterBlocks}, {"THREADS", threads},
                       {"INTO", into.has_value()}},
                      std::nullopt, false, s);
  return {outs[1], outs[0]};
}

// The row `into` with columns [start, start + count) replaced by `codes` (the paths other than the
// cluster kernel, which writes them there).
mx::array splice_codes(const mx::array& into, const mx::array& codes, int start, mx::Stream s) {
  const int rows = into.shape(0), width = into.shape(1), count = codes.shape(1);
  auto row = mx::astype(into, mx::int32, s);
  std::vector<mx::array> parts;
  if (start > 0) parts.push_back(mx::slice(row, {0, 0}, {rows, start}, s));
  parts.push_back(codes);
  if (start + count < width) parts.push_back(mx::slice(row, {0, start + count}, {rows, width}, s));
  return parts.size() == 1 ? parts[0] : mx::concatenate(parts, 1, s);
}

// ---------------------------------------------------------------- the op

void check_args(const mx::array& residual, const mx::array& codebooks, const mx::array& norms, int start,
                int count) {
  if (residual.ndim() != 2 || codebooks.ndim() != 3 || norms.ndim() != 2) {
    throw std::invalid_argument("rvq_search: expected residual [B, D], codebooks [Q, K, D], norms [Q, K]");
  }
  if (residual.shape(1) != codebooks.shape(2) || norms.shape(0) != codebooks.shape(0) ||
      norms.shape(1) != codebooks.shape(1)) {
    throw std::invalid_argument("rvq_search: residual, codebooks and norms do not agree in shape");
  }
  if (start < 0 || count < 1 || start + count > codebooks.shape(0)) {
    throw std::invalid_argument("rvq_search: codebooks [start, start + count) out of range");
  }
  if (!mx::issubdtype(residual.dtype(), mx::floating) || !mx::issubdtype(codebooks.dtype(), mx::floating)) {
    throw std::invalid_argument("rvq_search: residual and codebooks must be floating point");
  }
}

// The codes alone, [B, count] (every path but the cluster kernel).
std::vector<mx::array> rvq_search_codes(const mx::array& residual, const mx::array& codebooks, const mx::array& norms32,
                                        int start, int count, const std::string& method, mx::Stream s) {
  if (method == "composed" || gpu_stream(s)) {
    return rvq_search_composed(residual, codebooks, norms32, start, count, s);
  }
  // CPU: the loop wins for a few rows (the TTS step); BLAS wins for many (the codec encoder).
  const long work = static_cast<long>(residual.shape(0)) * count;
  if (method == "auto" && work > 64) {
    return rvq_search_composed(residual, codebooks, norms32, start, count, s);
  }
  auto r32 = mx::contiguous(mx::astype(residual, mx::float32, s), false, s);
  auto books = mx::contiguous(codebooks, false, s);
  auto n = mx::contiguous(norms32, false, s);
  const int rows = residual.shape(0), dim = residual.shape(1);
  return mx::array::make_arrays({{rows, count}, {rows, dim}}, {mx::int32, mx::float32},
                                std::make_shared<RvqSearch>(s, start, count), {r32, books, n});
}

}  // namespace

// method: "auto", "fused" (the C++ loop on the CPU, the cluster kernel on CUDA) or "composed" (MLX ops).
// into [B, Q] (optional): the rows' codes so far; the codes come back as those rows with [start,
// start + count) replaced.
std::vector<mx::array> rvq_search(const mx::array& residual, const mx::array& codebooks, const mx::array& norms,
                                  int start, int count, const std::string& method,
                                  const std::optional<mx::array>& into, mx::StreamOrDevice s_) {
  check_args(residual, codebooks, norms, start, count);
  if (method != "auto" && method != "fused" && method != "composed") {
    throw std::invalid_argument("rvq_search: method must be 'auto', 'fused' or 'composed', not '" + method + "'");
  }
  if (into && (into->ndim() != 2 || into->shape(0) != residual.shape(0) || into->shape(1) != codebooks.shape(0) ||
               !mx::issubdtype(into->dtype(), mx::integer))) {
    throw std::invalid_argument("rvq_search: into must be integer codes [B, Q] (B residual rows, Q codebooks)");
  }
  auto s = mx::to_stream(s_);
  auto norms32 = mx::astype(norms, mx::float32, s);
  const bool gpu = gpu_stream(s) && cuda_build();
  if (method == "fused" && gpu && !cluster_runs(residual, s)) {
    throw std::invalid_argument("rvq_search: method 'fused' on a CUDA stream is the cluster kernel, which runs "
                                "through voicechat's own kernel launch, with D <= " + std::to_string(kClusterMaxDim));
  }
  // The cluster kernel for the few rows of a TTS step on a CUDA GPU; the composed ops (a GEMM per
  // codebook) for many, and where our own launch is off. No mx::contiguous before the kernel: a custom
  // kernel makes its inputs row-contiguous itself, at eval and only when they are not, while a
  // Contiguous node costs the TTS step's graph a node each.
  if (gpu && (method == "fused" || (method == "auto" && residual.shape(0) <= 8 && cluster_runs(residual, s)))) {
    return rvq_search_cluster(residual, codebooks, norms32, start, count, into, s);
  }
  auto out = rvq_search_codes(residual, codebooks, norms32, start, count, method, s);
  if (into) out[0] = splice_codes(*into, out[0], start, s);
  return out;
}

VC_CUDA_SOURCES(cuda_cluster_source);
}  // namespace voicechat
