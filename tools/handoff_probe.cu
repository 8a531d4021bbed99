// The floor under a persistent kernel's hand-offs on this GPU (tools/handoff_probe.py runs it; docs/cuda_expert.md).
//
// A chain of `stages` dependent stages over every CTA (one a SM, all resident). At each stage every CTA stores its
// own tile (`words` 16-byte words) to global memory, then adds 1 to its group's counter with release semantics
// (after a CTA barrier: the persistent expert's pattern). At the next stage it polls, with acquire semantics, the
// counter of ANOTHER group of `fan_in` CTAs (other SMs) until all of them arrived, reads their tiles through L2, and
// only then stores its own. fan_in == gridDim.x makes every stage a grid-wide barrier (an expert stage waits for
// every producer of the tensor it reads); fan_in == 1 a point-to-point chain. No weights and no MMAs: the time a
// stage is the hand-off latency plus the tile bytes, the floor under any design with that many hand-offs a step.
//
// How a consumer reads (-DBULK): 0, every thread loads 16-byte words through L2 (`ld.global.cg`), which keeps only a
// few loads in flight a thread, so its rate is the probe's, not the memory system's (H200: 128 KB in ~15 µs);
// 1, thread 0 issues 1D bulk copies of up to BULK_CHUNK bytes into shared memory on one mbarrier after a
// `fence.proxy.async` (the expert kernel's activation path), and every thread waits for the bytes.
//
// The ring inside a CTA (-DRING_PAGES=n, 0: none): the expert kernel moves every 8 KB weight page from its loader
// warp to its consumers through a ring of RING_SLOTS mbarrier slots (the loader waits for a slot's `empty`, arrives
// on its `full`; the consumers wait for `full`, then each consumer warp arrives on `empty`, as each of the kernel's
// warpgroups does once its MMAs are done), n pages a GEMM unit. With n > 0 the
// block has a loader warp beside the 128 consumers; it runs ahead across stages as the kernel's weight loader does
// (no copies: the hand-offs alone), and each stage's consumers take n pages after their read. RING_CHECKS says who
// polls as the kernel's `wait_barrier` does (every 16th poll reads the global timer and a global error word): bit 1
// the consumers, bit 2 the loader; the others spin on `mbarrier.try_wait` alone. The difference between n = 16 and
// n = 0 is what the ring costs a 16-chunk unit.
//
// Launch e waits for fan_in x (e + 1) on counters zeroed once (the host passes e), so nothing is reset between
// launches. Tiles are double-buffered by stage parity; a slow reader can see a tile of a later stage (the values
// are not checked: the probe times the protocol, the expert kernel's tests check data).
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef BULK
#define BULK 0
#endif
#ifndef BULK_CHUNK
#define BULK_CHUNK 32768
#endif
#ifndef RING_PAGES
#define RING_PAGES 0
#endif
#ifndef RING_CHECKS
#define RING_CHECKS 3
#endif
#define RING_SLOTS 15
#define CONSUMERS 128

