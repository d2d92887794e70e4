// Fused Mamba-2 selective scan: one launch per layer per call, for a single decode step or a
// multi-token prefix starting from a given state.
//
//   for t in [0, L):                                  (head h uses group g = h / (H / G))
//     dt    = clip(softplus(dt_raw[t, h] + dt_bias[h]), lo, hi)
//     s     = exp(dt * A[h]) * s + dt * x[t, h, p] * B[t, g, :]        A = -exp(A_log)
//     y[t, h, p] = s . C[t, g, :] + D[h] * x[t, h, p]
//
// Shapes: x [b, L, H, P], dt [b, L, H], A_log / D / dt_bias [H], B / C [b, L, G, N],
// state [b, H, P, N] (absent = zeros). Returns y [b, L, H, P] in x's dtype and the final state
// [b, H, P, N] in float32. Everything accumulates in float32. Paths: CUDA (one warp per (b, h, p)
// row, lanes over the state), CPU (a C++ loop in a custom primitive), anything else composed ops.

#include "voicechat/mamba_scan.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_sources.h"
#include "jit_sources.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace voicechat {
namespace {

// ---------------------------------------------------------------- composed ops (any backend)

mx::array softplus(const mx::array& v, mx::StreamOrDevice s) {
  // torch's softplus (threshold 20); the same as log1p(exp(v)) in float32 above it.
  auto capped = mx::minimum(v, mx::array(20.0f), s);
  return mx::where(mx::greater(v, mx::array(20.0f), s), v, mx::log1p(mx::exp(capped, s), s), s);
}

std::vector<mx::array> mamba_scan_composed(const mx::array& x, const mx::array& dt_raw, const mx::array& A_log,
                                           const mx::array& B, const mx::array& C, const mx::array& D,
                                           const mx::array& dt_bias, const std::optional<mx::array>& state,
                                           float lo, float hi, mx::StreamOrDevice s) {
  const auto f32 = mx::float32;
  const int b = x.shape(0), L = x.shape(1), H = x.shape(2), P = x.shape(3);
  const int G = B.shape(2), N = B.shape(3);
  auto step = mx::add(mx::astype(dt_raw, f32, s), mx::astype(dt_bias, f32, s), s);
  step = mx::clip(softplus(step, s), mx::array(lo), mx::array(hi), s);  // [b, L, H]
  auto A = mx::negative(mx::exp(mx::astype(A_log, f32, s), s), s);
  auto Bh = mx::repeat(mx::astype(B, f32, s), H / G, 2, s);  // [b, L, H, N]
  auto Ch = mx::repeat(mx::astype(C, f32, s), H / G, 2, s);
  auto xf = mx::astype(x, f32, s);
  auto Df = mx::reshape(mx::astype(D, f32, s), {H, 1}, s);
  auto st = state ? mx::astype(*state, f32, s) : mx::zeros({b, H, P, N}, f32, s);
  std::vector<mx::array> ys;
  for (int t = 0; t < L; ++t) {
    auto dt_t = mx::take(step, t, 1, s);                                      // [b, H]
    auto x_t = mx::take(xf, t, 1, s);                                         // [b, H, P]
    auto decay = mx::reshape(mx::exp(mx::multiply(dt_t, A, s), s), {b, H, 1, 1}, s);
    auto dx = mx::multiply(mx::reshape(dt_t, {b, H, 1}, s), x_t, s);           // [b, H, P]
    auto B_t = mx::reshape(mx::take(Bh, t, 1, s), {b, H, 1, N}, s);
    auto C_t = mx::reshape(mx::take(Ch, t, 1, s), {b, H, N, 1}, s);
    st = mx::add(mx::multiply(decay, st, s), mx::multiply(mx::reshape(dx, {b, H, P, 1}, s), B_t, s), s);
    auto y = mx::add(mx::squeeze(mx::matmul(st, C_t, s), -1, s), mx::multiply(Df, x_t, s), s);
    ys.push_back(y);
  }
  auto y = L > 0 ? mx::stack(ys, 1, s) : mx::zeros({b, 0, H, P}, f32, s);
  return {mx::astype(y, x.dtype(), s), st};
}

// ---------------------------------------------------------------- CPU: a fused primitive

// Small per-head vectors of any float dtype (and any stride), read as float32.
std::vector<float> as_floats(const mx::array& a) {
  std::vector<float> out(a.size());
  const auto stride = a.ndim() ? a.strides()[0] : 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const auto at = static_cast<int64_t>(i) * stride;
    switch (a.dtype()) {
      case mx::float32: out[i] = a.data<float>()[at]; break;
      case mx::bfloat16: out[i] = static_cast<float>(a.data<mx::bfloat16_t>()[at]); break;
      case mx::float16: out[i] = static_cast<float>(a.data<mx::float16_t>()[at]); break;
      default: throw std::invalid_argument("mamba_scan: A_log, D and dt_bias must be floating point");
    }
  }
  return out;
}

