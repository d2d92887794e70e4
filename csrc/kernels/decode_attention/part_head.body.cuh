// Template args: D, H, HK, CH (kChunk when SINGLE, else kSplitChunk), THREADS, SINGLE, SCALE_BITS
// (the score scale as float bits), ROW_POS (offset and slot hold a value a batch row, else one for
// all); dims = [CAP]
// (the buffers' slots: an input, so that a growing cache does not compile a kernel per size).
// part: [B * H * NC, D + 2] = (max, sum, values); SINGLE (CAP <= CH, one chunk): the result itself,
// [B * H, D], and no second launch. With one chunk a block is its (b, h) whatever CAP holds, so
// nothing waits for the dims load before the query's and key's loads go out.
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
