// The integer-MMA product on the streamed layout's tiles (vc_qmv_imma_stream): 16-row slabs come
// by bulk copies into shared memory (as vc_qmv_stream's tiles: warp 0 asks for the next ones),
// x's expansion is built once a block (vc_imma's Layout), and each warp takes its groups of a slab
// (w, w + WARPS, ...) from shared memory: no global load, no address math a group beyond an offset.
// No block barrier a slab: the last warp done with one totals it, refills its stage and stores it.
// The weights' nibbles are the MMA's A operand as they stand, so a 64-wide group of 16 rows costs a
// warp ~36 instructions against ~80 for the pair form's float math. Include-guarded; it needs
// stream.cuh and imma.cuh before it.
#ifndef VC_IMMA_STREAM_HEADER
#define VC_IMMA_STREAM_HEADER
namespace vc_imma {

// out[m, row] for the 16-row slabs a block walks (b, b + grid, ...), STAGES of them in flight;
// NORM 0 / 2, the epilogue of vc_gemv::finish, EMIT as vc_qmv_stream's (a partial a slab). The
// dynamic shared memory holds x's expansion (Layout::BYTES, rounded up to 128) and then the STAGES
// slabs, the weights the MMA's A operand (LaneTerms).
// EPI_ARGMAX (16-row slabs, no norm, no bias): the two-head argmax. weight / scales / biases are head a's,
// weight_b / scales_b / biases_b head b's (N / 2 rows each); out, where not null, gets both heads' logits
// [2, M, N / 2], and keys[(m x 2 + head) x grid + block] the block's best argmax key of each.
template <int K, int N, int M, int WARPS, int STAGES, int EPI, bool HAS_BIAS, int NORM, int NP, int NG, bool EMIT,
          typename TX, typename TS, typename TB, typename TR, typename TN, typename TO, typename TE>
__device__ __forceinline__ void qmv_imma_stream(const TX* x, const unsigned int* weight, const TS* scales,
                                                const TS* biases, const TB* bias, const TR* residual, const TN* norm_w,
                                                float eps, TO* out, const TE* next_w, float* normed, float* partials,
                                                unsigned char* smem, const unsigned int* weight_b = nullptr,
                                                const TS* scales_b = nullptr, const TS* biases_b = nullptr,
                                                unsigned long long* keys = nullptr) {
  constexpr bool ARGMAX = EPI == vc_stream::EPI_ARGMAX;
  constexpr int LEVELS = vc_levels::TERMS;
  constexpr int SLAB = 16;
  using L = Layout<K, M, LEVELS>;
  constexpr int THREADS = WARPS * 32;
  constexpr int GROUPS = L::GROUPS;
  constexpr int TILES = N / SLAB;
  constexpr int SUMS = SLAB * M;
  // A warp reads 8 bytes a lane from rows g and g + 8 (g = lane / 4) at once: rows 4 words of banks apart in a half warp (a stride of 8 words mod 16) keep those reads
  // conflict-free; K / 8 words a row that are a multiple of 16 (K a multiple of 128) would put 2 or 4
  // of those rows on the same banks, so they are padded by 8 words. The lanes' scale and bias loads read one row each (8 rows,
  // 4 lanes a row): rows a multiple of 8 words apart would share 4 banks (4-way conflicts on 4 loads a
  // group, half the slab product's shared-memory traffic at out_proj, K = 10240), so those are padded
  // by 4 words.
  constexpr int ROW_BYTES = K / 2;
  constexpr int S_ROW_BYTES = GROUPS * static_cast<int>(sizeof(TS));
  using S = vc_stream::Stage<SLAB, ROW_BYTES, (ROW_BYTES / 4) % 16 == 0 ? ROW_BYTES + 32 : ROW_BYTES,
                             SLAB * S_ROW_BYTES, S_ROW_BYTES % 32 == 0 ? S_ROW_BYTES + 16 : S_ROW_BYTES>;
  constexpr int SROW = S::S_ROW_STRIDE / static_cast<int>(sizeof(TS));  // a scale row's stride in TS
  constexpr int FIRST = (L::BYTES + 127) / 128 * 128;
  constexpr int NGM = (NORM == 2 ? NG : 1) * M;
  static_assert(K % 64 == 0 && N % SLAB == 0 && (M == 1 || M == 2 || M == 4),
                "slabs of 64-wide groups; 1, 2 or 4 rows of x");
  static_assert(WARPS <= GROUPS, "a group at least for every warp: a warp without one would idle");
  static_assert(STAGES >= 2, "two stages at least");
  static_assert(NORM == 0 || (NORM == 2 && NP % NG == 0 && (K / NG) % 64 == 0), "no norm, or one its producer applied");
  static_assert(NGM <= SUMS, "the norm's group totals fit a slab's sums");
  static_assert(!ARGMAX || (NORM == 0 && !HAS_BIAS && !EMIT && (N / 2) % SLAB == 0),
                "a two-head argmax: 16-row slabs, each head whole slabs, no norm or bias");
  __shared__ unsigned long long bars[STAGES];
  __shared__ unsigned int arrived[STAGES];  // as vc_qmv_stream's: never reset
  __shared__ float red[STAGES][WARPS][SUMS];
  __shared__ float group_total[NGM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const unsigned char* wb = reinterpret_cast<const unsigned char*>(weight);
  const unsigned char* sb = reinterpret_cast<const unsigned char*>(scales);
  const unsigned char* bb = reinterpret_cast<const unsigned char*>(biases);
  const auto slabs = [&] {
    if constexpr (ARGMAX) {
      return vc_stream::HeadsWalk<S, TILES / 2>(wb, sb, bb, reinterpret_cast<const unsigned char*>(weight_b),
                                                reinterpret_cast<const unsigned char*>(scales_b),
                                                reinterpret_cast<const unsigned char*>(biases_b));
    } else {
      return vc_stream::Walk<S, TILES, 1>();
    }
  }();
  bool bulk = vc_gemv::aligned16(weight) && vc_gemv::aligned16(scales) && vc_gemv::aligned16(biases);
  unsigned long long* best = nullptr;  // (ARGMAX) the block's best key of each head and row of x
  if constexpr (ARGMAX) {
    bulk = bulk && vc_gemv::aligned16(weight_b) && vc_gemv::aligned16(scales_b) && vc_gemv::aligned16(biases_b);
    __shared__ unsigned long long best_keys[2 * M];
    if (threadIdx.x < 2 * M) {
      best_keys[threadIdx.x] = 0ull;  // seen by every warp after the barrier below, before any item ends
    }
    best = best_keys;
  }
  unsigned char* stages = smem + FIRST;
  // x and the norm's partials in flight before the first slabs are asked for (see vc_qmv_stream)
  const XItems<K, M, THREADS> items = load_x_items<K, M, THREADS>(x);
  vc_stream::Partials<NORM == 2 ? NP : 1, M, THREADS> norm_partials;
  if constexpr (NORM == 2) {
    norm_partials = vc_stream::load_partials<NP, M, THREADS>(norm_w);
  }
  const auto first_tail =
      vc_stream::stream_tail<M, EPI, HAS_BIAS, EMIT, N>(slabs, 0, lane, bias, residual, next_w);
  __syncthreads();  // every thread's loads issued
  if (threadIdx.x < 32 && bulk) {
    vc_stream::start_tiles<STAGES, S>(slabs, bars, arrived, stages, wb, sb, bb, lane);
  }
  if constexpr (NORM == 2) {
    vc_stream::sum_groups<NP, NG, M, THREADS>(norm_partials, &red[1][0][0], SUMS, group_total);
  }
  expand_items<K, M, LEVELS, THREADS>(items, smem, [&](int grp, int m) {
    if constexpr (NORM == 2) {
      constexpr int W = K / NG;
      return rsqrtf(group_total[(grp * 64 / W) * M + m] / static_cast<float>(W) + eps);
    } else {
      return 1.0f;
    }
  });
  __syncthreads();  // the expansion and the barriers' init seen by every thread
  auto walk = [&](auto slab_sums) {
    vc_stream::walk_tiles<M, WARPS, STAGES, S, EPI, HAS_BIAS, EMIT, N>(
        bulk, slabs, bars, arrived, &red[0][0][0], stages, wb, sb, bb, bias, residual, next_w, out, normed, partials,
        first_tail, [&](auto, const unsigned char* st, int b, int, auto) { slab_sums(st, b); },  // whole slabs only
        1, best);
    if constexpr (ARGMAX) {
      __syncthreads();  // every item's key in
      if (threadIdx.x < 2 * M) {
        const int h = static_cast<int>(threadIdx.x) / M, m = static_cast<int>(threadIdx.x) % M;
        keys[(static_cast<size_t>(m) * 2 + h) * gridDim.x + blockIdx.x] = best[threadIdx.x];
      }
    }
  };
  const LaneTerms<K, M, LEVELS> lt(smem, lane);
  // This warp's sums of the slab in stage st, rows g and g + 8 (totalled by the quad), into red[b].
  walk([&](const unsigned char* st, int b) {
    float acc[2][M];
    const unsigned char* w_lo = st + g * S::ROW_STRIDE + t * 8;  // row g: the lane's 8 bytes of a group's 32
    const unsigned char* w_hi = w_lo + 8 * S::ROW_STRIDE;         // row g + 8
    const TS* ts = reinterpret_cast<const TS*>(st + S::SCALES);
    const TS* tb = reinterpret_cast<const TS*>(st + S::BIASES);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = 0.0f;
#pragma unroll 3
    for (int grp = warp; grp < GROUPS; grp += WARPS) {
      const uint2 wl = *reinterpret_cast<const uint2*>(w_lo + grp * 32);
      const uint2 wh = *reinterpret_cast<const uint2*>(w_hi + grp * 32);
      lt.add_group(acc, wl, wh, grp, static_cast<float>(ts[g * SROW + grp]),
                   static_cast<float>(ts[(g + 8) * SROW + grp]), static_cast<float>(tb[g * SROW + grp]),
                   static_cast<float>(tb[(g + 8) * SROW + grp]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[h][m] += __shfl_xor_sync(0xffffffffu, acc[h][m], 1);
        acc[h][m] += __shfl_xor_sync(0xffffffffu, acc[h][m], 2);
        if (t == 0) red[b][warp][(g + 8 * h) * M + m] = acc[h][m];
      }
    }
  });
}

}  // namespace vc_imma
#endif
