// Our own launches of our CUDA kernels (the default where built; VOICECHAT_OWN_LAUNCH=0 for MLX's): compiled by NVRTC
// here and kept on disk as cubins, then added to MLX's command encoder by a primitive of ours.
//
// Why: MLX-CUDA 0.32.4 keeps no custom kernel in its PTX cache (CustomKernel::eval_gpu asks
// get_jit_module for no disk cache), so every process would compile all of ours again (tens of
// seconds before the LLM step's first steps), and every launch hashes the kernel's text.
// The pieces that need no GPU (the text NVRTC compiles, the cache file, the NVRTC call itself)
// build everywhere and are tested on the CPU; the launch builds only against mlx-cuda with CUDA's
// headers (VC_OWN_LAUNCH).
#pragma once

#include <filesystem>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_sources.h"

namespace voicechat {

// The CUDA C++ type of an MLX dtype in a kernel's signature ("float", "__nv_bfloat16", ...).
std::string cuda_type_name(mlx::core::Dtype t);

// A template argument as MLX writes it: "int:4", "bool:true", "type:float".
std::string template_arg_text(const mlx::core::fast::TemplateArg& arg);

// The whole translation unit NVRTC compiles for one instance: the prelude our kernels rely on
// (the same as the nvcc check's stand-in for MLX's), the source's header, and
// `extern "C" __global__ void vc_kernel(inputs..., outputs...)` with the template args as constexpr
// / using lines before the body, as MLX writes its kernels (and `__launch_bounds__` where the source
// names its threads arg). The first line names the target
// (`// sm_90`), so that one text is one cubin.
std::string own_kernel_text(const CudaSource& source, const CudaInstance& instance, const std::string& arch);

// The text of the kernel that copies a strided view (at most kCopyMaxDims dimensions) into a
// row-contiguous array, for inputs of our launches that are not row-contiguous (MLX's custom kernels
// copy theirs the same way): `vc_kernel(src, dst, layout, bytes, n)`.
constexpr int kCopyMaxDims = 12;
std::string strided_copy_text(const std::string& arch);

// The cache file's name for a text: "vc_" and 32 hex digits of two 64-bit hashes of it.
std::string own_kernel_file_name(const std::string& text);

// A cubin kept on disk beside the text it was compiled from: the file holds both, and a file whose
// text differs from `text` (a hash collision, another NVRTC) or that is cut short reads as a miss.
// Writes go to a temporary name first and are renamed over, so a reader never sees half a file.
bool read_cached_cubin(const std::string& path, const std::string& text, std::string& cubin);
void write_cached_cubin(const std::string& path, const std::string& text, const std::string& cubin);

// NVRTC, found in the process (libmlx loads it) or by its soname: `text` compiled for `arch`
// ("sm_90") with `include_dirs`; throws with NVRTC's log when it does not compile, or when no
// NVRTC can be loaded.
std::string nvrtc_cubin(const std::string& text, const std::string& arch, const std::vector<std::string>& include_dirs);

// The folders NVRTC searches for CUDA's headers, as MLX-CUDA's own JIT searches them: the CCCL the
// mlx wheel bundles (<mlx_root>/include/cccl), CUDA's runtime headers from pip
// (<site-packages>/nvidia/{cu13,cu12,cuda_runtime}/include), else $CUDA_HOME or $CUDA_PATH or
// /usr/local/cuda's include/ and include/cccl. mlx_root: the loaded libmlx's package folder.
std::vector<std::string> cuda_include_dirs();
std::vector<std::string> cuda_include_dirs(const std::filesystem::path& mlx_root);

// VOICECHAT_CUBIN_DIR (voicechat's __init__ sets it beside the kernel texts; empty: no disk cache).
std::string cubin_folder();

// Whether this build has the launch (a CUDA build with CUDA's headers), and whether it is asked for
// (unless VOICECHAT_OWN_LAUNCH=0).
bool own_launch_built();
bool own_launch_wanted();

// A CustomKernelFunction with fast::cuda_kernel's arguments that compiles (or reads from the cubin
// cache) each instance once a process and launches it through our primitive. Where our launch fails
// (no NVRTC, no CUDA headers, ...), the whole process falls back to MLX's launch, made by
// `mlx_launch` on first need, with one line on stderr; a launch with an init_value takes MLX's too.
// Where the launch is not built: throws.
mlx::core::fast::CustomKernelFunction make_own_kernel(
    const CudaSource& source, int shared_memory, std::function<mlx::core::fast::CustomKernelFunction()> mlx_launch);

// Discovery on the calling thread (off by default): our launches there record the text of each
// kernel that the cubin cache lacks and give zeros of the outputs' shapes in place of the launch,
// for a graph that is only traced; take_discovered_kernels returns the (text, arch) recorded so
// far, once each, and forgets them. Where the launch is not built nothing is recorded.
void set_own_launch_discovery(bool on);
std::vector<std::pair<std::string, std::string>> take_discovered_kernels();

// Why this process fell back to MLX's launch (the first failure of ours), or nothing.
std::optional<std::string> own_launch_fallback();

// (registers a thread, most threads a block) of the vc_kernel in a cubin, on GPU 0: our launch
// refuses a block of more threads, which would not run. Throws where the launch is not built.
std::pair<int, int> cubin_limits(const std::string& cubin);

// How blocking work (an NVRTC compile inside a launch) runs: by default on the calling thread as it
// is; a host sets a section that wraps it (the Python binding releases the GIL in it, so that other
// threads run and compile meanwhile).
using BlockingSection = void (*)(const std::function<void()>& work);
void set_blocking_section(BlockingSection section);
void run_blocking(const std::function<void()>& work);

// A shared library: the file named by the environment variable `env` when set (failing to load it
// throws), else the first of `sonames` the process has loaded, else the first that loads; or null.
void* open_library(const char* env, std::initializer_list<const char*> sonames);

}  // namespace voicechat
