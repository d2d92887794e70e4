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
// `rnnt_greedy_streams` decodes several streams (a server's sessions) in one call: each pass of
// the loop runs the prediction network for every stream that emitted and one joint query for every
// stream still decoding, so a weight row is read once for all of them; each stream's dot products
// are the ones it computes alone, so it gets the same tokens.

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

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// A dot product's end: the eight partial sums `acc` added up, then the products from `d` to `n`.
template <typename W>
inline float dot_finish(const float* acc, const float* x, const W* w, int64_t d, int64_t n) {
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) sum += x[d] * load(w, d);
  return sum;
}

// Eight independent partial sums, so the compiler can vectorize the loop. (Interleaving several
// rows' or streams' sums in one loop, or GCC's generic vector types, measured slower: the compiler
// then spills the partial sums.)
template <typename W>
inline float dot(const float* x, const W* w, int n) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int t = 0; t < 8; ++t) acc[t] += x[d + t] * load(w, d + t);
  }
  return dot_finish(acc, x, w, d, n);
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
  Matrix embed;  // [V + 1, H]
  std::vector<Matrix> wx, wh;
  std::vector<const float*> bias;  // [4H] per layer
  Matrix pred_w;                   // [J, H]
  const float* pred_b;             // [J]
  Matrix out_w;                    // [V + 1, J]
  const float* out_b;              // [V + 1]
};

// One stream's decode: its frames, where it starts and where its results go.
struct Stream {
  const float* enc_proj;  // [frames, J]
  int frames;
  const float* state_in;  // [2, layers, H] (h, then c)
  const int32_t* last_in; // [1] (read when the loop runs: the encoder only records the inputs)
  int32_t* out;           // [frames, max_symbols]
  float* state_out;       // [2, layers, H]
  int32_t* last_out;      // [1]
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

// One stream's buffers, written by every worker (each its own slice) between barriers.
struct StreamBuffers {
  StreamBuffers(int layers, int hidden, int joint, int classes, int threads, const float* state)
      : x(hidden), gates(4 * hidden), pred(joint), act(joint), logits(classes), best(threads) {
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
  std::vector<std::vector<float>> h[2], c[2];  // [buffer][layer][H]: the state and the candidate
  std::vector<float> x, gates, pred, act, logits;
  std::vector<int> best;  // each worker's first argmax over its classes (-1: none)
};

// Where one stream's loop stands. Every worker keeps its own copy and runs the same control flow,
// so all agree on each token without a broadcast.
struct Cursor {
  int t = 0, emitted = 0, last = 0, cur = 0;  // h[cur] / c[cur]: the state; the other buffer: the candidate
  bool pred_ready = false;
  bool done() const { return t < 0; }
};

// Every worker owns a slice of the hidden units (their four gate rows and cell update), of the
// joint units and of the classes, for every stream. Each dot product is computed whole by one
// thread with the same code whatever the thread and stream counts, so the tokens are
// bit-identical for any count, and a stream decoded beside others gets the tokens it gets alone.
struct Shared {
  Shared(const Weights& w, int threads, const std::vector<Stream>& streams)
      : layers(static_cast<int>(w.wx.size())), hidden(w.embed.cols), joint(w.pred_w.rows), classes(w.out_w.rows),
        barrier(threads) {
    buffers.reserve(streams.size());
    for (const auto& st : streams) buffers.emplace_back(layers, hidden, joint, classes, threads, st.state_in);
  }
  const int layers, hidden, joint, classes;
  std::vector<StreamBuffers> buffers;
  SpinBarrier barrier;
};

// Matrix rows [r0, r1), each against every stream's input: y_i[r] += W[r] . x_i. Rows outer, so
// that each weight row is read once from memory for all the streams.
template <typename W>
void add_rows_generic(const Matrix& m, int r0, int r1, const std::vector<const float*>& x,
                      const std::vector<float*>& y) {
  const W* w = static_cast<const W*>(m.data);
  const size_t n = x.size();
  for (int r = r0; r < r1; ++r) {
    const W* row = w + static_cast<int64_t>(r) * m.cols;
    for (size_t i = 0; i < n; ++i) y[i][r] += dot(x[i], row, m.cols);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VOICECHAT_AVX2 1

__attribute__((target("avx2,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,f16c"))) inline __m256 load8(const uint16_t* p) {  // bfloat16
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
__attribute__((target("avx2,f16c"))) inline __m256 load8(const mx::float16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// `add_rows_generic` with AVX2: the (row, stream) dot products four at a time, their eight-lane
// sums in four registers (independent chains: the additions of one do not wait on another's).
// Each dot product is `dot`'s: lane t sums the products at d = t (mod 8) in order, multiply then
// add (no FMA), and the lanes and the tail add up in `dot`'s order, so the bits are the same.
template <typename W>
__attribute__((target("avx2,f16c"))) void add_rows_avx2(const Matrix& m, int r0, int r1,
                                                        const std::vector<const float*>& x,
                                                        const std::vector<float*>& y) {
  const W* w = static_cast<const W*>(m.data);
  const int64_t n = static_cast<int64_t>(x.size()), cols = m.cols, pairs = (r1 - r0) * n;
  const int64_t body = cols / 8 * 8;
  int64_t p = 0;
  for (; p < pairs; p += 4) {  // pairs in row order, the streams within a row (a row's weights stay in cache)
    const int k_count = static_cast<int>(std::min<int64_t>(4, pairs - p));
    const float* xs[4];
    const W* ws[4];
    float* out[4];
    for (int k = 0; k < 4; ++k) {
      const int64_t q = p + std::min(k, k_count - 1);
      const int64_t r = r0 + q / n, i = q % n;
      xs[k] = x[i];
      ws[k] = w + r * cols;
      out[k] = y[i] + r;
    }
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    // The rows after this group's, fetched meanwhile: four rows read side by side are not a stream
    // the hardware prefetcher follows.
    const char* next = reinterpret_cast<const char*>(ws[3] + cols);
    for (int64_t d = 0; d < body; d += 8) {
      _mm_prefetch(next + d * 4 * sizeof(W), _MM_HINT_T0);
      _mm_prefetch(next + d * 4 * sizeof(W) + 64, _MM_HINT_T0);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(xs[0] + d), load8(ws[0] + d)));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(xs[1] + d), load8(ws[1] + d)));
      a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(xs[2] + d), load8(ws[2] + d)));
      a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_loadu_ps(xs[3] + d), load8(ws[3] + d)));
    }
    float lanes[4][8];
    _mm256_storeu_ps(lanes[0], a0);
    _mm256_storeu_ps(lanes[1], a1);
    _mm256_storeu_ps(lanes[2], a2);
    _mm256_storeu_ps(lanes[3], a3);
    for (int k = 0; k < k_count; ++k) {
      *out[k] += dot_finish(lanes[k], xs[k], ws[k], body, cols);
    }
  }
}
#endif

