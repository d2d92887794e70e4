// pybind11 <-> mlx.core.array, zero-copy.
//
// mlx.core is bound with nanobind (domain "mlx"); pybind11 cannot see its types on its own. This
// caster reaches them through a private static copy of nanobind compiled with NB_DOMAIN=mlx: the
// Python object's C++ array is used in place (an mlx array is a shared handle, so copying it
// copies no data), and results are moved into new mlx.core.array objects.
#pragma once

#include <nanobind/nanobind.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "mlx/array.h"
#include "mlx/device.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace pybind11::detail {

template <>
struct type_caster<mlx::core::array> {
 public:
  static constexpr auto name = const_name("mlx.core.array");

  // mlx::core::array has no default constructor: hold a pointer into the Python object.
  template <typename T>
  using cast_op_type = mlx::core::array&;

  bool load(handle src, bool /*convert*/) {
    nanobind::handle h(src.ptr());
    if (!nanobind::isinstance<mlx::core::array>(h)) {
      return false;
    }
    ptr_ = nanobind::inst_ptr<mlx::core::array>(h);
    return true;
  }

  operator mlx::core::array&() {
    if (ptr_ == nullptr) {
      throw reference_cast_error();
    }
    return *ptr_;
  }

  static handle cast(const mlx::core::array& src, return_value_policy, handle) {
    return nanobind::cast(mlx::core::array(src), nanobind::rv_policy::move).release().ptr();
  }

 private:
  mlx::core::array* ptr_ = nullptr;
};

// `stream=None | mx.Stream | mx.Device`, as MLX's own ops take it.
template <>
struct type_caster<mlx::core::StreamOrDevice> {
 public:
  PYBIND11_TYPE_CASTER(mlx::core::StreamOrDevice, const_name("mlx.core.Stream | mlx.core.Device | None"));

  bool load(handle src, bool) {
    if (src.is_none()) {
      value = std::monostate{};
      return true;
    }
    nanobind::handle h(src.ptr());
    if (nanobind::isinstance<mlx::core::Stream>(h)) {
      value = *nanobind::inst_ptr<mlx::core::Stream>(h);
      return true;
    }
    if (nanobind::isinstance<mlx::core::Device>(h)) {
      value = *nanobind::inst_ptr<mlx::core::Device>(h);
      return true;
    }
    // mx.cpu / mx.gpu are DeviceType enum members: let mlx make the Device.
    object core = module_::import("mlx.core");
    if (isinstance(src, core.attr("DeviceType"))) {
      object device = core.attr("Device")(src);
      value = *nanobind::inst_ptr<mlx::core::Device>(nanobind::handle(device.ptr()));
      return true;
    }
    return false;
  }

  static handle cast(const mlx::core::StreamOrDevice&, return_value_policy, handle) {
    return none().release();
  }
};

}  // namespace pybind11::detail
