// FastConformer relative-position self-attention with the chunked-limited mask, in one op.
//
//   scores[i, j] = (q_i + u) . k_j * s + (q_i + v_bias) . p[L - 1 - i + j] * s   for j in ctx(i)
//   out_i        = softmax_j(scores[i, :]) @ v
//
// k, v [B, H, L, D]; q [B, H, n, D] the queries of the last n <= L frames (row r is frame L - n + r: a
// stream's new frames attend to its cached ones without queries for those); p [H, P, D]: rows
// [pos_first, pos_first + P) of the projected table of
// relative positions L-1 .. -(L-1) (all 2L - 1 of them by default; the rows the context window
// uses are enough, see position_window in kernels/rel_pos_attention.py); u, v_bias [H, D]. ctx(i): chunks of `right + 1` frames, frame i sees the frames of its own chunk
// and of the `left / (right + 1)` chunks before it (left < 0: all of them). NeMo's rel_shift (pad,
// reshape, drop a row) is only the index arithmetic `L - 1 - i + j`, so no path here copies it.
// Entry (i, j) reads row `L - 1 - i + j - pos_first` of p. key_start [B] (int32, optional): batch row
// b's frames begin at key key_start[b] (a stream whose cache is not yet full keeps its keys at one
// length: the keys before are not frames). Its context windows count from there and the keys
// before get no weight: its rows equal those of k[b, :, key_start[b]:] alone (the table rows are
// those of the same relative positions), bit for bit on the CPU and CUDA paths.
//
// Paths: CPU, a fused loop that only scores each frame's window (O(L * window), not O(L^2));
// CUDA, one block per query row with an online softmax; anything else, composed MLX ops with an
// as_strided view for rel_shift. Everything accumulates in float32.

#include "voicechat/rel_pos_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// First frame of frame i's context window, and one past its last (frames from 0; a stream's from its
// key start: the caller adds it).
inline int window_begin(int i, int left, int right) {
  const int chunk = right + 1;
  if (left < 0) return 0;
  return std::max(0, (i / chunk - left / chunk) * chunk);
}

inline int window_end(int i, int length, int right) {
  const int chunk = right + 1;
  return std::min(length, (i / chunk + 1) * chunk);
}

// ---------------------------------------------------------------- composed ops (any backend)

// [L, L], or [B, 1, L, L] where the frames begin at key_start [B]: (i, j) in frame i's context.
mx::array context_mask(int length, int left, int right, const std::optional<mx::array>& key_start, mx::Stream s) {
  auto index = mx::arange(length, mx::int32, s);
  mx::array frame = index;  // each key's index among its row's frames (negative: not a frame)
  if (key_start) {
    frame = mx::subtract(mx::reshape(index, {1, 1, 1, length}, s),
                         mx::reshape(*key_start, {key_start->shape(0), 1, 1, 1}, s), s);
  }
  // Chunks by floor division: a key before the frames lands in a chunk below 0, never in a window.
  auto chunk_of = mx::floor_divide(frame, mx::array(right + 1), s);
  auto diff = key_start ? mx::subtract(mx::swapaxes(chunk_of, -1, -2, s), chunk_of, s)
                        : mx::subtract(mx::expand_dims(chunk_of, 1, s), mx::expand_dims(chunk_of, 0, s), s);
  auto allowed = mx::greater_equal(diff, mx::array(0), s);
  if (left >= 0) {
    allowed = mx::logical_and(allowed, mx::less_equal(diff, mx::array(left / (right + 1)), s), s);
  }
  if (key_start) {
    allowed = mx::logical_and(allowed, mx::greater_equal(frame, mx::array(0), s), s);
  }
  return allowed;
}

