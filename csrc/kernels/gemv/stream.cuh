// The streamed 4-bit matvec (vc_qmv_stream): the weight bytes moved by the copy engine instead of
// the threads' loads. In the block layout each thread makes one trip to memory and then does its
// math and the block sum with nothing in flight. Here a block stays on its SM and walks tiles (ROWS
// consecutive rows, whole K): a warp asks for the next STAGES tiles' weights, scales and biases with
// cp.async.bulk into shared memory (an mbarrier a stage counts their bytes), so the bytes in flight
// do not cost registers; every thread keeps its chunks of x in registers for all tiles (loaded once,
// already as int8 terms, the input norm's scale folded in), and reads each tile's weights from shared
// memory. A warp goes on to its next tile without waiting for the others; the last one done with a
// tile stores it and asks for the tile STAGES ahead into its stage (walk_tiles). Include-guarded; it
// needs common.cuh and persistent.cuh before it.
#ifndef VC_STREAM_HEADER
#define VC_STREAM_HEADER
namespace vc_stream {

#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arms the barrier's current phase for `bytes` of copies, then copies [src, src + bytes) into dst.
__device__ __forceinline__ void bar_expect(unsigned long long* bar, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// The block's threads are done reading a stage (they passed a barrier): order those reads before
// the copy engine's writes into it.
__device__ __forceinline__ void reads_before_copies() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void bar_wait(unsigned long long* bar, unsigned int parity) {
  unsigned int done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  }
}
#else  // the CPU emulation (tests/data/cuda_emu/cuda_emu.h): a copy lands when its phase is waited for
inline void bar_init(unsigned long long* bar) { cuda_emu::mbarrier_init(bar); }
inline void bar_expect(unsigned long long* bar, unsigned int bytes) { cuda_emu::mbarrier_expect_tx(bar, bytes); }
inline void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  cuda_emu::bulk_copy(dst, src, bytes, bar);
}
inline void reads_before_copies() { cuda_emu::fence_proxy_async(); }
inline void bar_wait(unsigned long long* bar, unsigned int parity) { cuda_emu::mbarrier_wait(bar, parity); }
#endif

// The sums over a warp of N values (N a power of two <= 32) in 2N - 1 + (5 - log2 N) shuffles
// instead of 5N: at each halving step lanes with bit O set keep the upper half of their values and
// send the lower half across, the others the reverse. Returns, in every lane, the total of value
// (lane >> (5 - log2 N)) & (N - 1). v is overwritten.
template <int N, int O>
__device__ __forceinline__ float fold_sums(float* v, int lane) {
  if constexpr (O == 0) {
    return v[0];
  } else if constexpr (N > 1) {
    constexpr int H = N / 2;
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const float send = up ? v[i] : v[i + H];
      const float keep = up ? v[i + H] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    return fold_sums<H, O / 2>(v, lane);
  } else {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
    return fold_sums<1, O / 2>(v, lane);
  }
}

// Whether this warp is the last of the block's WARPS done with round `round` of a stage (every lane
// gets the answer; the count is never reset: round r's last warp sees r * WARPS + WARPS - 1). The
// warp's reads of the stage and its writes before the call are ordered before its count, and for
// the last warp the others' before what it does next.
template <int WARPS>
__device__ __forceinline__ bool last_warp(unsigned int* arrived, int round, int lane) {
  __syncwarp();
  unsigned int last = 0u;
  if (lane == 0) {
    __threadfence_block();
    last = atomicAdd(arrived, 1u) == static_cast<unsigned int>(round * WARPS + WARPS - 1);
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last) {
    __threadfence_block();
  }
  return last != 0u;
}

// A stage's layout: ROWS weight rows of ROW_BYTES each, ROW_STRIDE apart (a stride past ROW_BYTES
// pads the rows, so that a warp reading across rows misses its own shared-memory banks), then the
// tile's scales and its biases: S_BYTES each in global memory (ROWS rows of S_ROW_BYTES), laid out
// in the stage S_ROW_STRIDE apart a row (S_ROW_BYTES: as they come, one copy each).
template <int ROWS_, int ROW_BYTES_, int ROW_STRIDE_, int S_BYTES_, int S_ROW_STRIDE_ = S_BYTES_ / ROWS_>
struct Stage {
  static constexpr int ROWS = ROWS_, ROW_BYTES = ROW_BYTES_, ROW_STRIDE = ROW_STRIDE_, S_BYTES = S_BYTES_;
  static constexpr int S_ROW_BYTES = S_BYTES / ROWS, S_ROW_STRIDE = S_ROW_STRIDE_;
  static constexpr bool W_PADDED = ROW_STRIDE != ROW_BYTES, S_PADDED = S_ROW_STRIDE != S_ROW_BYTES;
  static constexpr int W_BYTES = ROWS * ROW_BYTES;  // the weight bytes of a tile
  static constexpr int SCALES = ROWS * ROW_STRIDE;  // where its scales start
  static constexpr int BIASES = SCALES + ROWS * S_ROW_STRIDE;
  static constexpr int BYTES = BIASES + ROWS * S_ROW_STRIDE;
  static_assert(ROW_STRIDE >= ROW_BYTES && ROW_STRIDE % 16 == 0 && ROW_BYTES % 16 == 0 && S_BYTES % 16 == 0,
                "bulk copies move multiples of 16 bytes to 16-byte aligned places");
  static_assert(S_BYTES % ROWS == 0 && S_ROW_STRIDE >= S_ROW_BYTES && (!S_PADDED || (S_ROW_BYTES % 16 == 0 &&
                S_ROW_STRIDE % 16 == 0)), "padded scale rows are bulk copied a row at a time");
};

