// The parts of voicechat._ext, each defined in its own file of csrc/python.
#pragma once

#include <pybind11/pybind11.h>

namespace voicechat {

void bind_ops(pybind11::module_& m);   // ops.cpp: the kernels of include/voicechat
void bind_cuda(pybind11::module_& m);  // cuda.cpp: kernel sources and our own launch

}  // namespace voicechat
