// Runs a CUDA kernel body on the CPU, to check a kernel's index math, reductions and the order of
// its shared-memory traffic where there is no GPU: one std::thread per CUDA thread of a block, the
// blocks one after another (a cluster's blocks together: its barrier and its blocks' shared memory
// are shared by them).
// __shared__ variables become function statics (shared by the block's threads; blocks do not
// overlap, so a kernel of clusters keeps its shared data in dynamic shared memory), __syncthreads a
// block barrier, __shfl_xor_sync / __shfl_sync an exchange through a warp barrier, __syncwarp a warp
// barrier, atomicAdd / atomicMax / __threadfence_block the host's atomics.
// What the GPU leaves undefined is garbage here: shared memory (static and dynamic) is filled with
// fresh garbage at every block's start, so nothing a block wrote is there for the next; a bulk copy
// (cp.async.bulk) fills its destination with garbage when it is issued and writes its bytes only when
// a thread waits on its mbarrier's phase; a copy into shared memory the block's threads have used
// (read after an earlier copy landed, or written) needs a fence.proxy.async by the issuing thread
// after that use, or the emulation aborts. The statics are found through the cuda_emu_shared section
// (tests/data/cuda_emu/shared.ld collects the kernels' statics, namespace cuda_emu_kernels, there).
// Only what our kernel sources use is here. Hardware facts (alignment faults, caching, timing)
// are not modelled.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

using std::int32_t;
using std::int64_t;
using std::size_t;
using std::uint32_t;
using std::uint8_t;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct Dim3 {
  unsigned int x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx;
inline thread_local Dim3 blockIdx;
inline Dim3 gridDim;
inline Dim3 blockDim;

struct uint4 {
  unsigned int x, y, z, w;
};
struct uint2 {
  unsigned int x, y;
};
struct float4 {
  float x, y, z, w;
};
struct float2 {
  float x, y;
};

inline float __uint_as_float(unsigned int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int v;
  std::memcpy(&v, &f, 4);
  return v;
}
inline float __int_as_float(int v) { return __uint_as_float(static_cast<unsigned int>(v)); }
// fmaf (fused, as CUDA's) and the other float functions the kernels call (expf, log1pf, tanhf, ...): <cmath>'s
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }  // CUDA: an approximation within 2 ulp
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
template <typename T>
inline T __ldcs(const T* p) {
  return *p;
}

struct __nv_bfloat16 {
  unsigned short bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {  // round to nearest even, as __float2bfloat16
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0;
    } else {
      bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const { return __uint_as_float(static_cast<unsigned int>(bits) << 16); }
};

struct __half {
  _Float16 v;
  __half() = default;
  __half(float f) : v(static_cast<_Float16>(f)) {}
  operator float() const { return static_cast<float>(v); }
};
struct __half2 {
  __half x, y;
};
inline float2 __half22float2(__half2 h) { return {static_cast<float>(h.x), static_cast<float>(h.y)}; }

// The kernels' __shared__ statics (shared.ld places them between these).
extern "C" unsigned char __start_cuda_emu_shared[], __stop_cuda_emu_shared[];

namespace cuda_emu {

constexpr size_t kDynamicSmem = 232448;  // a block's most dynamic shared memory on sm_90

// Garbage: xorshift bytes from `seed`, different for every block.
inline void fill_garbage(void* p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  auto* out = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out + i, &x, std::min<size_t>(8, n - i));
  }
}

// The order of events in a launch (copies landing, fences), for the proxy-fence check.
inline std::atomic<uint64_t> clock{1};
inline thread_local uint64_t fence_time = 0;  // this CUDA thread's last fence.proxy.async

// An mbarrier: its completed phases, the arrivals its current phase still expects (one: mbarrier.init
// with a count of 1), the bytes its copies still owe, and those copies, in flight until a wait.
struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  unsigned int bytes;
};
struct Mbarrier {
  uint64_t completed = 0;
  int arrivals = 1;
  int64_t tx = 0;
  std::vector<Copy> copies;
};

struct alignas(128) Bytes {
  unsigned char at[kDynamicSmem];
};

struct Block {
  Block(int threads, uint64_t seed) : bar(threads), dynamic(new Bytes), seen(new Bytes) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
    fill_garbage(smem(), kDynamicSmem, seed);
    std::memcpy(seen->at, smem(), kDynamicSmem);
  }
  unsigned char* smem() { return dynamic->at; }  // the block's dynamic shared memory
  struct Warp {
    std::barrier<> bar{32};
    unsigned long long slot[32];
    unsigned int frag[32][6];  // mma operands: each lane's A (4 words) and B (2)
  };
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  std::unique_ptr<Bytes> dynamic;
  // Bulk copies: the barriers by address, the dynamic shared memory as the last copy that landed left
  // each byte (or as it started), and when each copy destination last landed.
  std::mutex mu;
  std::vector<std::pair<const void*, Mbarrier>> mbarriers;
  std::unique_ptr<Bytes> seen;
  struct Landed {
    size_t lo, hi;
    uint64_t time;
  };
  std::vector<Landed> landed;
  uint64_t start = clock++;
};
inline thread_local Block* block = nullptr;  // the calling CUDA thread's block

