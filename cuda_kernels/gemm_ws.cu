// out[M, N] (bf16) = epilogue(A[M, K] @ W[N_w, K]^T), fp32 accumulation: a warp-specialized persistent GEMM (sm_90a).
//
// Why by hand: Triton 3.6 warp-specializes on Blackwell only, and the prefix's bf16 GEMMs sit at ~600 TFLOP/s in
// Triton against cuBLAS's ~700. The Hopper recipe: one producer thread keeps a ring of TMA-loaded k-chunks full
// while two consumer warpgroups run wgmma on them, so loads never wait behind MMAs and MMAs never behind loads.
//
// Grid: one CTA per SM (gridDim.x, chosen by the launcher). Block: 384 threads (three warpgroups).
//   warpgroups 0, 1  consumers (setmaxnreg up to 232): warpgroup c computes rows [64c, 64c + 64) of the CTA's
//                    128 x BLOCK_N tile with wgmma m64nBLOCK_Nk16 (both operands from shared memory), then runs the
//                    epilogue straight from its accumulators to global memory (masked at the M / N tails)
//   warpgroup 2      producer (setmaxnreg down to 40): its first thread TMA-loads the A (128 x 64) and W
//                    (BLOCK_N x 64) k-chunks of every tile into a STAGES-deep ring, 128-byte swizzled
// Ring hand-off: full[s] completes when the stage's TMA bytes land (expect_tx); empty[s] when each of the 8 consumer
// warps has seen the wgmmas reading that stage complete (an arrive a warp, after its own wgmma.wait_group).
// Both sides walk the same tile sequence, so one running (stage, phase) pair each keeps them in step.
// Tiles: t = blockIdx.x, blockIdx.x + gridDim.x, ... over a grouped raster (GROUP_M row tiles share a column sweep,
// so a wave's W columns and A rows stay in L2); gemm_ws.py's `tile_order` is the same formula, tested on the CPU.
// Tails: TMA zero-fills loads outside [M, K] / [N_w, K] (so a K tail adds zeros: K need only be a multiple of 8,
// TMA's 16-byte row-stride rule), and the epilogue stores only rows < M, columns < N (N a multiple of 8).
//
// Compile-time options (-D, gemm_ws.py's Variant.defines):
//   BLOCK_N   128 | 256 accumulator columns a tile (wgmma N)
//   STAGES    ring depth (STAGES x (16 KB + BLOCK_N x 128 B) of shared memory)
//   HAS_BIAS  + bias[N] (bf16); with GATED bias holds 2N values, gate then up, as W's rows
//   RESIDUAL  out += ..., reading out before writing it (Gemma's o_proj / down with the residual stream)
//   GATED     W = [gate rows; up rows] (N_w = 2N): a tile loads gate rows [n0, n0 + BLOCK_N/2) and up rows
//             [N + n0, ...) into one W page, so a thread holds gate and up of the same output column and the
//             epilogue is gelu_tanh(gate) * up, the formula of triton_kernels/gemm_epilogue.py (BLOCK_N/2 outputs)

#include <cuda_bf16.h>
#include <stddef.h>
#include <stdint.h>

#ifndef BLOCK_N
#error "compile with gemm_ws.py's Variant.defines (-DBLOCK_N=... -DSTAGES=...)"
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef RESIDUAL
#define RESIDUAL 0
#endif
#ifndef GATED
#define GATED 0
#endif

