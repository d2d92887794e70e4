#include "cuda_sources.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string_view>

#include "mlx/mlx.h"
#include "registry.h"

namespace py = pybind11;

namespace voicechat {

namespace {
std::deque<CudaSource>& storage() {
  static std::deque<CudaSource> list;  // a deque: references stay valid as kernels register
  return list;
}
}  // namespace

const CudaSource& register_cuda_source(CudaSource source) {
  storage().push_back(std::move(source));
  return storage().back();
}

const std::deque<CudaSource>& cuda_sources() { return storage(); }

bool cuda_build() { return std::string_view(VC_BACKEND) == "cuda"; }

bool gpu_stream(const mlx::core::Stream& s) { return s.device == mlx::core::Device::gpu; }

namespace {
void bind(py::module_& m) {
  m.def("cuda_sources", [] {
    py::list out;
    for (const auto& src : cuda_sources()) {
      py::dict d;
      d["name"] = src.name;
      d["input_names"] = src.input_names;
      d["output_names"] = src.output_names;
      d["source"] = src.source;
      d["header"] = src.header;
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
}
}  // namespace
VC_REGISTER(bind);

}  // namespace voicechat