// Bulk copy c of tile `tile` into stage st (laid out as S): the weight rows (one copy, or one a row
// where they are padded), then the scales, then the biases (likewise). COPIES of them.
template <typename S>
struct TileCopies {
  static constexpr int W = S::W_PADDED ? S::ROWS : 1;
  static constexpr int SCALE = S::S_PADDED ? S::ROWS : 1;  // each for the scales and the biases
  static constexpr int COPIES = W + 2 * SCALE;

  static __device__ __forceinline__ void copy(int c, unsigned char* st, const unsigned char* w,
                                              const unsigned char* s, const unsigned char* b, int tile,
                                              unsigned long long* bar) {
    if (c < W) {
      const unsigned char* wt = w + static_cast<size_t>(tile) * S::W_BYTES;
      if constexpr (W == 1) {
        bulk_copy(st, wt, S::W_BYTES, bar);
      } else {
        bulk_copy(st + c * S::ROW_STRIDE, wt + c * S::ROW_BYTES, S::ROW_BYTES, bar);
      }
      return;
    }
    const int j = c - W, r = j % SCALE;
    const bool biases = j >= SCALE;
    const unsigned char* src = (biases ? b : s) + static_cast<size_t>(tile) * S::S_BYTES + r * S::S_ROW_BYTES;
    bulk_copy(st + (biases ? S::BIASES : S::SCALES) + r * S::S_ROW_STRIDE, src, SCALE == 1 ? S::S_BYTES : S::S_ROW_BYTES,
              bar);
  }
};

// Tile `tile`'s bulk copies into stage st, spread over the lanes of one warp (all 32 calling): lane 0
// arms the barrier for the tile's bytes, then lane l issues copies l, l + 32, ... (one thread issuing
// a padded slab's dozens of copies would hold its warp, and with it the tile's store).
template <typename S>
__device__ __forceinline__ void fetch_bulk(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                           const unsigned char* b, int tile, unsigned long long* bar, int lane) {
  if (lane == 0) {
    bar_expect(bar, S::W_BYTES + 2 * S::S_BYTES);
  }
  __syncwarp();
  for (int c = lane; c < TileCopies<S>::COPIES; c += 32) TileCopies<S>::copy(c, st, w, s, b, tile, bar);
}

// The bulk copies of part q of tile `tile` (its weight rows q x PART_ROWS on, into their place in
// stage st, and the whole tile's scales and biases: their rows need not be whole 16 bytes), spread
// over the lanes of one warp as fetch_bulk's.
template <typename S, int PART_ROWS>
__device__ __forceinline__ void fetch_part(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                           const unsigned char* b, int tile, int q, unsigned long long* bar, int lane) {
  static_assert(!S::W_PADDED, "a part's weight rows in one copy");
  constexpr int BYTES = PART_ROWS * S::ROW_BYTES;
  if (lane == 0) {
    bar_expect(bar, BYTES + 2 * S::S_BYTES);
  }
  __syncwarp();
  for (int c = lane; c < TileCopies<S>::COPIES; c += 32) {
    if (c == 0) {
      bulk_copy(st + q * BYTES, w + static_cast<size_t>(tile) * S::W_BYTES + q * BYTES, BYTES, bar);
    } else {
      TileCopies<S>::copy(c, st, w, s, b, tile, bar);
    }
  }
}

// Tile `tile`'s bulk copies into stage st in GROUPS row groups (see Walk), spread over the lanes of
// one warp as fetch_bulk's: the scales and biases first, then each group's rows in one copy, so that
// the copy engine brings the first rows in first. bars: the stage's GROUPS barriers.
template <typename S, int GROUPS>
__device__ __forceinline__ void fetch_row_groups(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                                 const unsigned char* b, int tile, unsigned long long* bars, int lane) {
  static_assert(!S::W_PADDED && !S::S_PADDED && S::ROWS % GROUPS == 0, "whole rows a group, one copy each");
  constexpr int BYTES = S::ROWS / GROUPS * S::ROW_BYTES;  // a group's weight bytes
  if (lane == 0) {
    for (int g = 0; g < GROUPS; ++g) bar_expect(&bars[g], BYTES + (g == 0 ? 2 * S::S_BYTES : 0));
  }
  __syncwarp();
  for (int c = lane; c < 2 + GROUPS; c += 32) {
    if (c < 2) {
      const unsigned char* src = (c == 0 ? s : b) + static_cast<size_t>(tile) * S::S_BYTES;
      bulk_copy(st + (c == 0 ? S::SCALES : S::BIASES), src, S::S_BYTES, &bars[0]);
    } else {
      const int g = c - 2;
      bulk_copy(st + g * BYTES, w + static_cast<size_t>(tile) * S::W_BYTES + g * BYTES, BYTES, &bars[g]);
    }
  }
}

