// RNNT greedy decoding of a whole utterance in one call (the transcript branch).
//
//   state = 0, last = blank
//   for t in frames:
//     up to max_symbols times:
//       (out, state') = LSTM stack(last == blank ? 0 : embed[last], state)
//       tok = argmax(out_w relu(enc_proj[t] + pred_w out + pred_b) + out_b)   (first index on ties)
//       tok == blank: next frame;  else emit tok, last = tok, state = state'
//
// The prediction network's output depends only on (last, state), which change only when a token
// is emitted, so it is computed once per emission and reused by the following queries. The loop
// is sequential and data-dependent: it always runs on the CPU stream (a GPU caller's arrays are in
// unified memory), with weights read in their stored dtype and everything else float32.
// Output: [F, max_symbols] int32, the tokens of each frame followed by -1.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <variant>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx_caster.h"
#include "registry.h"

namespace py = pybind11;
namespace mx = mlx::core;

namespace voicechat {
namespace {

// ---------------------------------------------------------------- weights in their stored dtype

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {  // bfloat16: the high half of a float32
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const mx::float16_t* p, int64_t i) { return static_cast<float>(p[i]); }

// Eight independent partial sums, so the compiler can vectorize the loop.
template <typename W>
inline float dot(const float* x, const W* w, int n) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int t = 0; t < 8; ++t) acc[t] += x[d + t] * load(w, d + t);
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) sum += x[d] * load(w, d);
  return sum;
}

struct Matrix {  // a row-contiguous [rows, cols] weight of dtype float32, bfloat16 or float16
  const void* data;
  mx::Dtype dtype;
  int rows, cols;

  static Matrix of(const mx::array& a) {
    return {a.data<void>(), a.dtype(), static_cast<int>(a.shape(0)), static_cast<int>(a.shape(1))};
  }

  template <typename W>
  void add_rows(const float* x, float* y) const {
    const W* w = static_cast<const W*>(data);
    for (int r = 0; r < rows; ++r) y[r] += dot(x, w + static_cast<int64_t>(r) * cols, cols);
  }

  // y += W x
  void add_product(const float* x, float* y) const {
    if (dtype == mx::bfloat16) {
      add_rows<uint16_t>(x, y);
    } else if (dtype == mx::float16) {
      add_rows<mx::float16_t>(x, y);
    } else {
      add_rows<float>(x, y);
    }
  }

  // One row as float32 (an embedding lookup).
  void row(int r, float* out) const {
    const int64_t base = static_cast<int64_t>(r) * cols;
    for (int c = 0; c < cols; ++c) {
      if (dtype == mx::bfloat16) {
        out[c] = load(static_cast<const uint16_t*>(data), base + c);
      } else if (dtype == mx::float16) {
        out[c] = load(static_cast<const mx::float16_t*>(data), base + c);
      } else {
        out[c] = load(static_cast<const float*>(data), base + c);
      }
    }
  }
};

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

struct Weights {
  const float* enc_proj;  // [F, J]
  Matrix embed;           // [V + 1, H]
  std::vector<Matrix> wx, wh;
  std::vector<const float*> bias;  // [4H] per layer
  Matrix pred_w;                   // [J, H]
  const float* pred_b;             // [J]
  Matrix out_w;                    // [V + 1, J]
  const float* out_b;              // [V + 1]
};

