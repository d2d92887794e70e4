// Our own launch of our CUDA kernels (own_launch.h): discovery, and where built (VC_OWN_LAUNCH: a
// CUDA build with CUDA's headers) the cubins loaded with the driver API and added to MLX's command
// encoder by a primitive of ours.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <variant>

#include "cuda/own_launch.h"
#include "mlx/mlx.h"

#ifdef VC_OWN_LAUNCH
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "mlx/primitives.h"
#endif

namespace mx = mlx::core;

namespace voicechat {

namespace {
// Discovery (`own_launch_discovery`): a thread that turns it on traces graphs without compiling our
// kernels. A launch there whose kernel the cubin cache lacks records the kernel's text and gives
// zeros of its outputs' shapes in place of the launch, so a traced step names every kernel it needs
// at once, and they compile side by side afterwards (voicechat.precompile). Such a graph is only
// traced: its values are not the kernels'. Other threads launch as usual.
thread_local bool discovering = false;
std::mutex discovered_lock;
std::vector<std::pair<std::string, std::string>> discovered;  // (text, arch), under discovered_lock
std::set<std::string> discovered_texts;                         // the same texts, for uniqueness
}  // namespace

void set_own_launch_discovery(bool on) { discovering = on; }

std::vector<std::pair<std::string, std::string>> take_discovered_kernels() {
  std::lock_guard<std::mutex> guard(discovered_lock);
  std::vector<std::pair<std::string, std::string>> out;
  out.swap(discovered);
  discovered_texts.clear();
  return out;
}

bool own_launch_built() {
#ifdef VC_OWN_LAUNCH
  return true;
#else
  return false;
#endif
}

bool own_launch_wanted() {
  // on unless VOICECHAT_OWN_LAUNCH=0 (MLX's custom-kernel launch, which compiles ours in every process)
  const char* v = std::getenv("VOICECHAT_OWN_LAUNCH");
  return v == nullptr || std::string(v) != "0";
}

#ifdef VC_OWN_LAUNCH
namespace {

// The driver API, looked up in the libcuda that libmlx loaded.
struct Driver {
  int (*load)(CUmodule*, const void*);
  int (*function)(CUfunction*, CUmodule, const char*);
  int (*attribute)(CUfunction, int, int);
  int (*get_attribute)(int*, int, CUfunction);
  // a kernel of clusters goes into MLX's graph as a child graph of its one node (see OwnKernel)
  int (*graph_create)(CUgraph*, unsigned int);
  int (*graph_add_kernel)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, const CUDA_KERNEL_NODE_PARAMS*);
  int (*graph_node_attribute)(CUgraphNode, CUlaunchAttributeID, const CUlaunchAttributeValue*);
  int (*graph_destroy)(CUgraph);
};

const Driver& driver() {
  static const Driver api = [] {
    void* lib = open_library("VOICECHAT_LIBCUDA", {"libcuda.so.1", "libcuda.so"});
    if (lib == nullptr) throw std::runtime_error("own launch: libcuda cannot be loaded");
    Driver d{};
    d.load = reinterpret_cast<decltype(d.load)>(dlsym(lib, "cuModuleLoadData"));
    d.function = reinterpret_cast<decltype(d.function)>(dlsym(lib, "cuModuleGetFunction"));
    d.attribute = reinterpret_cast<decltype(d.attribute)>(dlsym(lib, "cuFuncSetAttribute"));
    d.get_attribute = reinterpret_cast<decltype(d.get_attribute)>(dlsym(lib, "cuFuncGetAttribute"));
    d.graph_create = reinterpret_cast<decltype(d.graph_create)>(dlsym(lib, "cuGraphCreate"));
    d.graph_add_kernel = reinterpret_cast<decltype(d.graph_add_kernel)>(dlsym(lib, "cuGraphAddKernelNode_v2"));
    d.graph_node_attribute =
        reinterpret_cast<decltype(d.graph_node_attribute)>(dlsym(lib, "cuGraphKernelNodeSetAttribute"));
    d.graph_destroy = reinterpret_cast<decltype(d.graph_destroy)>(dlsym(lib, "cuGraphDestroy"));
    if (!d.load || !d.function || !d.attribute || !d.get_attribute || !d.graph_create || !d.graph_add_kernel ||
        !d.graph_node_attribute || !d.graph_destroy) {
      throw std::runtime_error("own launch: libcuda lacks an entry point");
    }
    return d;
  }();
  return api;
}

// A loaded kernel and what its registers allow: a launch of more threads a block than max_threads
// does not run, and neither MLX's graph nor ours reports it (the block's registers, its threads times
// the kernel's per thread, past the SM's 65536: its output is left unwritten).
struct Loaded {
  CUfunction fn = nullptr;
  int registers = 0;
  int max_threads = 0;
};

// A launch its kernel cannot take (a bigger block than its registers allow, a grid that is not a whole
// number of its clusters): said to the caller (a ValueError), not fallen back on, since MLX's launch
// would not run it either.
struct LaunchRefused : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// The vc_kernel of a cubin, loaded into the current context (its module stays loaded), or nullptr.
CUfunction load_vc_kernel(const std::string& cubin) {
  const Driver& api = driver();
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  return api.load(&module, cubin.data()) == 0 && api.function(&fn, module, "vc_kernel") == 0 ? fn : nullptr;
}

Loaded limits_of(CUfunction fn, const std::string& what) {
  Loaded k{fn};
  const Driver& api = driver();
  if (api.get_attribute(&k.registers, CU_FUNC_ATTRIBUTE_NUM_REGS, fn) != 0 ||
      api.get_attribute(&k.max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn) != 0) {
    throw std::runtime_error(what + ": the compiled kernel's registers cannot be read");
  }
  return k;
}

// The cubin of `text`: from the cubin cache, else NVRTC (and into the cache). Called without
// loaded_function's lock and as blocking work (run_blocking: the Python binding releases the GIL), so that
// threads compile distinct kernels at once: NVRTC compiles distinct programs concurrently, and a
// cache file is written under a temporary name and renamed (two threads or processes compiling one
// text write the same bytes).
std::string cached_or_compiled(const std::string& text, const std::string& arch) {
  std::string cubin;
  const std::string folder = cubin_folder();
  const std::string path = folder.empty() ? std::string() : folder + "/" + own_kernel_file_name(text) + ".cubin";
  if (!path.empty() && read_cached_cubin(path, text, cubin)) return cubin;
  {
    run_blocking([&] { cubin = nvrtc_cubin(text, arch, cuda_include_dirs()); });
  }
  if (!path.empty()) {
    try {
      write_cached_cubin(path, text, cubin);
    } catch (const std::exception& e) {
      // an unwritable cache costs the next process a compile, never this launch: said once
      static std::atomic<bool> said{false};
      if (!said.exchange(true)) {
        std::fprintf(stderr, "voicechat: cannot keep compiled kernels in %s (%s); every process will compile "
                     "them again (VOICECHAT_CUBIN_DIR picks the folder)\n", folder.c_str(), e.what());
      }
    }
  }
  return cubin;
}

// A kernel by `key` (what tells it apart: device, types, args, shared memory): from this process's
// table, else the cubin cache, else NVRTC (and into the cache). Modules stay loaded for the process.
// `text_for(arch)` writes the text, called only on a miss (not at every launch). The table's lock
// is not held over a compile (cached_or_compiled): two threads that miss one key both compile it,
// and the first to load it fills the table.
Loaded loaded_function(const std::string& key, const std::string& what, int smem, const mx::Stream& s,
                       const std::function<std::string(const std::string&)>& text_for) {
  static std::mutex lock;
  static auto* loaded = new std::map<std::string, Loaded>();  // never freed: outlives the runtime
  {
    std::lock_guard<std::mutex> guard(lock);
    if (auto it = loaded->find(key); it != loaded->end()) return it->second;
  }
  auto& device = mx::cu::device(s.device);
  const std::string arch =
      "sm_" + std::to_string(device.compute_capability_major()) + std::to_string(device.compute_capability_minor());
  const std::string cubin = cached_or_compiled(text_for(arch), arch);
  std::lock_guard<std::mutex> guard(lock);
  if (auto it = loaded->find(key); it != loaded->end()) return it->second;
  device.make_current();
  CUfunction fn = load_vc_kernel(cubin);
  if (!fn) {
    throw std::runtime_error(what + ": the compiled kernel did not load");
  }
  if (smem > 48 * 1024 && driver().attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem) != 0) {
    throw std::runtime_error(what + ": " + std::to_string(smem) + " bytes of dynamic shared memory refused");
  }
  const Loaded k = limits_of(fn, what);
  loaded->emplace(key, k);
  return k;
}