// Tile `tile`'s weight rows, scales and biases into stage `st` by the block's threads, word by word
// (the pointers not 16-byte aligned for bulk copies), laid out as S.
template <typename S, int THREADS>
__device__ __forceinline__ void fetch_words(unsigned char* st, const unsigned char* w, const unsigned char* s,
                                            const unsigned char* b, int tile) {
  const unsigned char* wt = w + static_cast<size_t>(tile) * S::W_BYTES;
  const unsigned char* st_src = s + static_cast<size_t>(tile) * S::S_BYTES;
  const unsigned char* bt_src = b + static_cast<size_t>(tile) * S::S_BYTES;
  // scales and biases are 2-byte types at least; the weight words 4 bytes
  for (int o = 2 * static_cast<int>(threadIdx.x); o < S::W_BYTES; o += 2 * THREADS) {
    const int to = S::W_PADDED ? o / S::ROW_BYTES * S::ROW_STRIDE + o % S::ROW_BYTES : o;
    *reinterpret_cast<unsigned short*>(st + to) = *reinterpret_cast<const unsigned short*>(wt + o);
  }
  for (int o = 2 * static_cast<int>(threadIdx.x); o < S::S_BYTES; o += 2 * THREADS) {
    const int to = o / S::S_ROW_BYTES * S::S_ROW_STRIDE + o % S::S_ROW_BYTES;
    *reinterpret_cast<unsigned short*>(st + S::SCALES + to) = *reinterpret_cast<const unsigned short*>(st_src + o);
    *reinterpret_cast<unsigned short*>(st + S::BIASES + to) = *reinterpret_cast<const unsigned short*>(bt_src + o);
  }
}

// The items a persistent block walks (tiles of S::ROWS rows, TILES of them): whole rounds (tile
// blockIdx.x + i x gridDim.x, i < rounds), then the `left` tiles of the last round. With SPLIT 1
// each of those goes whole to one of the first `left` blocks; with SPLIT > 1 each is cut into SPLIT
// parts of PART_ROWS rows, one for each of the first left x SPLIT blocks, so that the round costs
// those blocks a part instead of a tile while the others wait (gemv.cpp's split_last_round picks it).
// An item's totals are partial p of np when emitting: the tiles', then the parts', in row order.
//
// BARS > 1 (whole tiles only): each tile's weight rows come in BARS row groups, each with an
// mbarrier of its own (the first also counting the scales and biases, asked for ahead of the
// weights: fetch_row_groups); a stage's barriers are BARS consecutive ones, and walk_tiles waits for
// the first before an item's product, which waits for the others as it gets to their rows.
template <typename S, int TILES, int SPLIT_, int BARS_ = 1>
struct Walk {
  static constexpr int ROWS = S::ROWS, SPLIT = SPLIT_, PART_ROWS = ROWS / SPLIT_, BARS = BARS_;
  static_assert(SPLIT_ >= 1 && ROWS % SPLIT_ == 0, "a tile cut into parts of whole rows");
  static_assert(BARS_ == 1 || (SPLIT_ == 1 && ROWS % BARS_ == 0), "row groups of whole tiles");
  int b, g, rounds, left, count;

  __device__ __forceinline__ Walk()
      : b(static_cast<int>(blockIdx.x)), g(static_cast<int>(gridDim.x)), rounds(TILES / g), left(TILES - rounds * g),
        count(rounds + (b < left * SPLIT ? 1 : 0)) {}
  __device__ __forceinline__ bool part(int i) const { return SPLIT > 1 && i >= rounds; }
  __device__ __forceinline__ int tile(int i) const { return i < rounds ? b + i * g : rounds * g + b / SPLIT; }
  __device__ __forceinline__ int q() const { return b % SPLIT; }  // the block's part of its last tile
  __device__ __forceinline__ int row0(int i) const {
    return part(i) ? rounds * g * ROWS + b * PART_ROWS : tile(i) * ROWS;
  }
  __device__ __forceinline__ int p(int i) const { return i < rounds ? tile(i) : rounds * g + b; }
  __device__ __forceinline__ int np() const { return rounds * g + left * SPLIT; }
  // Item i's bulk copies into stage st (one warp, all its lanes); bar: the stage's first barrier.
  __device__ __forceinline__ void fetch(int i, unsigned char* st, const unsigned char* wb, const unsigned char* sb,
                                        const unsigned char* bb, unsigned long long* bar, int lane) const {
    if constexpr (BARS > 1) {
      fetch_row_groups<S, BARS>(st, wb, sb, bb, tile(i), bar, lane);
      return;
    }
    if constexpr (SPLIT > 1) {
      if (part(i)) {
        fetch_part<S, PART_ROWS>(st, wb, sb, bb, tile(i), q(), bar, lane);
        return;
      }
    }
    fetch_bulk<S>(st, wb, sb, bb, tile(i), bar, lane);
  }
  // Item i's whole tile copied into stage st by the block's threads (the pointers not 16-byte aligned).
  template <int THREADS>
  __device__ __forceinline__ void copy_words(int i, unsigned char* st, const unsigned char* wb,
                                             const unsigned char* sb, const unsigned char* bb) const {
    fetch_words<S, THREADS>(st, wb, sb, bb, tile(i));
  }
};

