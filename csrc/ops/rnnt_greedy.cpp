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
// Output: [F, max_symbols] int32, the tokens of each frame followed by -1; `rnnt_greedy_from` also
// starts from a given (state, last) and returns the state and last token it ends with, so that a
// stream decoded a few frames at a time gives the same tokens as one call over every frame (the
// prediction output is a function of (last, state), recomputed bit for bit on resuming).

#include "voicechat/rnnt_greedy.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

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

  // Columns [c0, c1) of one row as float32 (an embedding lookup), into out[c0, c1).
  void row(int r, int c0, int c1, float* out) const {
    const int64_t base = static_cast<int64_t>(r) * cols;
    for (int c = c0; c < c1; ++c) {
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

// A sense-reversing barrier for the loop's worker threads: spins briefly (a query is tens of
// microseconds of work), then yields, so that a busy machine is not starved by waiting threads.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    const int gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins > 2000) std::this_thread::yield();
    }
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0}, generation_{0};
};

// [begin, end) of `n` items for worker `id` of `count`.
inline std::pair<int, int> slice(int n, int id, int count) {
  return {static_cast<int>(static_cast<int64_t>(n) * id / count), static_cast<int>(static_cast<int64_t>(n) * (id + 1) / count)};
}

// Every worker runs the same control flow (so all agree on each token without a broadcast) and
// owns a slice of the hidden units (their four gate rows and cell update), of the joint units and
// of the classes. Each dot product is computed whole by one thread, with the same code whatever
// the thread count: the result is bit-identical for any count.
struct Shared {
  // state: [2, layers, hidden] float32 (h, then c) to start from.
  Shared(const Weights& w, int threads, const float* state)
      : layers(static_cast<int>(w.wx.size())), hidden(w.embed.cols), joint(w.pred_w.rows), classes(w.out_w.rows),
        x(hidden), gates(4 * hidden), pred(joint), act(joint), logits(classes), best(threads), barrier(threads) {
    for (int b = 0; b < 2; ++b) {
      h[b].assign(layers, std::vector<float>(hidden, 0.0f));
      c[b] = h[b];
    }
    for (int l = 0; l < layers; ++l) {
      std::copy(state + static_cast<int64_t>(l) * hidden, state + static_cast<int64_t>(l + 1) * hidden, h[0][l].begin());
      const float* cs = state + static_cast<int64_t>(layers + l) * hidden;
      std::copy(cs, cs + hidden, c[0][l].begin());
    }
  }
  const int layers, hidden, joint, classes;
  std::vector<std::vector<float>> h[2], c[2];  // [buffer][layer][H]: the state and the candidate
  std::vector<float> x, gates, pred, act, logits;
  std::vector<int> best;  // each worker's first argmax over its classes (-1: none)
  SpinBarrier barrier;
};

template <typename W>
void add_rows(const Matrix& m, int r0, int r1, const float* x, float* y) {
  const W* w = static_cast<const W*>(m.data);
  for (int r = r0; r < r1; ++r) y[r] += dot(x, w + static_cast<int64_t>(r) * m.cols, m.cols);
}

// y[r] += W[r] . x for rows [r0, r1), in row order (one weight stream for the prefetcher).
void add_rows(const Matrix& m, int r0, int r1, const float* x, float* y) {
  if (m.dtype == mx::bfloat16) {
    add_rows<uint16_t>(m, r0, r1, x, y);
  } else if (m.dtype == mx::float16) {
    add_rows<mx::float16_t>(m, r0, r1, x, y);
  } else {
    add_rows<float>(m, r0, r1, x, y);
  }
}

