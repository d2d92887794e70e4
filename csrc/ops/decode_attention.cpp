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
// values: scores in shared memory, see csrc/kernels/decode_attention/part_tail.body.cuh), then one
// block per (b, h) merges the chunks: two launches, or one while the buffers hold <= 1024 slots
// (one chunk normalizes and writes the result itself; `chunked` asks for the two launches at any
// capacity, so that a row's result does not depend on how many slots the buffers hold). offset and
// slot hold one value for every batch row, or one a row. No block waits for another. Every warp of a block works in each phase and no lane's
// loads wait on one another's, so a step's time does not grow slot by slot (as it would with one
// slot a warp at a time). CUDA through
// fast::cuda_kernel; elsewhere MLX's attention with the mask (the reference:
// voicechat.kernels.decode_attention).

#include "voicechat/decode_attention.h"

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "cuda/cuda_sources.h"
#include "jit_sources.h"
#include "mlx/mlx.h"

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

const CudaSource& part_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int d, int h, int hk, bool single, bool write = false, bool row_pos = false) {
    return CudaInstance{{"float", "float", "float", "int32_t", "int32_t", "float", "float", "int32_t"},
                        {"float"},
                        {P{"D", int_arg(d)}, P{"H", int_arg(h)},
                         P{"HK", int_arg(hk)}, P{"CH", int_arg(single ? kChunk : kSplitChunk)},
                         P{"THREADS", int_arg(kThreads)},
                         P{"SINGLE", single ? "bool:true" : "bool:false"},
                         P{"WRITE", write ? "bool:true" : "bool:false"},
                         P{"ROW_POS", row_pos ? "bool:true" : "bool:false"},
                         P{"SCALE_BITS", int_arg(float_bits(1.0f / std::sqrt(static_cast<float>(d))))}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_decode_attn_part",
      {"q", "k", "v", "offset", "dims", "k_new", "v_new", "slot"},
      {"part"},
      std::string(jit::decode_attention::part_head_body) + jit::decode_attention::plain_prologue_body +
          jit::decode_attention::part_tail_body,
      block_reduce_header(),
      // the TTS backbone; the LLM's grouped heads (its decode step writing the cache in place, in
      // chunks: one session, and sessions stepped together at their own positions)
      {inst(72, 16, 16, true), inst(72, 16, 16, false), inst(128, 40, 8, false), inst(128, 40, 8, false, true),
       inst(128, 40, 8, false, true, true)},
  });
  return src;
}