mx::array rel_pos_attention_composed(const mx::array& q_in, const mx::array& k, const mx::array& v,
                                     const mx::array& p_in, const mx::array& u, const mx::array& vb, float scale,
                                     int left, int right, int pos_first, const std::optional<mx::array>& key_start,
                                     mx::Stream s) {
  const int batch = q_in.shape(0), heads = q_in.shape(1), length = k.shape(2), queries = q_in.shape(2);
  auto f32 = [&](const mx::array& a) { return mx::astype(a, mx::float32, s); };
  // The whole table: rows outside the given window only ever meet masked scores, so zeros do.
  const int rows = p_in.shape(-2);
  const std::vector<std::pair<int, int>> widths = {{0, 0}, {pos_first, 2 * length - 1 - pos_first - rows}, {0, 0}};
  auto p = mx::pad(f32(p_in), widths, mx::array(0.0f), "constant", s);
  // Zero queries stand for the frames before the given ones; their rows are dropped at the end.
  auto q = mx::pad(f32(q_in), {{0, 0}, {0, 0}, {length - queries, 0}, {0, 0}}, mx::array(0.0f), "constant", s);
  auto qu = mx::add(q, mx::expand_dims(f32(u), 1, s), s);
  auto qv = mx::add(q, mx::expand_dims(f32(vb), 1, s), s);
  auto ac = mx::matmul(qu, mx::swapaxes(f32(k), -1, -2, s), s);               // [B, H, L, L]
  auto bd_full = mx::matmul(qv, mx::swapaxes(f32(p), -1, -2, s), s);         // [B, H, L, 2L-1], contiguous
  // rel_shift as a view: element (i, j) sits at i * (2L - 1) + (L - 1 - i + j).
  const int64_t pos = 2 * static_cast<int64_t>(length) - 1;
  auto bd = mx::as_strided(bd_full, {batch, heads, length, length},
                           {heads * length * pos, length * pos, pos - 1, 1}, static_cast<size_t>(length - 1), s);
  auto sc = mx::array(scale, mx::float32);
  auto scores = mx::add(mx::multiply(ac, sc, s), mx::multiply(bd, sc, s), s);
  const auto mask = context_mask(length, left, right, key_start, s);
  scores = mx::where(mask, scores, mx::array(-1e30f, mx::float32), s);
  auto out = mx::matmul(mx::softmax(scores, std::vector<int>{-1}, false, s), f32(v), s);
  if (key_start) {  // a query before its row's frames: zeros, as the kernels give
    out = mx::where(mx::any(mask, -1, true, s), out, mx::array(0.0f), s);
  }
  if (queries < length) out = mx::slice(out, {0, 0, length - queries, 0}, {batch, heads, length, q_in.shape(3)}, s);
  return mx::astype(out, q_in.dtype(), s);
}

// ---------------------------------------------------------------- CPU: a fused primitive

// Dot product with eight independent partial sums, so the compiler can vectorize it.
inline float dot(const float* a, const float* b, int64_t b_stride, int n) {
  if (b_stride != 1) {
    float acc = 0.0f;
    for (int d = 0; d < n; ++d) acc += a[d] * b[d * b_stride];
    return acc;
  }
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int t = 0; t < 8; ++t) acc[t] += a[d + t] * b[d + t];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

struct View4 {  // a float32 [B, H, L, D] (or [H, P, D] with stride0 = 0) read through its strides
  const float* data;
  int64_t s0, s1, s2, s3;
  const float* row(int b, int h, int i) const { return data + b * s0 + h * s1 + i * s2; }
};

View4 view_of(const mx::array& a) {
  const auto& st = a.strides();
  if (a.ndim() == 4) return {a.data<float>(), st[0], st[1], st[2], st[3]};
  return {a.data<float>(), 0, st[0], st[1], st[2]};  // [H, P, D], shared by every batch row
}

