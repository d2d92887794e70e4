// One query position against fixed-size K/V buffers whose slots past the position are not yet
// written (the decode step of a cache that grows in chunks or rings):
//
//   out[b, h] = softmax_s(scale * q[b, h] . k[b, h / G, s]) @ v[b, h / G, s]   over slots s <= offset
//
// Optionally slot `slot` is read from k_new / v_new [B, HK, 1, D] instead of the buffers: the new
// position's key, not yet written (on CUDA the TTS step's launch then writes it in place, see
// decode_attention_qkv; elsewhere the backbone writes every layer's new keys in one update). slot =
// -1: the buffers only.
//
// G = H / HK (grouped heads). MLX's fast attention takes neither a mask array nor head dim 72 on
// CUDA, and its fallback is a matmul, the mask, a softmax and a matmul (with layout copies). Here
// NC chunks of CH slots per (b, h) each make the softmax of their valid slots (max, sum, weighted
// values: scores in shared memory, see kPartBody), then one block per (b, h) merges the chunks: two
// launches, or one while the buffers hold <= 1024 slots (one chunk normalizes and writes the result
// itself). No block waits for another. Every warp of a block works in each phase and no lane's
// loads wait on one another's, so a step's time does not grow slot by slot (as it would with one
// slot a warp at a time). CUDA through
// fast::cuda_kernel; elsewhere MLX's attention with the mask (the reference:
// voicechat.kernels.decode_attention).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "cuda_sources.h"
#include "mlx/mlx.h"
#include "mlx_caster.h"
#include "registry.h"

namespace py = pybind11;
namespace mx = mlx::core;

namespace voicechat {
namespace {

constexpr int kThreads = 256;
// Slots per block of the first launch. Up to kChunk slots one block per (b, h) takes them all (4
// passes of its 8 warps) and writes the result: one launch. Beyond, the merge launch is paid
// anyway, so the chunks shrink to one pass a warp (kSplitChunk) for 4x the blocks: the TTS's 32
// (b, h) pairs read ~0.8 GB of K/V a step at 120 s, and 64 blocks could not stream it.
constexpr int kChunk = 1024;
constexpr int kSplitChunk = 256;

// Template args: D, H, HK, CH (kChunk when SINGLE, else kSplitChunk), THREADS, SINGLE, SCALE_BITS
// (the score scale as float bits); dims = [CAP]
// (the buffers' slots: an input, so that a growing cache does not compile a kernel per size).
// part: [B * H * NC, D + 2] = (max, sum, values); SINGLE (CAP <= CH, one chunk): the result itself,
// [B * H, D], and no second launch. With one chunk a block is its (b, h) whatever CAP holds, so
// nothing waits for the dims load before the query's and key's loads go out.
constexpr const char* kPartHead = R"(
  const float neg_inf = -__uint_as_float(0x7f800000u);  // MLX's CUDA prelude has no `inf`
  const int CAP = dims[0];
  const int NC = SINGLE ? 1 : (CAP + CH - 1) / CH;
  constexpr int WARPS = THREADS / 32;
  constexpr int PER = (D + 31) / 32;  // dims per lane
  __shared__ __align__(16) float qs[D];
  __shared__ float wacc[WARPS][D];
  __shared__ float ws[CH];  // the chunk's scores, then its softmax weights
  __shared__ float red[WARPS];
  const int bh = SINGLE ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x) / NC;
  const int chunk = SINGLE ? 0 : static_cast<int>(blockIdx.x) % NC;
  const int b = bh / H, h = bh % H, hk = h / (H / HK);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
)";

// The plain kernel: q [B, H, 1, D] and the new key / value (k_new, v_new, slot) as inputs; with
// WRITE the first chunk of the first query head of each K/V head also stores them in the buffers'
// slot itself (in place, as the qkv kernel's WRITE: no block reads the slot from the buffers).
// Template arg WRITE.
constexpr const char* kPlainPrologue = R"(  for (int d = threadIdx.x; d < D; d += THREADS) qs[d] = q[static_cast<size_t>(bh) * D + d];
  __syncthreads();
  const float* kn = k_new + (static_cast<size_t>(b) * HK + hk) * D;
  const float* vn = v_new + (static_cast<size_t>(b) * HK + hk) * D;
  if constexpr (WRITE) {
    if (chunk == 0 && h % (H / HK) == 0 && slot[0] >= 0) {
      const size_t at = ((static_cast<size_t>(b) * HK + hk) * CAP + slot[0]) * D;
      for (int d = threadIdx.x; d < D; d += THREADS) {
        const_cast<float*>(k)[at + d] = kn[d];
        const_cast<float*>(v)[at + d] = vn[d];
      }
    }
  }
)";

