// Every CUDA kernel source the library can JIT through mlx::core::fast::cuda_kernel (or our own launch),
// with the template instances it is used at, so that tests can compile each one with nvcc without a
// GPU. The texts themselves are the files of csrc/kernels, embedded at build time (jit_sources.h).
#pragma once

#include <deque>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "mlx/fast.h"
#include "mlx/stream.h"

namespace voicechat {

// One way a kernel is instantiated: CUDA type names of inputs and outputs ("float",
// "__nv_bfloat16", "int32_t", "uint32_t", ...) and template args as MLX writes them
// ({"N", "int:4"}, {"T", "type:float"}, {"FLAG", "bool:true"}).
struct CudaInstance {
  std::vector<std::string> input_types;
  std::vector<std::string> output_types;
  std::vector<std::pair<std::string, std::string>> template_args;
};

struct CudaSource {
  std::string name;
  std::vector<std::string> input_names;
  std::vector<std::string> output_names;
  std::string source;  // the kernel body, as given to fast::cuda_kernel
  std::string header;  // code placed before the kernel (device helpers)
  std::vector<CudaInstance> instances;
  // Blocks a thread-block cluster (1: none). A source of clusters runs only through our own launch,
  // which asks for them (MLX's custom-kernel launch cannot), and each grid is a whole number of them.
  int cluster = 1;
  // The template arg that gives the block's threads (times `threads_scale`), stated to the compiler
  // as __launch_bounds__ by our own launch: an instance that would take more registers a thread than
  // a block of that size has spills instead of failing to launch. Empty: none.
  std::string threads_arg = "";
  int threads_scale = 1;
};

// The name MLX compiles `source` under: its name and a hash of its text. MLX keeps compiled kernels
// on disk (MLX_PTX_CACHE_DIR) keyed by name and template args only, so an edited kernel must not
// reuse its old name, or a cache from an older voicechat would run the old code.
std::string jit_name(const CudaSource& source);

// The header and body a kernel is handed to MLX as. MLX-CUDA 0.32.4 hashes a custom kernel's whole
// text at every launch (std::hash in CustomKernel::eval_gpu, to name its module): host time that
// grows with the text, paid at each of a frame's ~300 launches. So the texts are written to files in `folder`,
// named by jit_name (which hashes them), and MLX gets two #include lines (the body's inside the
// kernel) of ~100 bytes. An empty or unusable folder: the texts themselves (included = false).
struct KernelText {
  std::string header;
  std::string body;
  bool included;
};
KernelText launch_text(const CudaSource& source, const std::string& folder);

// A file's bytes (empty where it cannot be read).
std::string file_text(const std::filesystem::path& path);

// `bytes` written to a scratch name beside `path` and renamed over it (its folder made first), so a
// reader never sees half a file; the scratch file is removed on failure, which throws.
void write_file_whole(const std::filesystem::path& path, const std::string& bytes);

// VOICECHAT_KERNEL_TEXT_DIR (voicechat's __init__ sets it beside the PTX cache; empty: inline).
std::string kernel_text_folder();

// mlx::core::fast::cuda_kernel for `source`, under jit_name(source), launched with `shared_memory`
// bytes of dynamic shared memory; its texts as launch_text(source, kernel_text_folder()) gives them.
// A source of clusters gets our own launch (its fallback to MLX's throws); where our launch is not
// built or wanted, making one throws.
mlx::core::fast::CustomKernelFunction make_cuda_kernel(const CudaSource& source, int shared_memory = 0);

// Whether a launch made now goes through our own launch (built, wanted, and not fallen back to
// MLX's): what a source of clusters needs.
bool own_launch_active();

// CUDA text without its comments, indentation and empty lines (string and character literals kept,
// a macro's continued lines kept whole): what register_cuda_source stores of a header and a body.
std::string compact_kernel_text(const std::string& text);

// Returns its argument (header and body compacted), so a kernel file can write
//   static const auto& kSrc = register_cuda_source({...});
const CudaSource& register_cuda_source(CudaSource source);

// Runs a kernel file's source functions when the library is loaded, so that cuda_sources() lists
// every kernel before any op runs: `VC_CUDA_SOURCES(source, other_source);` at namespace scope.
struct SourcesAtLoad {
  template <typename... Source>
  explicit SourcesAtLoad(Source... sources) {
    (sources(), ...);
  }
};
#define VC_CUDA_SOURCES(...) static const ::voicechat::SourcesAtLoad vc_sources_at_load(__VA_ARGS__)

const std::deque<CudaSource>& cuda_sources();

// Backend facts for dispatch.
bool cuda_build();  // built against mlx-cuda
bool gpu_stream(const mlx::core::Stream& s);
bool float_dtype(mlx::core::Dtype t);  // float32, bfloat16 or float16: what the kernels read

// Template args of a CudaInstance, as MLX writes them: int_arg(4) = "int:4", type_arg("float") =
// "type:float".
std::string int_arg(int v);

// A float >= 0 as the int template argument that carries it into a kernel (read there with
// __int_as_float): scalars such as eps go in this way, not as one-element arrays made on the host
// for each call, which every launch then read from memory the CPU wrote. Negative values are
// refused: MLX names a kernel after its template args, and a '-' there does not compile (a signed
// scalar goes in as its magnitude and a bool).
int float_bits(float f);

// An int32 array of `values`, made and evaluated once per list and kept for the process: for ints
// a kernel must read from memory (sizes, an index), never a fresh host array each call (each
// launch would wait for its upload).
const mlx::core::array& kept_ints(const std::vector<int>& values);
std::string type_arg(const std::string& cuda_type);

// Device helpers for kernel headers: vc_block_sum / vc_block_max<THREADS>(v, scratch), the sum /
// max of v over the block in every thread (scratch: THREADS / 32 floats, free again on return).
// Include-guarded, so several kernels' headers may carry it.
const std::string& block_reduce_header();

// Device helper for kernel headers: vc_head_norm_rope<D, TX>(x, scale, inv_freq, eps, position, o,
// lane), one warp: one attention head's RMS norm (times scale) and rotate-half RoPE, the TTS's
// head preparation (qkv_heads, decode_attention_qkv). Include-guarded.
const std::string& head_norm_rope_header();

}  // namespace voicechat
