// Our own launch's pieces that need no GPU: the text NVRTC compiles for an instance, the cubin cache
// file, NVRTC itself and where it finds CUDA's headers. They build everywhere and are tested on the CPU.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "cuda/own_launch.h"
#include "jit_sources.h"
#include "mlx/mlx.h"
#include "mlx/version.h"

namespace mx = mlx::core;

namespace voicechat {

std::string cuda_type_name(mx::Dtype t) {
  if (t == mx::float32) return "float";
  if (t == mx::bfloat16) return "__nv_bfloat16";
  if (t == mx::float16) return "__half";
  if (t == mx::int32) return "int32_t";
  if (t == mx::uint32) return "uint32_t";
  if (t == mx::int64) return "int64_t";
  if (t == mx::uint64) return "uint64_t";
  if (t == mx::int16) return "int16_t";
  if (t == mx::uint16) return "uint16_t";
  if (t == mx::int8) return "int8_t";
  if (t == mx::uint8) return "uint8_t";
  if (t == mx::bool_) return "bool";
  throw std::invalid_argument("own launch: no CUDA type for this dtype");
}

std::string template_arg_text(const mx::fast::TemplateArg& arg) {
  if (const int* i = std::get_if<int>(&arg)) return "int:" + std::to_string(*i);
  if (const bool* b = std::get_if<bool>(&arg)) return *b ? "bool:true" : "bool:false";
  return "type:" + cuda_type_name(std::get<mx::Dtype>(arg));
}

namespace {


std::string template_line(const std::string& name, const std::string& value) {
  const auto colon = value.find(':');
  const std::string kind = value.substr(0, colon), v = value.substr(colon + 1);
  if (kind == "int") return "  constexpr int " + name + " = " + v + ";\n";
  if (kind == "bool") return "  constexpr bool " + name + " = " + v + ";\n";
  if (kind == "type") return "  using " + name + " = " + v + ";\n";
  throw std::invalid_argument("own launch: template arg " + name + " = " + value);
}

std::uint64_t fnv1a(const std::string& text, std::uint64_t h) {
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
  return h;
}

std::uint64_t fnv1(const std::string& text, std::uint64_t h) {
  for (unsigned char c : text) h = (h * 1099511628211ULL) ^ c;
  return h;
}

constexpr const char* kCacheMagic = "voicechat-cubin 1\n";

}  // namespace

std::string own_kernel_text(const CudaSource& source, const CudaInstance& instance, const std::string& arch) {
  if (instance.input_types.size() != source.input_names.size() ||
      instance.output_types.size() != source.output_names.size()) {
    throw std::invalid_argument(source.name + ": an instance's types do not match its inputs and outputs");
  }
  std::string params;
  for (size_t i = 0; i < source.input_names.size(); ++i) {
    params += (params.empty() ? "    const " : ",\n    const ") + instance.input_types[i] + "* " + source.input_names[i];
  }
  for (size_t i = 0; i < source.output_names.size(); ++i) {
    params += (params.empty() ? "    " : ",\n    ") + instance.output_types[i] + "* " + source.output_names[i];
  }
  std::string consts, bounds;
  for (const auto& [name, value] : instance.template_args) {
    consts += template_line(name, value);
    if (!source.threads_arg.empty() && name == source.threads_arg) {
      if (value.rfind("int:", 0) != 0) {
        throw std::invalid_argument(source.name + ": its threads arg " + name + " is not an int");
      }
      bounds = "__launch_bounds__(" + std::to_string(std::stoi(value.substr(4)) * source.threads_scale) + ") ";
    }
  }
  // the prelude (csrc/kernels/launch/prelude.cuh): what our kernels may rely on of MLX's JIT prelude
  // (tests/data/cuda_stub says the same to nvcc)
  return "// " + arch + "\n" + jit::launch::prelude + source.header +
         "\nnamespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n\nextern \"C\" __global__ void " + bounds +
         "vc_kernel(\n" +
         params + ") {\n" + consts + source.source + "\n}\n\n}  // namespace mlx::core::cu\n";
}

std::string strided_copy_text(const std::string& arch) {
  // the kernel text spells the layout's capacity VC_COPY_MAX_DIMS
  std::string text = jit::launch::strided_copy;
  for (size_t at; (at = text.find("VC_COPY_MAX_DIMS")) != std::string::npos;) {
    text.replace(at, 16, std::to_string(kCopyMaxDims));
  }
  return "// " + arch + "\n" + text;
}

std::string own_kernel_file_name(const std::string& text) {
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(fnv1a(text, 1469598103934665603ULL)),
                static_cast<unsigned long long>(fnv1(text, 14695981039346656037ULL)));
  return std::string("vc_") + hex;
}

bool read_cached_cubin(const std::string& path, const std::string& text, std::string& cubin) {
  const std::string data = file_text(path);
  const std::string head = kCacheMagic + std::to_string(text.size()) + "\n";
  if (data.compare(0, head.size(), head) != 0 || data.size() <= head.size() + text.size() ||
      data.compare(head.size(), text.size(), text) != 0) {
    return false;
  }
  cubin = data.substr(head.size() + text.size());
  return true;
}

void write_cached_cubin(const std::string& path, const std::string& text, const std::string& cubin) {
  write_file_whole(path, kCacheMagic + std::to_string(text.size()) + "\n" + text + cubin);
}

void* open_library(const char* env, std::initializer_list<const char*> sonames) {
  if (const char* path = std::getenv(env); path != nullptr && *path) {
    if (void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL)) return h;
    throw std::runtime_error(std::string(env) + "=" + path + " cannot be loaded: " + dlerror());
  }
  for (const char* name : sonames) {  // the copy libmlx loaded, then any on the search path
    if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) return h;
  }
  for (const char* name : sonames) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
  }
  return nullptr;
}