template <typename W>
void add_rows_of(const Matrix& m, int r0, int r1, const std::vector<const float*>& x, const std::vector<float*>& y) {
#ifdef VOICECHAT_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (avx2 && x.size() > 1) {  // (one stream: row by row measured faster, its weights streaming from memory)
    add_rows_avx2<W>(m, r0, r1, x, y);
    return;
  }
#endif
  add_rows_generic<W>(m, r0, r1, x, y);
}

// y_i[r] += W[r] . x_i for rows [r0, r1) and every stream i, each dot product as `dot` makes it.
void add_rows(const Matrix& m, int r0, int r1, const std::vector<const float*>& x, const std::vector<float*>& y) {
  if (x.empty() || r1 <= r0) return;
  if (m.dtype == mx::bfloat16) {
    add_rows_of<uint16_t>(m, r0, r1, x, y);
  } else if (m.dtype == mx::float16) {
    add_rows_of<mx::float16_t>(m, r0, r1, x, y);
  } else {
    add_rows_of<float>(m, r0, r1, x, y);
  }
}

// The loop over every stream at once: each pass computes the prediction network for the streams
// that emitted (one weight pass for all), then one joint query for every stream still decoding.
// On return (worker 0) each stream's last token and state buffer (`cursors[i].last / .cur`).
void greedy_worker(const Weights& w, const std::vector<Stream>& streams, Shared& s, int id, int count, int blank,
                   int max_symbols, std::vector<Cursor>* result) {
  const int H = s.hidden;
  const auto [u0, u1] = slice(H, id, count);
  const auto [j0, j1] = slice(s.joint, id, count);
  const auto [k0, k1] = slice(s.classes, id, count);
  const size_t n = streams.size();
  std::vector<Cursor> cursors(n);
  size_t live = 0;
  for (size_t i = 0; i < n; ++i) {
    cursors[i].last = *streams[i].last_in;
    if (streams[i].frames <= 0) {
      cursors[i].t = -1;
    } else {
      ++live;
    }
  }
  std::vector<size_t> predicting, querying;
  std::vector<const float*> xs;
  std::vector<float*> ys;
  while (live > 0) {
    predicting.clear();
    querying.clear();
    for (size_t i = 0; i < n; ++i) {
      if (cursors[i].done()) continue;
      querying.push_back(i);
      if (!cursors[i].pred_ready) predicting.push_back(i);
    }
    if (!predicting.empty()) {  // prediction network for (last, state): candidate state and joint input
      for (size_t i : predicting) {
        auto& b = s.buffers[i];
        for (int k = u0; k < u1; ++k) b.x[k] = 0.0f;
        if (cursors[i].last != blank) w.embed.row(cursors[i].last, u0, u1, b.x.data());
      }
      s.barrier.wait();
      for (int l = 0; l < s.layers; ++l) {
        xs.clear();
        ys.clear();
        for (size_t i : predicting) {  // this worker's units' rows only: no other worker reads them
          auto& b = s.buffers[i];
          float* g = b.gates.data();
          for (int q = 0; q < 4; ++q) std::copy(w.bias[l] + q * H + u0, w.bias[l] + q * H + u1, g + q * H + u0);
          xs.push_back(l == 0 ? b.x.data() : b.h[1 - cursors[i].cur][l - 1].data());
          ys.push_back(g);
        }
        for (int q = 0; q < 4; ++q) add_rows(w.wx[l], q * H + u0, q * H + u1, xs, ys);
        xs.clear();
        for (size_t i : predicting) xs.push_back(s.buffers[i].h[cursors[i].cur][l].data());
        for (int q = 0; q < 4; ++q) add_rows(w.wh[l], q * H + u0, q * H + u1, xs, ys);
        for (size_t i : predicting) {
          auto& b = s.buffers[i];
          const int cur = cursors[i].cur;
          const float* g = b.gates.data();
          for (int k = u0; k < u1; ++k) {
            const float c_new = sigmoid(g[H + k]) * b.c[cur][l][k] + sigmoid(g[k]) * std::tanh(g[2 * H + k]);
            b.c[1 - cur][l][k] = c_new;
            b.h[1 - cur][l][k] = sigmoid(g[3 * H + k]) * std::tanh(c_new);
          }
        }
        s.barrier.wait();
      }
      xs.clear();
      ys.clear();
      for (size_t i : predicting) {
        auto& b = s.buffers[i];
        std::copy(w.pred_b + j0, w.pred_b + j1, b.pred.data() + j0);
        xs.push_back(b.h[1 - cursors[i].cur][s.layers - 1].data());
        ys.push_back(b.pred.data());
        cursors[i].pred_ready = true;
      }
      add_rows(w.pred_w, j0, j1, xs, ys);
    }
    xs.clear();
    ys.clear();
    for (size_t i : querying) {
      auto& b = s.buffers[i];
      const float* enc = streams[i].enc_proj + static_cast<int64_t>(cursors[i].t) * s.joint;
      for (int j = j0; j < j1; ++j) b.act[j] = std::max(enc[j] + b.pred[j], 0.0f);
      xs.push_back(b.act.data());
      ys.push_back(b.logits.data());
    }
    s.barrier.wait();  // (past it, no worker still reads the last pass's logits)
    for (size_t i : querying) std::copy(w.out_b + k0, w.out_b + k1, s.buffers[i].logits.data() + k0);
    add_rows(w.out_w, k0, k1, xs, ys);
    for (size_t i : querying) {
      auto& b = s.buffers[i];
      int mine = -1;  // the first largest logit of this slice, NaN never chosen
      for (int k = k0; k < k1; ++k) {
        if (!std::isnan(b.logits[k]) && (mine < 0 || b.logits[k] > b.logits[mine])) mine = k;
      }
      b.best[id] = mine;
    }
    s.barrier.wait();
    for (size_t i : querying) {
      const auto& b = s.buffers[i];
      auto& c = cursors[i];
      // As one scan `tok = 0; for k: if (l[k] > l[tok]) tok = k` would pick: index 0 when l[0] is
      // NaN, else the first largest of the non-NaN logits (0 when all are NaN).
      int tok = -1;
      if (!std::isnan(b.logits[0])) {
        for (int v = 0; v < count; ++v) {
          const int best = b.best[v];
          if (best >= 0 && (tok < 0 || b.logits[best] > b.logits[tok])) tok = best;
        }
      }
      tok = tok < 0 ? 0 : tok;
      if (tok != blank) {
        if (id == 0) streams[i].out[static_cast<int64_t>(c.t) * max_symbols + c.emitted] = tok;
        ++c.emitted;
        c.last = tok;
        c.cur = 1 - c.cur;
        c.pred_ready = false;
      }
      if (tok == blank || c.emitted == max_symbols) {  // next frame
        c.emitted = 0;
        if (++c.t == streams[i].frames) {
          c.t = -1;
          --live;
        }
      }
    }
  }
  if (id == 0) *result = std::move(cursors);
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

void greedy_loop(const Weights& w, const std::vector<Stream>& streams, int blank, int max_symbols, int threads) {
  for (const auto& st : streams) std::fill(st.out, st.out + static_cast<int64_t>(st.frames) * max_symbols, -1);
  const int count = std::max(1, std::min(threads > 0 ? threads : auto_threads(w), w.embed.cols));
  Shared s(w, count, streams);
  std::vector<Cursor> cursors;
  std::vector<std::thread> pool;
  for (int id = 1; id < count; ++id) {
    pool.emplace_back(greedy_worker, std::cref(w), std::cref(streams), std::ref(s), id, count, blank, max_symbols,
                      nullptr);
  }
  greedy_worker(w, streams, s, 0, count, blank, max_symbols, &cursors);
  for (auto& th : pool) th.join();
  for (size_t i = 0; i < streams.size(); ++i) {
    const auto& b = s.buffers[i];
    const int cur = cursors[i].cur;
    for (int l = 0; l < s.layers; ++l) {
      std::copy(b.h[cur][l].begin(), b.h[cur][l].end(), streams[i].state_out + static_cast<int64_t>(l) * s.hidden);
      std::copy(b.c[cur][l].begin(), b.c[cur][l].end(),
                streams[i].state_out + static_cast<int64_t>(s.layers + l) * s.hidden);
    }
    *streams[i].last_out = cursors[i].last;
  }
}

class RnntGreedy : public mx::Primitive {
 public:
  RnntGreedy(mx::Stream stream, int blank, int max_symbols, int layers, int threads)
      : mx::Primitive(stream), blank_(blank), max_symbols_(max_symbols), layers_(layers), threads_(threads) {}

  // inputs: embed, (Wx, Wh, bias) per layer, pred_w, pred_b, out_w, out_b, then per stream its enc_proj
  // [F, J] float32, state [2, layers, H] float32 and last [1] int32. outputs per stream: the table
  // [F, max_symbols], the state and last token at the end.
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) enc.set_input_array(a);
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      enc.set_output_array(o);
    }
    const int L = layers_, first = 5 + 3 * L;
    Weights w{Matrix::of(in[0]), {}, {}, {}, Matrix::of(in[1 + 3 * L]), in[2 + 3 * L].data<float>(),
              Matrix::of(in[3 + 3 * L]), in[4 + 3 * L].data<float>()};
    for (int l = 0; l < L; ++l) {
      w.wx.push_back(Matrix::of(in[1 + 3 * l]));
      w.wh.push_back(Matrix::of(in[2 + 3 * l]));
      w.bias.push_back(in[3 + 3 * l].data<float>());
    }
    std::vector<Stream> streams;
    for (size_t i = 0; i < outputs.size() / 3; ++i) {
      const auto& e = in[first + 3 * i];
      streams.push_back({e.data<float>(), static_cast<int>(e.shape(0)), in[first + 3 * i + 1].data<float>(),
                         in[first + 3 * i + 2].data<int32_t>(), outputs[3 * i].data<int32_t>(),
                         outputs[3 * i + 1].data<float>(), outputs[3 * i + 2].data<int32_t>()});
    }
    enc.dispatch([w = std::move(w), streams = std::move(streams), blank = blank_, max_symbols = max_symbols_,
                  threads = threads_]() { greedy_loop(w, streams, blank, max_symbols, threads); });
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