// The walk of a two-head argmax: the tiles of two heads of one shape (TILES a head) as one list, head
// a's then head b's, each head's bytes from its own arrays (the walk's, not walk_tiles' pointers), as
// Walk's whole rounds and last round of whole tiles (so row0 counts head b's rows from TILES x ROWS on).
template <typename S, int TILES>
struct HeadsWalk {
  static constexpr int ROWS = S::ROWS, SPLIT = 1, PART_ROWS = ROWS, BARS = 1;
  // each head's arrays apart, picked by a select (an array indexed at run time went to local memory)
  const unsigned char *wa, *sa, *ba, *wb, *sb, *bb;
  int blk, g, count;

  __device__ __forceinline__ HeadsWalk(const unsigned char* wa_, const unsigned char* sa_, const unsigned char* ba_,
                                       const unsigned char* wb_, const unsigned char* sb_, const unsigned char* bb_)
      : wa(wa_), sa(sa_), ba(ba_), wb(wb_), sb(sb_), bb(bb_), blk(static_cast<int>(blockIdx.x)),
        g(static_cast<int>(gridDim.x)), count((2 * TILES - blk + g - 1) / g) {}
  __device__ __forceinline__ bool part(int) const { return false; }
  __device__ __forceinline__ int tile(int i) const { return blk + i * g; }
  __device__ __forceinline__ int q() const { return 0; }
  __device__ __forceinline__ int row0(int i) const { return tile(i) * ROWS; }
  __device__ __forceinline__ int p(int i) const { return tile(i); }
  __device__ __forceinline__ int np() const { return 2 * TILES; }
  // item i's tile in its head's arrays
  struct HeadTile {
    const unsigned char *w, *s, *b;
    int tile;
  };
  __device__ __forceinline__ HeadTile head_tile(int i) const {
    const int t = tile(i);
    return t >= TILES ? HeadTile{wb, sb, bb, t - TILES} : HeadTile{wa, sa, ba, t};
  }
  __device__ __forceinline__ void fetch(int i, unsigned char* st, const unsigned char*, const unsigned char*,
                                        const unsigned char*, unsigned long long* bar, int lane) const {
    const HeadTile h = head_tile(i);
    fetch_bulk<S>(st, h.w, h.s, h.b, h.tile, bar, lane);
  }
  template <int THREADS>
  __device__ __forceinline__ void copy_words(int i, unsigned char* st, const unsigned char*, const unsigned char*,
                                             const unsigned char*) const {
    const HeadTile h = head_tile(i);
    fetch_words<S, THREADS>(st, h.w, h.s, h.b, h.tile);
  }
};

// One warp (all its lanes): the bulk copies of the block's items [from, to) (of its Walk, the first
// round: item s into stage s) asked for.
template <typename S, typename W>
__device__ __forceinline__ void ask_for_items(const W& walk, int from, int to, unsigned long long* bars,
                                              unsigned char* stages, const unsigned char* wb,
                                              const unsigned char* sb, const unsigned char* bb, int lane) {
  for (int s = from; s < to && s < walk.count; ++s) {
    walk.fetch(s, stages + s * S::BYTES, wb, sb, bb, &bars[s * W::BARS], lane);
  }
}

// Warp 0 of a block on the bulk path (all its lanes): the stages' barriers and counts set up, and the
// block's first `first` items (of its Walk) asked for (the kernel, or walk_tiles's ramp_tiles, asks
// for the others: all STAGES at once, their bytes would hold up the prologue's loads). The block's
// other threads see the barriers after its next barrier.
template <int STAGES, typename S, typename W>
__device__ __forceinline__ void start_tiles(const W& walk, unsigned long long* bars, unsigned int* arrived,
                                            unsigned char* stages, const unsigned char* wb, const unsigned char* sb,
                                            const unsigned char* bb, int lane, int first = 1) {
  if (lane == 0) {
    for (int s = 0; s < STAGES; ++s) {
      for (int k = 0; k < W::BARS; ++k) bar_init(&bars[s * W::BARS + k]);
      arrived[s] = 0u;
    }
  }
  __syncwarp();
  ask_for_items<S>(walk, 0, first, bars, stages, wb, sb, bb, lane);
}

// Warp 0 (all its lanes) once round i's tile is in: round i + 1's first tile asked for,
// while the first round lasts, from round `from` on (the kernel asked for the ones before).
template <int STAGES, typename S, typename W>
__device__ __forceinline__ void ramp_tiles(int i, const W& walk, unsigned long long* bars, unsigned char* stages,
                                           const unsigned char* wb, const unsigned char* sb, const unsigned char* bb,
                                           int lane, int from = 1) {
  if (threadIdx.x < 32 && i + 1 >= from && i + 1 < STAGES && i + 1 < walk.count) {
    walk.fetch(i + 1, stages + (i + 1) * S::BYTES, wb, sb, bb, &bars[(i + 1) * W::BARS], lane);
  }
}

// f(vc_gemv::Int<R>{}) with R the rows of item i of a Walk: PART_ROWS for a part, ROWS for a tile.
template <typename W, typename F>
__device__ __forceinline__ auto with_rows(const W& walk, int i, F f) {
  if constexpr (W::SPLIT > 1) {
    if (walk.part(i)) {
      return f(vc_gemv::Int<W::PART_ROWS>{});
    }
  }
  return f(vc_gemv::Int<W::ROWS>{});
}