namespace {

constexpr int BLOCK_M = 128;
constexpr int BLOCK_K = 64;  // one 128-byte swizzle row of bf16
constexpr int ACC = BLOCK_N / 2;  // fp32 accumulators a consumer thread: 64 x BLOCK_N over 128 threads
constexpr int OUT_N = GATED ? BLOCK_N / 2 : BLOCK_N;  // output columns a tile
constexpr int A_BYTES = BLOCK_M * BLOCK_K * 2;
constexpr int W_BYTES = BLOCK_N * BLOCK_K * 2;
constexpr int STAGE_BYTES = A_BYTES + W_BYTES;
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_THREAD = 256;
static_assert(BLOCK_N == 128 || BLOCK_N == 256, "BLOCK_N is 128 or 256");
static_assert(STAGES >= 2 && STAGES <= 8, "2..8 stages");
static_assert(STAGES * STAGE_BYTES + 1024 + 2 * STAGES * 8 <= 232448, "ring exceeds Hopper's 227 KB");

struct alignas(64) TmaMap {
  uint64_t words[16];  // a CUtensorMap, encoded on the host (driver.tensor_map_3d_bf16)
};

// gemm_ws.py's Params, field for field (320 bytes; a CPU test compares the offsets)
struct Params {
  TmaMap a_map;  // A: (K, M, 1), boxes of 64 x 128
  TmaMap w_map;  // W: (K, N_w, 1), boxes of 64 x BLOCK_N (GATED: 64 x BLOCK_N/2)
  __nv_bfloat16* out;  // (M, N), row stride N
  const __nv_bfloat16* bias;  // (N,) or, GATED, (2N,); unused without HAS_BIAS
  int m, n, k, group_m;  // n: output columns
};
static_assert(sizeof(Params) == 320 && offsetof(Params, out) == 256 && offsetof(Params, m) == 272, "Params layout");

#include "ptx.cuh"  // PTX wrappers (mbarrier, TMA, wgmma)

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  const uint32_t addr = smem_addr(bar);
  while (!mbar_try_wait_at(addr, parity)) {
  }
}

// grouped raster: GROUP_M row tiles sweep the columns together (tile_order in gemm_ws.py)
__device__ __forceinline__ void tile_at(int t, int tiles_m, int tiles_n, int group_m, int& m0, int& n0) {
  const int per_group = group_m * tiles_n;
  const int first_m = (t / per_group) * group_m;
  const int rows = min(tiles_m - first_m, group_m);
  const int local = t % per_group;
  m0 = (first_m + local % rows) * BLOCK_M;
  n0 = (local / rows) * OUT_N;
}

struct Ring {
  uint8_t* base;  // STAGES x (A page, W page), 1024-byte aligned (the swizzle pattern's period)
  uint64_t* full;
  uint64_t* empty;
  __device__ uint8_t* a_page(int s) const { return base + s * STAGE_BYTES; }
  __device__ uint8_t* w_page(int s) const { return base + s * STAGE_BYTES + A_BYTES; }
};