// `last`: the token to start from (blank: none yet); on return (worker 0) the token and state buffer
// (`cur`) the loop ended with.
void greedy_worker(const Weights& w, Shared& s, int id, int count, int frames, int blank, int max_symbols,
                   int32_t* out, int* last_io, int* cur_out) {
  const int H = s.hidden;
  const auto [u0, u1] = slice(H, id, count);
  const auto [j0, j1] = slice(s.joint, id, count);
  const auto [k0, k1] = slice(s.classes, id, count);
  int cur = 0, last = *last_io;  // s.h[cur] / s.c[cur]: the state; the other buffer: the candidate
  bool pred_ready = false;
  for (int t = 0; t < frames; ++t) {
    const float* enc = w.enc_proj + static_cast<int64_t>(t) * s.joint;
    for (int emitted = 0; emitted < max_symbols;) {
      if (!pred_ready) {  // prediction network for (last, state): candidate state and joint input
        for (int k = u0; k < u1; ++k) s.x[k] = 0.0f;
        if (last != blank) w.embed.row(last, u0, u1, s.x.data());
        s.barrier.wait();
        const float* in = s.x.data();
        for (int l = 0; l < s.layers; ++l) {
          float* g = s.gates.data();  // this worker's units' rows only: no other worker reads them
          for (int q = 0; q < 4; ++q) {
            std::copy(w.bias[l] + q * H + u0, w.bias[l] + q * H + u1, g + q * H + u0);
            add_rows(w.wx[l], q * H + u0, q * H + u1, in, g);
          }
          for (int q = 0; q < 4; ++q) add_rows(w.wh[l], q * H + u0, q * H + u1, s.h[cur][l].data(), g);
          for (int k = u0; k < u1; ++k) {
            const float c_new = sigmoid(g[H + k]) * s.c[cur][l][k] + sigmoid(g[k]) * std::tanh(g[2 * H + k]);
            s.c[1 - cur][l][k] = c_new;
            s.h[1 - cur][l][k] = sigmoid(g[3 * H + k]) * std::tanh(c_new);
          }
          s.barrier.wait();
          in = s.h[1 - cur][l].data();
        }
        std::copy(w.pred_b + j0, w.pred_b + j1, s.pred.data() + j0);
        add_rows(w.pred_w, j0, j1, in, s.pred.data());
        pred_ready = true;
      }
      for (int j = j0; j < j1; ++j) s.act[j] = std::max(enc[j] + s.pred[j], 0.0f);
      s.barrier.wait();
      std::copy(w.out_b + k0, w.out_b + k1, s.logits.data() + k0);
      add_rows(w.out_w, k0, k1, s.act.data(), s.logits.data());
      int mine = -1;  // the first largest logit of this slice, NaN never chosen
      for (int k = k0; k < k1; ++k) {
        if (!std::isnan(s.logits[k]) && (mine < 0 || s.logits[k] > s.logits[mine])) mine = k;
      }
      s.best[id] = mine;
      s.barrier.wait();
      // As one scan `tok = 0; for k: if (l[k] > l[tok]) tok = k` would pick: index 0 when l[0] is
      // NaN, else the first largest of the non-NaN logits (0 when all are NaN).
      int tok = -1;
      if (!std::isnan(s.logits[0])) {
        for (int i = 0; i < count; ++i) {
          const int b = s.best[i];
          if (b >= 0 && (tok < 0 || s.logits[b] > s.logits[tok])) tok = b;
        }
      }
      tok = tok < 0 ? 0 : tok;
      if (tok == blank) break;
      if (id == 0) out[static_cast<int64_t>(t) * max_symbols + emitted] = tok;
      ++emitted;
      last = tok;
      cur = 1 - cur;
      pred_ready = false;
    }
  }
  if (id == 0) {
    *last_io = last;
    *cur_out = cur;
  }
}

// Worker threads for a model of this size: one below ~1M weights a step (the barriers would cost
// more than they save), else up to half the cores, at most 8.
int auto_threads(const Weights& w) {
  const int64_t per_step = 8LL * w.embed.cols * w.embed.cols * static_cast<int64_t>(w.wx.size()) +
                           static_cast<int64_t>(w.out_w.rows) * w.out_w.cols;
  if (per_step < (1 << 20)) return 1;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(8, cores / 2));
}

// state_in / state_out: [2, layers, H] (h, then c); last_in / last_out: the last emitted token.
void greedy_loop(const Weights& w, int frames, int blank, int max_symbols, int threads, int32_t* out,
                 const float* state_in, int last_in, float* state_out, int32_t* last_out) {
  std::fill(out, out + static_cast<int64_t>(frames) * max_symbols, -1);
  const int count = std::max(1, std::min(threads > 0 ? threads : auto_threads(w), w.embed.cols));
  Shared s(w, count, state_in);
  int last = last_in, cur = 0;
  int ignored_last = last_in, ignored_cur = 0;  // (only worker 0 reports)
  std::vector<std::thread> pool;
  for (int id = 1; id < count; ++id) {
    pool.emplace_back(greedy_worker, std::cref(w), std::ref(s), id, count, frames, blank, max_symbols, out,
                      &ignored_last, &ignored_cur);
  }
  greedy_worker(w, s, 0, count, frames, blank, max_symbols, out, &last, &cur);
  for (auto& th : pool) th.join();
  for (int l = 0; l < s.layers; ++l) {
    std::copy(s.h[cur][l].begin(), s.h[cur][l].end(), state_out + static_cast<int64_t>(l) * s.hidden);
    std::copy(s.c[cur][l].begin(), s.c[cur][l].end(), state_out + static_cast<int64_t>(s.layers + l) * s.hidden);
  }
  *last_out = last;
}