// The Tail that lane `lane` stores for item i of this block's Walk (its output row when its warp
// stores the item): zeros past the block's items and for lanes past the item's sums.
template <int M, int EPI, bool HAS_BIAS, bool EMIT, int N, typename W, typename TB, typename TR, typename TE>
__device__ __forceinline__ vc_gemv::Tail<TB, TR, TE> stream_tail(const W& walk, int i, int lane, const TB* bias,
                                                                const TR* residual, const TE* next_w) {
  if (i >= walk.count) {
    return vc_gemv::zero_tail<TB, TR, TE>();
  }
  return with_rows(walk, i, [&](auto rows) {
    return vc_gemv::slot_tail<decltype(rows)::value, M, EPI, HAS_BIAS>(lane, bias, residual, walk.row0(i), N,
                                                                      EMIT ? next_w : nullptr);
  });
}

// A streamed kernel's walk over its block's items (`walk`, a Walk: tiles of S::ROWS rows, whole K,
// laid out as S in shared memory, and with SPLIT > 1 a part of a last-round tile). `sums(rows, st, b,
// r0)` computes this thread's share of the item's R rows (rows: vc_gemv::Int<R>, R = ROWS or
// PART_ROWS) in stage st, the tile's rows r0 on, and leaves its warp's R x M sums in red buffer b
// (red: buffers of WARPS x ROWS x M floats, one a stage, two at least). Bulk (start_tiles asked for
// the first items, ramp_tiles asks for the rest of the first round): no block barrier an item; a warp
// waits only for its item's mbarrier, and the last warp done with an item (last_warp) totals it,
// asks for the item STAGES ahead into the stage and stores it. Otherwise (pointers not 16-byte
// aligned) the block copies each item's whole tile itself into stage 0, behind barriers, and warp 0
// stores it. first_tail: stream_tail(walk, 0, ...), which the kernel asks for with x, before its
// first tiles. ramp_from: the first round's tiles from it on are asked for by ramp_tiles (the kernel
// asked for the ones before). best: EPI_ARGMAX's keys (store_totals).
template <int M, int WARPS, int STAGES, typename S, int EPI, bool HAS_BIAS, bool EMIT, int N, typename W, typename TB,
          typename TR, typename TE, typename TO, typename Sums>
__device__ __forceinline__ void walk_tiles(bool bulk, const W& walk, unsigned long long* bars, unsigned int* arrived,
                                           float* red, unsigned char* stages, const unsigned char* wb,
                                           const unsigned char* sb, const unsigned char* bb, const TB* bias,
                                           const TR* residual, const TE* next_w, TO* out, float* normed,
                                           float* partials, const vc_gemv::Tail<TB, TR, TE>& first_tail,
                                           Sums sums, int ramp_from = 1, unsigned long long* best = nullptr) {
  constexpr int SUMS = S::ROWS * M;
  constexpr int THREADS = WARPS * 32;
  const int lane = threadIdx.x & 31;
  if (bulk) {
    // This lane's Tail of item i, asked for an item ahead so that its trip to memory overlaps an
    // item's product. Item 0's comes with x: asked for here, behind the first tiles' bulk copies, it
    // would come in after them and hold every warp until then.
    auto next_tail = first_tail;
    for (int i = 0; i < walk.count; ++i) {
      const int s = i % STAGES;
      const auto tail = next_tail;
      next_tail = stream_tail<M, EPI, HAS_BIAS, EMIT, N>(walk, i + 1, lane, bias, residual, next_w);
      bar_wait(&bars[s * W::BARS], (i / STAGES) & 1);
      ramp_tiles<STAGES, S>(i, walk, bars, stages, wb, sb, bb, lane, ramp_from);
      with_rows(walk, i, [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        // row group g's barrier (the first passed above), for an item's product
        const auto ready = [&](int g) { bar_wait(&bars[s * W::BARS + g], (i / STAGES) & 1); };
        sums(rows, stages + s * S::BYTES, s, walk.part(i) ? walk.q() * R : 0, ready);
        if (last_warp<WARPS>(&arrived[s], i / STAGES, lane)) {
          constexpr int TURNS = EndTurns<R, M>::TURNS;
          float v[TURNS];
          if constexpr (TURNS == 1) {
            v[0] = tile_total<R * M, WARPS>(red + s * WARPS * SUMS, SUMS, lane);
          } else {
            turn_totals<R, M, WARPS>(red + s * WARPS * SUMS, SUMS, lane, v);
          }
          __syncwarp();  // every lane has its totals (red[s] read) before the stage and red[s] can be used again
          if (i + STAGES < walk.count) {
            reads_before_copies();  // each lane, before its copies
            walk.fetch(i + STAGES, stages + s * S::BYTES, wb, sb, bb, &bars[s * W::BARS], lane);
          }
          if constexpr (TURNS == 1) {
            store_totals<M, R, EPI, HAS_BIAS, EMIT, N>(v[0], lane, walk.row0(i), walk.p(i), walk.np(), tail, out,
                                                       normed, partials, best);
          } else {
            store_turns<M, R, EPI, HAS_BIAS, EMIT, N>(v, lane, walk.row0(i), walk.p(i), walk.np(), bias, residual,
                                                      next_w, out, normed, partials, best);
          }
        }
      });
    }
    return;
  }
  for (int i = 0; i < walk.count; ++i) {
    with_rows(walk, i, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      const int row0 = walk.row0(i);
      const auto tail = vc_gemv::row_tail<R, M, EPI, HAS_BIAS>(bias, residual, row0, N, EMIT ? next_w : nullptr);
      walk.template copy_words<THREADS>(i, stages, wb, sb, bb);
      __syncthreads();
      // red double-buffered: a warp may write the next item's before warp 0 reads this one's
      sums(rows, stages, i & 1, walk.part(i) ? walk.q() * R : 0, [](int) {});
      __syncthreads();  // the stage read and the sums written by every thread
      if constexpr (EndTurns<R, M>::TURNS == 1) {
        store_tile<M, R, WARPS, EPI, HAS_BIAS, EMIT, N>(red + (i & 1) * WARPS * SUMS, SUMS, row0, walk.p(i),
                                                            walk.np(), tail, out, normed, partials, best);
      } else if (threadIdx.x < 32) {
        float v[EndTurns<R, M>::TURNS];
        turn_totals<R, M, WARPS>(red + (i & 1) * WARPS * SUMS, SUMS, lane, v);
        store_turns<M, R, EPI, HAS_BIAS, EMIT, N>(v, lane, row0, walk.p(i), walk.np(), bias, residual, next_w, out,
                                                  normed, partials, best);
      }
    });
  }
}