class RelPosAttention : public mx::UnaryPrimitive {
 public:
  RelPosAttention(mx::Stream stream, float scale, int left, int right, int pos_first)
      : mx::UnaryPrimitive(stream), scale_(scale), left_(left), right_(right), pos_first_(pos_first) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& q = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    const int batch = q.shape(0), heads = q.shape(1), queries = q.shape(2), dim = q.shape(3);
    const int length = inputs[1].shape(2), q_first = length - queries;
    const auto& us = inputs[4].strides();
    const auto& vs = inputs[5].strides();
    const int32_t* starts = inputs.size() > 6 ? inputs[6].data<int32_t>() : nullptr;
    const int64_t start_stride = inputs.size() > 6 ? inputs[6].strides()[0] : 0;
    enc.dispatch([q = view_of(inputs[0]), k = view_of(inputs[1]), v = view_of(inputs[2]),
                  p = view_of(inputs[3]), u = inputs[4].data<float>(), vb = inputs[5].data<float>(),
                  u0 = us[0], u1 = us[1], v0 = vs[0], v1 = vs[1], o = out.data<float>(), batch, heads, length,
                  dim, queries, q_first, starts, start_stride, scale = scale_, left = left_, right = right_,
                  first = pos_first_]() {
      std::vector<float> qu(dim), qv(dim), acc(dim), scores(length);
      for (int b = 0; b < batch; ++b) {
        const int start = starts ? starts[b * start_stride] : 0;
        for (int h = 0; h < heads; ++h) {
          for (int i = q_first; i < length; ++i) {
            const float* qi = q.row(b, h, i - q_first);
            float* oi = o + ((static_cast<int64_t>(b) * heads + h) * queries + i - q_first) * dim;
            if (i < start) {  // a query before the frames: no key in its window
              std::fill(oi, oi + dim, 0.0f);
              continue;
            }
            for (int d = 0; d < dim; ++d) {
              const float x = qi[d * q.s3];
              qu[d] = x + u[h * u0 + d * u1];
              qv[d] = x + vb[h * v0 + d * v1];
            }
            const int lo = start + window_begin(i - start, left, right);
            const int hi = start + window_end(i - start, length - start, right);
            float top = -std::numeric_limits<float>::infinity();
            for (int j = lo; j < hi; ++j) {
              const float ac = dot(qu.data(), k.row(b, h, j), k.s3, dim);
              const float bd = dot(qv.data(), p.row(b, h, length - 1 - i + j - first), p.s3, dim);
              const float sc = ac * scale + bd * scale;
              scores[j - lo] = sc;
              top = std::max(top, sc);
            }
            float total = 0.0f;
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int j = lo; j < hi; ++j) {
              const float e = std::exp(scores[j - lo] - top);
              total += e;
              const float* vj = v.row(b, h, j);
              for (int d = 0; d < dim; ++d) acc[d] += e * vj[d * v.s3];
            }
            const float inv = 1.0f / total;
            for (int d = 0; d < dim; ++d) oi[d] = acc[d] * inv;
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RelPosAttention runs on the CPU stream only (GPU uses cuda_kernel).");
  }

  const char* name() const override { return "RelPosAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RelPosAttention&>(other);
    return scale_ == o.scale_ && left_ == o.left_ && right_ == o.right_ && pos_first_ == o.pos_first_;
  }

 private:
  float scale_;
  int left_, right_, pos_first_;
};

// ---------------------------------------------------------------- CUDA

constexpr int kCudaThreads = 128;

const CudaSource& cuda_source() {
  static const CudaSource& src = register_cuda_source({
      "rel_pos_attention",
      {"q", "k", "v", "p", "pos_bias_u", "pos_bias_v", "dims", "scale", "starts"},
      {"out"},
      jit::rel_pos_attention::rel_pos_attention_body,
      "",
      {
          {{"float", "float", "float", "float", "float", "float", "int32_t", "float", "int32_t"}, {"float"},
           {{"T", "type:float"}, {"D", "int:128"}, {"THREADS", "int:128"}, {"STARTS", "bool:false"}}},
          {{"float", "float", "float", "float", "float", "float", "int32_t", "float", "int32_t"}, {"float"},
           {{"T", "type:float"}, {"D", "int:128"}, {"THREADS", "int:128"}, {"STARTS", "bool:true"}}},
          {{"__nv_bfloat16", "__nv_bfloat16", "__nv_bfloat16", "__nv_bfloat16", "float", "float", "int32_t",
            "float", "int32_t"},
           {"float"},
           {{"T", "type:__nv_bfloat16"}, {"D", "int:20"}, {"THREADS", "int:128"}, {"STARTS", "bool:true"}}},
      },
  });
  return src;
}

mx::array rel_pos_attention_cuda(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& p,
                                 const mx::array& u, const mx::array& vb, float scale, int left, int right,
                                 int pos_first, const std::optional<mx::array>& key_start, mx::Stream s) {
  static auto kernel = [] {
    const auto& src = cuda_source();
    return make_cuda_kernel(src);
  }();
  const int batch = q.shape(0), heads = q.shape(1), queries = q.shape(2), dim = q.shape(3), length = k.shape(2);
  auto dtype = q.dtype() == mx::bfloat16 ? mx::bfloat16 : mx::float32;
  // No mx::contiguous: the launch copies an input that is not row-contiguous itself, at eval and only
  // then, while a Contiguous node costs the encoder's graph a node per input.
  auto as = [&](const mx::array& a, mx::Dtype t) { return mx::astype(a, t, s); };
  auto dims = mx::array({length, heads, left, right, pos_first, static_cast<int>(p.shape(1)), length - queries},
                        mx::int32);
  auto sc = mx::array({scale}, mx::float32);
  // Without key starts the kernel reads none: dims stands in for them.
  auto out = kernel({as(q, dtype), as(k, dtype), as(v, dtype), as(p, dtype), as(u, mx::float32),
                     as(vb, mx::float32), dims, sc, key_start ? *key_start : dims},
                    {{batch, heads, queries, dim}}, {mx::float32},
                    {batch * heads * queries * kCudaThreads, 1, 1}, {kCudaThreads, 1, 1},
                    {{"T", dtype}, {"D", dim}, {"THREADS", kCudaThreads}, {"STARTS", key_start.has_value()}},
                    std::nullopt, false, s)[0];
  return mx::astype(out, q.dtype(), s);
}

// ---------------------------------------------------------------- the op

// Rows of the full table that frame pairs inside the context read: [first, last].
std::pair<int, int> rows_needed(int length, int left, int right) {
  int first = 2 * length, last = -1;
  for (int i = 0; i < length; ++i) {
    first = std::min(first, length - 1 - i + window_begin(i, left, right));
    last = std::max(last, length - 1 - i + window_end(i, length, right) - 1);
  }
  return {first, last};
}

void check_args(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& p, const mx::array& u,
                const mx::array& vb, int left, int right, int pos_first, const std::optional<mx::array>& key_start) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape() || q.shape(0) != k.shape(0) ||
      q.shape(1) != k.shape(1) || q.shape(3) != k.shape(3) || q.shape(2) > k.shape(2)) {
    throw std::invalid_argument("rel_pos_attention: k and v must be [B, H, L, D] and q [B, H, n, D] with n <= L");
  }
  if (right < 0) {
    throw std::invalid_argument("rel_pos_attention: right context must be >= 0");
  }
  const int heads = q.shape(1), length = k.shape(2), dim = q.shape(3);
  const int rows = p.ndim() >= 2 ? p.shape(-2) : 0;
  const bool p_ok = (p.ndim() == 3 && p.shape() == mx::Shape{heads, rows, dim}) ||
                    (p.ndim() == 4 && p.shape() == mx::Shape{1, heads, rows, dim});
  if (!p_ok) {
    throw std::invalid_argument("rel_pos_attention: p must be [H, P, D] (P = 2L - 1 for the whole table)");
  }
  if (length > 0) {
    const auto [need_first, need_last] = rows_needed(length, left, right);
    if (pos_first < 0 || pos_first > need_first || pos_first + rows - 1 < need_last ||
        pos_first + rows > 2 * length - 1) {
      throw std::invalid_argument(
          "rel_pos_attention: p holds table rows [" + std::to_string(pos_first) + ", " +
          std::to_string(pos_first + rows) + ") but the context needs rows [" + std::to_string(need_first) + ", " +
          std::to_string(need_last + 1) + ") of the 2L - 1 = " + std::to_string(2 * length - 1) + " rows");
    }
  }
  if (u.shape() != mx::Shape{heads, dim} || vb.shape() != mx::Shape{heads, dim}) {
    throw std::invalid_argument("rel_pos_attention: pos_bias_u and pos_bias_v must be [H, D]");
  }
  if (key_start && (key_start->dtype() != mx::int32 || key_start->shape() != mx::Shape{q.shape(0)})) {
    throw std::invalid_argument("rel_pos_attention: key_start must be int32 [B]");
  }
  for (const auto* a : {&q, &k, &v, &p, &u, &vb}) {
    if (!mx::issubdtype(a->dtype(), mx::floating)) {
      throw std::invalid_argument("rel_pos_attention: inputs must be floating point");
    }
  }
}

}  // namespace