Loaded instance_function(const CudaSource& source, const CudaInstance& instance, int smem, const mx::Stream& s) {
  std::string key = source.name + "|" + std::to_string(s.device.index) + "|" + std::to_string(smem);
  for (const auto& t : instance.input_types) key += "|" + t;
  for (const auto& t : instance.output_types) key += "|" + t;
  for (const auto& [name, value] : instance.template_args) key += "|" + name + "=" + value;
  return loaded_function(key, source.name, smem, s,
                         [&](const std::string& arch) { return own_kernel_text(source, instance, arch); });
}

// Discovery's record of one launch: the instance's text, unless the cubin cache holds it already.
void discover(const CudaSource& source, const CudaInstance& instance, const mx::Stream& s) {
  auto& device = mx::cu::device(s.device);
  const std::string arch =
      "sm_" + std::to_string(device.compute_capability_major()) + std::to_string(device.compute_capability_minor());
  std::string text = own_kernel_text(source, instance, arch);
  {
    std::lock_guard<std::mutex> guard(discovered_lock);
    if (discovered_texts.count(text)) return;
  }
  const std::string folder = cubin_folder();
  std::string cubin;
  if (!folder.empty() && read_cached_cubin(folder + "/" + own_kernel_file_name(text) + ".cubin", text, cubin)) return;
  std::lock_guard<std::mutex> guard(discovered_lock);
  if (discovered_texts.insert(text).second) discovered.emplace_back(std::move(text), arch);
}

