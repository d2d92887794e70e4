// Each kernel file registers its Python bindings here, so adding a kernel touches no shared file.
#pragma once

#include <pybind11/pybind11.h>

#include <vector>

namespace voicechat {

using Registrar = void (*)(pybind11::module_&);

std::vector<Registrar>& registrars();

struct AutoRegister {
  explicit AutoRegister(Registrar r) { registrars().push_back(r); }
};

}  // namespace voicechat

#define VC_REGISTER(fn) static ::voicechat::AutoRegister vc_register_##fn(fn)