// From the stacked projection instead (vc_decode_attn_qkv_part): warp 0 makes this head's q, warp 1
// the new key of its K/V head (vc_head_norm_rope, as qkv_heads does), warp 2 copies the new value; the
// first chunk of the first query head of each K/V head writes that key and value out for the cache,
// and with WRITE also into the buffers' slot itself (in place: see decode_attention_qkv).
// Template args TX: qkv's type; WRITE; EPS_BITS (the head norms' eps as float bits).
constexpr const char* kQkvPrologue = R"(
  __shared__ __align__(16) float kns[D];
  __shared__ __align__(16) float vns[D];
  {
    constexpr int ROW = (H + 2 * HK) * D;
    const TX* row = qkv + static_cast<size_t>(b) * ROW;
    if (warp < 2) {
      vc_head_norm_rope<D, TX>(row + (warp == 0 ? h : H + hk) * D, warp == 0 ? q_scale : k_scale, inv_freq,
                               __int_as_float(EPS_BITS),
                               static_cast<float>(offset[0]), warp == 0 ? qs : kns, lane);
    } else if (warp == 2) {
      const TX* x = row + (H + HK + hk) * D;
      for (int d = lane; d < D; d += 32) vns[d] = static_cast<float>(x[d]);
    }
  }
  __syncthreads();
  if (chunk == 0 && h % (H / HK) == 0) {
    for (int d = threadIdx.x; d < D; d += THREADS) {
      k_out[(static_cast<size_t>(b) * HK + hk) * D + d] = kns[d];
      v_out[(static_cast<size_t>(b) * HK + hk) * D + d] = vns[d];
    }
    if constexpr (WRITE) {  // no block of this launch reads the slot from the buffers (it reads kns / vns)
      const size_t at = ((static_cast<size_t>(b) * HK + hk) * CAP + slot[0]) * D;
      for (int d = threadIdx.x; d < D; d += THREADS) {
        const_cast<float*>(k)[at + d] = kns[d];
        const_cast<float*>(v)[at + d] = vns[d];
      }
    }
  }
  const float* kn = kns;
  const float* vn = vns;
)";

// Both prologues leave qs (this head's query) in shared memory and kn / vn (the new key and value,
// read in slot `slot`; -1: none); the body reads the buffers around them. Three phases over the
// chunk's n valid slots, every warp busy in each, each lane's loads independent of one another:
// scores (G = 4 lanes a slot, each a strided share of the key row's float4s, two shuffles join
// them; 8 slots a warp at a time) into shared memory with the block's max; the softmax weights and
// their sum; the weighted values (a slot a warp at a time, lanes over d), summed over the warps.
// (One slot a lane would leave a 40-slot step with 2 of 8 warps working and ~10 dependent memory
// round trips.)
constexpr const char* kPartBody = R"(  const float sc = __int_as_float(SCALE_BITS);
  const int cur = slot[0];
  const int last = min(offset[0], CAP - 1);  // the highest valid slot
  const float* kb = k + (static_cast<size_t>(b) * HK + hk) * CAP * D;
  const float* vb = v + (static_cast<size_t>(b) * HK + hk) * CAP * D;
  const int start = chunk * CH;
  const int n = max(0, min(CH, last + 1 - start));  // this chunk's valid slots
  constexpr int G = 4;          // lanes a slot while scoring
  constexpr int SPW = 32 / G;   // slots a warp at a time
  const int g = lane % G;
  float local_max = neg_inf;
  for (int base = warp * SPW; base < n; base += WARPS * SPW) {  // warp-uniform: the shuffles see all lanes
    const int t = base + lane / G;
    float dot = 0.0f;
    if (t < n) {
      const int s = start + t;
      const float* ks = s == cur ? kn : kb + static_cast<size_t>(s) * D;
      if (D % 4 == 0 && (reinterpret_cast<unsigned long long>(ks) & 15ull) == 0ull) {
        const float4* k4 = reinterpret_cast<const float4*>(ks);
        const float4* q4 = reinterpret_cast<const float4*>(qs);
#pragma unroll
        for (int j = 0; j < (D / 4 + G - 1) / G; ++j) {  // a constant count: every load goes out at once
          const int i = g + j * G;
          if (i < D / 4) {
            const float4 kv = k4[i];
            const float4 qv = q4[i];
            dot = fmaf(qv.x, kv.x, dot);
            dot = fmaf(qv.y, kv.y, dot);
            dot = fmaf(qv.z, kv.z, dot);
            dot = fmaf(qv.w, kv.w, dot);
          }
        }
      } else {
        for (int d = g; d < D; d += G) dot = fmaf(qs[d], ks[d], dot);
      }
    }
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    dot += __shfl_xor_sync(0xffffffffu, dot, 2);
    if (t < n && g == 0) {
      ws[t] = dot * sc;
      local_max = fmaxf(local_max, dot * sc);
    }
  }
  const float mb = vc_block_max<THREADS>(local_max, red);  // -inf for a chunk with no valid slot
  float lsum = 0.0f;
  for (int t = threadIdx.x; t < n; t += THREADS) {
    const float w = expf(ws[t] - mb);
    ws[t] = w;
    lsum += w;
  }
  const float l = vc_block_sum<THREADS>(lsum, red);  // its barrier also publishes the weights
  float acc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