// An array's device address for a kernel argument; null for an empty one (whose buffer may be none).
void* device_pointer(const mx::array& a) {
  return a.size() == 0 || a.buffer().ptr() == nullptr ? nullptr : mx::gpu_ptr<void>(a);
}

// The host side of strided_copy_text's VcLayout (same members, same C layout).
struct CopyLayout {
  int ndim;
  long long shape[kCopyMaxDims];
  long long strides[kCopyMaxDims];
};

// `in` (a view that is not row-contiguous) copied into a fresh row-contiguous array on the
// encoder's stream, kept alive by the encoder until the launch that reads it is done.
mx::array contiguous_copy(mx::cu::CommandEncoder& encoder, const mx::array& in, const mx::Stream& s) {
  if (in.ndim() > kCopyMaxDims) {
    throw std::invalid_argument("own launch: a non-contiguous input of " + std::to_string(in.ndim()) +
                                " dimensions (at most " + std::to_string(kCopyMaxDims) + ")");
  }
  CUfunction fn = loaded_function("vc_strided_copy|" + std::to_string(s.device.index), "vc_strided_copy", 0, s,
                                  strided_copy_text)
                      .fn;
  CopyLayout layout{static_cast<int>(in.ndim()), {}, {}};
  for (size_t d = 0; d < in.ndim(); ++d) {
    layout.shape[d] = in.shape(static_cast<int>(d));
    layout.strides[d] = in.strides()[d];
  }
  mx::array copy(in.shape(), in.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  const void* src = mx::gpu_ptr<void>(in);
  void* dst = mx::gpu_ptr<void>(copy);
  int bytes = static_cast<int>(in.itemsize());
  long long n = static_cast<long long>(in.size());
  void* params[] = {&src, &dst, &layout, &bytes, &n};
  constexpr long long kThreads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<long long>((n + kThreads - 1) / kThreads, 1 << 20));
  encoder.set_input_array(in);
  encoder.set_output_array(copy);
  encoder.add_kernel_node_raw(fn, dim3(blocks), dim3(kThreads), dim3(1, 1, 1), 0, params);
  encoder.add_temporary(copy);
  return copy;
}

