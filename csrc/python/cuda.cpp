// Bindings of the kernel sources and of our own launch's pieces, for the compile checks, the CPU
// emulation and voicechat.precompile.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_sources.h"
#include "cuda/own_launch.h"
#include "jit_sources.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace voicechat {
namespace {

const CudaSource& registered(const std::string& name) {
  for (const auto& src : cuda_sources()) {
    if (src.name == name) return src;
  }
  throw std::invalid_argument("no registered CUDA source named " + name);
}

// Blocking work (an NVRTC compile inside a launch) with the GIL released where this thread holds it,
// so that other threads run, and compile distinct kernels, meanwhile.
void without_gil(const std::function<void()>& work) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release released;
    work();
  } else {
    work();
  }
}

}  // namespace

void bind_cuda(py::module_& m) {
  set_blocking_section(&without_gil);
  m.def("cuda_sources", [] {
    py::list out;
    for (const auto& src : cuda_sources()) {
      py::dict d;
      d["name"] = src.name;
      d["jit_name"] = jit_name(src);
      d["input_names"] = src.input_names;
      d["output_names"] = src.output_names;
      d["source"] = src.source;
      d["header"] = src.header;
      d["cluster"] = src.cluster;
      d["threads_arg"] = src.threads_arg;
      d["threads_scale"] = src.threads_scale;
      py::list instances;
      for (const auto& inst : src.instances) {
        py::dict i;
        i["input_types"] = inst.input_types;
        i["output_types"] = inst.output_types;
        i["template_args"] = inst.template_args;
        instances.append(i);
      }
      d["instances"] = instances;
      out.append(d);
    }
    return out;
  }, "The CUDA kernel sources this extension JITs, with their instances (for compile checks).");
  m.def(
      "launch_text",
      [](const py::dict& source, const std::string& folder) {
        CudaSource src;
        src.name = source["name"].cast<std::string>();
        src.input_names = source["input_names"].cast<std::vector<std::string>>();
        src.output_names = source["output_names"].cast<std::vector<std::string>>();
        src.source = source["source"].cast<std::string>();
        src.header = source["header"].cast<std::string>();
        const KernelText text = launch_text(src, folder);
        return py::make_tuple(text.header, text.body, text.included);
      },
      py::arg("source"), py::arg("folder"),
      "(header, body, included): the texts a kernel (a dict as cuda_sources() lists them) is handed to MLX as, "
      "with `folder` as VOICECHAT_KERNEL_TEXT_DIR: #include lines of files written there, or the texts "
      "themselves where the folder is empty or unusable.");
  m.def("kernel_text_folder", &kernel_text_folder, "VOICECHAT_KERNEL_TEXT_DIR as the extension reads it.");
  m.def("compact_kernel_text", &compact_kernel_text, py::arg("text"),
        "A kernel's text as registered: comments dropped, lines trimmed, empty lines dropped (what MLX-CUDA "
        "handles at every launch).");
  m.def(
      "own_kernel_text",
      [](const std::string& name, int instance, const std::string& arch) {
        const CudaSource& src = registered(name);
        if (instance < 0 || instance >= static_cast<int>(src.instances.size())) {
          throw std::invalid_argument(name + " has no instance " + std::to_string(instance));
        }
        return own_kernel_text(src, src.instances[instance], arch);
      },
      py::arg("name"), py::arg("instance"), py::arg("arch") = "sm_90",
      "The translation unit our own launch compiles for a registered source's instance (extern \"C\" "
      "vc_kernel).");
  m.def("own_kernel_file_name", &own_kernel_file_name, py::arg("text"),
        "The cubin cache's file name (without .cubin) for a kernel text.");
  m.def(
      "write_cached_cubin",
      [](const std::string& path, const std::string& text, const py::bytes& cubin) {
        write_cached_cubin(path, text, cubin);
      },
      py::arg("path"), py::arg("text"), py::arg("cubin"), "Keep a cubin on disk beside its text.");
  m.def(
      "read_cached_cubin",
      [](const std::string& path, const std::string& text) -> py::object {
        std::string cubin;
        if (!read_cached_cubin(path, text, cubin)) return py::none();
        return py::bytes(cubin);
      },
      py::arg("path"), py::arg("text"), "The cubin kept for `text` at `path`, or None.");
  m.def(
      "nvrtc_cubin",
      [](const std::string& text, const std::string& arch, const std::optional<std::vector<std::string>>& dirs) {
        std::string cubin;
        {
          py::gil_scoped_release released;  // threads compile distinct texts at once
          cubin = nvrtc_cubin(text, arch, dirs ? *dirs : cuda_include_dirs());
        }
        return py::bytes(cubin);
      },
      py::arg("text"), py::arg("arch") = "sm_90", py::arg("include_dirs") = py::none(),
      "`text` compiled by NVRTC (VOICECHAT_NVRTC names the library, else the loaded / system one); "
      "include_dirs: cuda_include_dirs() when None. Releases the GIL while NVRTC runs.");
  m.def("own_launch_discovery", &set_own_launch_discovery, py::arg("on"),
        "Discovery on the calling thread: our launches there record the texts of kernels the cubin cache "
        "lacks and give zeros instead of launching (for tracing only; voicechat.precompile).");
  m.def("own_launch_discovered", &take_discovered_kernels,
        "The (text, arch) of every kernel discovery recorded since the last call (then forgotten).");
  m.def("strided_copy_text", &strided_copy_text, py::arg("arch") = "sm_90",
        "The kernel that copies a non-row-contiguous input of our own launch into a row-contiguous one.");
  m.def(
      "cuda_include_dirs",
      [](const std::optional<std::string>& mlx_root) {
        return mlx_root ? cuda_include_dirs(std::filesystem::path(*mlx_root)) : cuda_include_dirs();
      },
      py::arg("mlx_root") = py::none(),
      "The folders NVRTC searches for CUDA's headers; mlx_root: the mlx package's folder (default: the "
      "loaded libmlx's).");
  m.def("own_launch", [] { return py::make_tuple(own_launch_built(), own_launch_wanted()); },
        "(built, wanted): whether this build can launch our kernels itself, and VOICECHAT_OWN_LAUNCH.");
  m.def(
      "cubin_limits", [](const py::bytes& cubin) { return cubin_limits(cubin); }, py::arg("cubin"),
      "(registers a thread, most threads a block) of the vc_kernel in a cubin (nvrtc_cubin's), on GPU 0: "
      "our launch refuses a block of more threads, which would not run.");
  m.def("own_launch_fallback", &own_launch_fallback,
        "Why this process fell back to MLX's launch after ours failed (the first failure), or None.");
  m.def(
      "kernel_files",
      [] {
        py::dict files;
        for (const auto& file : jit::files) files[py::str(file.path)] = py::str(file.text);
        return files;
      },
      "The CUDA texts embedded in the library at build time: {path under csrc/kernels: text}.");
}

}  // namespace voicechat
