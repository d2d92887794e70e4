// The decode-speed matrix-vector kernels' device code (csrc/ops/gemv.cpp launches them).
//
// Block layout (vc_qmv, vc_dense_mv): one block computes ROWS output rows for the M input rows; its THREADS threads split K: thread t reads the 16-byte chunks t, t + THREADS, ... of each of
// the ROWS weight rows (a warp reads 512 contiguous bytes of a row per step), keeps the activations
// of a chunk in registers while it serves all ROWS rows, and accumulates in float32. A block-wide sum
// through shared memory ends the block. Rows past N are clamped onto row N - 1 and not written.
// The persistent 4-bit layouts (vc_qmv_stream, vc_qmv_imma_stream, the two-head argmax): see
// stream.cuh and imma_stream.cuh.
//
// A kernel's header is made of include-guarded parts, so that each kernel carries only what it uses
// (MLX-CUDA spends host time on a kernel's whole text at every launch): this file, then the parts its
// kernel needs in this order: pair.cuh (4-bit pairs), block_qmv.cuh (the block layout's 4- / 8-bit
// matvec; needs pair.cuh), block_dense.cuh (the dense matvecs); persistent.cuh and stream.cuh (the
// streamed layout), imma.cuh and imma_stream.cuh (the integer-MMA layout).
//
// Loads, reductions and the epilogues every matvec shares.
#ifndef VC_GEMV_COMMON
#define VC_GEMV_COMMON
namespace vc_gemv {

// A compile-time int as a value (a generic lambda's template argument; no <type_traits> in NVRTC).
template <int V>
struct Int {
  static constexpr int value = V;
};

// Two bfloat16 / float16 values of a word (element 0 in the low half), or one float32.
__device__ __forceinline__ void unpack_dense(unsigned int v, float* q, const __nv_bfloat16*) {
  q[0] = __uint_as_float(v << 16);
  q[1] = __uint_as_float(v & 0xFFFF0000u);
}
__device__ __forceinline__ void unpack_dense(unsigned int v, float* q, const __half*) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v));
  q[0] = f.x;
  q[1] = f.y;
}
__device__ __forceinline__ void unpack_dense(unsigned int v, float* q, const float*) {
  q[0] = __uint_as_float(v);
}

__device__ __forceinline__ unsigned int word(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// N (4 or 8) consecutive activations as float32. `vec`: the activation array is 16-byte aligned,
// so (K being a multiple of 8) every such run can be read with one or two vector loads.
template <int N>
__device__ __forceinline__ void load_x(const float* p, float* out, bool vec) {
  if (vec) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      out[i] = f.x;
      out[i + 1] = f.y;
      out[i + 2] = f.z;
      out[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = p[i];
  }
}

template <int N, typename T16>
__device__ __forceinline__ void load_x16(const T16* p, float* out, bool vec) {
  if (vec) {
    unsigned int u[N / 2];
    if constexpr (N == 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
    } else {
      static_assert(N == 4, "4 or 8 values");
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      u[0] = v.x; u[1] = v.y;
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) unpack_dense(u[i], out + 2 * i, p);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<float>(p[i]);
  }
}

template <int N>
__device__ __forceinline__ void load_x(const __nv_bfloat16* p, float* out, bool vec) {
  load_x16<N>(p, out, vec);
}

template <int N>
__device__ __forceinline__ void load_x(const __half* p, float* out, bool vec) {
  load_x16<N>(p, out, vec);
}

template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

// `word` made to depend on `loaded` through a zero ptxas cannot see (no user-space address reaches
// bit 63 of `p`): the loads behind `loaded` are then issued before `word`'s first use, where ptxas
// would otherwise sink each one down to its own use.
__device__ __forceinline__ unsigned int tied(unsigned int word, unsigned int loaded, const void* p) {
  return word ^ (loaded & static_cast<unsigned int>(reinterpret_cast<unsigned long long>(p) >> 63));
}

// total[o] = sum over the block's threads of vals[o], o < COUNT. part: COUNT * THREADS floats of
// shared memory. Every thread of the block must call it (it synchronizes the block).
template <int COUNT, int THREADS>
__device__ __forceinline__ void block_sum(const float* vals, float* part, float* total) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 0; o < COUNT; ++o) part[o * THREADS + threadIdx.x] = vals[o];
  __syncthreads();
  for (int o = warp; o < COUNT; o += WARPS) {
    float s = 0.0f;
    for (int t = lane; t < THREADS; t += 32) s += part[o * THREADS + t];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) total[o] = s;
  }
  __syncthreads();
}

// What an output's epilogue reads besides its sum: bias[row], residual[m, row], and the next norm's
// weight next_w[row] (an emitting matvec). The block-walking kernels load it before their product:
// loaded after the block's last barrier, it is one more trip to memory on every block's path. Kept
// in the arrays' own types and made float only where the epilogue adds them: a conversion next to
// the loads would wait out their trip to memory ahead of the tile's product.
template <typename TB, typename TR, typename TE>
struct Tail {
  TB bias;
  TR residual;
  TE next_w;
};

template <typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> zero_tail() {
  return Tail<TB, TR, TE>{static_cast<TB>(0.0f), static_cast<TR>(0.0f), static_cast<TE>(0.0f)};
}

template <int EPI, bool HAS_BIAS, typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> load_tail(const TB* bias, const TR* residual, int m, int row, int n,
                                                      const TE* next_w = nullptr) {
  Tail<TB, TR, TE> t = zero_tail<TB, TR, TE>();
  if constexpr (HAS_BIAS) {
    t.bias = bias[row];
  }
  if constexpr (EPI == 1) {
    t.residual = residual[static_cast<size_t>(m) * n + row];
  }
  if (next_w != nullptr) {
    t.next_w = next_w[row];
  }
  return t;
}