// One kernel launch: its inputs' and outputs' device pointers as the kernel's arguments, added to
// the stream's command encoder as MLX adds its own kernels.
class OwnKernel : public mx::Primitive {
 public:
  OwnKernel(mx::Stream s, CUfunction fn, const std::string* name, dim3 grid, dim3 block, int smem, int cluster)
      : mx::Primitive(s), fn_(fn), name_(name), grid_(grid), block_(block), cluster_(cluster, 1, 1), smem_(smem) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(*name_ + ": our own kernel launch runs on a CUDA stream only");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cu::get_command_encoder(stream());
    // a view that is not row-contiguous is copied first, as MLX's custom kernels copy theirs; the
    // copies' nodes go in before this launch's inputs are named (naming them ties them to the next node)
    std::vector<mx::array> sources;
    sources.reserve(inputs.size());
    for (const auto& in : inputs) {
      sources.push_back(in.flags().row_contiguous || in.size() == 0 ? in : contiguous_copy(encoder, in, stream()));
    }
    std::vector<void*> pointers;
    pointers.reserve(inputs.size() + outputs.size());
    for (const auto& in : sources) {
      pointers.push_back(device_pointer(in));
      encoder.set_input_array(in);
    }
    for (auto& out : outputs) {
      // MLX's own launches take stream-ordered device memory (cu::malloc_async), which libmlx does
      // not export; its allocator's malloc gives managed memory (CudaAllocator::malloc is
      // malloc_async(size, -1, nullptr) in 0.32.4's disassembly), which serves a steady chain of launches
      // as well.
      out.set_data(mx::allocator::malloc(out.nbytes()));
      pointers.push_back(device_pointer(out));
      encoder.set_output_array(out);
    }
    std::vector<void*> params(pointers.size());
    for (size_t i = 0; i < pointers.size(); ++i) params[i] = &pointers[i];
    if (cluster_.x == 1) {
      encoder.add_kernel_node_raw(fn_, grid_, block_, cluster_, static_cast<uint32_t>(smem_), params.data());
    } else {
      add_cluster_node(encoder, params.data());
    }
  }

  const char* name() const override { return "VoicechatKernel"; }

 private:
  // MLX 0.32.4 keys a cached executable graph by its nodes' kinds and edges ("K" for any kernel node,
  // its cluster attribute not counted) and updates it in place (cudaGraphExecUpdate) for the next
  // graph of that key; an update between kernel nodes of different cluster shapes is not done right
  // (MLX's own note where it keys child graphs): cluster launches as plain kernel nodes give wrong
  // results to the launches that take their cached graph (test_rvq_kernel's sequence). A child graph's key holds its kernels' cluster shapes, so ours goes in as a child graph of its
  // one node: only a node of the same shape ever takes its place.
  void add_cluster_node(mx::cu::CommandEncoder& encoder, void** params) {
    const Driver& api = driver();
    CUgraph child = nullptr;
    if (api.graph_create(&child, 0) != 0) throw std::runtime_error(*name_ + ": cuGraphCreate failed");
    std::unique_ptr<CUgraph_st, int (*)(CUgraph)> owned(child, api.graph_destroy);
    CUDA_KERNEL_NODE_PARAMS p{};
    p.func = fn_;
    p.gridDimX = grid_.x, p.gridDimY = grid_.y, p.gridDimZ = grid_.z;
    p.blockDimX = block_.x, p.blockDimY = block_.y, p.blockDimZ = block_.z;
    p.sharedMemBytes = static_cast<unsigned int>(smem_);
    p.kernelParams = params;  // (copied into the node)
    CUgraphNode node = nullptr;
    CUlaunchAttributeValue shape{};
    shape.clusterDim.x = cluster_.x, shape.clusterDim.y = cluster_.y, shape.clusterDim.z = cluster_.z;
    if (api.graph_add_kernel(&node, child, nullptr, 0, &p) != 0 ||
        api.graph_node_attribute(node, CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, &shape) != 0) {
      throw std::runtime_error(*name_ + ": its cluster launch could not be made a graph node");
    }
    encoder.add_graph_node(child);  // (cloned into MLX's graph)
  }

  CUfunction fn_;
  const std::string* name_;  // the source's name, alive for the process (the registry holds it)
  dim3 grid_, block_, cluster_;
  int smem_;
};

std::mutex fallback_lock;
std::string fallback_reason;  // under fallback_lock; set once
std::atomic<bool> fell_back{false};

// Our launch failed where MLX's may work (no NVRTC, no CUDA headers, a driver without an entry
// point): the process goes on with MLX's launch, said once on stderr.
void fall_back(const std::string& source_name, const std::string& what) {
  std::lock_guard<std::mutex> guard(fallback_lock);
  if (fell_back.load()) return;
  fallback_reason = source_name + ": " + what.substr(0, what.find('\n'));
  std::fprintf(stderr, "voicechat: our own kernel launch failed (%s); MLX's launch is used in this process "
               "(VOICECHAT_OWN_LAUNCH=0 skips ours)\n", fallback_reason.c_str());
  fell_back.store(true);
}

// The MLX launch of a source, made on first need.
struct MlxLaunch {
  std::function<mx::fast::CustomKernelFunction()> make;
  std::once_flag made;
  mx::fast::CustomKernelFunction fn;
  const mx::fast::CustomKernelFunction& get() {
    std::call_once(made, [this] { fn = make(); });
    return fn;
  }
};
}  // namespace