std::vector<mx::array> rnnt_greedy_streams(const std::vector<mx::array>& enc_projs, const mx::array& embed,
                                           const std::vector<mx::array>& lstm, const mx::array& pred_w,
                                           const mx::array& pred_b, const mx::array& out_w, const mx::array& out_b,
                                           int blank_id, int max_symbols, int threads, mx::StreamOrDevice stream,
                                           const std::vector<mx::array>& states, const std::vector<mx::array>& lasts) {
  expect(!enc_projs.empty(), "give at least one stream");
  expect(embed.ndim() == 2, "embed must be [V + 1, H]");
  expect(!lstm.empty() && lstm.size() % 3 == 0, "lstm must hold (Wx, Wh, bias) for each layer");
  const int hidden = embed.shape(1), joint = pred_w.ndim() == 2 ? pred_w.shape(0) : -1;
  const int layers = static_cast<int>(lstm.size() / 3);
  for (int l = 0; l < layers; ++l) {
    expect(lstm[3 * l].shape() == mx::Shape{4 * hidden, hidden} && lstm[3 * l + 1].shape() == mx::Shape{4 * hidden, hidden} &&
               lstm[3 * l + 2].shape() == mx::Shape{4 * hidden},
           "LSTM layer " + std::to_string(l) + " must have Wx, Wh [4H, H] and bias [4H] with H = " +
               std::to_string(hidden));
  }
  expect(pred_w.shape() == mx::Shape{joint, hidden} && pred_b.shape() == mx::Shape{joint},
         "pred_w must be [J, H] and pred_b [J]");
  const int classes = out_w.ndim() == 2 ? out_w.shape(0) : -1;
  expect(out_w.ndim() == 2 && out_w.shape(1) == joint && out_b.shape() == mx::Shape{classes},
         "out_w must be [C, J] and out_b [C]");
  expect(embed.shape(0) == classes, "embed must have one row per class (blank included)");
  expect(blank_id >= 0 && blank_id < classes, "blank_id out of range");
  expect(max_symbols >= 1, "max_symbols must be >= 1");
  expect(threads >= 0, "threads must be >= 0 (0: chosen by the model's size)");
  expect(states.size() == lasts.size() && (states.empty() || states.size() == enc_projs.size()),
         "give a state and a last token for every stream, or none");
  for (size_t i = 0; i < enc_projs.size(); ++i) {
    expect(enc_projs[i].ndim() == 2 && enc_projs[i].shape(1) == joint, "enc_proj must be [F, J] with J = " +
                                                                           std::to_string(joint));
    if (!states.empty()) {
      expect(states[i].shape() == mx::Shape{2, layers, hidden}, "state must be [2, layers, H] (h, then c)");
      expect(lasts[i].size() == 1, "last must hold one token id");
    }
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
  std::vector<mx::array> inputs = {weight(embed)};
  for (int l = 0; l < layers; ++l) {
    inputs.push_back(weight(lstm[3 * l]));
    inputs.push_back(weight(lstm[3 * l + 1]));
    inputs.push_back(f32(lstm[3 * l + 2]));
  }
  inputs.push_back(weight(pred_w));
  inputs.push_back(f32(pred_b));
  inputs.push_back(weight(out_w));
  inputs.push_back(f32(out_b));
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < enc_projs.size(); ++i) {
    inputs.push_back(f32(enc_projs[i]));
    inputs.push_back(states.empty() ? mx::zeros({2, layers, hidden}, mx::float32, s) : f32(states[i]));
    inputs.push_back(states.empty() ? mx::full({1}, blank_id, mx::int32, s)
                                    : mx::contiguous(mx::reshape(mx::astype(lasts[i], mx::int32, s), {1}, s), false, s));
    shapes.insert(shapes.end(), {{enc_projs[i].shape(0), max_symbols}, {2, layers, hidden}, {1}});
    dtypes.insert(dtypes.end(), {mx::int32, mx::float32, mx::int32});
  }
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<RnntGreedy>(s, blank_id, max_symbols, layers, threads),
                                std::move(inputs));
}