void greedy_loop(const Weights& w, int frames, int blank, int max_symbols, int32_t* out) {
  const int layers = static_cast<int>(w.wx.size());
  const int hidden = w.embed.cols, joint = w.pred_w.rows, classes = w.out_w.rows;
  std::vector<std::vector<float>> h(layers, std::vector<float>(hidden, 0.0f)), c = h, h_new = h, c_new = h;
  std::vector<float> x(hidden), gates(4 * hidden), pred(joint), act(joint), logits(classes);
  std::fill(out, out + static_cast<int64_t>(frames) * max_symbols, -1);
  int last = blank;
  bool pred_ready = false;
  for (int t = 0; t < frames; ++t) {
    const float* enc = w.enc_proj + static_cast<int64_t>(t) * joint;
    for (int emitted = 0; emitted < max_symbols;) {
      if (!pred_ready) {  // prediction network for (last, state): candidate state and joint input
        if (last == blank) {
          std::fill(x.begin(), x.end(), 0.0f);
        } else {
          w.embed.row(last, x.data());
        }
        const float* in = x.data();
        for (int l = 0; l < layers; ++l) {
          std::memcpy(gates.data(), w.bias[l], sizeof(float) * 4 * hidden);
          w.wx[l].add_product(in, gates.data());
          w.wh[l].add_product(h[l].data(), gates.data());
          for (int k = 0; k < hidden; ++k) {
            const float ig = sigmoid(gates[k]), fg = sigmoid(gates[hidden + k]);
            const float gg = std::tanh(gates[2 * hidden + k]), og = sigmoid(gates[3 * hidden + k]);
            c_new[l][k] = fg * c[l][k] + ig * gg;
            h_new[l][k] = og * std::tanh(c_new[l][k]);
          }
          in = h_new[l].data();
        }
        std::memcpy(pred.data(), w.pred_b, sizeof(float) * joint);
        w.pred_w.add_product(in, pred.data());
        pred_ready = true;
      }
      for (int j = 0; j < joint; ++j) act[j] = std::max(enc[j] + pred[j], 0.0f);
      std::memcpy(logits.data(), w.out_b, sizeof(float) * classes);
      w.out_w.add_product(act.data(), logits.data());
      int tok = 0;
      for (int k = 1; k < classes; ++k) {
        if (logits[k] > logits[tok]) tok = k;
      }
      if (tok == blank) break;
      out[static_cast<int64_t>(t) * max_symbols + emitted] = tok;
      ++emitted;
      last = tok;
      std::swap(h, h_new);
      std::swap(c, c_new);
      pred_ready = false;
    }
  }
}

class RnntGreedy : public mx::UnaryPrimitive {
 public:
  RnntGreedy(mx::Stream stream, int blank, int max_symbols, int layers)
      : mx::UnaryPrimitive(stream), blank_(blank), max_symbols_(max_symbols), layers_(layers) {}

  // inputs: enc_proj, embed, (Wx, Wh, bias) per layer, pred_w, pred_b, out_w, out_b
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    Weights w{in[0].data<float>(), Matrix::of(in[1]), {}, {}, {}, Matrix::of(in[2 + 3 * layers_]),
              in[3 + 3 * layers_].data<float>(), Matrix::of(in[4 + 3 * layers_]), in[5 + 3 * layers_].data<float>()};
    for (int l = 0; l < layers_; ++l) {
      w.wx.push_back(Matrix::of(in[2 + 3 * l]));
      w.wh.push_back(Matrix::of(in[3 + 3 * l]));
      w.bias.push_back(in[4 + 3 * l].data<float>());
    }
    enc.dispatch([w = std::move(w), frames = static_cast<int>(in[0].shape(0)), blank = blank_,
                  max_symbols = max_symbols_, o = out.data<int32_t>()]() {
      greedy_loop(w, frames, blank, max_symbols, o);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RnntGreedy runs on the CPU stream only.");
  }

  const char* name() const override { return "RnntGreedy"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RnntGreedy&>(other);
    return blank_ == o.blank_ && max_symbols_ == o.max_symbols_ && layers_ == o.layers_;
  }

 private:
  int blank_, max_symbols_, layers_;
};

// ---------------------------------------------------------------- the op

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("rnnt_greedy: " + what);
}