std::optional<std::string> own_launch_fallback() {
  std::lock_guard<std::mutex> guard(fallback_lock);
  if (!fell_back.load()) return std::nullopt;
  return fallback_reason;
}

mx::fast::CustomKernelFunction make_own_kernel(const CudaSource& source, int shared_memory,
                                               std::function<mx::fast::CustomKernelFunction()> mlx_launch) {
  const CudaSource* src = &source;  // registered sources live for the process
  auto mlx = std::make_shared<MlxLaunch>();
  mlx->make = std::move(mlx_launch);
  return [src, shared_memory, mlx](const std::vector<mx::array>& inputs, const std::vector<mx::Shape>& output_shapes,
                                   const std::vector<mx::Dtype>& output_dtypes, std::tuple<int, int, int> grid,
                                   std::tuple<int, int, int> threadgroup,
                                   std::vector<std::pair<std::string, mx::fast::TemplateArg>> template_args,
                                   std::optional<float> init_value, bool verbose, mx::StreamOrDevice s_) {
    const auto s = mx::to_stream(s_);
    if (!init_value && !fell_back.load(std::memory_order_relaxed)) {  // (init_value: MLX's launch has it)
      try {
        CudaInstance instance;
        for (const auto& in : inputs) instance.input_types.push_back(cuda_type_name(in.dtype()));
        for (const auto& t : output_dtypes) instance.output_types.push_back(cuda_type_name(t));
        for (const auto& [name, value] : template_args) {
          instance.template_args.emplace_back(name, template_arg_text(value));
        }
        if (discovering) {
          discover(*src, instance, s);
          std::vector<mx::array> zeros;
          for (size_t i = 0; i < output_shapes.size(); ++i) zeros.push_back(mx::zeros(output_shapes[i], output_dtypes[i], s));
          return zeros;
        }
        const Loaded k = instance_function(*src, instance, shared_memory, s);
        const auto [gx, gy, gz] = grid;
        const auto [tx, ty, tz] = threadgroup;
        if (tx * ty * tz > k.max_threads) {
          throw LaunchRefused(src->name + ": this instance takes " + std::to_string(k.registers) +
                              " registers a thread, so at most " + std::to_string(k.max_threads) +
                              " threads a block, and the launch asks for " + std::to_string(tx * ty * tz));
        }
        // MLX's grid counts threads: blocks = ceil(grid / threadgroup) on each axis
        const dim3 blocks((gx + tx - 1) / tx, (gy + ty - 1) / ty, (gz + tz - 1) / tz), block(tx, ty, tz);
        if (blocks.x % src->cluster != 0) {
          throw LaunchRefused(src->name + ": " + std::to_string(blocks.x) + " blocks are not a whole number of its " +
                              std::to_string(src->cluster) + "-block clusters");
        }
        return mx::array::make_arrays(
            output_shapes, output_dtypes,
            std::make_shared<OwnKernel>(s, k.fn, &src->name, blocks, block, shared_memory, src->cluster), inputs);
      } catch (const LaunchRefused&) {
        throw;
      } catch (const std::exception& e) {
        fall_back(src->name, e.what());
      }
    }
    return mlx->get()(inputs, output_shapes, output_dtypes, grid, threadgroup, std::move(template_args), init_value,
                      verbose, s);
  };
}

std::pair<int, int> cubin_limits(const std::string& cubin) {
  mx::cu::device(mx::Device(mx::Device::gpu, 0)).make_current();
  CUfunction fn = load_vc_kernel(cubin);  // left loaded: a tool's and tests' query
  if (!fn) {
    throw std::invalid_argument("cubin_limits: the cubin does not load, or has no vc_kernel");
  }
  const Loaded k = limits_of(fn, "cubin_limits");
  return {k.registers, k.max_threads};
}
#else
std::optional<std::string> own_launch_fallback() { return std::nullopt; }

std::pair<int, int> cubin_limits(const std::string&) {
  throw std::runtime_error("cubin_limits: this build has no own kernel launch (a CUDA build with CUDA's headers)");
}

mx::fast::CustomKernelFunction make_own_kernel(const CudaSource& source, int,
                                               std::function<mx::fast::CustomKernelFunction()>) {
  throw std::runtime_error(source.name + ": this build has no own kernel launch (a CUDA build with CUDA's headers)");
}
#endif

}  // namespace voicechat