class RnntGreedy : public mx::Primitive {
 public:
  RnntGreedy(mx::Stream stream, int blank, int max_symbols, int layers, int threads)
      : mx::Primitive(stream), blank_(blank), max_symbols_(max_symbols), layers_(layers), threads_(threads) {}

  // inputs: enc_proj, embed, (Wx, Wh, bias) per layer, pred_w, pred_b, out_w, out_b, state [2, layers, H]
  // float32, last [1] int32. outputs: the table [F, max_symbols], the state and last token at the end.
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto &out = outputs[0], &state_out = outputs[1], &last_out = outputs[2];
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) enc.set_input_array(a);
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      enc.set_output_array(o);
    }
    Weights w{in[0].data<float>(), Matrix::of(in[1]), {}, {}, {}, Matrix::of(in[2 + 3 * layers_]),
              in[3 + 3 * layers_].data<float>(), Matrix::of(in[4 + 3 * layers_]), in[5 + 3 * layers_].data<float>()};
    for (int l = 0; l < layers_; ++l) {
      w.wx.push_back(Matrix::of(in[2 + 3 * l]));
      w.wh.push_back(Matrix::of(in[3 + 3 * l]));
      w.bias.push_back(in[4 + 3 * l].data<float>());
    }
    enc.dispatch([w = std::move(w), frames = static_cast<int>(in[0].shape(0)), blank = blank_,
                  max_symbols = max_symbols_, threads = threads_, o = out.data<int32_t>(),
                  state_in = in[6 + 3 * layers_].data<float>(), last_in = in[7 + 3 * layers_].data<int32_t>(),
                  state = state_out.data<float>(), last = last_out.data<int32_t>()]() {
      greedy_loop(w, frames, blank, max_symbols, threads, o, state_in, *last_in, state, last);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("RnntGreedy runs on the CPU stream only.");
  }

  const char* name() const override { return "RnntGreedy"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RnntGreedy&>(other);
    return blank_ == o.blank_ && max_symbols_ == o.max_symbols_ && layers_ == o.layers_ && threads_ == o.threads_;
  }

 private:
  int blank_, max_symbols_, layers_, threads_;
};

// ---------------------------------------------------------------- the op

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("rnnt_greedy: " + what);
}

}  // namespace

// (state [2, layers, H], last [1]): where to start; none: zeros and blank, the utterance's start.
std::vector<mx::array> rnnt_greedy_from(const mx::array& enc_proj, const mx::array& embed,
                                        const std::vector<mx::array>& lstm, const mx::array& pred_w,
                                        const mx::array& pred_b, const mx::array& out_w, const mx::array& out_b,
                                        int blank_id, int max_symbols, int threads, mx::StreamOrDevice stream,
                                        const std::optional<mx::array>& state, const std::optional<mx::array>& last) {
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
  expect(threads >= 0, "threads must be >= 0 (0: chosen by the model's size)");
  expect(state.has_value() == last.has_value(), "give both state and last, or neither");
  if (state.has_value()) {
    expect(state->shape() == mx::Shape{2, layers, hidden}, "state must be [2, layers, H] (h, then c)");
    expect(last->size() == 1, "last must hold one token id");
  }

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
  inputs.push_back(state.has_value() ? f32(*state) : mx::zeros({2, layers, hidden}, mx::float32, s));
  inputs.push_back(last.has_value() ? mx::contiguous(mx::reshape(mx::astype(*last, mx::int32, s), {1}, s), false, s)
                                    : mx::full({1}, blank_id, mx::int32, s));
  return mx::array::make_arrays({{frames, max_symbols}, {2, layers, hidden}, {1}}, {mx::int32, mx::float32, mx::int32},
                                std::make_shared<RnntGreedy>(s, blank_id, max_symbols, layers, threads),
                                std::move(inputs));
}

mx::array rnnt_greedy(const mx::array& enc_proj, const mx::array& embed, const std::vector<mx::array>& lstm,
                      const mx::array& pred_w, const mx::array& pred_b, const mx::array& out_w,
                      const mx::array& out_b, int blank_id, int max_symbols, int threads, mx::StreamOrDevice stream) {
  return rnnt_greedy_from(enc_proj, embed, lstm, pred_w, pred_b, out_w, out_b, blank_id, max_symbols, threads, stream,
                          std::nullopt, std::nullopt)[0];
}

}  // namespace voicechat