#pragma unroll 4
  for (int t = warp; t < n; t += WARPS) {
    const float w = ws[t];
    const int s = start + t;
    const float* vs = s == cur ? vn : vb + static_cast<size_t>(s) * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane + 32 * i;
      if (d < D) acc[i] = fmaf(w, vs[d], acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int d = lane + 32 * i;
    if (d < D) wacc[warp][d] = acc[i];
  }
  __syncthreads();
  if constexpr (SINGLE) {  // one chunk holds every slot: normalize and write the result itself
    for (int d = threadIdx.x; d < D; d += THREADS) {
      float total = 0.0f;
      for (int w = 0; w < WARPS; ++w) total += wacc[w][d];
      part[static_cast<size_t>(blockIdx.x) * D + d] = total / l;
    }
    return;
  }
  float* out = part + static_cast<size_t>(blockIdx.x) * (D + 2);
  for (int d = threadIdx.x; d < D + 2; d += THREADS) {
    if (d < D) {
      float total = 0.0f;
      for (int w = 0; w < WARPS; ++w) total += wacc[w][d];
      out[d + 2] = total;
    } else if (d == D) {
      out[1] = l;   // the sum
    } else {
      out[0] = mb;  // the max
    }
  }
)";

// Template args: D, CH, THREADS; dims = [CAP]. out: [B * H, D] (the step's [B, 1, H * D]).
constexpr const char* kCombineSource = R"(
  const float neg_inf = -__uint_as_float(0x7f800000u);  // MLX's CUDA prelude has no `inf`
  const int NC = (dims[0] + CH - 1) / CH;
  const float* pr = part + static_cast<size_t>(blockIdx.x) * NC * (D + 2);
  float mb = neg_inf;
  for (int c = 0; c < NC; ++c) mb = fmaxf(mb, pr[c * (D + 2)]);
  float lsum = 0.0f;
  for (int c = 0; c < NC; ++c) {
    const float mc = pr[c * (D + 2)];
    if (mc != neg_inf) lsum += expf(mc - mb) * pr[c * (D + 2) + 1];
  }
  for (int d = threadIdx.x; d < D; d += THREADS) {
    float total = 0.0f;
    for (int c = 0; c < NC; ++c) {
      const float mc = pr[c * (D + 2)];
      if (mc != neg_inf) total += expf(mc - mb) * pr[c * (D + 2) + 2 + d];
    }
    out[static_cast<size_t>(blockIdx.x) * D + d] = total / lsum;
  }
)";

const CudaSource& part_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int d, int h, int hk, bool single, bool write = false) {
    return CudaInstance{{"float", "float", "float", "int32_t", "int32_t", "float", "float", "int32_t"},
                        {"float"},
                        {P{"D", int_arg(d)}, P{"H", int_arg(h)},
                         P{"HK", int_arg(hk)}, P{"CH", int_arg(single ? kChunk : kSplitChunk)},
                         P{"THREADS", int_arg(kThreads)},
                         P{"SINGLE", single ? "bool:true" : "bool:false"},
                         P{"WRITE", write ? "bool:true" : "bool:false"},
                         P{"SCALE_BITS", int_arg(float_bits(1.0f / std::sqrt(static_cast<float>(d))))}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_decode_attn_part",
      {"q", "k", "v", "offset", "dims", "k_new", "v_new", "slot"},
      {"part"},
      std::string(kPartHead) + kPlainPrologue + kPartBody,
      block_reduce_header(),
      // the TTS backbone, the LLM's grouped heads (its decode step writing the cache in place)
      {inst(72, 16, 16, true), inst(72, 16, 16, false), inst(128, 40, 8, false), inst(128, 40, 8, true, true)},
  });
  return src;
}

