#include "cuda_sources.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
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

std::string jit_name(const CudaSource& source) {
  // FNV-1a (64 bit) over the header, the body and the argument names, each ended by a NUL.
  std::uint64_t h = 1469598103934665603ULL;
  auto feed = [&h](const std::string& text) {
    for (unsigned char c : text) {
      h = (h ^ c) * 1099511628211ULL;
    }
    h = (h ^ 0) * 1099511628211ULL;
  };
  feed(source.header);
  feed(source.source);
  for (const auto& n : source.input_names) feed(n);
  for (const auto& n : source.output_names) feed(n);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return source.name + "_" + std::string(hex, 12);
}

mlx::core::fast::CustomKernelFunction make_cuda_kernel(const CudaSource& source, int shared_memory) {
  return mlx::core::fast::cuda_kernel(jit_name(source), source.input_names, source.output_names, source.source,
                                      source.header, true, shared_memory);
}

bool cuda_build() { return std::string_view(VC_BACKEND) == "cuda"; }

bool gpu_stream(const mlx::core::Stream& s) { return s.device == mlx::core::Device::gpu; }

bool float_dtype(mlx::core::Dtype t) {
  return t == mlx::core::float32 || t == mlx::core::bfloat16 || t == mlx::core::float16;
}

std::string int_arg(int v) { return "int:" + std::to_string(v); }

int float_bits(float f) {
  int i;
  std::memcpy(&i, &f, sizeof(i));
  if (i < 0) {
    throw std::invalid_argument("float_bits: " + std::to_string(f) + " is negative (pass its magnitude and a sign)");
  }
  return i;
}

const mlx::core::array& kept_ints(const std::vector<int>& values) {
  static std::mutex lock;
  static auto* kept = new std::map<std::vector<int>, mlx::core::array>();  // never freed: outlives the runtime
  std::lock_guard<std::mutex> guard(lock);
  auto it = kept->find(values);
  if (it == kept->end()) {
    mlx::core::array a(values.begin(), mlx::core::Shape{static_cast<int>(values.size())}, mlx::core::int32);
    mlx::core::eval(a);
    it = kept->emplace(values, a).first;
  }
  return it->second;
}

std::string type_arg(const std::string& cuda_type) { return "type:" + cuda_type; }

const std::string& block_reduce_header() {
  static const std::string text = R"(
#ifndef VC_BLOCK_REDUCE
#define VC_BLOCK_REDUCE
template <int THREADS>
__device__ __forceinline__ float vc_block_sum(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

template <int THREADS>
__device__ __forceinline__ float vc_block_max(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float best = scratch[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) best = fmaxf(best, scratch[w]);
  __syncthreads();
  return best;
}
#endif
)";
  return text;
}

namespace {
void bind(py::module_& m) {
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