__device__ void producer(const Params& p, const Ring& r, int tiles_m, int tiles_n) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(&p.a_map) : "memory");
  asm volatile("prefetch.tensormap [%0];" ::"l"(&p.w_map) : "memory");
  const int nk = (p.k + BLOCK_K - 1) / BLOCK_K;
  int stage = 0;
  unsigned phase = 0;
  for (int t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
    int m0, n0;
    tile_at(t, tiles_m, tiles_n, p.group_m, m0, n0);
    for (int kc = 0; kc < nk; ++kc) {
      mbar_wait(&r.empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once: the ring starts empty
      mbar_expect_tx(&r.full[stage], STAGE_BYTES);  // out-of-bounds box elements count too (zero-filled)
      tma_load_3d(r.a_page(stage), &p.a_map, kc * BLOCK_K, m0, 0, &r.full[stage]);
      if (GATED) {
        tma_load_3d(r.w_page(stage), &p.w_map, kc * BLOCK_K, n0, 0, &r.full[stage]);
        tma_load_3d(r.w_page(stage) + W_BYTES / 2, &p.w_map, kc * BLOCK_K, p.n + n0, 0, &r.full[stage]);
      } else {
        tma_load_3d(r.w_page(stage), &p.w_map, kc * BLOCK_K, n0, 0, &r.full[stage]);
      }
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
}

__device__ __forceinline__ void mma_chunk(float (&acc)[ACC], uint32_t a_page, uint32_t w_page, bool first) {
#pragma unroll
  for (int kk = 0; kk < BLOCK_K / 16; ++kk) {  // k16 steps: 32 bytes along the swizzled 128-byte rows
    const uint64_t da = sw128_desc(a_page + kk * 32, 16, 1024);
    const uint64_t db = sw128_desc(w_page + kk * 32, 16, 1024);
#if BLOCK_N == 256
    wgmma_n256_ss(acc, da, db, !first || kk != 0);
#else
    wgmma_n128_ss(acc, da, db, !first || kk != 0);
#endif
  }
}

// Triton's fp32 exp (ex2.approx, without flush-to-zero, of x times log2(e) rounded to fp32) and fp32 '/' (div.full),
// so the gate below rounds as gemm_epilogue.py's gelu_tanh does
__device__ __forceinline__ float exp_as_triton(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
__device__ __forceinline__ float div_as_triton(float a, float b) {
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// gemm_epilogue.py's gelu_tanh, operation for operation: x * sigmoid(2u), sigmoid(v) = 1 / (1 + exp(-v)). Whether
// both compilers contract x + 0.044715 x^3 into the same fma is not checked: an fp32 ulp, rarely a bf16 one.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x * div_as_triton(1.0f, 1.0f + exp_as_triton(-(2.0f * u)));
}

// acc element 4i + 2h + e sits at row (16 warp + g + 8h), column 8i + 2 t4 + e of the warpgroup's 64 x BLOCK_N block
__device__ __forceinline__ void epilogue(const Params& p, const float (&acc)[ACC], int row0, int n0, int t4) {
#pragma unroll
  for (int i = 0; i < OUT_N / 8; ++i) {
    const int col = n0 + 8 * i + 2 * t4;
    if (col >= p.n) continue;  // N is a multiple of 8, so col + 1 < N too
    float b0 = 0.f, b1 = 0.f, bu0 = 0.f, bu1 = 0.f;
    if (HAS_BIAS) {
      const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(p.bias + col);
      b0 = __low2float(b), b1 = __high2float(b);
      if (GATED) {
        const __nv_bfloat162 bu = *reinterpret_cast<const __nv_bfloat162*>(p.bias + p.n + col);
        bu0 = __low2float(bu), bu1 = __high2float(bu);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      if (row >= p.m) continue;
      float v0 = acc[4 * i + 2 * h] + b0, v1 = acc[4 * i + 2 * h + 1] + b1;
      if (GATED) {  // the up column sits OUT_N columns (ACC / 2 registers) after its gate column
        v0 = gelu_tanh(v0) * (acc[ACC / 2 + 4 * i + 2 * h] + bu0);
        v1 = gelu_tanh(v1) * (acc[ACC / 2 + 4 * i + 2 * h + 1] + bu1);
      }
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(p.out + (size_t)row * p.n + col);
      if (RESIDUAL) {
        const __nv_bfloat162 res = *dst;
        v0 += __low2float(res);
        v1 += __high2float(res);
      }
      *dst = __floats2bfloat162_rn(v0, v1);
    }
  }
}

__device__ void consumer(const Params& p, const Ring& r, int tiles_m, int tiles_n) {
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int nk = (p.k + BLOCK_K - 1) / BLOCK_K;
  float acc[ACC];
#pragma unroll
  for (int j = 0; j < ACC; ++j) acc[j] = 0.f;
  int stage = 0;
  unsigned phase = 0;
  for (int t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
    int m0, n0;
    tile_at(t, tiles_m, tiles_n, p.group_m, m0, n0);
    int prev = -1;
    for (int kc = 0; kc < nk; ++kc) {
      mbar_wait(&r.full[stage], phase);
      wgmma_fence();
      mma_chunk(acc, smem_addr(r.a_page(stage)) + wg * 64 * 128, smem_addr(r.w_page(stage)), kc == 0);
      wgmma_commit();
      if (prev >= 0) {  // one chunk's MMAs stay in flight; the one before has finished reading its stage
        wgmma_wait<1>();
        if (lane == 0) mbar_arrive(&r.empty[prev]);
      }
      prev = stage;
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    fence_regs(acc);
    if (lane == 0) mbar_arrive(&r.empty[prev]);
    epilogue(p, acc, m0 + wg * 64 + warp * 16 + lane / 4, n0, lane % 4);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(384, 1) gemm_ws_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  Ring r;
  r.base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // the launcher asks for 1 KB extra
  r.full = reinterpret_cast<uint64_t*>(r.base + STAGES * STAGE_BYTES);
  r.empty = r.full + STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&r.full[s], 1);
      mbar_init(&r.empty[s], CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int tiles_m = (p.m + BLOCK_M - 1) / BLOCK_M, tiles_n = (p.n + OUT_N - 1) / OUT_N;
  if (threadIdx.x >= PRODUCER_THREAD) {  // the producer warpgroup gives its registers to the consumers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == PRODUCER_THREAD) producer(p, r, tiles_m, tiles_n);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  consumer(p, r, tiles_m, tiles_n);
}