const CudaSource& qkv_part_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int d, int h, int hk, bool single, const std::string& tx, bool write) {
    return CudaInstance{{tx, "float", "float", "float", "float", "float", "int32_t", "int32_t", "int32_t"},
                        {"float", "float", "float"},
                        {P{"D", int_arg(d)}, P{"H", int_arg(h)}, P{"HK", int_arg(hk)},
                         P{"CH", int_arg(single ? kChunk : kSplitChunk)}, P{"THREADS", int_arg(kThreads)},
                         P{"SINGLE", single ? "bool:true" : "bool:false"}, P{"TX", type_arg(tx)},
                         P{"WRITE", write ? "bool:true" : "bool:false"},
                         P{"SCALE_BITS", int_arg(float_bits(0.0625f))}, P{"EPS_BITS", int_arg(float_bits(1e-6f))}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_decode_attn_qkv_part",
      {"qkv", "q_scale", "k_scale", "inv_freq", "k", "v", "offset", "dims", "slot"},
      {"part", "k_out", "v_out"},
      std::string(kPartHead) + kQkvPrologue + kPartBody,
      head_norm_rope_header() + block_reduce_header(),
      // the TTS backbone's step (one chunk, then several; writing the cache in place), grouped heads in
      // bfloat16
      {inst(72, 16, 16, true, "float", true), inst(72, 16, 16, false, "float", true),
       inst(72, 16, 16, true, "float", false), inst(80, 4, 2, false, "__nv_bfloat16", false)},
  });
  return src;
}

const CudaSource& combine_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int d) {
    return CudaInstance{{"float", "int32_t"},
                        {"float"},
                        {P{"D", int_arg(d)}, P{"CH", int_arg(kSplitChunk)},
                         P{"THREADS", "int:128"}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_decode_attn_combine",
      {"part", "dims"},
      {"out"},
      kCombineSource,
      "",
      {inst(72), inst(128)},
  });
  return src;
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("decode_attention: " + what);
}

// How the first launch splits CAP slots: nc chunks of ch slots (kChunk up to kChunk slots, else
// kSplitChunk), the dims input [CAP], and whether one chunk holds them all (the part kernel then
// writes the result, no merge launch).
struct Chunking {
  int nc;
  mx::array dims;
  bool single;
  int ch;  // slots per chunk
};

Chunking chunking(int cap) {
  const int ch = cap <= kChunk ? kChunk : kSplitChunk;
  const int nc = (cap + ch - 1) / ch;
  return {nc, kept_ints({cap}), nc == 1, ch};
}

// The second launch: one block per (b, h) merges its chunks' partial softmaxes -> [B, 1, H * D].
mx::array combine_chunks(const mx::array& parts, const mx::array& dims, int b, int h, int d, mx::Stream s) {
  static auto combine = make_cuda_kernel(combine_source());
  return combine({parts, dims}, {{b, 1, h * d}}, {mx::float32}, {b * h * 128, 1, 1}, {128, 1, 1},
                 {{"D", d}, {"CH", kSplitChunk}, {"THREADS", 128}}, std::nullopt, false, s)[0];
}

