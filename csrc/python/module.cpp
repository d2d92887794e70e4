// voicechat._ext: a thin binding over the voicechat_kernels library. The module, its version guard
// and the zero-copy probes; the ops and the kernel sources are bound in ops.cpp and cuda.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/cuda_sources.h"
#include "cuda/own_launch.h"
#include "mlx/mlx.h"
#include "mlx/version.h"
#include "python/mlx_caster.h"
#include "python/bindings.h"
#include "python/native_trace.h"

namespace py = pybind11;
namespace mx = mlx::core;

namespace voicechat {

namespace {

void check_runtime_mlx() {
  const std::string running = mx::version();
  if (running != VC_MLX_VERSION) {
    throw py::import_error(
        "voicechat._ext was built against mlx " VC_MLX_VERSION " but mlx " + running +
        " is running; reinstall voicechat with `pip install --force-reinstall --no-build-isolation "
        "voicechat` (or install mlx==" VC_MLX_VERSION ").");
  }
  py::object probe = py::module_::import("mlx.core").attr("array")(0);
  if (!nanobind::isinstance<mx::array>(nanobind::handle(probe.ptr()))) {
    throw py::import_error(
        "voicechat._ext cannot read mlx.core arrays (nanobind internals differ from this mlx "
        "build); rebuild voicechat against the installed mlx with `pip install "
        "--force-reinstall --no-build-isolation voicechat`.");
  }
}

py::dict build_info() {
  py::dict info;
  info["mlx_version"] = VC_MLX_VERSION;
  info["backend"] = VC_BACKEND;
  info["compiler"] = __VERSION__;
  info["kernels"] = cuda_sources().size();  // CUDA kernel sources (csrc/kernels)
  info["own_launch"] = own_launch_built();  // csrc/cuda/own_launch.h: used unless VOICECHAT_OWN_LAUNCH=0
  return info;
}

}  // namespace
}  // namespace voicechat

PYBIND11_MODULE(_ext, m) {
  m.doc() = "voicechat's C++ kernels on MLX arrays";
  py::module_::import("mlx.core");
  nanobind::register_module(nanobind::handle(m.ptr()));
  voicechat::check_runtime_mlx();
  if (const char* v = std::getenv("VOICECHAT_NATIVE_TRACE"); v != nullptr && std::string(v) == "1") {
    voicechat::install_native_trace();
  }

  m.def("build_info", &voicechat::build_info,
        "The mlx version and backend this extension was built with.");
  m.def("identity", [](const mx::array& a) { return a; },
        "Return the same array through the C++ boundary (zero-copy probe).");
  m.def("identity_list", [](const std::vector<mx::array>& xs) { return xs; },
        "Return the same arrays through the C++ boundary (zero-copy probe).");
  m.def("data_ptr", [](mx::array a) {
        mx::eval(a);
        return reinterpret_cast<std::uintptr_t>(a.data<void>());
      },
      "Address of an array's data after evaluation (to check that nothing was copied).");

  voicechat::bind_ops(m);
  voicechat::bind_cuda(m);
}