// (state [2, layers, H], last [1]): where to start; none: zeros and blank, the utterance's start.
std::vector<mx::array> rnnt_greedy_from(const mx::array& enc_proj, const mx::array& embed,
                                        const std::vector<mx::array>& lstm, const mx::array& pred_w,
                                        const mx::array& pred_b, const mx::array& out_w, const mx::array& out_b,
                                        int blank_id, int max_symbols, int threads, mx::StreamOrDevice stream,
                                        const std::optional<mx::array>& state, const std::optional<mx::array>& last) {
  expect(state.has_value() == last.has_value(), "give both state and last, or neither");
  std::vector<mx::array> states, lasts;
  if (state.has_value()) {
    states.push_back(*state);
    lasts.push_back(*last);
  }
  return rnnt_greedy_streams({enc_proj}, embed, lstm, pred_w, pred_b, out_w, out_b, blank_id, max_symbols, threads,
                             stream, states, lasts);
}

mx::array rnnt_greedy(const mx::array& enc_proj, const mx::array& embed, const std::vector<mx::array>& lstm,
                      const mx::array& pred_w, const mx::array& pred_b, const mx::array& out_w,
                      const mx::array& out_b, int blank_id, int max_symbols, int threads, mx::StreamOrDevice stream) {
  return rnnt_greedy_from(enc_proj, embed, lstm, pred_w, pred_b, out_w, out_b, blank_id, max_symbols, threads, stream,
                          std::nullopt, std::nullopt)[0];
}

}  // namespace voicechat