// q [B, H, 1, D]; k, v [B, HK, CAP, D]; offset: the query's position (slots <= it are valid);
// k_new, v_new [B, HK, 1, D] and slot: read in that slot instead of the buffers (all three or none);
// write_cache (with them): also stored there in place, as decode_attention_qkv's write_cache (same
// conditions). Returns [B, 1, H * D] float32.
mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& offset,
                           float scale, const std::optional<mx::array>& k_new, const std::optional<mx::array>& v_new,
                           const std::optional<mx::array>& slot, bool write_cache, mx::StreamOrDevice s_) {
  expect(q.ndim() == 4 && q.shape(2) == 1, "q must be [B, H, 1, D]");
  expect(k.ndim() == 4 && v.shape() == k.shape(), "k and v must be [B, HK, CAP, D] alike");
  const int b = q.shape(0), h = q.shape(1), d = q.shape(3), hk = k.shape(1), cap = k.shape(2);
  expect(k.shape(0) == b && k.shape(3) == d, "q and k disagree in batch or head dim");
  expect(hk >= 1 && h % hk == 0, "the query heads must be a multiple of the K/V heads");
  expect(offset.size() == 1, "offset must hold one position");
  const bool with_new = k_new.has_value();
  expect(with_new == v_new.has_value() && with_new == slot.has_value(), "give k_new, v_new and slot together");
  if (with_new) {
    const mx::Shape one{b, hk, 1, d};
    expect(k_new->shape() == one && v_new->shape() == one, "k_new and v_new must be [B, HK, 1, D]");
    expect(k_new->dtype() == mx::float32 && v_new->dtype() == mx::float32, "k_new and v_new must be float32");
    expect(slot->size() == 1, "slot must hold one slot");
  }
  expect(!write_cache || with_new, "write_cache needs k_new, v_new and slot");
  auto s = mx::to_stream(s_);
  expect(gpu_stream(s) && cuda_build() && q.dtype() == mx::float32 && k.dtype() == mx::float32 &&
             v.dtype() == mx::float32,
         "runs on a CUDA stream (float32); elsewhere use voicechat.kernels.decode_attention, which uses "
         "MLX's attention with a mask");
  static auto part = make_cuda_kernel(part_source());
  const auto [nc, dims, single, ch] = chunking(cap);
  // The offset goes in as its one value and a one-launch result comes out as [B, 1, H * D] (the
  // same flat values as [B * H, D]): no reshape nodes in the graph.
  const mx::Shape result{b, 1, h * d};
  // Without a new key: slot -1, and k_new / v_new fill their places unread.
  auto parts = part({q, k, v, mx::astype(offset, mx::int32, s), dims, with_new ? *k_new : q,
                     with_new ? *v_new : q, with_new ? mx::astype(*slot, mx::int32, s) : kept_ints({-1})},
                    {single ? result : mx::Shape{b * h * nc, d + 2}}, {mx::float32}, {b * h * nc * kThreads, 1, 1},
                    {kThreads, 1, 1},
                    {{"D", d}, {"H", h}, {"HK", hk}, {"CH", ch}, {"THREADS", kThreads}, {"SINGLE", single},
                     {"WRITE", write_cache}, {"SCALE_BITS", float_bits(scale)}},
                    std::nullopt, false, s)[0];
  return single ? parts : combine_chunks(parts, dims, b, h, d, s);
}

