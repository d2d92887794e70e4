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
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cuda_sources.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx_caster.h"
#include "registry.h"

namespace py = pybind11;
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

// CUDA: a key orders (distance, index) as mx.argmin does: smaller distance, then the smaller index.
constexpr const char* kCudaHeader = R"(
#ifndef VC_RVQ_HEADER
#define VC_RVQ_HEADER
namespace vc_rvq {

__device__ __forceinline__ unsigned long long key(float dist, int index) {
  const unsigned int b = __float_as_uint(dist);
  const unsigned int ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | static_cast<unsigned int>(index);
}

// The best key (the smallest) of codewords [k0, k1) of one codebook `book` ([K, D]; `norms` its
// ||e_k||^2) against r (D floats in shared memory), in thread 0: a warp a codeword, lanes over D.
// warp_best: WARPS slots.
template <typename T, int D, int WARPS>
__device__ __forceinline__ unsigned long long block_best(const T* book, const float* norms, const float* r, int k0,
                                                         int k1, unsigned long long* warp_best) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  unsigned long long mine = ~0ull;
  for (int k = k0 + warp; k < k1; k += WARPS) {
    const T* e = book + static_cast<size_t>(k) * D;
    float dot = 0.0f;
    for (int d = lane; d < D; d += 32) dot += r[d] * static_cast<float>(e[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const unsigned long long kk = key(norms[k] - 2.0f * dot, k);
    mine = kk < mine ? kk : mine;
  }
  if (lane == 0) warp_best[warp] = mine;
  __syncthreads();
  unsigned long long best = warp_best[0];
  if (threadIdx.x == 0) {
    for (int w = 1; w < WARPS; ++w) best = warp_best[w] < best ? warp_best[w] : best;
  }
  return best;
}

}  // namespace vc_rvq
#endif
)";

// The whole run of codebooks in one launch, where our own launch runs it (MLX's cannot ask for
// clusters): a thread-block cluster of CB blocks a row, each block scoring its K / CB codewords of a
// codebook (block_best: a warp a codeword, lanes over D), putting its best key in its shared memory,
// and after a cluster barrier every block reads the CB keys (distributed shared memory), takes the
// code and forms the next residual itself. The cluster's blocks are scheduled together, so the
// barrier cannot wait on a block that never starts (a spin over global memory across blocks could
// hang). Each block first asks the L2 for its share of every codebook of the run. One launch a run
// of codebooks: a TTS frame's RVQ is one launch an unmasking iteration.
constexpr const char* kClusterHeader = R"(
#ifndef VC_CLUSTER_HEADER
#define VC_CLUSTER_HEADER
namespace vc_cluster {
#ifdef __CUDA_ARCH__
#define VC_CLUSTER_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ unsigned int rank() {
  unsigned int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster; shared-memory writes before it are seen after it.
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The value at `p` (this block's shared memory) in block `r`'s shared memory.
__device__ __forceinline__ unsigned long long load_remote(const unsigned long long* p, unsigned int r) {
  const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(p));
  unsigned int remote;
  unsigned long long v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
  asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
#else
#define VC_CLUSTER_SMEM(name) unsigned char* name = cuda_emu::dynamic_smem()
inline unsigned int rank() { return cuda_emu::cluster_rank(); }
inline void sync() { cuda_emu::cluster_sync(); }
inline unsigned long long load_remote(const unsigned long long* p, unsigned int r) {
  return *cuda_emu::cluster_smem(p, r);
}
inline void prefetch_l2(const void*, unsigned int) {}
#endif
}  // namespace vc_cluster
#endif
)";

// Template args: T, D, K, CB (blocks a cluster: the source's cluster), THREADS, INTO (codes_in holds
// the row's codes so far; else the other columns are -1). q: [start, count, the run's first column
// in the code row, the row's width W]. Dynamic shared memory: 8 (WARPS + 3) + 4 D bytes.
constexpr const char* kCudaClusterSource = R"(
  constexpr int KB = (K + CB - 1) / CB;
  constexpr int WARPS = THREADS / 32;
  VC_CLUSTER_SMEM(smem);
  unsigned long long* slot = reinterpret_cast<unsigned long long*>(smem);
  unsigned long long* warp_best = slot + 2;
  int* chosen = reinterpret_cast<int*>(warp_best + WARPS);
  float* r = reinterpret_cast<float*>(smem + 8 * (WARPS + 3));
  const unsigned int rank = vc_cluster::rank();
  const int row = blockIdx.x / CB;
  const int start = q[0], count = q[1], col0 = q[2], width = q[3];
  const int k0 = static_cast<int>(rank) * KB, k1 = min(K, k0 + KB);
  if constexpr (K % CB == 0 && (KB * D * sizeof(T)) % 16 == 0) {
    if ((reinterpret_cast<size_t>(codebooks) & 15) == 0) {
      for (int i = threadIdx.x; i < count; i += THREADS) {
        vc_cluster::prefetch_l2(codebooks + (static_cast<size_t>(start + i) * K + k0) * D, KB * D * sizeof(T));
      }
    }
  }
  for (int d = threadIdx.x; d < D; d += THREADS) r[d] = r_in[static_cast<size_t>(row) * D + d];
  if (rank == 0) {
    for (int c = threadIdx.x; c < width; c += THREADS) {
      codes_out[static_cast<size_t>(row) * width + c] = INTO ? codes_in[static_cast<size_t>(row) * width + c] : -1;
    }
  }
  __syncthreads();
  for (int i = 0; i < count; ++i) {
    const int qi = start + i;
    const T* book = codebooks + static_cast<size_t>(qi) * K * D;
    const unsigned long long mine =
        vc_rvq::block_best<T, D, WARPS>(book, norms + static_cast<size_t>(qi) * K, r, k0, k1, warp_best);
    if (threadIdx.x == 0) slot[i & 1] = mine;
    vc_cluster::sync();
    if (threadIdx.x == 0) {
      unsigned long long best = ~0ull;
      for (int b = 0; b < CB; ++b) {
        const unsigned long long v = vc_cluster::load_remote(slot + (i & 1), b);
        best = v < best ? v : best;
      }
      *chosen = static_cast<int>(best & 0xFFFFFFFFull);
      if (rank == 0) codes_out[static_cast<size_t>(row) * width + col0 + i] = *chosen;
    }
    __syncthreads();
    const T* e = book + static_cast<size_t>(*chosen) * D;
    for (int d = threadIdx.x; d < D; d += THREADS) r[d] -= static_cast<float>(e[d]);
    __syncthreads();
  }
  if (rank == 0) {
    for (int d = threadIdx.x; d < D; d += THREADS) residual_out[static_cast<size_t>(row) * D + d] = r[d];
  }
  vc_cluster::sync();
)";

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
      kCudaClusterSource,
      std::string(kCudaHeader) + kClusterHeader,
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

void bind(py::module_& m) {
  cuda_cluster_source();  // registered at import, so the compile checks see it
  m.def("rvq_search", &rvq_search, py::arg("residual"), py::arg("codebooks"), py::arg("norms"), py::arg("start"),
        py::arg("count"), py::arg("method") = "auto", py::kw_only(), py::arg("into") = py::none(),
        py::arg("stream") = py::none(),
        "Sequential residual quantization over codebooks [start, start + count): (codes [B, count] int32, "
        "residual [B, D] float32); with into [B, Q] (the codes so far), the codes are those rows with "
        "[start, start + count) replaced.");
}

}  // namespace
VC_REGISTER(bind);
}  // namespace voicechat