mx::array rnnt_greedy(const mx::array& enc_proj, const mx::array& embed, const std::vector<mx::array>& lstm,
                      const mx::array& pred_w, const mx::array& pred_b, const mx::array& out_w,
                      const mx::array& out_b, int blank_id, int max_symbols, mx::StreamOrDevice stream) {
  expect(enc_proj.ndim() == 2, "enc_proj must be [F, J]");
  expect(embed.ndim() == 2, "embed must be [V + 1, H]");
  expect(!lstm.empty() && lstm.size() % 3 == 0, "lstm must hold (Wx, Wh, bias) for each layer");
  const int frames = enc_proj.shape(0), joint = enc_proj.shape(1), hidden = embed.shape(1);
  const int layers = static_cast<int>(lstm.size() / 3);
  for (int l = 0; l < layers; ++l) {
    expect(lstm[3 * l].shape() == mx::Shape{4 * hidden, hidden} && lstm[3 * l + 1].shape() == mx::Shape{4 * hidden, hidden} &&
               lstm[3 * l + 2].shape() == mx::Shape{4 * hidden},
           "LSTM layer " + std::to_string(l) + " must have Wx, Wh [4H, H] and bias [4H] with H = " +
               std::to_string(hidden));
  }
  expect(pred_w.shape() == mx::Shape{joint, hidden} && pred_b.shape() == mx::Shape{joint},
         "pred_w must be [J, H] and pred_b [J]");
  const int classes = out_w.shape(0);
  expect(out_w.ndim() == 2 && out_w.shape(1) == joint && out_b.shape() == mx::Shape{classes},
         "out_w must be [C, J] and out_b [C]");
  expect(embed.shape(0) == classes, "embed must have one row per class (blank included)");
  expect(blank_id >= 0 && blank_id < classes, "blank_id out of range");
  expect(max_symbols >= 1, "max_symbols must be >= 1");

  // A caller's own CPU stream lets the loop run beside other work (its own worker thread).
  auto s = mx::default_stream(mx::Device::cpu);
  if (std::holds_alternative<mx::Stream>(stream)) {
    s = std::get<mx::Stream>(stream);
  } else if (std::holds_alternative<mx::Device>(stream)) {
    s = mx::default_stream(std::get<mx::Device>(stream));
  }
  expect(s.device == mx::Device::cpu, "the stream must be a CPU stream (the loop is sequential host code)");
  auto f32 = [&](const mx::array& a) { return mx::contiguous(mx::astype(a, mx::float32, s), false, s); };
  auto weight = [&](const mx::array& a) {
    const auto t = a.dtype();
    return (t == mx::float32 || t == mx::bfloat16 || t == mx::float16) ? mx::contiguous(a, false, s) : f32(a);
  };
  std::vector<mx::array> inputs = {f32(enc_proj), weight(embed)};
  for (int l = 0; l < layers; ++l) {
    inputs.push_back(weight(lstm[3 * l]));
    inputs.push_back(weight(lstm[3 * l + 1]));
    inputs.push_back(f32(lstm[3 * l + 2]));
  }
  inputs.push_back(weight(pred_w));
  inputs.push_back(f32(pred_b));
  inputs.push_back(weight(out_w));
  inputs.push_back(f32(out_b));
  return mx::array({frames, max_symbols}, mx::int32, std::make_shared<RnntGreedy>(s, blank_id, max_symbols, layers),
                   std::move(inputs));
}

void bind(py::module_& m) {
  m.def("rnnt_greedy", &rnnt_greedy, py::arg("enc_proj"), py::arg("embed"), py::arg("lstm"), py::arg("pred_w"),
        py::arg("pred_b"), py::arg("out_w"), py::arg("out_b"), py::arg("blank_id"), py::arg("max_symbols"), py::arg("stream") = py::none(),
        "Greedy RNNT decode of every frame: enc_proj [F, J] (the joint's encoder projection), embed [V+1, H], "
        "lstm = [Wx0, Wh0, b0, Wx1, ...], pred_w [J, H], pred_b [J], out_w [V+1, J], out_b [V+1] -> "
        "[F, max_symbols] int32 tokens per frame, -1 padded. Runs on `stream` (a CPU stream; default: the "
        "default CPU stream).");
}

}  // namespace
VC_REGISTER(bind);
}  // namespace voicechat