namespace {

BlockingSection& blocking_section() {
  static BlockingSection section = nullptr;
  return section;
}

// NVRTC's entry points, looked up by name (no build-time dependency on its header or library).
struct Nvrtc {
  using Program = void*;
  int (*create)(Program*, const char*, const char*, int, const char* const*, const char* const*);
  int (*compile)(Program, int, const char* const*);
  int (*log_size)(Program, size_t*);
  int (*log)(Program, char*);
  int (*cubin_size)(Program, size_t*);
  int (*cubin)(Program, char*);
  int (*destroy)(Program*);
  const char* (*error)(int);
};

template <typename F>
void find(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (fn == nullptr) throw std::runtime_error(std::string("own launch: no ") + name + " in NVRTC");
}

const Nvrtc& nvrtc() {
  static const Nvrtc api = [] {
    void* lib = open_library("VOICECHAT_NVRTC", {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"});
    if (lib == nullptr) throw std::runtime_error("own launch: NVRTC (libnvrtc.so) cannot be loaded");
    Nvrtc a{};
    find(lib, "nvrtcCreateProgram", a.create);
    find(lib, "nvrtcCompileProgram", a.compile);
    find(lib, "nvrtcGetProgramLogSize", a.log_size);
    find(lib, "nvrtcGetProgramLog", a.log);
    find(lib, "nvrtcGetCUBINSize", a.cubin_size);
    find(lib, "nvrtcGetCUBIN", a.cubin);
    find(lib, "nvrtcDestroyProgram", a.destroy);
    find(lib, "nvrtcGetErrorString", a.error);
    return a;
  }();
  return api;
}

}  // namespace

std::string nvrtc_cubin(const std::string& text, const std::string& arch, const std::vector<std::string>& include_dirs) {
  const Nvrtc& api = nvrtc();
  auto check = [&api](int rc, const char* what) {
    if (rc != 0) throw std::runtime_error(std::string("own launch: ") + what + ": " + api.error(rc));
  };
  Nvrtc::Program prog = nullptr;
  check(api.create(&prog, text.c_str(), "vc_kernel.cu", 0, nullptr, nullptr), "nvrtcCreateProgram");
  std::unique_ptr<Nvrtc::Program, void (*)(Nvrtc::Program*)> owner(&prog, [](Nvrtc::Program* p) { nvrtc().destroy(p); });
  // -default-device: MLX 0.32.4 compiles with it too (as --device-as-default-execution-space, in its
  // libmlx's strings); without it an unannotated lambda inside a kernel is host code to NVRTC
  std::vector<std::string> options = {"--gpu-architecture=" + arch, "-default-device"};
  for (const auto& dir : include_dirs) options.push_back("--include-path=" + dir);
  std::vector<const char*> argv;
  for (const auto& o : options) argv.push_back(o.c_str());
  if (api.compile(prog, static_cast<int>(argv.size()), argv.data()) != 0) {
    size_t size = 0;
    api.log_size(prog, &size);
    std::string log(size, '\0');
    if (size) api.log(prog, log.data());
    throw std::runtime_error("own launch: NVRTC did not compile the kernel:\n" + log);
  }
  size_t size = 0;
  check(api.cubin_size(prog, &size), "nvrtcGetCUBINSize");
  std::string cubin(size, '\0');
  check(api.cubin(prog, cubin.data()), "nvrtcGetCUBIN");
  return cubin;
}

namespace {
// The folder libmlx was loaded from (site-packages/mlx/lib for a wheel).
std::filesystem::path libmlx_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&mx::version), &info) == 0 || info.dli_fname == nullptr) return {};
  return std::filesystem::path(info.dli_fname).parent_path();
}
}  // namespace

std::vector<std::string> cuda_include_dirs() { return cuda_include_dirs(libmlx_dir().parent_path()); }

std::vector<std::string> cuda_include_dirs(const std::filesystem::path& mlx_root) {
  // MLX-CUDA 0.32.4's own JIT's folders, in its order, so that our kernels see the headers its
  // kernels see: the CCCL its wheel bundles, CUDA's runtime headers from pip (nvidia-cuda-runtime),
  // else the toolkit's ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda).
  std::vector<std::string> dirs;
  auto add = [&dirs](const std::filesystem::path& dir) {
    std::error_code error;
    const bool there = std::filesystem::is_directory(dir, error);
    if (there) dirs.push_back(dir.string());
    return there;
  };
  if (!mlx_root.empty()) {
    add(mlx_root / "include" / "cccl");
    for (const char* pip : {"cu13", "cu12", "cuda_runtime"}) {
      if (add(mlx_root.parent_path() / "nvidia" / pip / "include")) return dirs;
    }
  }
  std::string home = "/usr/local/cuda";
  for (const char* env : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* v = std::getenv(env); v != nullptr && *v) {
      home = v;
      break;
    }
  }
  add(std::filesystem::path(home) / "include");
  add(std::filesystem::path(home) / "include" / "cccl");
  return dirs;
}

std::string cubin_folder() {
  const char* folder = std::getenv("VOICECHAT_CUBIN_DIR");
  return folder == nullptr ? std::string() : std::string(folder);
}

void set_blocking_section(BlockingSection section) { blocking_section() = section; }

void run_blocking(const std::function<void()>& work) {
  if (const BlockingSection section = blocking_section()) {
    section(work);
  } else {
    work();
  }
}

}  // namespace voicechat