// The Tail of the output that slot `slot` stores when ROWS * MC slots store rows row0, row0 + 1, ...
// of input rows m0 .. m0 + MC - 1 (slot i: row row0 + i / MC, input row m0 + i % MC; MC = M: every
// input row at once); zeros for the other slots and past n.
template <int ROWS, int M, int EPI, bool HAS_BIAS, int MC = M, typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> slot_tail(int slot, const TB* bias, const TR* residual, int row0, int n,
                                                      const TE* next_w = nullptr, int m0 = 0) {
  const int row = row0 + slot / MC;
  if (slot < ROWS * MC && row < n) {
    return load_tail<EPI, HAS_BIAS>(bias, residual, m0 + slot % MC, row, n, next_w);
  }
  return zero_tail<TB, TR, TE>();
}

// slot_tail with the block's threads as the slots (its first ROWS * M threads store the rows).
template <int ROWS, int M, int EPI, bool HAS_BIAS, typename TB, typename TR, typename TE = float>
__device__ __forceinline__ Tail<TB, TR, TE> row_tail(const TB* bias, const TR* residual, int row0, int n,
                                                     const TE* next_w = nullptr) {
  return slot_tail<ROWS, M, EPI, HAS_BIAS>(static_cast<int>(threadIdx.x), bias, residual, row0, n, next_w);
}

// The epilogue of every matvec kernel: the output value of row `row`, input row `m`, from its float
// sum v and its Tail. EPI 0: v (+ bias); 1: that + residual[m, row] (a residual stream added in the
// same pass); 2: relu(that)^2 (squared-ReLU activation). All in float32, rounded to TO once. Returns
// the value stored (as float).
template <int EPI, bool HAS_BIAS, typename TO, typename TB, typename TR, typename TE>
__device__ __forceinline__ float finish(float v, const Tail<TB, TR, TE>& t, TO* out, int m, int row, int n) {
  if constexpr (HAS_BIAS) {
    v += static_cast<float>(t.bias);
  }
  if constexpr (EPI == 1) {
    v += static_cast<float>(t.residual);
  } else if constexpr (EPI == 2) {
    v = fmaxf(v, 0.0f);
    v = v * v;
  }
  const TO stored = static_cast<TO>(v);
  out[static_cast<size_t>(m) * n + row] = stored;
  return static_cast<float>(stored);
}

// The same with the Tail loaded now (where no barrier lies between the loads and the product's end).
template <int EPI, bool HAS_BIAS, typename TB, typename TR, typename TO>
__device__ __forceinline__ float finish(float v, const TB* bias, const TR* residual, TO* out, int m, int row, int n) {
  return finish<EPI, HAS_BIAS>(v, load_tail<EPI, HAS_BIAS>(bias, residual, m, row, n), out, m, row, n);
}

// out[m, row0 + r] = finish(total[r * M + m] (* row_scale[m])) for the block's rows inside [0, n):
// the store that ends the block-layout matvec kernels. tail: this thread's (row_tail, loaded before
// the product).
template <int ROWS, int M, int EPI, bool HAS_BIAS, typename TO, typename TL>
__device__ __forceinline__ void store_rows(const float* total, const TL& tail, TO* out, int row0, int n,
                                           const float* row_scale = nullptr) {
  if (threadIdx.x < ROWS * M) {
    const int row = row0 + threadIdx.x / M;
    const int m = threadIdx.x % M;
    if (row < n) {
      const float v = row_scale ? total[threadIdx.x] * row_scale[m] : total[threadIdx.x];
      finish<EPI, HAS_BIAS>(v, tail, out, m, row, n);
    }
  }
}

// (value, index) as one integer whose order is mx.argmax's: a larger value wins, equal values go
// to the smaller index. The value's bits are made monotonic (flip all bits of negatives, the sign
// bit of positives); -0 counts as +0; every NaN counts as larger than +inf, so the first NaN wins
// (what mx.argmax does). 0 is below every key: the empty value.
__device__ __forceinline__ unsigned long long argmax_key(float v, int index) {
  unsigned int b = __float_as_uint(v);
  if (v != v) {
    b = 0x7FFFFFFFu;
  } else if (v == 0.0f) {
    b = 0u;
  }
  const unsigned int ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | static_cast<unsigned long long>(~static_cast<unsigned int>(index));
}

// The end of an emitting matvec's row group, in one warp (all 32 lanes call it): lane t with
// `valid` stores finish(v) for row `row`, input row m0 + t % MC (MC input rows from m0 at a time; MC =
// M: all), and the next norm's input normed = stored * next_w[row] (tail: the lane's, with next_w);
// partials[m * np + p] gets the sum of stored^2 over the group's rows. The sum over the rows pairs
// them as xor butterflies from the farthest, whatever MC is: an input row's partial has the same bits
// at every M.
template <int M, int EPI, bool HAS_BIAS, int MC = M, typename TO, typename TL>
__device__ __forceinline__ void emit_rows(float v, bool valid, int row, const TL& tail, TO* out, int n, float* normed,
                                          float* partials, int p, int np, int m0 = 0) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int m = m0 + lane % MC;
  float sq = 0.0f;
  if (valid) {
    const float stored = finish<EPI, HAS_BIAS>(v, tail, out, m, row, n);
    normed[static_cast<size_t>(m) * n + row] = stored * static_cast<float>(tail.next_w);
    sq = stored * stored;
  }
#pragma unroll
  for (int off = 16; off >= MC; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
  if (lane < MC) partials[static_cast<size_t>(m0 + lane) * np + p] = sq;
}

}  // namespace vc_gemv
#endif