namespace {
#include "../cuda_kernels/ptx.cuh"

struct Params {
  unsigned* counters;  // stages x groups, zeroed once
  uint4* tiles;        // 2 x ctas x words
  unsigned* sink;      // one word a CTA: keeps the reads alive
  int stages;
  int fan_in;          // CTAs a group; divides gridDim.x
  int words;           // 16-byte words a CTA stores a stage (a consumer reads fan_in x words)
  unsigned epoch;      // this launch's index
};

// bar.sync over the consumers only (the ring's loader warp runs its own loop)
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

// waits for `bar`'s phase `parity` as the expert kernel's wait_barrier does (CHECKS) or by try_wait alone
template <bool CHECKS>
__device__ __forceinline__ void ring_wait(uint64_t* bar, unsigned parity, const unsigned* error) {
  for (unsigned it = 0;; ++it) {
    if (mbar_try_wait(bar, parity)) return;
    if (CHECKS && (it & 15) == 15) {
      if (global_timer() == 0 || *(volatile const unsigned*)error == 0x9e3779b9u) return;  // practically never
    }
  }
}

// the ring's loader: `pages` hand-offs a stage for `stages` stages, as far ahead as the slots allow
__device__ void ring_loader(uint64_t* full, uint64_t* empty, long long pages, const unsigned* error) {
  for (long long i = 0; i < pages; ++i) {
    const int slot = (int)(i % RING_SLOTS);
    const unsigned use = (unsigned)(i / RING_SLOTS);
    if (use > 0) ring_wait<(RING_CHECKS & 2) != 0>(&empty[slot], (use & 1) ^ 1, error);
    mbar_arrive(&full[slot]);
  }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32) handoff_probe(Params p) {
  const int cta = blockIdx.x, ctas = gridDim.x, groups = ctas / p.fan_in, group = cta / p.fan_in;
  const size_t buffer = (size_t)ctas * p.words;
  unsigned acc = 0;
#if BULK
  extern __shared__ __align__(128) uint4 landing[];  // fan_in x words 16-byte words (dynamic shared memory)
  __shared__ uint64_t arrived;
  unsigned phase = 0;
#endif
#if RING_PAGES
  __shared__ uint64_t full[RING_SLOTS], empty[RING_SLOTS];
  long long taken = 0;  // ring pages the consumers took so far
#endif
  if (threadIdx.x == 0) {
#if BULK
    mbar_init(&arrived, 1);
#endif
#if RING_PAGES
    for (int i = 0; i < RING_SLOTS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], CONSUMERS / 32);  // every consumer warp releases: none can be a phase behind
    }
#endif
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= CONSUMERS) {  // the ring's loader warp (launched with RING_PAGES only)
#if RING_PAGES
    if (threadIdx.x == CONSUMERS) ring_loader(full, empty, (long long)p.stages * RING_PAGES, p.sink);
#endif
    return;
  }
  for (int s = 0; s < p.stages; ++s) {
    if (s > 0) {  // the previous stage's tiles of the next group's CTAs
      const int src = (group + 1) % groups;
      if (threadIdx.x == 0) {
        const unsigned* counter = p.counters + (size_t)(s - 1) * groups + src;
        const unsigned target = (unsigned)p.fan_in * (p.epoch + 1);
        while (load_acquire(counter) < target) {
        }
      }
      consumers_sync();
      const uint4* theirs = p.tiles + ((s - 1) & 1) * buffer + (size_t)src * p.fan_in * p.words;
#if BULK
      const unsigned bytes = (unsigned)p.fan_in * p.words * 16;
      if (bytes > 0) {
        if (threadIdx.x == 0) {
          fence_proxy_async_global();  // the producers' generic-proxy stores, for the async proxy's reads
          mbar_expect_tx(&arrived, bytes);
          for (unsigned off = 0; off < bytes; off += BULK_CHUNK)
            bulk_copy((uint8_t*)landing + off, (const uint8_t*)theirs + off, min(bytes - off, (unsigned)BULK_CHUNK),
                      &arrived);
        }
        while (!mbar_try_wait(&arrived, phase)) {
        }
        phase ^= 1;
        const uint4 v = landing[threadIdx.x % (p.fan_in * p.words)];
        acc += v.x ^ v.w;
        consumers_sync();  // nobody still reads the landing buffer when thread 0 issues the next stage's copies
      }
#else
      for (int i = threadIdx.x; i < p.fan_in * p.words; i += CONSUMERS) {
        const uint4 v = __ldcg(theirs + i);
        acc += v.x ^ v.w;
      }
#endif
    }
#if RING_PAGES
    for (int page = 0; page < RING_PAGES; ++page, ++taken) {  // a GEMM unit's weight pages, one hand-off each
      const int slot = (int)(taken % RING_SLOTS);
      ring_wait<(RING_CHECKS & 1) != 0>(&full[slot], (unsigned)(taken / RING_SLOTS) & 1, p.sink);
      __syncwarp();  // the warp's every thread saw the page before its lane 0 gives the slot back
      if (threadIdx.x % 32 == 0) mbar_arrive(&empty[slot]);
    }
#endif
    uint4* mine = p.tiles + (s & 1) * buffer + (size_t)cta * p.words;
    for (int i = threadIdx.x; i < p.words; i += CONSUMERS) __stcg(mine + i, make_uint4(acc + i, s, cta, acc));
    consumers_sync();
    if (threadIdx.x == 0) add_release(p.counters + (size_t)s * groups + group, 1);
  }
  if (acc == 0x9e3779b9u) p.sink[cta] = acc;  // practically never: the reads cannot be dropped
}