// Float32 x's chunks (32 values each; lane l of warp w takes chunk w x 32 + l + j x THREADS, j <
// CPT) loaded coalesced: the warp's 32 chunks of round j are 4 KB of x, float4 i x 32 + lane of them
// a lane's i-th load (4 cache lines an instruction, against 32 when each lane reads its own chunk).
// `spread` then hands them round through shared memory (the warp's 4 KB slices at `region`,
// float4 slots swizzled so that neither the writes nor the reads share banks) into the lane's own
// chunks. Loaded before the first tiles are asked for, spread after.
template <typename T>
struct IsFloat {
  static constexpr bool value = false;
};
template <>
struct IsFloat<float> {
  static constexpr bool value = true;
};

template <int K, int M, int CPT, int THREADS>
struct StagedX {
  static constexpr int CHUNKS = K / 32;
  static constexpr int BYTES = THREADS / 32 * CPT * M * 4096;  // the block's slices (every warp's)
  float4 raw[CPT][M][8];

  static __device__ __forceinline__ int slot(int chunk, int q) { return chunk * 8 + (q ^ (chunk & 7)); }

  __device__ __forceinline__ void load(const float* x, int lane, int warp) {
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int first = warp * 32 + j * THREADS;  // the warp's first chunk of round j
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4* src = reinterpret_cast<const float4*>(x + static_cast<size_t>(m) * K) + first * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int f = i * 32 + lane;
          raw[j][m][i] = first + (f >> 3) < CHUNKS ? src[f] : float4{0.0f, 0.0f, 0.0f, 0.0f};
        }
      }
    }
  }

  // xv[j][m][k][0..7]: the lane's chunk j, row m, values 8k..8k + 7, as vc_gemv::load_x<8> leaves them.
  __device__ __forceinline__ void spread(float4* region, int lane, int warp, float (&xv)[CPT][M][4][8]) const {
    float4* mine = region + warp * CPT * M * 256;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float4* slice = mine + (j * M + m) * 256;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int f = i * 32 + lane;
          slice[slot(f >> 3, f & 7)] = raw[j][m][i];
        }
        __syncwarp();
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float4 v = slice[slot(lane, q)];
          float* out = &xv[j][m][q >> 1][(q & 1) * 4];
          out[0] = v.x;
          out[1] = v.y;
          out[2] = v.z;
          out[3] = v.w;
        }
      }
    }
  }
};

// out[m, row] for the streamed matvec's tiles: NORM 0 (x as it is) or 2 (x normalized by its
// producer: norm_w holds NP partial sums of squares an input row in NG groups, see vc_gemv::qmv_block),
// the epilogue of vc_gemv::finish, and with EMIT the next norm's input as vc_qmv_emit writes it
// (partials: one a tile, and one a part of a split last-round tile). N a multiple of ROWS. SPLIT: the
// parts a last-round tile is cut into (Walk). The dynamic shared memory `smem` holds STAGES tiles
// (and with XS 2, x's slices past them). The products are integer dot products (dp4a: four weights an
// instruction a term) with each thread's chunk of x as vc_levels::TERMS int8 terms, each row's integer
// sums of a chunk then scaled in float32 (5 float instructions a pair of weights cost more).
template <int GROUP, int K, int N, int M, int ROWS, int THREADS, int STAGES, int XS, int SPLIT, int EPI,
          bool HAS_BIAS, int NORM, int NP, int NG, bool EMIT, typename TX, typename TS, typename TB, typename TR,
          typename TN, typename TO, typename TE>
