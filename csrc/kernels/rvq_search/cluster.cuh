// The whole run of codebooks in one launch, where our own launch runs it (MLX's cannot ask for
// clusters): a thread-block cluster of CB blocks a row, each block scoring its K / CB codewords of a
// codebook (block_best: a warp a codeword, lanes over D), putting its best key in its shared memory,
// and after a cluster barrier every block reads the CB keys (distributed shared memory), takes the
// code and forms the next residual itself. The cluster's blocks are scheduled together, so the
// barrier cannot wait on a block that never starts (a spin over global memory across blocks could
// hang). Each block first asks the L2 for its share of every codebook of the run. One launch a run
// of codebooks: a TTS frame's RVQ is one launch an unmasking iteration.
#ifndef VC_CLUSTER_HEADER
#define VC_CLUSTER_HEADER
namespace vc_cluster {
#ifdef __CUDA_ARCH__
#define VC_CLUSTER_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ unsigned int rank() {
  unsigned int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster; shared-memory writes before it are seen after it.
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The value at `p` (this block's shared memory) in block `r`'s shared memory.
__device__ __forceinline__ unsigned long long load_remote(const unsigned long long* p, unsigned int r) {
  const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(p));
  unsigned int remote;
  unsigned long long v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
  asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
#else
#define VC_CLUSTER_SMEM(name) unsigned char* name = cuda_emu::dynamic_smem()
inline unsigned int rank() { return cuda_emu::cluster_rank(); }
inline void sync() { cuda_emu::cluster_sync(); }
inline unsigned long long load_remote(const unsigned long long* p, unsigned int r) {
  return *cuda_emu::cluster_smem(p, r);
}
inline void prefetch_l2(const void*, unsigned int) {}
#endif
}  // namespace vc_cluster
#endif
