// The bandwidth ceilings the persistent expert kernel designs against (tools/bandwidth_probe.py runs it).
//
// Every CTA streams "units" the way an expert GEMM unit does: W_CHUNKS CHUNK_KB chunks of its OWN weights (a region of
// a large buffer, read once: HBM) and A_CHUNKS 8 KB chunks of ONE activation image that every CTA reads (L2
// resident), each into its own ring of shared-memory stages by 1D bulk copies completing on mbarriers. With
// MULTICAST, the activation chunks are fetched once per cluster of CLUSTER CTAs: chunk c is issued by the CTA of
// rank c % CLUSTER with `.multicast::cluster` into the same slot of every CTA of the cluster, and a slot is
// refilled only after every CTA of the cluster released it (remote mbarrier arrivals). No arithmetic: the
// consumers only wait, touch one word and release, so the time is the memory system's.
#include <stdint.h>

#ifndef CLUSTER
#define CLUSTER 1
#endif
#ifndef MULTICAST
#define MULTICAST 0
#endif

#ifndef CHUNK_KB
#define CHUNK_KB 8
#endif
#ifndef RING_KB
#define RING_KB 192  // shared memory of the two rings together (weights 7/12, activations 5/12)
#endif

namespace {
constexpr int CHUNK = CHUNK_KB * 1024;
constexpr int W_STAGES = RING_KB * 7 / 12 / CHUNK_KB;
constexpr int A_STAGES = RING_KB * 5 / 12 / CHUNK_KB;
static_assert(W_STAGES >= 2 && A_STAGES >= 2, "rings of two stages at least");

struct Params {
  const uint8_t* w;        // (ctas, w_region) bytes
  const uint8_t* a;        // A_CHUNKS x CHUNK, shared by every CTA
  unsigned* sink;          // one word per CTA (keeps the consumers' reads alive)
  long long w_region;      // bytes of weights per CTA (a multiple of CHUNK)
  int units;
  int w_chunks;
  int a_chunks;
  int pad;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes) : "memory");
}

// arrive on the barrier at the same offset in the CTA of cluster rank `rank` (this CTA's own included)
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, unsigned rank) {
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
      "r"(rank) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT;\n}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void bulk_copy_multicast(void* dst, const void* src, unsigned bytes, uint64_t* bar,
                                                    uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
      "%4;" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "h"(mask) : "memory");
}

struct Ring {
  uint8_t* data;
  uint64_t* full;
  uint64_t* empty;
};
}  // namespace

// 128 threads: warp 0 lane 0 weight producer, warp 1 lane 0 activation producer, warp 2 lane 0 weight consumer,
// warp 3 lane 0 activation consumer
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(128, 1)
    bandwidth_probe(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  Ring w{smem, nullptr, nullptr}, a{smem + W_STAGES * CHUNK, nullptr, nullptr};
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + (W_STAGES + A_STAGES) * CHUNK);
  w.full = bars;
  w.empty = w.full + W_STAGES;
  a.full = w.empty + W_STAGES;
  a.empty = a.full + A_STAGES;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned rank = cluster_rank();
  if (threadIdx.x == 0) {
    for (int i = 0; i < W_STAGES; ++i) {
      mbar_init(&w.full[i], 1);
      mbar_init(&w.empty[i], 1);
    }
    for (int i = 0; i < A_STAGES; ++i) {
      mbar_init(&a.full[i], 1);
      mbar_init(&a.empty[i], MULTICAST ? CLUSTER : 1);  // every CTA of the cluster releases a multicast slot
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();
  const long long w_total = (long long)p.units * p.w_chunks, a_total = (long long)p.units * p.a_chunks;
  if (lane == 0) {
    if (warp == 0) {  // weights: this CTA's region, read front to back, wrapping
      const uint8_t* base = p.w + blockIdx.x * p.w_region;
      const long long region_chunks = p.w_region / CHUNK;
      for (long long i = 0; i < w_total; ++i) {
        const int s = (int)(i % W_STAGES);
        if (i >= W_STAGES) mbar_wait(&w.empty[s], ((i / W_STAGES) - 1) & 1);
        mbar_expect_tx(&w.full[s], CHUNK);
        bulk_copy(w.data + s * CHUNK, base + (i % region_chunks) * CHUNK, CHUNK, &w.full[s]);
      }
    } else if (warp == 1) {  // activations: chunk c of every unit, all CTAs the same bytes
      for (long long i = 0; i < a_total; ++i) {
        const int s = (int)(i % A_STAGES);
        const int c = (int)(i % p.a_chunks);
        if (i >= A_STAGES) mbar_wait(&a.empty[s], ((i / A_STAGES) - 1) & 1);
        mbar_expect_tx(&a.full[s], CHUNK);
        if (!MULTICAST) {
          bulk_copy(a.data + s * CHUNK, p.a + (size_t)c * CHUNK, CHUNK, &a.full[s]);
        } else if (c % CLUSTER == (int)rank) {
          bulk_copy_multicast(a.data + s * CHUNK, p.a + (size_t)c * CHUNK, CHUNK, &a.full[s],
                              (uint16_t)((1u << CLUSTER) - 1));
        }
      }
    } else {  // consumers
      Ring& r = warp == 2 ? w : a;
      const int stages = warp == 2 ? W_STAGES : A_STAGES;
      const long long total = warp == 2 ? w_total : a_total;
      unsigned acc = 0;
      for (long long i = 0; i < total; ++i) {
        const int s = (int)(i % stages);
        mbar_wait(&r.full[s], (i / stages) & 1);
        acc += *reinterpret_cast<volatile unsigned*>(r.data + s * CHUNK + (i % 64) * 128);
        if (warp == 3 && MULTICAST) {
          for (unsigned q = 0; q < CLUSTER; ++q) mbar_arrive_cluster(&r.empty[s], q);
        } else {
          mbar_arrive_cluster(&r.empty[s], rank);
        }
      }
      atomicAdd(p.sink + blockIdx.x, acc);
    }
  }
  __syncwarp();
  cluster_sync();  // no CTA leaves while a peer may still write its shared memory or arrive on its barriers
}