__device__ __forceinline__ void qmv_stream(const TX* x, const unsigned int* weight, const TS* scales,
                                           const TS* biases, const TB* bias, const TR* residual, const TN* norm_w,
                                           float eps, TO* out, const TE* next_w, float* normed, float* partials,
                                           unsigned char* smem) {
  constexpr int CHUNK = 32;  // 4-bit values in a 16-byte chunk
  constexpr int CHUNKS = K / CHUNK;
  constexpr int WARPS = THREADS / 32;
  constexpr int CPT = (CHUNKS + THREADS - 1) / THREADS;  // chunks a thread
  constexpr int GROUPS = K / GROUP;
  constexpr int TILES = N / ROWS;
  constexpr int LV = vc_levels::TERMS;
  // the rows unpadded: a warp reads consecutive chunks of one row
  using S = Stage<ROWS, K / 2, K / 2, ROWS * GROUPS * static_cast<int>(sizeof(TS))>;
  constexpr int SUMS = ROWS * M;
  constexpr int NGM = (NORM == 2 ? NG : 1) * M;
  static_assert(N % ROWS == 0 && K % GROUP == 0 && GROUP % CHUNK == 0, "whole tiles; a chunk inside a group");
  static_assert(STAGES >= 2 && SUMS <= 32 && THREADS % 32 == 0, "two stages at least; a tile's sums in one warp");
  static_assert(NORM == 0 || NORM == 2, "no norm, or one its producer applied");
  static_assert(NORM == 0 || (NP % NG == 0 && K % NG == 0 && (K / NG) % CHUNK == 0), "NP partials in NG groups");
  // Whole tiles come in two row groups, a bulk copy and an mbarrier each (Walk), so that a warp's
  // product of the first rows overlaps the arrival of the rest.
  constexpr int BARS = ROWS % 2 == 0 && SPLIT == 1 ? 2 : 1;
  __shared__ unsigned long long bars[STAGES * BARS];
  // Bulk path: arrived[s] counts the warps done with stage s's tiles (never reset: round r's last
  // warp sees r * WARPS + WARPS - 1), red[s] holds their sums of its tile.
  __shared__ unsigned int arrived[STAGES];
  constexpr int RED = STAGES > 2 ? STAGES : 2;
  __shared__ float red[RED][WARPS][SUMS];
  // the warps' group sums apart from red: a tile may have fewer rows than the norm has groups
  __shared__ float group_scratch[NORM == 2 ? WARPS : 1][NGM];
  __shared__ float group_total[NGM];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kt = static_cast<int>(threadIdx.x);
  const Walk<S, TILES, SPLIT, BARS> walk;
  const bool bulk = vc_gemv::aligned16(weight) && vc_gemv::aligned16(scales) && vc_gemv::aligned16(biases);
  const unsigned char* wb = reinterpret_cast<const unsigned char*>(weight);
  const unsigned char* sb = reinterpret_cast<const unsigned char*>(scales);
  const unsigned char* bb = reinterpret_cast<const unsigned char*>(biases);
  // This thread's chunks of x and the input norm's partials, loaded before the first tiles are asked
  // for: behind every block's bulk copies they would wait for the copies' bytes.
  float xv[CPT][M][4][8];
  const bool vec = vc_gemv::aligned16(x);
  // XS (gemv.cpp's pick_stream): float32 x loaded coalesced and handed to each lane through shared
  // memory (StagedX): 1 through the last X_STAGES stages' buffers, where the block's slices fit in one
  // stage, or for one row of x in all but the first (the bulk path asks for those stages' tiles only
  // after x's spread, the others at the start; the block's own copies use the first stage alone), 2
  // through a region of its own past the stages.
  using SX = StagedX<K, M, CPT, THREADS>;
  constexpr int X_STAGES = (SX::BYTES + S::BYTES - 1) / S::BYTES;
  constexpr bool STAGE_X =
      IsFloat<TX>::value && (XS == 2 || (XS == 1 && X_STAGES < STAGES && (X_STAGES == 1 || M == 1)));
  const bool staged = STAGE_X && vec;
  // the first items asked for at the start: the stages x does not pass through
  const int first = staged && XS == 1 ? STAGES - X_STAGES : 1;
  SX sx;
  if (staged) {
    sx.load(reinterpret_cast<const float*>(x), lane, warp);
  } else {
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int c = min(kt + j * THREADS, CHUNKS - 1);
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          vc_gemv::load_x<8>(x + static_cast<size_t>(m) * K + c * CHUNK + k * 8, xv[j][m][k], vec);
        }
      }
    }
  }
  Partials<NORM == 2 ? NP : 1, M, THREADS> norm_partials;
  if constexpr (NORM == 2) {
    norm_partials = load_partials<NP, M, THREADS>(norm_w);
  }
  const auto first_tail = stream_tail<M, EPI, HAS_BIAS, EMIT, N>(walk, 0, lane, bias, residual, next_w);
  __syncthreads();  // every thread's loads issued
  if (threadIdx.x < 32 && bulk) {
    start_tiles<STAGES, S>(walk, bars, arrived, smem, wb, sb, bb, lane, first);
  }
  // The input norm's scales (NORM 2): each group's partials summed by the block.
  if constexpr (NORM == 2) {
    sum_groups<NP, NG, M, THREADS>(norm_partials, &group_scratch[0][0], NGM, group_total);
  }
  if (staged) {
    unsigned char* region = smem + (XS == 2 ? STAGES : STAGES - X_STAGES) * S::BYTES;
    sx.spread(reinterpret_cast<float4*>(region), lane, warp, xv);
    // each thread's accesses to the staged x ordered before the copy engine's writes into the stage
    // (after the barrier)
    if constexpr (XS == 1) {
      reads_before_copies();
      __syncthreads();
    }
  }
  // The rest of the first round's tiles are asked for here, once the prologue's loads are in (and x's
  // staged slices out of their stage): asked for at the start, their bytes would hold up the
  // prologue's loads.
  if (bulk && threadIdx.x < 32) {
    ask_for_items<S>(walk, first, STAGES, bars, smem, wb, sb, bb, lane);
  }
  // x's terms (word k's lo / hi of vc_levels::terms8, a level each), and per chunk 2^E / 128 times
  // the norm's scale (xup) and the sum of the scaled x.
  float xsum[CPT][M], xup[CPT][M];
  unsigned int tlo[CPT][M][LV][4], thi[CPT][M][LV][4];