struct Cluster {
  Cluster(int threads, std::vector<Block*> members) : bar(threads), blocks(std::move(members)) {}
  std::barrier<> bar;
  std::vector<Block*> blocks;
};
inline thread_local Cluster* cluster = nullptr;
inline thread_local unsigned int rank_in_cluster = 0;

// Launch `kernel` over `blocks` blocks of `threads` threads (threads a multiple of 32), in clusters
// of `cluster_size` consecutive blocks (blocks a multiple of it), each cluster's threads at once.
// Every block starts with garbage in its shared memory (its statics too: blocks do not overlap).
inline void launch(int blocks, int threads, const std::function<void()>& kernel, int cluster_size = 1) {
  gridDim.x = blocks;
  blockDim.x = threads;
  for (int first = 0; first < blocks; first += cluster_size) {
    fill_garbage(__start_cuda_emu_shared, __stop_cuda_emu_shared - __start_cuda_emu_shared, 2 * first + 1);
    std::vector<std::unique_ptr<Block>> own;
    std::vector<Block*> members;
    for (int r = 0; r < cluster_size; ++r) {
      own.push_back(std::make_unique<Block>(threads, 2 * (first + r)));
      members.push_back(own.back().get());
    }
    Cluster group(cluster_size * threads, members);
    std::vector<std::thread> pool;
    for (int r = 0; r < cluster_size; ++r) {
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, r, t] {
          block = members[r];
          cluster = &group;
          rank_in_cluster = static_cast<unsigned int>(r);
          blockIdx.x = first + r;
          threadIdx.x = t;
          kernel();
        });
      }
    }
    for (auto& th : pool) th.join();
  }
}

inline unsigned int cluster_rank() { return rank_in_cluster; }
// barrier.cluster: every thread of the cluster's blocks
inline void cluster_sync() { cluster->bar.arrive_and_wait(); }
// `p` (in this block's dynamic shared memory) in block `r`'s: distributed shared memory
template <typename T>
inline const T* cluster_smem(const T* p, unsigned int r) {
  const auto offset = reinterpret_cast<const unsigned char*>(p) - block->smem();
  return reinterpret_cast<const T*>(cluster->blocks[r]->smem() + offset);
}

}  // namespace cuda_emu

inline void __syncthreads() { cuda_emu::block->bar.arrive_and_wait(); }

namespace cuda_emu {
inline unsigned char* dynamic_smem() { return block->smem(); }

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_emu: block %u thread %u: %s\n", blockIdx.x, threadIdx.x, what);
  std::abort();
}

// The calling block's mbarrier at `bar` (the block's lock held).
inline Mbarrier& mbarrier(const void* bar) {
  for (auto& [at, m] : block->mbarriers) {
    if (at == bar) return m;
  }
  fail("an mbarrier used before mbarrier.init");
}

// The phase's copies land: their bytes written, what they owe paid, and with no arrival left the
// phase completes (the block's lock held).
inline void land(Mbarrier& m) {
  for (const Copy& c : m.copies) {
    std::memcpy(c.dst, c.src, c.bytes);
    const size_t lo = c.dst - block->smem();
    if (lo < kDynamicSmem) {
      std::memcpy(block->seen->at + lo, c.dst, c.bytes);
      const uint64_t now = clock++;
      auto& landed = block->landed;
      const auto same = std::find_if(landed.begin(), landed.end(), [&](const Block::Landed& l) { return l.lo == lo; });
      if (same != landed.end()) {
        *same = {lo, lo + c.bytes, now};
      } else {
        landed.push_back({lo, lo + c.bytes, now});
      }
    }
    m.tx -= c.bytes;
  }
  m.copies.clear();
  if (m.arrivals == 0 && m.tx == 0) {
    ++m.completed;
    m.arrivals = 1;
  }
}

// mbarrier.init.shared::cta.b64 [bar], 1
inline void mbarrier_init(unsigned long long* bar) {
  std::lock_guard<std::mutex> lock(block->mu);
  *bar = 0;
  for (auto& [at, m] : block->mbarriers) {
    if (at == bar) {
      m = Mbarrier{};
      return;
    }
  }
  block->mbarriers.emplace_back(bar, Mbarrier{});
}

// mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], bytes: the phase owes `bytes` more, and the
// calling thread arrives.
inline void mbarrier_expect_tx(unsigned long long* bar, unsigned int bytes) {
  std::lock_guard<std::mutex> lock(block->mu);
  Mbarrier& m = mbarrier(bar);
  if (m.arrivals == 0) fail("an arrival on an mbarrier whose phase expects none");
  m.tx += bytes;
  --m.arrivals;
  if (m.arrivals == 0 && m.tx == 0) {
    ++m.completed;
    m.arrivals = 1;
  }
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], bytes, [bar]: in
// flight (dst garbage) until a thread waits on the barrier. Into bytes the block's threads have
// used (read since an earlier copy landed there, or written since the block started), the issuing
// thread must have fenced the async proxy (fence.proxy.async) after that use.
inline void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  std::lock_guard<std::mutex> lock(block->mu);
  Mbarrier& m = mbarrier(bar);
  auto* d = static_cast<unsigned char*>(dst);
  const size_t lo = d - block->smem();
  if (lo < kDynamicSmem) {
    if (lo + bytes > kDynamicSmem) fail("a bulk copy past the dynamic shared memory");
    uint64_t used = std::memcmp(d, block->seen->at + lo, bytes) != 0 ? block->start : 0;
    for (const Block::Landed& l : block->landed) {
      if (l.lo < lo + bytes && lo < l.hi) used = std::max(used, l.time);
    }
    if (used > fence_time) fail("a bulk copy into shared memory the threads have used, with no fence.proxy.async since");
  }
  fill_garbage(d, bytes, clock++);
  if (lo < kDynamicSmem) std::memcpy(block->seen->at + lo, d, bytes);
  m.copies.push_back({d, static_cast<const unsigned char*>(src), bytes});
}

// mbarrier.try_wait.parity until the phase of that parity is complete; the waiting thread lands the
// barrier's copies in flight. A phase still open after a minute has nothing left to complete it (on
// the GPU: a hang).
inline void mbarrier_wait(unsigned long long* bar, unsigned int parity) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    {
      std::lock_guard<std::mutex> lock(block->mu);
      Mbarrier& m = mbarrier(bar);
      if ((m.completed & 1u) != parity) return;
      land(m);
      if ((m.completed & 1u) != parity) return;
    }
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
      fail("an mbarrier wait whose phase never completes");
    }
    std::this_thread::yield();
  }
}

// fence.proxy.async.shared::cta: the calling thread's earlier use of shared memory ordered before its
// later bulk copies.
inline void fence_proxy_async() { fence_time = clock++; }
}  // namespace cuda_emu

namespace cuda_emu {
// Every lane of the warp deposits v, then reads lane `src`'s.
template <typename T>
inline T warp_exchange(T v, int src) {
  static_assert(sizeof(T) <= 8, "up to 64-bit values");
  auto& w = *block->warps[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  std::memcpy(&w.slot[lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &w.slot[src & 31], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}
}  // namespace cuda_emu

namespace cuda_emu {
// mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 for the calling warp (A unsigned, B signed),
// fragments as PTX lays them out (lane 4g + t): A (16x32) a[0] rows g, a[1] rows
// g + 8 at columns 4t..4t+3, a[2] / a[3] the same at columns 16 + 4t..; B (32x8) b[0] rows
// 4t..4t+3, b[1] rows 16 + 4t.. of column g; D (16x8 s32) d[0], d[1] row g columns 2t, 2t + 1,
// d[2], d[3] row g + 8.
inline void mma_m16n8k32_u8s8(int* d, const unsigned int* a, const unsigned int* b) {
  auto& w = *block->warps[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < 4; ++i) w.frag[lane][i] = a[i];
  w.frag[lane][4] = b[0];
  w.frag[lane][5] = b[1];
  w.bar.arrive_and_wait();
  auto byte = [](unsigned int word, int k, bool is_signed) {
    const unsigned int v = (word >> (8 * (k % 4))) & 0xFFu;
    return is_signed ? static_cast<int>(static_cast<signed char>(v)) : static_cast<int>(v);
  };
  auto A = [&](int row, int k) {
    return byte(w.frag[(row % 8) * 4 + (k % 16) / 4][(row >= 8 ? 1 : 0) + (k >= 16 ? 2 : 0)], k, false);
  };
  auto B = [&](int k, int col) { return byte(w.frag[col * 4 + (k % 16) / 4][4 + (k >= 16 ? 1 : 0)], k, true); };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    int sum = 0;
    for (int k = 0; k < 32; ++k) sum += A(g + (i >= 2 ? 8 : 0), k) * B(k, 2 * t + (i & 1));
    d[i] += sum;
  }
  w.bar.arrive_and_wait();
}
}  // namespace cuda_emu

// A warp barrier that also orders the lanes' memory accesses, as on the GPU.
inline void __syncwarp(unsigned int = 0xffffffffu) { cuda_emu::block->warps[threadIdx.x / 32]->bar.arrive_and_wait(); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}

template <typename T>
inline T __shfl_xor_sync(unsigned int, T v, int offset) {
  return cuda_emu::warp_exchange(v, (threadIdx.x % 32) ^ offset);
}

template <typename T>
inline T __shfl_sync(unsigned int, T v, int src) {
  return cuda_emu::warp_exchange(v, src);
}