const CudaSource& qkv_part_source() {
  using P = std::pair<std::string, std::string>;
  auto inst = [](int d, int h, int hk, bool single, const std::string& tx, bool write, bool row_pos = false) {
    return CudaInstance{{tx, "float", "float", "float", "float", "float", "int32_t", "int32_t", "int32_t"},
                        {"float", "float", "float"},
                        {P{"D", int_arg(d)}, P{"H", int_arg(h)}, P{"HK", int_arg(hk)},
                         P{"CH", int_arg(single ? kChunk : kSplitChunk)}, P{"THREADS", int_arg(kThreads)},
                         P{"SINGLE", single ? "bool:true" : "bool:false"}, P{"TX", type_arg(tx)},
                         P{"WRITE", write ? "bool:true" : "bool:false"},
                         P{"ROW_POS", row_pos ? "bool:true" : "bool:false"},
                         P{"SCALE_BITS", int_arg(float_bits(0.0625f))}, P{"EPS_BITS", int_arg(float_bits(1e-6f))}}};
  };
  static const CudaSource& src = register_cuda_source({
      "vc_decode_attn_qkv_part",
      {"qkv", "q_scale", "k_scale", "inv_freq", "k", "v", "offset", "dims", "slot"},
      {"part", "k_out", "v_out"},
      std::string(jit::decode_attention::part_head_body) + jit::decode_attention::qkv_prologue_body +
          jit::decode_attention::part_tail_body,
      head_norm_rope_header() + block_reduce_header(),
      // the TTS backbone's step (one chunk, then several; writing the cache in place), grouped heads in
      // bfloat16, and sessions' rows at their own positions (chunked)
      {inst(72, 16, 16, true, "float", true), inst(72, 16, 16, false, "float", true),
       inst(72, 16, 16, true, "float", false), inst(80, 4, 2, false, "__nv_bfloat16", false),
       inst(72, 16, 16, false, "float", true, true)},
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
      jit::decode_attention::vc_decode_attn_combine_body,
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

Chunking chunking(int cap, bool chunked = false) {
  const int ch = cap <= kChunk && !chunked ? kChunk : kSplitChunk;
  const int nc = (cap + ch - 1) / ch;
  return {nc, kept_ints({cap}), nc == 1 && !chunked, ch};
}

// The second launch: one block per (b, h) merges its chunks' partial softmaxes -> [B, 1, H * D].
mx::array combine_chunks(const mx::array& parts, const mx::array& dims, int b, int h, int d, mx::Stream s) {
  static auto combine = make_cuda_kernel(combine_source());
  return combine({parts, dims}, {{b, 1, h * d}}, {mx::float32}, {b * h * 128, 1, 1}, {128, 1, 1},
                 {{"D", d}, {"CH", kSplitChunk}, {"THREADS", 128}}, std::nullopt, false, s)[0];
}

}  // namespace

// q [B, H, 1, D]; k, v [B, HK, CAP, D]; offset: the query's position (slots <= it are valid), [1]
// or one a row [B]; k_new, v_new [B, HK, 1, D] and slot ([1] or [B]): read in that slot instead of
// the buffers (all three or none); write_cache (with them): also stored there in place, as
// decode_attention_qkv's write_cache (same conditions); chunked: the two launches at any capacity.
// Returns [B, 1, H * D] float32.
mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& offset,
                           float scale, const std::optional<mx::array>& k_new, const std::optional<mx::array>& v_new,
                           const std::optional<mx::array>& slot, bool write_cache, bool chunked,
                           mx::StreamOrDevice s_) {
  expect(q.ndim() == 4 && q.shape(2) == 1, "q must be [B, H, 1, D]");
  expect(k.ndim() == 4 && v.shape() == k.shape(), "k and v must be [B, HK, CAP, D] alike");
  const int b = q.shape(0), h = q.shape(1), d = q.shape(3), hk = k.shape(1), cap = k.shape(2);
  expect(k.shape(0) == b && k.shape(3) == d, "q and k disagree in batch or head dim");
  expect(hk >= 1 && h % hk == 0, "the query heads must be a multiple of the K/V heads");
  const bool row_pos = offset.size() != 1;
  expect(offset.size() == 1 || static_cast<int>(offset.size()) == b, "offset must hold one position, or one a row");
  const bool with_new = k_new.has_value();
  expect(with_new == v_new.has_value() && with_new == slot.has_value(), "give k_new, v_new and slot together");
  if (with_new) {
    const mx::Shape one{b, hk, 1, d};
    expect(k_new->shape() == one && v_new->shape() == one, "k_new and v_new must be [B, HK, 1, D]");
    expect(k_new->dtype() == mx::float32 && v_new->dtype() == mx::float32, "k_new and v_new must be float32");
    expect(slot->size() == offset.size(), "slot must hold as many slots as offset holds positions");
  }
  expect(!write_cache || with_new, "write_cache needs k_new, v_new and slot");
  auto s = mx::to_stream(s_);
  expect(gpu_stream(s) && cuda_build() && q.dtype() == mx::float32 && k.dtype() == mx::float32 &&
             v.dtype() == mx::float32,
         "runs on a CUDA stream (float32); elsewhere use voicechat.kernels.decode_attention, which uses "
         "MLX's attention with a mask");
  static auto part = make_cuda_kernel(part_source());
  const auto [nc, dims, single, ch] = chunking(cap, chunked);
  // The offset goes in as its one value and a one-launch result comes out as [B, 1, H * D] (the
  // same flat values as [B * H, D]): no reshape nodes in the graph.
  const mx::Shape result{b, 1, h * d};
  // Without a new key: slot -1, and k_new / v_new fill their places unread.
  auto parts = part({q, k, v, mx::astype(offset, mx::int32, s), dims, with_new ? *k_new : q,
                     with_new ? *v_new : q,
                     with_new ? mx::astype(*slot, mx::int32, s) : row_pos ? mx::full({b}, -1, mx::int32, s)
                                                                          : kept_ints({-1})},
                    {single ? result : mx::Shape{b * h * nc, d + 2}}, {mx::float32}, {b * h * nc * kThreads, 1, 1},
                    {kThreads, 1, 1},
                    {{"D", d}, {"H", h}, {"HK", hk}, {"CH", ch}, {"THREADS", kThreads}, {"SINGLE", single},
                     {"WRITE", write_cache}, {"ROW_POS", row_pos}, {"SCALE_BITS", float_bits(scale)}},
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
//
// offset and slot: one value for every row, or one a row ([B]: rows of sessions at their own
// positions). chunked: the two launches at any capacity, as decode_attention's (a row's result
// then does not depend on the buffers' capacity).
std::tuple<mx::array, mx::array, mx::array> decode_attention_qkv(
    const mx::array& qkv, const mx::array& q_scale, const mx::array& k_scale, const mx::array& inv_freq, float eps,
    const mx::array& k, const mx::array& v, const mx::array& offset, float scale, const mx::array& slot, int heads,
    bool write_cache, bool chunked, mx::StreamOrDevice s_) {
  expect(k.ndim() == 4 && v.shape() == k.shape(), "k and v must be [B, HK, CAP, D] alike");
  const int b = k.shape(0), hk = k.shape(1), cap = k.shape(2), d = k.shape(3);
  expect(heads >= 1 && heads % hk == 0, "the query heads must be a multiple of the K/V heads");
  expect(q_scale.ndim() == 1 && q_scale.shape(0) == d && k_scale.shape() == q_scale.shape(),
         "q_scale and k_scale must be [D]");
  expect(d % 2 == 0 && inv_freq.shape() == mx::Shape{d / 2}, "D must be even and inv_freq [D / 2]");
  expect(qkv.size() == static_cast<size_t>(b) * (heads + 2 * hk) * d,
         "qkv must hold B x (heads + 2 kv_heads) x D values");
  const bool row_pos = offset.size() != 1;
  expect((offset.size() == 1 || static_cast<int>(offset.size()) == b) && slot.size() == offset.size(),
         "offset and slot must hold one value each, or one a row each");
  auto s = mx::to_stream(s_);
  expect(gpu_stream(s) && cuda_build() && float_dtype(qkv.dtype()) && k.dtype() == mx::float32 &&
             v.dtype() == mx::float32 && q_scale.dtype() == mx::float32 && k_scale.dtype() == mx::float32 &&
             inv_freq.dtype() == mx::float32,
         "decode_attention_qkv runs on a CUDA stream (float32 buffers, scales and inv_freq); elsewhere use "
         "voicechat.kernels.decode_attention.decode_attention_qkv, which composes qkv_heads and the attention");
  static auto part = make_cuda_kernel(qkv_part_source());
  const auto [nc, dims, single, ch] = chunking(cap, chunked);
  const mx::Shape result{b, 1, heads * d}, one{b, hk, 1, d};
  auto outs = part({qkv, q_scale, k_scale, inv_freq, k, v, mx::astype(offset, mx::int32, s), dims,
                    mx::astype(slot, mx::int32, s)},
                   {single ? result : mx::Shape{b * heads * nc, d + 2}, one, one},
                   {mx::float32, mx::float32, mx::float32}, {b * heads * nc * kThreads, 1, 1}, {kThreads, 1, 1},
                   {{"D", d}, {"H", heads}, {"HK", hk}, {"CH", ch}, {"THREADS", kThreads}, {"SINGLE", single},
                    {"TX", qkv.dtype()}, {"WRITE", write_cache}, {"ROW_POS", row_pos}, {"SCALE_BITS", float_bits(scale)},
                    {"EPS_BITS", float_bits(eps)}},
                   std::nullopt, false, s);
  return {single ? outs[0] : combine_chunks(outs[0], dims, b, heads, d, s), outs[1], outs[2]};
}

VC_CUDA_SOURCES(part_source, qkv_part_source, combine_source);
}  // namespace voicechat