// method: "auto" / "fused" (the C++ or CUDA kernel) or "composed" (MLX ops).
mx::array rel_pos_attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& p,
                            const mx::array& u, const mx::array& vb, float scale, int left, int right,
                            int pos_first, const std::optional<mx::array>& key_start, const std::string& method,
                            mx::StreamOrDevice s_) {
  check_args(q, k, v, p, u, vb, left, right, pos_first, key_start);
  if (method != "auto" && method != "fused" && method != "composed") {
    throw std::invalid_argument("rel_pos_attention: method must be 'auto', 'fused' or 'composed'");
  }
  auto s = mx::to_stream(s_);
  auto p3 = p.ndim() == 4 ? mx::squeeze(p, 0, s) : p;
  if (method == "composed" || q.size() == 0) {
    return rel_pos_attention_composed(q, k, v, p3, u, vb, scale, left, right, pos_first, key_start, s);
  }
  if (gpu_stream(s)) {
    if (cuda_build()) {
      return rel_pos_attention_cuda(q, k, v, p3, u, vb, scale, left, right, pos_first, key_start, s);
    }
    return rel_pos_attention_composed(q, k, v, p3, u, vb, scale, left, right, pos_first, key_start, s);
  }
  auto f32 = [&](const mx::array& a) { return mx::astype(a, mx::float32, s); };
  std::vector<mx::array> inputs = {f32(q), f32(k), f32(v), f32(p3), f32(u), f32(vb)};
  if (key_start) inputs.push_back(*key_start);
  auto out = mx::array(q.shape(), mx::float32, std::make_shared<RelPosAttention>(s, scale, left, right, pos_first),
                       std::move(inputs));
  return mx::astype(out, q.dtype(), s);
}

VC_CUDA_SOURCES(cuda_source);
}  // namespace voicechat