// The TTS step's head preparation and attention in one launch (two beyond 1024 slots): q and the new
// key / value come from the stacked projection qkv [B, (H + 2 HK) * D] (any leading shape; float32,
// bfloat16 or float16), normed and rotated as qkv_heads does at position `offset`; the new key and
// value are read in `slot` instead of the buffers k, v [B, HK, CAP, D]. Returns (out [B, 1, H * D],
// k_new, v_new [B, HK, 1, D]) float32: the step's attention and what the cache is to store.
//
// write_cache: the launch also stores k_new / v_new in `slot` of k and v themselves, in place, where
// MLX sees no write. That is what lets a decode step keep its cache without an update op: MLX-CUDA
// keeps every launch's inputs until it completes, so an update of a buffer that launches still in
// flight read is never done in place but copies the whole buffer (~0.8 GB a step at 120 s). Safe
// when (a) no block of the launch reads the slot from memory (it reads the new key from shared
// memory), (b) the caller orders every earlier reader and writer of the buffers before this launch
// (the TTS cache makes a step's buffers depend on the previous step's launches: mx.depends; the
// graph alone does not when a step's input is not made from the last step's output), and (c) k
// and v are row-contiguous views of the cache's buffers (MLX would otherwise hand the kernel a
// copy; the GPU tests would see it).
std::tuple<mx::array, mx::array, mx::array> decode_attention_qkv(
    const mx::array& qkv, const mx::array& q_scale, const mx::array& k_scale, const mx::array& inv_freq, float eps,
    const mx::array& k, const mx::array& v, const mx::array& offset, float scale, const mx::array& slot, int heads,
    bool write_cache, mx::StreamOrDevice s_) {
  expect(k.ndim() == 4 && v.shape() == k.shape(), "k and v must be [B, HK, CAP, D] alike");
  const int b = k.shape(0), hk = k.shape(1), cap = k.shape(2), d = k.shape(3);
  expect(heads >= 1 && heads % hk == 0, "the query heads must be a multiple of the K/V heads");
  expect(q_scale.ndim() == 1 && q_scale.shape(0) == d && k_scale.shape() == q_scale.shape(),
         "q_scale and k_scale must be [D]");
  expect(d % 2 == 0 && inv_freq.shape() == mx::Shape{d / 2}, "D must be even and inv_freq [D / 2]");
  expect(qkv.size() == static_cast<size_t>(b) * (heads + 2 * hk) * d,
         "qkv must hold B x (heads + 2 kv_heads) x D values");
  expect(offset.size() == 1 && slot.size() == 1, "offset and slot must hold one value each");
  auto s = mx::to_stream(s_);
  expect(gpu_stream(s) && cuda_build() && float_dtype(qkv.dtype()) && k.dtype() == mx::float32 &&
             v.dtype() == mx::float32 && q_scale.dtype() == mx::float32 && k_scale.dtype() == mx::float32 &&
             inv_freq.dtype() == mx::float32,
         "decode_attention_qkv runs on a CUDA stream (float32 buffers, scales and inv_freq); elsewhere use "
         "voicechat.kernels.decode_attention.decode_attention_qkv, which composes qkv_heads and the attention");
  static auto part = make_cuda_kernel(qkv_part_source());
  const auto [nc, dims, single, ch] = chunking(cap);
  const mx::Shape result{b, 1, heads * d}, one{b, hk, 1, d};
  auto outs = part({qkv, q_scale, k_scale, inv_freq, k, v, mx::astype(offset, mx::int32, s), dims,
                    mx::astype(slot, mx::int32, s)},
                   {single ? result : mx::Shape{b * heads * nc, d + 2}, one, one},
                   {mx::float32, mx::float32, mx::float32}, {b * heads * nc * kThreads, 1, 1}, {kThreads, 1, 1},
                   {{"D", d}, {"H", heads}, {"HK", hk}, {"CH", ch}, {"THREADS", kThreads}, {"SINGLE", single},
                    {"TX", qkv.dtype()}, {"WRITE", write_cache}, {"SCALE_BITS", float_bits(scale)},
                    {"EPS_BITS", float_bits(eps)}},
                   std::nullopt, false, s);
  return {single ? outs[0] : combine_chunks(outs[0], dims, b, heads, d, s), outs[1], outs[2]};
}

void bind(py::module_& m) {
  part_source();  // registered at import, so the compile checks see them
  qkv_part_source();
  combine_source();
  m.def("decode_attention", &decode_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("offset"),
        py::arg("scale"), py::kw_only(), py::arg("k_new") = py::none(), py::arg("v_new") = py::none(),
        py::arg("slot") = py::none(), py::arg("write_cache") = false, py::arg("stream") = py::none(),
        "Attention of one query q [B, H, 1, D] over the slots <= offset of K/V buffers [B, HK, CAP, D] "
        "(grouped heads), slot `slot` read from k_new / v_new [B, HK, 1, D] when given: [B, 1, H * D] "
        "float32, in one CUDA launch while CAP <= 1024, two beyond; CUDA streams only. write_cache=True also "
        "stores k_new / v_new in `slot` of k and v in place (as decode_attention_qkv's write_cache).");
  m.def("decode_attention_qkv", &decode_attention_qkv, py::arg("qkv"), py::arg("q_scale"), py::arg("k_scale"),
        py::arg("inv_freq"), py::arg("eps"), py::arg("k"), py::arg("v"), py::arg("offset"), py::arg("scale"),
        py::arg("slot"), py::arg("heads"), py::kw_only(), py::arg("write_cache") = false,
        py::arg("stream") = py::none(),
        "qkv_heads and decode_attention with a new key in one launch: from the stacked projection qkv "
        "[B, (heads + 2 HK) * D], q and the new key are RMS-normed per head (q_scale / k_scale) and rotated at "
        "`offset`; the new key and value are read in `slot` instead of the buffers k, v [B, HK, CAP, D]. Returns "
        "(out [B, 1, heads * D], k_new, v_new [B, HK, 1, D]) float32; CUDA streams only. write_cache=True also "
        "stores the new key and value in `slot` of k and v in place (they must be row-contiguous views of the "
        "cache's buffers, and nothing may read the slot's old contents later).");
}

}  // namespace
VC_REGISTER(bind);
}  // namespace voicechat