#pragma unroll
  for (int j = 0; j < CPT; ++j) {
    const int c = min(kt + j * THREADS, CHUNKS - 1);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float r = 1.0f;
      if constexpr (NORM == 2) {
        r = rsqrtf(group_total[(c * CHUNK / (K / NG)) * M + m] / static_cast<float>(K / NG) + eps);
      }
      float top = 0.0f, sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          top = fmaxf(top, fabsf(xv[j][m][k][i]));
          sum += xv[j][m][k][i];
        }
      }
      const vc_levels::Scale two_e = vc_levels::scale_for(top);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        unsigned int lo[LV], hi[LV];
        vc_levels::terms8<LV>(xv[j][m][k], two_e.down, lo, hi);
#pragma unroll
        for (int l = 0; l < LV; ++l) {
          tlo[j][m][l][k] = lo[l];
          thi[j][m][l][k] = hi[l];
        }
      }
      xup[j][m] = two_e.up * (1.0f / 128.0f) * r;
      xsum[j][m] = sum * r;
    }
  }
  __syncthreads();  // the barriers' init seen by every thread
  // This warp's sums of the R rows in stage st, the tile's rows r0 on (each thread's, folded over the
  // warp: see fold_sums), into red[b][warp]. ready(g): waits for row group g of the stage (BARS > 1;
  // the first is in before the call).
  auto row_sums = [&](auto rows, const unsigned char* st, int b, int r0, auto ready) {
    constexpr int R = decltype(rows)::value;
    constexpr int RM = R * M;
    constexpr int LOG = RM >= 32 ? 5 : RM >= 16 ? 4 : RM >= 8 ? 3 : RM >= 4 ? 2 : RM >= 2 ? 1 : 0;
    static_assert(RM == 1 << LOG, "a tile's (and a part's) rows x M a power of two");
    float acc[R][M];
    const uint4* w4 = reinterpret_cast<const uint4*>(st);
    const TS* tscale = reinterpret_cast<const TS*>(st + S::SCALES);
    const TS* tbias = reinterpret_cast<const TS*>(st + S::BIASES);
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int c = kt + j * THREADS;
      if (c < CHUNKS) {
        const int g = c * CHUNK / GROUP;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if constexpr (BARS > 1) {
            if (r > 0 && r % (ROWS / BARS) == 0) ready(r / (ROWS / BARS));
          }
          const uint4 wv = w4[(r0 + r) * CHUNKS + c];
          const float scale = static_cast<float>(tscale[(r0 + r) * GROUPS + g]);
          const float bias_g = static_cast<float>(tbias[(r0 + r) * GROUPS + g]);
          // each level's integer sum over the chunk (|sum| <= 15 x 64 x 32 < 2^15), then two levels
          // a word: 128 s0 + s1 and 128 s2 + s3 (< 2^22: exact as floats); the chunk's q . x is
          // 2^E / 128 ((128 s0 + s1) + (128 s2 + s3) / 2^14)
          int sums[M][LV];
#pragma unroll
          for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int l = 0; l < LV; ++l) sums[m][l] = 0;
          }
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const unsigned int v = vc_gemv::word(wv, k);
            const unsigned int lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
              for (int l = 0; l < LV; ++l) {
                sums[m][l] = vc_levels::dp4a(lo, tlo[j][m][l][k], sums[m][l]);
                sums[m][l] = vc_levels::dp4a(hi, thi[j][m][l][k], sums[m][l]);
              }
            }
          }
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const int high = sums[m][0] * 128 + sums[m][1], low = sums[m][2] * 128 + sums[m][3];
            const float q = fmaf(static_cast<float>(low), 1.0f / 16384.0f, static_cast<float>(high));
            acc[r][m] += fmaf(scale * xup[j][m], q, bias_g * xsum[j][m]);
          }
        }
      }
    }
    const float v = fold_sums<RM, 16>(&acc[0][0], lane);
    if ((lane & ((1 << (5 - LOG)) - 1)) == 0) {
      red[b][warp][(lane >> (5 - LOG)) & (RM - 1)] = v;
    }
  };
  // No block barrier a tile on the bulk path (it would hold every warp to the slowest): see walk_tiles.
  walk_tiles<M, WARPS, STAGES, S, EPI, HAS_BIAS, EMIT, N>(bulk, walk, bars, arrived, &red[0][0][0], smem, wb, sb, bb,
                                                         bias, residual, next_w, out, normed, partials, first_tail,
                                                         row_sums, STAGES);
}

}  // namespace vc_stream
#endif