class MambaScan : public mx::Primitive {
 public:
  MambaScan(mx::Stream stream, float lo, float hi, bool has_state)
      : mx::Primitive(stream), lo_(lo), hi_(hi), has_state_(has_state) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& y = outputs[0];
    auto& state_out = outputs[1];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    state_out.set_data(mx::allocator::malloc(state_out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(y);
    enc.set_output_array(state_out);
    switch (inputs[0].dtype()) {
      case mx::bfloat16: dispatch<mx::bfloat16_t>(enc, inputs, y, state_out); break;
      case mx::float16: dispatch<mx::float16_t>(enc, inputs, y, state_out); break;
      default: dispatch<float>(enc, inputs, y, state_out); break;
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("MambaScan runs on the CPU stream only (GPU uses cuda_kernel).");
  }

  const char* name() const override { return "MambaScan"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const MambaScan&>(other);
    return lo_ == o.lo_ && hi_ == o.hi_ && has_state_ == o.has_state_;
  }

 private:
  // Inputs keep their strides (slices of in_proj's output arrive as views): index through them.
  template <typename T>
  void dispatch(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& in, mx::array& y_arr,
                mx::array& s_arr) {
    const auto &x = in[0], &dt = in[1], &B = in[3], &C = in[4];
    const int b = x.shape(0), L = x.shape(1), H = x.shape(2), P = x.shape(3);
    const int G = B.shape(2), N = B.shape(3);
    const auto xs = x.strides(), dts = dt.strides(), bs = B.strides(), cs = C.strides();
    mx::Strides ss = has_state_ ? in[7].strides() : mx::Strides{};
    const float* s_in = has_state_ ? in[7].data<float>() : nullptr;
    // Inputs are computed by earlier tasks on this stream: read them inside the task only.
    enc.dispatch([x = x.data<T>(), dt = dt.data<T>(), Bp = B.data<T>(), Cp = C.data<T>(), A_arr = in[2],
                  D_arr = in[5], bias_arr = in[6], s_in, ss, xs, dts, bs, cs, y = y_arr.data<T>(),
                  s_out = s_arr.data<float>(), b, L, H, P, G, N, lo = lo_, hi = hi_]() {
      const auto A_log = as_floats(A_arr), D = as_floats(D_arr), bias = as_floats(bias_arr);
      const int heads_per_group = H / G;
      std::vector<float> step(L), decay(L), st(N);
      for (int bi = 0; bi < b; ++bi) {
        for (int h = 0; h < H; ++h) {
          const int g = h / heads_per_group;
          const float A = -std::exp(A_log[h]);
          for (int t = 0; t < L; ++t) {
            const float v = static_cast<float>(dt[bi * dts[0] + t * dts[1] + h * dts[2]]) + bias[h];
            const float sp = v > 20.0f ? v : std::log1p(std::exp(v));
            step[t] = std::min(std::max(sp, lo), hi);
            decay[t] = std::exp(step[t] * A);
          }
          for (int p = 0; p < P; ++p) {
            const size_t row = ((static_cast<size_t>(bi) * H + h) * P + p) * N;
            for (int n = 0; n < N; ++n) {
              st[n] = s_in ? s_in[bi * ss[0] + h * ss[1] + p * ss[2] + n * ss[3]] : 0.0f;
            }
            for (int t = 0; t < L; ++t) {
              const float xv = static_cast<float>(x[bi * xs[0] + t * xs[1] + h * xs[2] + p * xs[3]]);
              const float dx = step[t] * xv;
              const T* Bt = Bp + bi * bs[0] + t * bs[1] + g * bs[2];
              const T* Ct = Cp + bi * cs[0] + t * cs[1] + g * cs[2];
              float acc = 0.0f;
              for (int n = 0; n < N; ++n) {
                st[n] = decay[t] * st[n] + dx * static_cast<float>(Bt[n * bs[3]]);
                acc += st[n] * static_cast<float>(Ct[n * cs[3]]);
              }
              y[((static_cast<size_t>(bi) * L + t) * H + h) * P + p] = static_cast<T>(acc + D[h] * xv);
            }
            std::memcpy(s_out + row, st.data(), sizeof(float) * N);
          }
        }
      }
    });
  }

  float lo_, hi_;
  bool has_state_;
};

// ---------------------------------------------------------------- CUDA

constexpr int kCudaThreads = 128;  // 4 rows per block

const CudaSource& cuda_source() {
  static const CudaSource& src = register_cuda_source({
      "mamba_scan",
      {"xbc", "dt", "A_log", "D", "dt_bias", "state", "dims"},
      {"y", "state_out"},
      jit::mamba_scan::mamba_scan_body,
      "",
      {
          // The published model: float32 activations read from in_proj's output (22656 wide, dt at
          // 22528), bf16 D / dt_bias, float32 A_log and state, limit (0, inf).
          {{"float", "float", "float", "__nv_bfloat16", "__nv_bfloat16", "float", "int32_t"},
           {"float", "float"},
           {{"T", "type:float"}, {"H", "int:128"}, {"P", "int:80"}, {"G", "int:8"}, {"N", "int:128"},
            {"DT_W", "int:22656"}, {"DT_OFF", "int:22528"}, {"HAS_STATE", "bool:true"}, {"LO_BITS", "int:0"},
            {"HI_BITS", "int:2139095040"}}},
          // bf16 activations, a state size that is not a multiple of 32, no initial state, a limit.
          {{"__nv_bfloat16", "__nv_bfloat16", "float", "float", "float", "float", "int32_t"},
           {"__nv_bfloat16", "float"},
           {{"T", "type:__nv_bfloat16"}, {"H", "int:8"}, {"P", "int:16"}, {"G", "int:2"}, {"N", "int:24"},
            {"DT_W", "int:8"}, {"DT_OFF", "int:0"}, {"HAS_STATE", "bool:false"}, {"LO_BITS", "int:0"},
            {"HI_BITS", "int:1036831949"}}},
      },
  });
  return src;
}

const CudaSource& conv_scan_source() {
  using Arg = std::pair<std::string, std::string>;
  auto inst = [](int h, int p, int g, int n, int w, int x_off, int dt_off, int rb, const std::string& ts,
                 const std::string& dparams, bool has_state, bool gated) {
    return CudaInstance{{ts, "float", "float", "float", "float", dparams, dparams, "float", "float"},
                        {"float", "float", "float", "float"},
                        {Arg{"H", int_arg(h)}, Arg{"P", int_arg(p)}, Arg{"G", int_arg(g)}, Arg{"N", int_arg(n)},
                         Arg{"K", "int:4"}, Arg{"W", int_arg(w)}, Arg{"X_OFF", int_arg(x_off)},
                         Arg{"DT_OFF", int_arg(dt_off)}, Arg{"RB", int_arg(rb)}, Arg{"HAS_BIAS", "bool:true"},
                         Arg{"HAS_STATE", has_state ? "bool:true" : "bool:false"},
                         Arg{"GATED", gated ? "bool:true" : "bool:false"}, Arg{"GATE_OFF", "int:0"},
                         Arg{"TS", type_arg(ts)}, Arg{"LO_BITS", "int:0"}, Arg{"HI_BITS", "int:2139095040"},
                         Arg{"BATCH", "int:1"}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_mamba_conv_scan_step",
      {"projected", "conv_state", "conv_weight", "conv_bias", "A_log", "D", "dt_bias", "state", "gate_w"},
      {"y", "state_out", "new_state", "partials"},
      jit::mamba_scan::vc_mamba_conv_scan_step_body,
      "",
      // the published mixer (float32 activations, bf16 D / dt_bias), gated as the model runs it and
      // plain; bfloat16 activations, no state
      {inst(128, 80, 8, 128, 22656, 10240, 22528, 16, "float", "__nv_bfloat16", true, true),
       inst(128, 80, 8, 128, 22656, 10240, 22528, 16, "float", "__nv_bfloat16", true, false),
       inst(8, 16, 2, 24, 500, 128, 300, 8, "__nv_bfloat16", "float", false, false)},
  });
  return src;
}

// Packed problem shape: xbc [b, L, H*P + 2*G*N], dt_src [b, L, dt_width] with dt at dt_offset.
struct Packed {
  int H, P, G, N, dt_offset;
};

std::vector<mx::array> mamba_scan_cuda(const mx::array& xbc, const mx::array& dt_src, const Packed& k,
                                       const mx::array& A_log, const mx::array& D, const mx::array& dt_bias,
                                       const std::optional<mx::array>& state, float lo, float hi, mx::Stream s) {
  static auto kernel = [] {
    const auto& src = cuda_source();
    return make_cuda_kernel(src);
  }();
  const int b = xbc.shape(0), L = xbc.shape(1);
  // Without a state (HAS_STATE false) the kernel never reads `state`: any array fills the slot.
  const auto& st = state ? *state : dt_bias;
  const int rows = b * k.H * k.P;
  return kernel({xbc, dt_src, A_log, D, dt_bias, st, kept_ints({L, b})}, {{b, L, k.H, k.P}, {b, k.H, k.P, k.N}},
                {xbc.dtype(), mx::float32}, {rows * 32, 1, 1}, {kCudaThreads, 1, 1},
                {{"T", xbc.dtype()}, {"H", k.H}, {"P", k.P}, {"G", k.G}, {"N", k.N},
                 {"DT_W", static_cast<int>(dt_src.shape(2))}, {"DT_OFF", k.dt_offset},
                 {"HAS_STATE", state.has_value()}, {"LO_BITS", float_bits(lo)}, {"HI_BITS", float_bits(hi)}},
                std::nullopt, false, s);
}

// ---------------------------------------------------------------- the op

// The per-head vectors and the state, for a problem of batch b, H heads of P channels, N states.
void check_params(const mx::array& A_log, const mx::array& D, const mx::array& dt_bias,
                  const std::optional<mx::array>& state, int b, int H, int P, int N) {
  for (const auto* v : {&A_log, &D, &dt_bias}) {
    if (v->shape() != mx::Shape{H}) {
      throw std::invalid_argument("mamba_scan: A_log, D and dt_bias must have shape [H]");
    }
    if (!mx::issubdtype(v->dtype(), mx::floating)) {
      throw std::invalid_argument("mamba_scan: inputs must be floating point");
    }
  }
  if (state && state->shape() != mx::Shape{b, H, P, N}) {
    throw std::invalid_argument("mamba_scan: state must have shape [b, H, P, N]");
  }
}

void check_args(const mx::array& x, const mx::array& dt, const mx::array& A_log, const mx::array& B,
                const mx::array& C, const mx::array& D, const mx::array& dt_bias,
                const std::optional<mx::array>& state) {
  if (x.ndim() != 4 || dt.ndim() != 3 || B.ndim() != 4 || C.ndim() != 4) {
    throw std::invalid_argument("mamba_scan: expected x [b, L, H, P], dt [b, L, H], B and C [b, L, G, N]");
  }
  const int b = x.shape(0), L = x.shape(1), H = x.shape(2), P = x.shape(3);
  const int G = B.shape(2), N = B.shape(3);
  if (dt.shape() != mx::Shape{b, L, H} || B.shape() != mx::Shape{b, L, G, N} || C.shape() != B.shape()) {
    throw std::invalid_argument("mamba_scan: the shapes of x, dt, B and C do not agree");
  }
  if (G < 1 || H % G != 0) {
    throw std::invalid_argument("mamba_scan: the group count must divide the head count");
  }
  for (const auto* v : {&x, &dt, &B, &C}) {
    if (!mx::issubdtype(v->dtype(), mx::floating)) {
      throw std::invalid_argument("mamba_scan: inputs must be floating point");
    }
  }
  check_params(A_log, D, dt_bias, state, b, H, P, N);
}

std::vector<mx::array> cpu_scan(const mx::array& x, const mx::array& dt, const mx::array& A_log,
                                const mx::array& B, const mx::array& C, const mx::array& D,
                                const mx::array& dt_bias, const std::optional<mx::array>& state, float lo,
                                float hi, mx::Stream s) {
  const int b = x.shape(0), H = x.shape(2), P = x.shape(3), N = B.shape(3);
  std::vector<mx::array> inputs = {x, dt, A_log, B, C, D, dt_bias};
  if (state) inputs.push_back(*state);
  return mx::array::make_arrays({x.shape(), {b, H, P, N}}, {x.dtype(), mx::float32},
                                std::make_shared<MambaScan>(s, lo, hi, state.has_value()), inputs);
}

// One element type for the per-position inputs, a float32 state.
mx::array as_dtype(const mx::array& a, mx::Dtype dtype, mx::Stream s) {
  return a.dtype() == dtype ? a : mx::astype(a, dtype, s);
}

}  // namespace

// method: "auto" / "fused" (the C++ or CUDA kernel) or "composed" (MLX ops).
std::vector<mx::array> mamba_scan(const mx::array& x, mx::array dt, const mx::array& A_log, mx::array B,
                                  mx::array C, const mx::array& D, const mx::array& dt_bias,
                                  std::optional<mx::array> state, float lo, float hi, const std::string& method,
                                  mx::StreamOrDevice s_) {
  check_args(x, dt, A_log, B, C, D, dt_bias, state);
  auto s = mx::to_stream(s_);
  if (method == "composed" || (gpu_stream(s) && !cuda_build())) {
    return mamba_scan_composed(x, dt, A_log, B, C, D, dt_bias, state, lo, hi, s);
  }
  dt = as_dtype(dt, x.dtype(), s);
  B = as_dtype(B, x.dtype(), s);
  C = as_dtype(C, x.dtype(), s);
  if (state) state = as_dtype(*state, mx::float32, s);
  if (gpu_stream(s)) {
    const int b = x.shape(0), L = x.shape(1), H = x.shape(2), P = x.shape(3), G = B.shape(2), N = B.shape(3);
    auto xbc = mx::concatenate({mx::reshape(x, {b, L, H * P}, s), mx::reshape(B, {b, L, G * N}, s),
                                mx::reshape(C, {b, L, G * N}, s)}, 2, s);
    return mamba_scan_cuda(xbc, dt, {H, P, G, N, 0}, A_log, D, dt_bias, state, lo, hi, s);
  }
  return cpu_scan(x, dt, A_log, B, C, D, dt_bias, state, lo, hi, s);
}

// The mixer's own buffers: xbc [b, L, H*P + 2*G*N] (x | B | C) and dt_src [b, L, W] holding the H
// step inputs at columns [dt_offset, dt_offset + H). The CUDA kernel reads them in place; other
// paths take views.
std::vector<mx::array> mamba_scan_packed(const mx::array& xbc, const mx::array& dt_src, int dt_offset,
                                         const mx::array& A_log, const mx::array& D, const mx::array& dt_bias,
                                         std::optional<mx::array> state, int heads, int head_dim, int groups,
                                         int state_size, float lo, float hi, const std::string& method,
                                         mx::StreamOrDevice s_) {
  const int H = heads, P = head_dim, G = groups, N = state_size;
  if (xbc.ndim() != 3 || dt_src.ndim() != 3 || xbc.shape(0) != dt_src.shape(0) ||
      xbc.shape(1) != dt_src.shape(1)) {
    throw std::invalid_argument("mamba_scan_packed: expected xbc [b, L, C] and dt_src [b, L, W]");
  }
  if (H < 1 || P < 1 || G < 1 || N < 1 || xbc.shape(2) != H * P + 2 * G * N) {
    throw std::invalid_argument("mamba_scan_packed: xbc's width is not heads * head_dim + 2 * groups * state_size");
  }
  if (dt_offset < 0 || dt_offset + H > dt_src.shape(2)) {
    throw std::invalid_argument("mamba_scan_packed: dt columns [dt_offset, dt_offset + heads) out of range");
  }
  auto s = mx::to_stream(s_);
  const int b = xbc.shape(0), L = xbc.shape(1);
  if (gpu_stream(s) && cuda_build() && method != "composed") {
    if (H % G != 0 || !mx::issubdtype(xbc.dtype(), mx::floating) || !mx::issubdtype(dt_src.dtype(), mx::floating)) {
      throw std::invalid_argument("mamba_scan_packed: groups must divide heads; inputs must be floating point");
    }
    check_params(A_log, D, dt_bias, state, b, H, P, N);
    if (state) state = as_dtype(*state, mx::float32, s);
    return mamba_scan_cuda(xbc, as_dtype(dt_src, xbc.dtype(), s), {H, P, G, N, dt_offset}, A_log, D, dt_bias,
                           state, lo, hi, s);
  }
  const int HP = H * P, GN = G * N;
  auto x = mx::reshape(mx::slice(xbc, {0, 0, 0}, {b, L, HP}, s), {b, L, H, P}, s);
  auto B = mx::reshape(mx::slice(xbc, {0, 0, HP}, {b, L, HP + GN}, s), {b, L, G, N}, s);
  auto C = mx::reshape(mx::slice(xbc, {0, 0, HP + GN}, {b, L, HP + 2 * GN}, s), {b, L, G, N}, s);
  auto dt = mx::slice(dt_src, {0, 0, dt_offset}, {b, L, dt_offset + H}, s);
  return mamba_scan(x, dt, A_log, B, C, D, dt_bias, state, lo, hi, method, s);
}

// The decode step's conv and scan in one launch (CUDA streams only): projected [b, 1, W] (in_proj's
// output: x | B | C at columns x_offset.., dt at dt_offset), conv_state [b, K-1, H*P + 2*G*N] and
// the float32 conv weight [C, K(, 1)] / bias [C]. Returns (y [b, 1, H*P] float32, the new ssm
// state [b, H, P, N] float32, the new conv state). With gate_weight [H*P] (the gated group norm's):
// y * silu(gate) * gate_weight instead of y (gate at columns [gate_offset, gate_offset + H*P)), and
// a fourth output, partials [b, 1, P'] float32: G consecutive runs of P' / G whose sums are each
// group's sum of (y * silu(gate))^2.
std::vector<mx::array> mamba_conv_scan_step(const mx::array& projected, const mx::array& conv_state, int x_offset,
                                            const mx::array& conv_weight, const std::optional<mx::array>& conv_bias,
                                            int dt_offset, const mx::array& A_log, const mx::array& D,
                                            const mx::array& dt_bias, std::optional<mx::array> state, int heads,
                                            int head_dim, int groups, int state_size, float lo, float hi,
                                            const std::optional<mx::array>& gate_weight, int gate_offset,
                                            mx::StreamOrDevice s_) {
  const int H = heads, P = head_dim, G = groups, N = state_size, conv = H * P + 2 * G * N;
  auto fail = [](const std::string& what) { throw std::invalid_argument("mamba_conv_scan_step: " + what); };
  if (projected.ndim() != 3 || projected.shape(1) != 1) fail("projected must be [b, 1, W] (one position)");
  const int b = projected.shape(0), width = projected.shape(2);
  if (H < 1 || P < 1 || G < 1 || N < 1 || H % G != 0) fail("groups must divide heads; all sizes positive");
  if (conv_state.ndim() != 3 || conv_state.shape(0) != b || conv_state.shape(2) != conv || conv_state.shape(1) < 1) {
    fail("conv_state must be [b, K-1, heads * head_dim + 2 * groups * state_size]");
  }
  const int k_size = conv_state.shape(1) + 1;
  if (conv_weight.ndim() < 2 || conv_weight.shape(0) != conv || conv_weight.shape(1) != k_size ||
      conv_weight.size() != static_cast<size_t>(conv) * k_size) {
    fail("conv_weight must be [C, K] (or [C, K, 1])");
  }
  if (conv_bias && conv_bias->shape() != mx::Shape{conv}) fail("conv_bias must be [C]");
  if (x_offset < 0 || x_offset + conv > width || dt_offset < 0 || dt_offset + H > width) {
    fail("the x | B | C or dt columns lie outside projected");
  }
  check_params(A_log, D, dt_bias, state, b, H, P, N);
  auto s = mx::to_stream(s_);
  if (!(gpu_stream(s) && cuda_build() && float_dtype(projected.dtype()) && conv_state.dtype() == mx::float32 &&
        conv_weight.dtype() == mx::float32 && (!conv_bias || conv_bias->dtype() == mx::float32))) {
    fail("runs on a CUDA stream (float32 conv state and weights); elsewhere use causal_conv_silu then "
         "mamba_scan_packed (voicechat.kernels.mamba_scan.mamba_conv_scan_step does)");
  }
  if (gate_weight && (gate_weight->shape() != mx::Shape{H * P} || !float_dtype(gate_weight->dtype()))) {
    fail("gate_weight must be a float array [heads * head_dim]");
  }
  if (gate_weight && (gate_offset < 0 || gate_offset + H * P > width)) {
    fail("the gate columns [gate_offset, gate_offset + heads * head_dim) lie outside projected");
  }
  if (state) state = as_dtype(*state, mx::float32, s);
  int rb = 16;  // rows (warps) a block: each block convolves its group's B and C once for all of them
  while (P % rb != 0) rb /= 2;
  static auto kernel = make_cuda_kernel(conv_scan_source());
  const auto& st = state ? *state : dt_bias;  // not read without a state
  const int blocks = b * H * (P / rb);
  auto outs = kernel(
      {projected, conv_state, conv_weight, conv_bias ? *conv_bias : conv_weight, A_log, D, dt_bias, st,
       gate_weight ? as_dtype(*gate_weight, mx::float32, s) : A_log},
      {{b, 1, H * P}, {b, H, P, N}, {b, k_size - 1, conv}, {b, 1, gate_weight ? H * (P / rb) : 1}},
      {mx::float32, mx::float32, mx::float32, mx::float32}, {blocks * rb * 32, 1, 1}, {rb * 32, 1, 1},
      {{"H", H}, {"P", P}, {"G", G}, {"N", N}, {"K", k_size}, {"W", width}, {"X_OFF", x_offset},
       {"DT_OFF", dt_offset}, {"RB", rb}, {"HAS_BIAS", conv_bias.has_value()}, {"HAS_STATE", state.has_value()},
       {"GATED", gate_weight.has_value()}, {"GATE_OFF", gate_weight ? gate_offset : 0}, {"TS", projected.dtype()},
       {"LO_BITS", float_bits(lo)}, {"HI_BITS", float_bits(hi)}, {"BATCH", b}},
      std::nullopt, false, s);
  if (!gate_weight) {
    outs.pop_back();
  }
  return outs;
}

VC_CUDA_SOURCES(cuda_source, conv_scan_source);
}  // namespace voicechat
