// One denoising step of π0's action expert as one persistent kernel (sm_90a).
//
// Grid: one CTA per SM (the count is a launch parameter). Block: 384 threads (three warpgroups).
//   warps 0-3, 4-7  two consumer warpgroups: run the CTA's instructions in order (wgmma GEMM tiles, attention
//                   blocks, merges, the embedding); warpgroup c owns columns [32c, 32c + 32) of every 64-column
//                   GEMM tile, and head dims [128c, 128c + 128) of every attention block
//   warp 8          weight loader: streams this CTA's weight pages (pre-swizzled 8 KB images, in the order the
//                   consumers use them) into a ring of W_PAGES shared-memory pages; never waits for activations
//   warp 9          activation loader: for each instruction, waits for the counters of the activation chunks it
//                   reads, then bulk-copies them (GEMM inputs; attention K/V by TMA) into a ring of A_SLOTS slots
// Hand-offs between CTAs: counters in global memory, +1 with release semantics after a producer's stores, polled
// with acquire until they reach (epoch + 1) x T; the epoch is read at kernel start and bumped by the last CTA to
// finish, so counters never need a reset between CUDA Graph replays. Every wait is bounded (timeout_ns): on a
// timeout it records an error code and carries on, so a broken protocol ends in wrong outputs and an error flag,
// never a hang. The schedule (which CTA runs which instruction) is data built by expert_schedule.py.
//
// Compile-time shape constants come from -D flags (expert_dims.py's template_args).

#include <cuda_bf16.h>
#include <stdint.h>

#ifndef BATCH
#error "compile with the expert_dims template arguments (-DBATCH=... -DSUFFIX=... ...)"
#endif
#ifndef PI05
#define PI05 0  // π0.5: no state token, action tokens from action_in_proj, adaptive norms from the step's row
#endif
#ifndef ACC_CHAINS
#define ACC_CHAINS 1  // 2: the GEMMs accumulate even and odd k-chunks in two register sets (see mainloop)
#endif
#ifndef DIAG
#define DIAG 0  // timing attribution only (wrong outputs), bits: 1 skips the GEMMs' MMAs, 2 their weight and
#endif          // activation copies (the barriers still complete), 4 the outputs' global stores (activation
                // images, split-K partials, sums of squares; the counters still count); 0 computes the step

namespace {

constexpr int TILE = 64;
constexpr int PAGE_BYTES = TILE * TILE * 2;
constexpr int KEY_ITEM = 32;
constexpr int ROW_GROUP = 16;
constexpr int CONSUMERS = 256;
constexpr int W_LOADER_WARP = 8;
constexpr int A_LOADER_WARP = 9;
constexpr int ROWS = BATCH * SUFFIX;
constexpr int STATE_ROWS = PI05 ? 0 : 1;  // π0's suffix starts with the state token
constexpr int CHUNK = SUFFIX - STATE_ROWS;
constexpr int ACT_ROWS = BATCH * CHUNK;
constexpr int M_PAD = M_TILES * TILE;
constexpr int KEYS = PREFIX + SUFFIX;
constexpr int HALF = HEAD_DIM / 2;
constexpr int Q_WIDTH = HEADS * HEAD_DIM;
constexpr int N_KC = WIDTH / TILE;  // 64-column chunks of x
constexpr int N_SPLITS = (PREFIX + KEYS_PER_SPLIT - 1) / KEYS_PER_SPLIT + 1;
constexpr int QKV_W = Q_WIDTH + 2 * HEAD_DIM;
// π0.5's step row (vla_rt.engine.weights.Pi05Weights: segments padded to 8 floats, all multiples of 8 here): per
// layer the attention norm's scale, the QKV bias (its folded shift), the attention gate, the FFN norm's scale, the
// gate/up bias and the FFN gate; then action_out_proj (ACTION_DIM x WIDTH, the final norm folded in) and its bias
constexpr int MOD_ATTN_SCALE = 0, MOD_QKV_BIAS = WIDTH, MOD_ATTN_GATE = WIDTH + QKV_W,
              MOD_FFN_SCALE = 2 * WIDTH + QKV_W, MOD_GU_BIAS = 3 * WIDTH + QKV_W, MOD_FFN_GATE = 3 * WIDTH + QKV_W + 2 * MLP,
              MOD_LAYER = 4 * WIDTH + QKV_W + 2 * MLP, MOD_ACTION_W = DEPTH * MOD_LAYER,
              MOD_ACTION_B = MOD_ACTION_W + ACTION_DIM * WIDTH;
static_assert(WIDTH % 8 == 0 && QKV_W % 8 == 0 && (ACTION_DIM * WIDTH) % 8 == 0, "π0.5 row segments unpadded");
constexpr int X_IMG = N_KC * M_TILES * TILE * TILE;  // elements of x (and of the embedding)
constexpr int H_IMG = MLP / TILE * M_TILES * TILE * TILE;
constexpr int ATTN_IMG = HEADS * HEAD_DIM / TILE * M_TILES * TILE * TILE;
static_assert(HEAD_DIM == 256, "attention register layout assumes head_dim 256");
static_assert(SUFFIX <= TILE, "a batch's suffix must fit one 64-row tile");
static_assert(M_TILES >= 1 && M_TILES <= 8, "1..8 row tiles");
static_assert(A_SLOT_BYTES % 1024 == 0 && A_SLOT_BYTES >= KEY_ITEM * HEAD_DIM * 2, "slot holds a K/V item");
// the consumer holds WGMMA_DEPTH chunks' pages and items while their MMAs run: the rings must hold one more
static_assert(WGMMA_DEPTH >= 1 && WGMMA_DEPTH + 1 <= W_PAGES, "weight ring deeper than the MMA window");
static_assert(ACC_CHAINS == 1 || ACC_CHAINS == 2, "one or two accumulator chains");
static_assert(WGMMA_DEPTH <= A_ITEM_CHUNKS * (A_SLOTS - 1), "activation ring deeper than the MMA window");

// instruction fields (expert_schedule.py's F_*)
enum Field { F_OP, F_LAYER, F_N, F_SPLIT, F_K0, F_NK, F_IN_CNT, F_IN_DIV, F_IN_T, F_OUT_CNT, F_SK_CNT, F_SK_T,
             F_A, F_B, F_C, F_D, FIELDS };
enum Op { OP_EMBED = 1, OP_MLP_OUT, OP_QK, OP_V, OP_ATTN, OP_MERGE, OP_O, OP_GATE_UP, OP_DOWN, OP_ACTION,
          OP_ACTION_ROWS };
static_assert(FIELDS % 4 == 0, "an instruction row is whole 16-byte words");
// error codes: site << 16 | cta
enum Site { ERR_COUNTER = 1, ERR_W_FULL, ERR_W_EMPTY, ERR_A_FULL, ERR_A_EMPTY };
// profiling stamps per instruction: consumer starts it, its first input is in shared memory, its MMAs are done,
// its outputs are stored, it has signalled; the loader saw its last input counter complete
enum Stamp { T_START, T_READY, T_MMA, T_STORED, T_DONE, T_LOADER, TRACE };

struct Params {
  const int* instrs;            // (n, FIELDS)
  const int* cta_instr;         // (ctas + 1) first instruction of each CTA
  const long long* cta_page;    // (ctas + 1) first weight page of each CTA
  const uint8_t* wstream;       // the packed weight pages
  unsigned* counters;
  unsigned* epoch;
  unsigned* exit_count;
  unsigned* error;
  __nv_bfloat16* x_img;         // (N_KC, M_TILES, 64 x 64) residual stream, swizzled tiles
  __nv_bfloat16* h_img;         // (MLP / 64, M_TILES, 64 x 64)
  __nv_bfloat16* attn_img;      // (Q_WIDTH / 64, M_TILES, 64 x 64)
  __nv_bfloat16* emb_img;       // (N_KC, M_TILES, 64 x 64) action-time embedding (action rows only)
  __nv_bfloat16* q_frag;        // (BATCH, HEADS, 4, 16, 32, 8) rotated Q in wgmma A-fragment order
  float* ssq;                   // (N_KC, M_PAD) per-tile sums of squares of x's rows
  float* part_o;                // (O_SPLITS, M_PAD, WIDTH) split-K partials of O
  float* part_d;                // (DOWN_SPLITS, M_PAD, WIDTH) split-K partials of down
  float* o_part;                // (BATCH, HEADS, N_SPLITS, 64, HEAD_DIM) unnormalised attention partials
  float* ml_part;               // (BATCH, HEADS, N_SPLITS, 64, 2) running max (log2 domain) and sum
  const uint8_t* kv_maps;       // (DEPTH, 2) CUtensorMap (128 bytes each): K and V caches, 3D (dims, keys, batch)
  __nv_bfloat16* const* k_cache;  // (DEPTH) pointers to (BATCH, KEYS, HEAD_DIM)
  __nv_bfloat16* const* v_cache;
  const float* rope_cos;        // (BATCH, SUFFIX, HALF)
  const float* rope_sin;
  const int* key_block;         // (BATCH, KEYS)
  const int* query_block;       // (BATCH, SUFFIX)
  const float* state;           // (BATCH, ACTION_DIM)
  float* x_t;                   // (BATCH, CHUNK, ACTION_DIM) updated in place
  const float* w_state;         // (WIDTH, ACTION_DIM)
  const float* b_state;         // (WIDTH)
  const float* w_action_time;   // (WIDTH, ACTION_DIM)
  const float* time_bias;       // π0: (WIDTH) time-bias row; π0.5: the step's packed row (MOD_*), per batch element
                                //   b at time_bias + b * mod_stride (mod_stride 0: one row for every element)
  const float* b_mlp_out;       // (WIDTH)
  const float* b_action_out;    // (ACTION_DIM)
  float dt;
  float scale_log2;             // head_dim^-0.5 * log2(e)
  float rms_eps;
  int pad0;
  unsigned long long timeout_ns;
  unsigned long long* trace;    // (instructions, TRACE) global-timer stamps (see Stamp), or null
  long long mod_stride;         // floats between the rows of consecutive batch elements (0: shared)
  __nv_bfloat16* xs_attn_img;   // π0.5: x (1 + attention norm scale), the QKV GEMMs' input (as x_img)
  __nv_bfloat16* xs_ffn_img;    // π0.5: x (1 + FFN norm scale), gate/up's input
  const float* w_action_in;     // π0.5: (WIDTH, ACTION_DIM) action_in_proj
  const float* b_action_in;     // π0.5: (WIDTH)
};

#include "ptx.cuh"  // PTX wrappers (mbarrier, bulk copy, TMA, wgmma)
#include "attention_block.cuh"  // one attention block's S, online softmax and P V (tools/unit_probe.cu times it)

// ----- bounded waits ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void record_error(const Params& p, int site) {
  atomicCAS(p.error, 0u, (unsigned)(site << 16 | blockIdx.x));
}

// spins until counter >= target (wrap-safe); false on timeout or when another wait already failed
__device__ bool wait_counter(const Params& p, int cnt, unsigned target) {
  const unsigned* c = p.counters + cnt;
  uint64_t start = 0;
  for (unsigned it = 0;; ++it) {
    if ((int)(load_acquire(c) - target) >= 0) return true;
    if ((it & 31) == 31) {
      uint64_t now = global_timer();
      if (start == 0) start = now;
      if (now - start > p.timeout_ns) {
        record_error(p, ERR_COUNTER);
        return false;
      }
      if (*(volatile unsigned*)p.error) return false;
      if (it > 1024) __nanosleep(64);
    }
  }
}

// Waits for `bar` (by its shared-memory address) to complete phase `parity`; false on a timeout (recorded at
// `site`) or when another CTA has recorded an error.
__device__ bool wait_barrier_at(const Params& p, uint32_t bar, unsigned parity, int site) {
  uint64_t start = 0;
  for (unsigned it = 0;; ++it) {
    if (mbar_try_wait_at(bar, parity)) return true;
    if ((it & 15) == 15) {
      uint64_t now = global_timer();
      if (start == 0) start = now;
      if (now - start > p.timeout_ns) {
        record_error(p, site);
        return false;
      }
      if (*(volatile unsigned*)p.error) return false;
    }
  }
}

__device__ __forceinline__ bool wait_barrier(const Params& p, uint64_t* bar, unsigned parity, int site) {
  return wait_barrier_at(p, smem_addr(bar), parity, site);
}

// An instruction row in registers: four 16-byte loads of the read-only table, once a unit. Reading
// `ins[...]` from global memory instead costs an L2 round trip after every mbarrier / wgmma (their asm clobbers
// memory, so the compiler re-loads the field) whenever this SM's L1 no longer holds the row, and it rarely does:
// each of the activation loader's ld.acquire.gpu polls invalidates the whole L1 (CCTL.IVALL). A QK unit's epilogue
// re-reads its layer, then the layer's K cache pointer, then its output counter: dependent round trips between its
// last MMA and its release.
struct InstrRow {
  int f[FIELDS];
};

__device__ __forceinline__ InstrRow load_instr(const int* row) {
  InstrRow r;
  const int4* v = reinterpret_cast<const int4*>(row);
#pragma unroll
  for (int q = 0; q < FIELDS / 4; ++q) {
    const int4 t = __ldg(v + q);
    r.f[4 * q] = t.x;
    r.f[4 * q + 1] = t.y;
    r.f[4 * q + 2] = t.z;
    r.f[4 * q + 3] = t.w;
  }
  return r;
}

// ----- shared memory plan ----------------------------------------------------------------------------------------
struct Smem {
  uint8_t* w;        // W_PAGES x PAGE_BYTES
  uint8_t* a;        // A_SLOTS x A_SLOT_BYTES
  uint64_t* w_full;  // W_PAGES
  uint64_t* w_empty;
  uint64_t* a_full;  // A_SLOTS
  uint64_t* a_empty;
  uint64_t* rms_full;   // 2: the loader computed a unit's RMS factors
  uint64_t* rms_empty;  // 2: the consumers are done with them
  float* rms;        // 2 x M_PAD row factors (a ring of two units)
  float* red;        // 2 x M_PAD cross-warpgroup partial sums
  int* flag;         // broadcast word
};

__device__ Smem carve_smem(uint8_t* raw) {
  uint8_t* base = (uint8_t*)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  Smem s;
  s.w = base;
  s.a = s.w + W_PAGES * PAGE_BYTES;
  uint8_t* misc = s.a + A_SLOTS * A_SLOT_BYTES;
  s.w_full = (uint64_t*)misc;
  s.w_empty = s.w_full + W_PAGES;  // (the consumers address the barriers by these offsets from w_full)
  s.a_full = s.w_empty + W_PAGES;
  s.a_empty = s.a_full + A_SLOTS;
  s.rms_full = s.a_empty + A_SLOTS;
  s.rms_empty = s.rms_full + 2;
  s.rms = (float*)(s.rms_empty + 2);
  s.red = s.rms + M_PAD;
  s.flag = (int*)(s.red + 2 * M_PAD);
  static_assert((W_PAGES + A_SLOTS) * 16 + 32 + 16 * M_PAD + 16 <= 8 * 1024, "misc shared memory");
  return s;
}

// activation image: tiles [col / 64][row / 64] of 64 x 64, 16-byte units swizzled by row % 8 (expert_pack.py)
__device__ __forceinline__ int img_offset(int row, int col) {
  int r = row % TILE, u = (col % TILE) / 8;
  return ((col / TILE) * M_TILES + row / TILE) * TILE * TILE + r * TILE + ((u ^ (r % 8)) * 8) + col % 8;
}

// rotated Q in the register order wgmma wants for A (per warp 16 rows, per k16 step 4 x 32-bit per lane)
__device__ __forceinline__ int q_frag_offset(int b, int h, int t, int d) {
  int w = t / 16, r16 = t % 16, kk = d / 16, d16 = d % 16;
  int lane = (r16 % 8) * 4 + (d16 % 8) / 2;
  int reg = r16 / 8 + 2 * (d16 / 8);
  return ((((b * HEADS + h) * 4 + w) * 16 + kk) * 32 + lane) * 8 + reg * 2 + (d % 2);
}

// ----- the weight loader (warp 8, one lane) -----------------------------------------------------------------------
__device__ void weight_loader(const Params& p, const Smem& s) {
  const long long first = p.cta_page[blockIdx.x], count = p.cta_page[blockIdx.x + 1] - first;
  const uint8_t* src = p.wstream + first * PAGE_BYTES;
  for (long long i = 0; i < count; ++i) {
    int slot = (int)(i % W_PAGES);
    unsigned use = (unsigned)(i / W_PAGES);
    if (use > 0 && !wait_barrier(p, &s.w_empty[slot], (use & 1) ^ 1, ERR_W_EMPTY)) return;
    if (DIAG & 2) {
      mbar_arrive(&s.w_full[slot]);
      continue;
    }
    mbar_expect_tx(&s.w_full[slot], PAGE_BYTES);
    bulk_copy(s.w + slot * PAGE_BYTES, src + i * PAGE_BYTES, PAGE_BYTES, &s.w_full[slot]);
  }
}

// ----- the activation loader (warp 9, one lane) -------------------------------------------------------------------
struct Ring {
  unsigned count = 0;  // items issued (loader) or consumed (consumer)
  __device__ int slot(int slots) const { return (int)(count % slots); }
  __device__ unsigned parity(int slots) const { return (count / slots) & 1; }
};

// the activation image a GEMM op reads
__device__ const __nv_bfloat16* gemm_input(const Params& p, int op) {
  switch (op) {
    case OP_MLP_OUT: return p.emb_img;
    case OP_O: return p.attn_img;
    case OP_DOWN: return p.h_img;
    case OP_QK:
    case OP_V: return PI05 ? p.xs_attn_img : p.x_img;
    case OP_GATE_UP: return PI05 ? p.xs_ffn_img : p.x_img;
    default: return p.x_img;
  }
}

// the modulation row of batch element b (π0.5), or π0's time-bias row
__device__ __forceinline__ const float* mod_row(const Params& p, int b) { return p.time_bias + b * p.mod_stride; }
// the row of padded row R of the suffix image (padding past the last batch element reads the last one's: finite,
// and its outputs are never read)
__device__ __forceinline__ const float* row_mod(const Params& p, int R) {
  return mod_row(p, min(R / SUFFIX, BATCH - 1));
}

// stores one value (bf16, bf16x2 or 8 x bf16) at `off` of an image
template <int IMG, typename T>
__device__ __forceinline__ void store_img(__nv_bfloat16* img, int off, T v) {
  if (!(DIAG & 4)) *reinterpret_cast<T*>(img + off) = v;
}

__device__ bool claim_a_slot(const Params& p, const Smem& s, Ring& ring, int& slot) {
  slot = ring.slot(A_SLOTS);
  unsigned use = ring.count / A_SLOTS;
  return use == 0 || wait_barrier(p, &s.a_empty[slot], (use & 1) ^ 1, ERR_A_EMPTY);
}

// The whole loader warp polls the input counters of a GEMM unit's chunks in parallel (one L2 round trip checks up
// to 64 chunks); `ready` caches the chunks (relative to the unit's first) already seen complete, so a unit whose
// inputs are all there costs one round trip, not one per chunk. True once chunks [c0, c1) are complete.
__device__ bool wait_chunks(const Params& p, const int* ins, int c0, int c1, uint64_t& ready, unsigned epoch,
                            int lane) {
  const uint64_t need = (c1 - c0 >= 64 ? ~0ull : ((1ull << (c1 - c0)) - 1)) << c0;
  if ((ready & need) == need) return false;  // nothing new acquired
  const int nk = ins[F_NK], k0 = ins[F_K0], base = ins[F_IN_CNT], div = ins[F_IN_DIV];
  const unsigned target = (epoch + 1) * (unsigned)ins[F_IN_T];
  uint64_t start = 0;
  for (unsigned it = 0;; ++it) {
    uint64_t mine = 0;
    for (int j = lane; j < nk; j += 32)
      if (!((ready >> j) & 1) && (int)(load_acquire(p.counters + base + (k0 + j) / div) - target) >= 0)
        mine |= 1ull << j;
    ready |= ((uint64_t)__reduce_or_sync(0xffffffff, (unsigned)(mine >> 32)) << 32) |
             __reduce_or_sync(0xffffffff, (unsigned)mine);
    if ((ready & need) == need) return true;  // newly acquired: the caller fences before its bulk copies
    int give_up = 0;
    if (lane == 0 && (it & 7) == 7) {
      const uint64_t now = global_timer();
      if (start == 0) start = now;
      if (now - start > p.timeout_ns) {
        record_error(p, ERR_COUNTER);
        give_up = 1;
      }
      give_up |= *(volatile unsigned*)p.error != 0;
    }
    if (__shfl_sync(0xffffffff, give_up, 0)) {
      ready = ~0ull;  // carry on with whatever is there: wrong outputs and an error flag, never a hang
      return true;
    }
  }
}

// After a normed GEMM unit's inputs are all complete: the RMS factor of every row, from the per-tile sums of
// squares the producers of x left, into the next slot of the two-unit ring (off the consumers' critical path).
__device__ void load_rms(const Params& p, const Smem& s, Ring& ring, int lane) {
  const int slot = ring.slot(2);
  const unsigned use = ring.count / 2;
  if (use > 0) wait_barrier(p, &s.rms_empty[slot], (use & 1) ^ 1, ERR_A_EMPTY);
  for (int r = lane; r < M_PAD; r += 32) {
    float part[N_KC];
#pragma unroll
    for (int t = 0; t < N_KC; ++t) part[t] = __ldcg(p.ssq + t * M_PAD + r);
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < N_KC; ++t) sum += part[t];
    s.rms[slot * M_PAD + r] = rsqrtf(sum / WIDTH + p.rms_eps);
  }
  __syncwarp();
  if (lane == 0) mbar_arrive(&s.rms_full[slot]);
  ++ring.count;
}

// warp 9, all lanes: lane 0 issues the copies, every lane helps poll counters
__device__ void activation_loader(const Params& p, const Smem& s, unsigned epoch, int lane) {
  Ring ring, rms_ring;
  const int* ins = p.instrs + p.cta_instr[blockIdx.x] * FIELDS;
  const int n = p.cta_instr[blockIdx.x + 1] - p.cta_instr[blockIdx.x];
  for (int i = 0; i < n; ++i, ins += FIELDS) {
    const int op = ins[F_OP];
    if (op == OP_ATTN) {
      const int layer = ins[F_LAYER], b = ins[F_A], key0 = ins[F_K0], items = ins[F_NK];
      const uint8_t* kmap = p.kv_maps + (layer * 2) * 128;
      bool kv_ready = ins[F_C] < 0;
      for (int ii = 0; ii < items; ++ii) {
        const int k = key0 + ii * KEY_ITEM;
        for (int kv = 0; kv < 2; ++kv) {
          int slot;
          claim_a_slot(p, s, ring, slot);
          if (k + KEY_ITEM > PREFIX && !kv_ready) {  // overlaps the suffix rows this layer's QKV writes
            if (lane == 0) wait_counter(p, ins[F_C], (epoch + 1) * (unsigned)ins[F_D]);
            __syncwarp();
            kv_ready = true;
            if (lane == 0) {
              fence_proxy_async_global();
              if (p.trace) p.trace[(p.cta_instr[blockIdx.x] + i) * TRACE + T_LOADER] = global_timer();
            }
          }
          if (lane == 0) {
            uint8_t* dst = s.a + slot * A_SLOT_BYTES;
            mbar_expect_tx(&s.a_full[slot], KEY_ITEM * HEAD_DIM * 2);
            for (int c = 0; c < HEAD_DIM / TILE; ++c)
              tma_load_3d(dst + c * KEY_ITEM * 128, kmap + kv * 128, c * TILE, k, b, &s.a_full[slot]);
          }
          ++ring.count;
        }
      }
    } else if (op == OP_MLP_OUT || op == OP_QK || op == OP_V || op == OP_O || op == OP_GATE_UP || op == OP_DOWN ||
               op == OP_ACTION) {
      const __nv_bfloat16* src = gemm_input(p, op);
      const int k0 = ins[F_K0], nk = ins[F_NK];
      uint64_t ready = 0;
      for (int c0 = 0; c0 < nk; c0 += A_ITEM_CHUNKS) {
        int slot;
        claim_a_slot(p, s, ring, slot);
        const bool fresh = wait_chunks(p, ins, c0, c0 + A_ITEM_CHUNKS, ready, epoch, lane);
        __syncwarp();
        if (lane == 0) {
          if (fresh) fence_proxy_async_global();
          if (p.trace && c0 + A_ITEM_CHUNKS >= nk) p.trace[(p.cta_instr[blockIdx.x] + i) * TRACE + T_LOADER] = global_timer();
          uint8_t* dst = s.a + slot * A_SLOT_BYTES;
          // the item's chunks are consecutive tiles of the image: one bulk copy
          if (DIAG & 2) {
            mbar_arrive(&s.a_full[slot]);
          } else {
            mbar_expect_tx(&s.a_full[slot], A_ITEM_CHUNKS * M_TILES * PAGE_BYTES);
            bulk_copy(dst, src + (size_t)(k0 + c0) * M_TILES * TILE * TILE, A_ITEM_CHUNKS * M_TILES * PAGE_BYTES,
                      &s.a_full[slot]);
          }
        }
        ++ring.count;
      }
      if (op == OP_QK || op == OP_V || op == OP_GATE_UP || op == OP_ACTION) load_rms(p, s, rms_ring, lane);
    }
  }
}

// ----- consumer helpers ------------------------------------------------------------------------------------------
struct Consumer {
  const Params& p;
  const Smem& s;
  unsigned epoch;
  int tid;       // 0..255
  int wg;        // warpgroup 0 / 1
  int wtid;      // 0..127 within the warpgroup
  int warp;      // 0..3 within the warpgroup
  int g, t4;     // lane / 4, lane % 4: the accumulator fragment coordinates
  Ring rms_ring;
  const float* rms = nullptr;            // the unit's RMS factors (shared memory)
  unsigned long long* trace = nullptr;   // this instruction's stamps, or null

  __device__ unsigned target(int t) const { return (epoch + 1) * (unsigned)t; }

  // accumulator element i of m-tile mt: row within the tile, column within this warpgroup's 32
  __device__ int acc_row(int i) const { return 16 * warp + g + ((i & 2) ? 8 : 0); }
  __device__ int acc_col(int i) const { return 8 * (i / 4) + 2 * t4 + (i & 1); }

  // A chunk's ring bookkeeping as running values and 32-bit shared addresses: re-deriving them at each wait and
  // release (S2UR of the CTA id and the shared window, the 1024-byte align-up, a slot by a modulo of 15 / 6, a wide
  // multiply) cost ~30 dependent instructions of a chunk's ~70 when nothing else is in it, and ~5% of a step.
  uint32_t bar0 = 0, page0 = 0;  // shared addresses of w_full[0] (then w_empty, a_full, a_empty) and of page 0
  int w_pos = 0, a_pos = 0;      // the next slot of each ring, and the phase it is in
  unsigned w_phase = 0, a_phase = 0;

  __device__ void ring_start() {
    bar0 = smem_addr(s.w_full);
    page0 = smem_addr(s.w);
    asm volatile("" : "+r"(bar0), "+r"(page0));  // opaque: kept in registers, not re-derived at every use
  }
  __device__ void wait_w(int& slot) {
    slot = w_pos;
    wait_barrier_at(p, bar0 + 8 * slot, w_phase, ERR_W_FULL);
    if (++w_pos == W_PAGES) w_pos = 0, w_phase ^= 1;
  }
  __device__ void wait_a(int& slot) {
    slot = a_pos;
    wait_barrier_at(p, bar0 + 8 * (2 * W_PAGES + slot), a_phase, ERR_A_FULL);
    if (++a_pos == A_SLOTS) a_pos = 0, a_phase ^= 1;
  }
  __device__ void release_w(int slot) { if (wtid == 0) mbar_arrive_at(bar0 + 8 * (W_PAGES + slot)); }
  __device__ void release_a(int slot) { if (wtid == 0) mbar_arrive_at(bar0 + 8 * (2 * W_PAGES + A_SLOTS + slot)); }
  __device__ uint32_t page_addr(int slot) const { return page0 + slot * PAGE_BYTES; }
  __device__ uint32_t a_slot_addr(int slot) const { return page0 + W_PAGES * PAGE_BYTES + slot * A_SLOT_BYTES; }

  // thread 0 waits for a counter, then all consumers proceed
  __device__ void wait_all(int cnt, int t) {
    if (tid == 0) wait_counter(p, cnt, target(t));
    consumer_sync();
  }
  __device__ void signal(int cnt) {
    consumer_sync();  // every consumer thread's stores are issued
    if (tid == 0 && cnt >= 0) add_release(p.counters + cnt, 1);  // cumulative over the barrier
  }

  // the RMS factors the loader computed for this unit (`rms` then points at them)
  __device__ void acquire_rms() {
    const int slot = rms_ring.slot(2);
    wait_barrier(p, &s.rms_full[slot], rms_ring.parity(2), ERR_A_FULL);
    rms = s.rms + slot * M_PAD;
  }
  __device__ void release_rms() {  // after the unit's last consumer_sync
    if (tid == 0) mbar_arrive(&s.rms_empty[rms_ring.slot(2)]);
    ++rms_ring.count;
  }

  __device__ void mark(int k) {
    if (trace && tid == 0) trace[k] = global_timer();
  }

  // acc[mt] = A(all rows, K range) x W(this warpgroup's 32 rows of the unit)^T over nk 64-wide k-chunks. Up to
  // WGMMA_DEPTH chunks' MMAs stay in flight; a chunk's weight page (and its activation item, after the item's last
  // chunk) goes back to its ring once the MMAs WGMMA_DEPTH chunks later have been issued and it has completed.
  // ACC_CHAINS 2: even and odd k-chunks accumulate into two register sets, summed at the end, so a chunk's MMAs need
  // not wait for the previous chunk's (the wgmmas of one accumulator run one after another).
  __device__ void mainloop(float (&acc)[M_TILES][16], int nk) {
    int pend_w[WGMMA_DEPTH], pend_a[WGMMA_DEPTH];  // slots to release when that chunk completes; -1: none
#pragma unroll
    for (int j = 0; j < WGMMA_DEPTH; ++j) pend_w[j] = pend_a[j] = -1;
    int a_slot = 0;
    auto chunk = [&](float (&c)[M_TILES][16], int kc) {
      const int ci = kc % A_ITEM_CHUNKS;
      if (ci == 0) {
        wait_a(a_slot);
        if (kc == 0) mark(T_READY);
      }
      int w_slot;
      wait_w(w_slot);
      wgmma_fence();
      const uint32_t w_base = page_addr(w_slot) + wg * 32 * 128;
      const uint32_t a_base = a_slot_addr(a_slot) + ci * M_TILES * PAGE_BYTES;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t da = sw128_desc(a_base + mt * PAGE_BYTES + kk * 32, 16, 1024);
          const uint64_t db = sw128_desc(w_base + kk * 32, 16, 1024);
          if (!(DIAG & 1)) wgmma_n32_ss(c[mt], da, db, kc >= ACC_CHAINS || kk != 0);  // a chain's first: c = A W^T
        }
      }
      wgmma_commit();
      const int out_w = pend_w[0], out_a = pend_a[0];
#pragma unroll
      for (int j = 0; j + 1 < WGMMA_DEPTH; ++j) {
        pend_w[j] = pend_w[j + 1];
        pend_a[j] = pend_a[j + 1];
      }
      pend_w[WGMMA_DEPTH - 1] = w_slot;
      pend_a[WGMMA_DEPTH - 1] = ci == A_ITEM_CHUNKS - 1 ? a_slot : -1;
      if (out_w >= 0) {
        wgmma_wait<WGMMA_DEPTH>();
        release_w(out_w);
        if (out_a >= 0) release_a(out_a);
      }
    };
#if ACC_CHAINS == 2
    float odd[M_TILES][16];
    int kc = 0;
    for (; kc + 1 < nk; kc += 2) {
      chunk(acc, kc);
      chunk(odd, kc + 1);
    }
    if (kc < nk) chunk(acc, kc);
#else
    for (int kc = 0; kc < nk; ++kc) chunk(acc, kc);
#endif
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) fence_regs(acc[mt]);
#if ACC_CHAINS == 2
    if (nk > 1) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        fence_regs(odd[mt]);
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[mt][e] += odd[mt][e];
      }
    }
#endif
#pragma unroll
    for (int j = 0; j < WGMMA_DEPTH; ++j) {
      if (pend_w[j] >= 0) release_w(pend_w[j]);
      if (pend_a[j] >= 0) release_a(pend_a[j]);
    }
  }

  // rs[mt][h]: this thread's sum of squares of row (16 warp + g + 8 h) of m-tile mt over its columns; summed over
  // the unit's 64 columns and written to ssq[tile][row_of(r)] (-1: not stored). All consumer threads call it.
  template <typename RowMap>
  __device__ void store_ssq(float (&rs)[M_TILES][2], int tile, RowMap row_of) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = rs[mt][h];
        v += __shfl_xor_sync(0xffffffff, v, 1);
        v += __shfl_xor_sync(0xffffffff, v, 2);
        if (t4 == 0) s.red[wg * M_PAD + mt * TILE + 16 * warp + g + 8 * h] = v;
      }
    }
    consumer_sync();
    for (int r = tid; r < M_PAD; r += CONSUMERS) {
      const int row = row_of(r);
      if (row >= 0 && !(DIAG & 4)) p.ssq[tile * M_PAD + row] = s.red[r] + s.red[M_PAD + r];
    }
  }

  // ----- the instructions ------------------------------------------------------------------------------------------
  __device__ void embed(const int* ins) {
    const int j = ins[F_N], col = j * TILE + tid % TILE, rg = tid / TILE;
    float w[ACTION_DIM], ws[ACTION_DIM];
#pragma unroll
    for (int a = 0; a < ACTION_DIM; ++a) {
      w[a] = p.w_action_time[col * ACTION_DIM + a];
      ws[a] = p.w_state[col * ACTION_DIM + a];
    }
    const float bs = p.b_state[col];
    for (int r = rg; r < ACT_ROWS; r += CONSUMERS / TILE) {
      float acc = 0.f;
#pragma unroll
      for (int a = 0; a < ACTION_DIM; ++a) acc += p.x_t[r * ACTION_DIM + a] * w[a];
      acc += mod_row(p, r / CHUNK)[col];  // the time-bias row of this row's batch element
      const float silu = acc / (1.f + expf(-acc));
      store_img<X_IMG>(p.emb_img, img_offset(r, col), __float2bfloat16_rn(silu));
    }
    for (int b = rg; b < BATCH; b += CONSUMERS / TILE) {
      float acc = 0.f;
#pragma unroll
      for (int a = 0; a < ACTION_DIM; ++a) acc += p.state[b * ACTION_DIM + a] * ws[a];
      const float y = bf16_round(acc + bs);
      store_img<X_IMG>(p.x_img, img_offset(b * SUFFIX, col), __float2bfloat16_rn(y));
      s.red[b * TILE + tid % TILE] = y * y;
    }
    consumer_sync();
    if (tid < BATCH) {
      float sum = 0.f;
      for (int c = 0; c < TILE; ++c) sum += s.red[tid * TILE + c];
      p.ssq[j * M_PAD + tid * SUFFIX] = sum;
    }
    signal(ins[F_OUT_CNT]);
    if (tid == 0) add_release(p.counters + ins[F_C], 1);
  }

  // π0.5: the action tokens x = x_t W_inᵀ + b_in (bf16) for 64 columns, their sums of squares, and layer 0's QKV
  // input x (1 + s_attn); each warp takes rows, each lane two columns
  __device__ void embed05(const int* ins) {
    const int j = ins[F_N], lane = tid % 32, col = j * TILE + 2 * lane;
    float w0[ACTION_DIM], w1[ACTION_DIM];
#pragma unroll
    for (int a = 0; a < ACTION_DIM; ++a) {
      w0[a] = p.w_action_in[col * ACTION_DIM + a];
      w1[a] = p.w_action_in[(col + 1) * ACTION_DIM + a];
    }
    const float b0 = p.b_action_in[col], b1 = p.b_action_in[col + 1];
    for (int r = tid / 32; r < ROWS; r += CONSUMERS / 32) {
      float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
      for (int a = 0; a < ACTION_DIM; ++a) {
        const float v = p.x_t[r * ACTION_DIM + a];
        acc0 += v * w0[a];
        acc1 += v * w1[a];
      }
      const float y0 = bf16_round(acc0 + b0), y1 = bf16_round(acc1 + b1);
      store_img<X_IMG>(p.x_img, img_offset(r, col), pack_bf16(y0, y1));
      const float* m = mod_row(p, r / SUFFIX) + MOD_ATTN_SCALE;
      store_img<X_IMG>(p.xs_attn_img, img_offset(r, col), pack_bf16(y0 * (1.f + m[col]), y1 * (1.f + m[col + 1])));
      float sq = y0 * y0 + y1 * y1;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffff, sq, o);
      if (lane == 0) p.ssq[j * M_PAD + r] = sq;
    }
    signal(ins[F_OUT_CNT]);
  }

  // π0.5's output for ROW_GROUP rows: v = x̂ W_kᵀ + b_k with the step's float32 action_out table (the final norm's
  // scale and shift folded in), x̂ = x r (r from x's sums of squares); x_t += dt v. Thread: one row, two actions.
  __device__ void action_rows(const int* ins) {
    for (int kc = 0; kc < N_KC; ++kc) wait_all(ins[F_IN_CNT] + kc, ins[F_IN_T]);
    mark(T_READY);
    const int R = ins[F_N] * ROW_GROUP + tid / 16, a = 2 * (tid % 16);
    if (R < ROWS && a < ACTION_DIM) {
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < N_KC; ++t) sum += __ldcg(p.ssq + t * M_PAD + R);
      const float rms = rsqrtf(sum / WIDTH + p.rms_eps);
      const float* m = mod_row(p, R / SUFFIX);
      const float4* w0 = reinterpret_cast<const float4*>(m + MOD_ACTION_W + a * WIDTH);
      const float4* w1 = reinterpret_cast<const float4*>(m + MOD_ACTION_W + (a + 1) * WIDTH);
      float acc0 = 0.f, acc1 = 0.f;
      for (int k = 0; k < WIDTH; k += 8) {
        const uint4 xv = __ldcg(reinterpret_cast<const uint4*>(p.x_img + img_offset(R, k)));
        const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&xv);
        const float4 wa = __ldg(w0 + k / 4), wb = __ldg(w0 + k / 4 + 1);
        const float4 va = __ldg(w1 + k / 4), vb = __ldg(w1 + k / 4 + 1);
        const float2 x0 = __bfloat1622float2(xh[0]), x1 = __bfloat1622float2(xh[1]);
        const float2 x2 = __bfloat1622float2(xh[2]), x3 = __bfloat1622float2(xh[3]);
        acc0 += x0.x * wa.x + x0.y * wa.y + x1.x * wa.z + x1.y * wa.w + x2.x * wb.x + x2.y * wb.y + x3.x * wb.z +
                x3.y * wb.w;
        acc1 += x0.x * va.x + x0.y * va.y + x1.x * va.z + x1.y * va.w + x2.x * vb.x + x2.y * vb.y + x3.x * vb.z +
                x3.y * vb.w;
      }
      float* xt = p.x_t + ((R / SUFFIX) * CHUNK + R % SUFFIX) * ACTION_DIM + a;
      xt[0] = (acc0 * rms + m[MOD_ACTION_B + a]) * p.dt + xt[0];
      if (a + 1 < ACTION_DIM) xt[1] = (acc1 * rms + m[MOD_ACTION_B + a + 1]) * p.dt + xt[1];
    }
    mark(T_STORED);
    consumer_sync();
  }

  __device__ void gemm(const int* ins) {
    const int op = ins[F_OP];
    float acc[M_TILES][16];
    Rope rope;
    if (op == OP_QK) rope.load(*this, ins[F_A]);  // static tables: fetched before the inputs arrive
    // the K / V cache base of the layer, fetched before the inputs arrive too (not re-read in the epilogue)
    __nv_bfloat16* kv = nullptr;
    if (op == OP_V) kv = p.v_cache[ins[F_LAYER]];
    if (op == OP_QK && ins[F_B] != 0) kv = p.k_cache[ins[F_LAYER]];
    mainloop(acc, ins[F_NK]);
    mark(T_MMA);
    const int layer = ins[F_LAYER], n = ins[F_N];
    const bool normed = op == OP_QK || op == OP_V || op == OP_GATE_UP || op == OP_ACTION;
    if (normed) acquire_rms();
    if (op == OP_QK) {
      epilogue_qk(acc, ins, layer, n, rope, kv);
    } else if (op == OP_V) {
      epilogue_v(acc, layer, n, kv);
    } else if (op == OP_GATE_UP) {
      epilogue_gate_up(acc, layer, n);
    } else if (op == OP_MLP_OUT) {
      epilogue_mlp_out(acc, n);
    } else if (op == OP_ACTION) {
      epilogue_action(acc);
    } else {  // O and down: split-K partials, merged by the last split to arrive (T_STORED: partial stored)
      if (op == OP_O)
        epilogue_split<O_SPLITS>(acc, ins, p.part_o);
      else
        epilogue_split<DOWN_SPLITS>(acc, ins, p.part_d);
      return;
    }
    mark(T_STORED);
    signal(ins[F_OUT_CNT]);
    if (normed) release_rms();
  }

  // the cos / sin of this thread's rows and first-half dims of a QK unit (kept for M_TILES <= 2)
  struct Rope {
    static constexpr int MT = M_TILES <= 2 ? M_TILES : 0;
    float2 c[MT > 0 ? MT : 1][4], sn[MT > 0 ? MT : 1][4];
    __device__ void load(const Consumer& me, int i0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 8; i += 2) me.rope_at(mt, i, i0, c[mt][i / 2], sn[mt][i / 2]);
    }
  };
  __device__ void rope_at(int mt, int i, int i0, float2& c, float2& sn) const {
    const int R = mt * TILE + acc_row(i);
    const int b = R / SUFFIX, t = R % SUFFIX, dim = i0 + 16 * wg + acc_col(i);
    if (R >= ROWS) {
      c = sn = make_float2(0.f, 0.f);
      return;
    }
    c = *reinterpret_cast<const float2*>(p.rope_cos + (b * SUFFIX + t) * HALF + dim);
    sn = *reinterpret_cast<const float2*>(p.rope_sin + (b * SUFFIX + t) * HALF + dim);
  }

  // kc: the layer's K cache, fetched before the mainloop (unused for a Q unit)
  __device__ void epilogue_qk(const float (&acc)[M_TILES][16], const int* ins, int layer, int head,
                              const Rope& rope, __nv_bfloat16* kc) {
    const bool is_k = ins[F_B] != 0;
    const int i0 = ins[F_A];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 8; i += 2) {  // elements 0-7 hold the first half (j = 0, 1), 8-15 their partners
        const int R = mt * TILE + acc_row(i);
        if (R >= ROWS) continue;
        const int b = R / SUFFIX, t = R % SUFFIX;
        const int dim = i0 + 16 * wg + acc_col(i);  // first-half dim; its partner is dim + HALF
        const float f = rms[R];
        float2 c, sn;
        if constexpr (Rope::MT > 0) {
          c = rope.c[mt][i / 2];
          sn = rope.sn[mt][i / 2];
        } else {
          rope_at(mt, i, i0, c, sn);
        }
        float x1a = acc[mt][i] * f, x1b = acc[mt][i + 1] * f;
        float x2a = acc[mt][i + 8] * f, x2b = acc[mt][i + 9] * f;
        if (PI05) {  // the folded shift of the attention norm: a bias on Q / K rows (before RoPE)
          const float* bias = mod_row(p, b) + layer * MOD_LAYER + MOD_QKV_BIAS + head * HEAD_DIM + dim;
          x1a += bias[0];
          x1b += bias[1];
          x2a += bias[HALF];
          x2b += bias[HALF + 1];
        }
        const uint32_t y1 = pack_bf16(x1a * c.x - x2a * sn.x, x1b * c.y - x2b * sn.y);
        const uint32_t y2 = pack_bf16(x2a * c.x + x1a * sn.x, x2b * c.y + x1b * sn.y);
        if (is_k) {
          __nv_bfloat16* row = kc + ((size_t)b * KEYS + PREFIX + t) * HEAD_DIM;
          *reinterpret_cast<uint32_t*>(row + dim) = y1;
          *reinterpret_cast<uint32_t*>(row + dim + HALF) = y2;
        } else {
          *reinterpret_cast<uint32_t*>(p.q_frag + q_frag_offset(b, head, t, dim)) = y1;
          *reinterpret_cast<uint32_t*>(p.q_frag + q_frag_offset(b, head, t, dim + HALF)) = y2;
        }
      }
    }
  }

  // vc: the layer's V cache, fetched before the mainloop
  __device__ void epilogue_v(const float (&acc)[M_TILES][16], int layer, int u, __nv_bfloat16* vc) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const int R = mt * TILE + acc_row(i);
        if (R >= ROWS) continue;
        const int b = R / SUFFIX, t = R % SUFFIX, dim = u * TILE + 32 * wg + acc_col(i);
        const float f = rms[R];
        float v0 = acc[mt][i] * f, v1 = acc[mt][i + 1] * f;
        if (PI05) {
          const float* bias = mod_row(p, b) + layer * MOD_LAYER + MOD_QKV_BIAS + Q_WIDTH + HEAD_DIM + dim;
          v0 += bias[0];
          v1 += bias[1];
        }
        *reinterpret_cast<uint32_t*>(vc + ((size_t)b * KEYS + PREFIX + t) * HEAD_DIM + dim) = pack_bf16(v0, v1);
      }
    }
  }

  __device__ static float gelu_tanh(float x) {
    // 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.f + expf(-2.f * u));
  }

  __device__ void epilogue_gate_up(const float (&acc)[M_TILES][16], int layer, int j) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int R = mt * TILE + acc_row(i);
        const float f = rms[R];
        const int col = 32 * j + 16 * wg + acc_col(i);
        float g0 = acc[mt][i] * f, g1 = acc[mt][i + 1] * f, u0 = acc[mt][i + 8] * f, u1 = acc[mt][i + 9] * f;
        if (PI05) {  // the folded shift of the FFN norm: biases on gate and up, before the GELU
          const float* bias = row_mod(p, R) + layer * MOD_LAYER + MOD_GU_BIAS;
          g0 += bias[col];
          g1 += bias[col + 1];
          u0 += bias[MLP + col];
          u1 += bias[MLP + col + 1];
        }
        const float y0 = gelu_tanh(g0) * u0;
        const float y1 = gelu_tanh(g1) * u1;
        store_img<H_IMG>(p.h_img, img_offset(R, col), pack_bf16(y0, y1));
      }
    }
  }

  __device__ void epilogue_mlp_out(const float (&acc)[M_TILES][16], int n) {
    float rs[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      rs[mt][0] = rs[mt][1] = 0.f;
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const int r = mt * TILE + acc_row(i), col = n * TILE + 32 * wg + acc_col(i);
        const float y0 = bf16_round(acc[mt][i] + p.b_mlp_out[col]);
        const float y1 = bf16_round(acc[mt][i + 1] + p.b_mlp_out[col + 1]);
        const bool real = r < ACT_ROWS;
        rs[mt][(i >> 1) & 1] += real ? y0 * y0 + y1 * y1 : 0.f;
        if (real) {
          const int R = (r / CHUNK) * SUFFIX + 1 + r % CHUNK;
          store_img<X_IMG>(p.x_img, img_offset(R, col), pack_bf16(y0, y1));
        }
      }
    }
    store_ssq(rs, n, [](int r) { return r < ACT_ROWS ? (r / CHUNK) * SUFFIX + 1 + r % CHUNK : -1; });
  }

  __device__ void epilogue_action(const float (&acc)[M_TILES][16]) {
    if (wg != 0) return;  // the action dims are this unit's first 32 columns
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int R = mt * TILE + acc_row(i), a = acc_col(i);
        const int t = R % SUFFIX - 1;
        if (R >= ROWS || t < 0 || a >= ACTION_DIM) continue;
        float* xt = p.x_t + ((R / SUFFIX) * CHUNK + t) * ACTION_DIM + a;
        *xt = (acc[mt][i] * rms[R] + p.b_action_out[a]) * p.dt + *xt;
      }
    }
  }

  // π0.5: the next normed GEMM's input x (1 + s): after O, gate/up's (this layer's FFN norm); after down, the next
  // layer's QKV (its attention norm; none after the last layer: the final norm lives in the action table)
  __device__ void store_scaled_x(int R, int col, float y0, float y1, bool after_o, int layer) {
    const float* m = row_mod(p, R);
    if (after_o) {
      const float* sc = m + layer * MOD_LAYER + MOD_FFN_SCALE;
      store_img<X_IMG>(p.xs_ffn_img, img_offset(R, col), pack_bf16(y0 * (1.f + sc[col]), y1 * (1.f + sc[col + 1])));
    } else if (layer + 1 < DEPTH) {
      const float* sc = m + (layer + 1) * MOD_LAYER + MOD_ATTN_SCALE;
      store_img<X_IMG>(p.xs_attn_img, img_offset(R, col), pack_bf16(y0 * (1.f + sc[col]), y1 * (1.f + sc[col + 1])));
    }
  }

  // split-K: store this split's fp32 partial; the last split of the tile to arrive adds all partials in split
  // order (bit-identical whoever is last) plus the residual, writes x and its row sums of squares
  template <int SPLITS>
  __device__ void epilogue_split(const float (&acc)[M_TILES][16], const int* ins, float* part) {
    const int n = ins[F_N], split = ins[F_SPLIT];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const int R = mt * TILE + acc_row(i), col = n * TILE + 32 * wg + acc_col(i);
        if (!(DIAG & 4))
          __stcg(reinterpret_cast<float2*>(part + ((size_t)split * M_PAD + R) * WIDTH + col),
                 make_float2(acc[mt][i], acc[mt][i + 1]));
      }
    }
    consumer_sync();
    mark(T_STORED);
    if (tid == 0) *s.flag = add_acq_rel(p.counters + ins[F_SK_CNT], 1) + 1 == target(SPLITS);
    consumer_sync();
    if (!*s.flag) return;
    float rs[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      rs[mt][0] = rs[mt][1] = 0.f;
      float2 got[SPLITS][8];  // every load of this m-tile in flight before the first add
      __nv_bfloat162 res[8];
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const int R = mt * TILE + acc_row(i), col = n * TILE + 32 * wg + acc_col(i);
#pragma unroll
        for (int sp = 0; sp < SPLITS; ++sp)
          got[sp][i / 2] = __ldcg(reinterpret_cast<const float2*>(part + ((size_t)sp * M_PAD + R) * WIDTH + col));
        res[i / 2] = __ldcg(reinterpret_cast<const __nv_bfloat162*>(p.x_img + img_offset(R, col)));
      }
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const int R = mt * TILE + acc_row(i), col = n * TILE + 32 * wg + acc_col(i);
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int sp = 0; sp < SPLITS; ++sp) {  // own partial from registers: the same bits it stored
          v0 += sp == split ? acc[mt][i] : got[sp][i / 2].x;
          v1 += sp == split ? acc[mt][i + 1] : got[sp][i / 2].y;
        }
        if (PI05) {  // the residual's gate (attention's after O, the FFN's after down)
          const float* gate = row_mod(p, R) + ins[F_LAYER] * MOD_LAYER +
                              (part == p.part_o ? MOD_ATTN_GATE : MOD_FFN_GATE);
          v0 *= gate[col];
          v1 *= gate[col + 1];
        }
        const float y0 = bf16_round(v0 + __bfloat162float(res[i / 2].x));
        const float y1 = bf16_round(v1 + __bfloat162float(res[i / 2].y));
        store_img<X_IMG>(p.x_img, img_offset(R, col), pack_bf16(y0, y1));
        if (PI05) store_scaled_x(R, col, y0, y1, part == p.part_o, ins[F_LAYER]);
        rs[mt][(i >> 1) & 1] += y0 * y0 + y1 * y1;
      }
    }
    store_ssq(rs, n, [](int r) { return r; });
    signal(ins[F_OUT_CNT]);
  }

  // softmax attention of one (batch, head) over one key range, unnormalised partial out
  __device__ void attention(const int* ins) {
    const int layer = ins[F_LAYER], h = ins[F_N], b = ins[F_A], split = ins[F_SPLIT];
    const int key0 = ins[F_K0], key1 = ins[F_B], items = ins[F_NK];
    (void)layer;
    wait_all(ins[F_IN_CNT], ins[F_IN_T]);
    mark(T_READY);
    uint32_t q[16][4];
    const uint4* qsrc = reinterpret_cast<const uint4*>(p.q_frag) + (((b * HEADS + h) * 4 + warp) * 16) * 32;
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const uint4 v = __ldcg(qsrc + kk * 32 + (wtid % 32));
      q[kk][0] = v.x; q[kk][1] = v.y; q[kk][2] = v.z; q[kk][3] = v.w;
      fence_regs(q[kk]);
    }
    int qblk[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int t = 16 * warp + g + 8 * hh;
      qblk[hh] = t < SUFFIX ? p.query_block[b * SUFFIX + t] : -1;
    }
    float o[2][32];
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[c][i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    for (int ii = 0; ii < items; ++ii) {
      const int kbase = key0 + ii * KEY_ITEM;
      int kb[8];  // the key blocks of this thread's 8 keys (acc_col of elements 4j + e), before the wait
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int key = kbase + 8 * (j / 2) + 2 * t4 + (j % 2);
        kb[j] = key < KEYS ? p.key_block[b * KEYS + key] : 0;
      }
      int ks, vs;
      wait_a(ks);
      float sc[16];
      fence_regs(sc);
      wgmma_fence();
      attn_scores(sc, q, a_slot_addr(ks), KEY_ITEM);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sc);
      release_a(ks);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)  // scaled to the log2 domain; keys outside the range or the row's blocks: -inf
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 4 * j + 2 * hh + e, key = kbase + acc_col(i);
            const int blk = kb[2 * j + e];
            const bool ok = key < key1 && key < KEYS && blk <= qblk[hh];
            sc[i] = ok ? sc[i] * p.scale_log2 : -INFINITY;
          }
      float p_[16];
      attn_softmax(sc, p_, m, l, o);
      uint32_t pa[2][4];
      attn_pack_p(p_, pa);
      wait_a(vs);
      fence_regs(pa[0]);
      fence_regs(pa[1]);
      fence_regs(o[0]);
      fence_regs(o[1]);
      wgmma_fence();
      attn_pv(o, pa, a_slot_addr(vs), wg, KEY_ITEM);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o[0]);
      fence_regs(o[1]);
      release_a(vs);
    }
    mark(T_MMA);
    const size_t unit = ((size_t)(b * HEADS + h) * N_SPLITS + split) * TILE;
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const int t = 16 * warp + g + ((i & 2) ? 8 : 0), dim = (2 * wg + c) * TILE + 8 * (i / 4) + 2 * t4;
        __stcg(reinterpret_cast<float2*>(p.o_part + (unit + t) * HEAD_DIM + dim), make_float2(o[c][i], o[c][i + 1]));
      }
    if (wg == 0 && t4 == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = 16 * warp + g + 8 * hh;
        __stcg(reinterpret_cast<float2*>(p.ml_part + (unit + t) * 2), make_float2(m[hh], l[hh]));
      }
    }
    mark(T_STORED);
    signal(ins[F_OUT_CNT]);
  }

  // merges the key splits of 16 query rows of one (batch, head) into the attention image
  __device__ void merge(const int* ins) {
    const int h = ins[F_N], b = ins[F_A], rg = ins[F_B];
    wait_all(ins[F_IN_CNT], ins[F_IN_T]);
    mark(T_READY);
    const int t = rg * ROW_GROUP + tid / 16, d0 = (tid % 16) * 16;
    if (t < SUFFIX) {
      const size_t base = (size_t)(b * HEADS + h) * N_SPLITS * TILE;
      float2 ml[N_SPLITS];
#pragma unroll
      for (int sp = 0; sp < N_SPLITS; ++sp)
        ml[sp] = __ldcg(reinterpret_cast<const float2*>(p.ml_part + (base + sp * TILE + t) * 2));
      float mx = -INFINITY;
#pragma unroll
      for (int sp = 0; sp < N_SPLITS; ++sp) mx = fmaxf(mx, ml[sp].x);
      float acc[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] = 0.f;
      float total = 0.f;
      constexpr int BATCH_SPLITS = 4;  // o loads in flight per round
#pragma unroll
      for (int s0 = 0; s0 < N_SPLITS; s0 += BATCH_SPLITS) {
        float4 x[BATCH_SPLITS][4];
#pragma unroll
        for (int j = 0; j < BATCH_SPLITS; ++j) {
          if (s0 + j >= N_SPLITS) break;
          const float4* src = reinterpret_cast<const float4*>(p.o_part + (base + (s0 + j) * TILE + t) * HEAD_DIM + d0);
#pragma unroll
          for (int v = 0; v < 4; ++v) x[j][v] = __ldcg(src + v);
        }
#pragma unroll
        for (int j = 0; j < BATCH_SPLITS; ++j) {
          if (s0 + j >= N_SPLITS) break;
          const float w = mx == -INFINITY ? 0.f : exp2f(ml[s0 + j].x - mx);
          total += ml[s0 + j].y * w;
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            acc[4 * v] += x[j][v].x * w;
            acc[4 * v + 1] += x[j][v].y * w;
            acc[4 * v + 2] += x[j][v].z * w;
            acc[4 * v + 3] += x[j][v].w * w;
          }
        }
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      const int R = b * SUFFIX + t, col = h * HEAD_DIM + d0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint4 v;
        v.x = pack_bf16(acc[8 * half + 0] * inv, acc[8 * half + 1] * inv);
        v.y = pack_bf16(acc[8 * half + 2] * inv, acc[8 * half + 3] * inv);
        v.z = pack_bf16(acc[8 * half + 4] * inv, acc[8 * half + 5] * inv);
        v.w = pack_bf16(acc[8 * half + 6] * inv, acc[8 * half + 7] * inv);
        store_img<ATTN_IMG>(p.attn_img, img_offset(R, col + 8 * half), v);
      }
    }
    mark(T_STORED);
    signal(ins[F_OUT_CNT]);
  }
};

}  // namespace

extern "C" __global__ void __launch_bounds__(384, 1) expert_step_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  const Smem s = carve_smem(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned epoch = *(volatile unsigned*)p.epoch;
  if (threadIdx.x == 0) {
    for (int i = 0; i < W_PAGES; ++i) {
      mbar_init(&s.w_full[i], 1);
      mbar_init(&s.w_empty[i], 2);
    }
    for (int i = 0; i < A_SLOTS; ++i) {
      mbar_init(&s.a_full[i], 1);
      mbar_init(&s.a_empty[i], 2);  // both consumer warpgroups
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(&s.rms_full[i], 1);
      mbar_init(&s.rms_empty[i], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp >= W_LOADER_WARP) {  // the producer warpgroup gives its registers to the consumers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    if (warp == W_LOADER_WARP && lane == 0) weight_loader(p, s);
    if (warp == A_LOADER_WARP) activation_loader(p, s, epoch, lane);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  Consumer c{p, s, epoch};
  c.tid = threadIdx.x;
  c.wg = threadIdx.x / 128;
  c.wtid = threadIdx.x % 128;
  c.warp = c.wtid / 32;
  c.g = lane / 4;
  c.t4 = lane % 4;
  c.ring_start();
  const int first = p.cta_instr[blockIdx.x], last = p.cta_instr[blockIdx.x + 1];
  for (int i = first; i < last; ++i) {
    const InstrRow cur = load_instr(p.instrs + i * FIELDS);  // one round trip for every field
    const int* ins = cur.f;
    c.trace = p.trace ? p.trace + TRACE * i : nullptr;
    c.mark(T_START);
    switch (ins[F_OP]) {
      case OP_EMBED:
        c.mark(T_READY);
        if (PI05)
          c.embed05(ins);
        else
          c.embed(ins);
        break;
      case OP_ACTION_ROWS: c.action_rows(ins); break;
      case OP_ATTN: c.attention(ins); break;
      case OP_MERGE: c.merge(ins); break;
      default: c.gemm(ins); break;
    }
    c.mark(T_DONE);
  }
  consumer_sync();
  if (c.tid == 0) {
    const unsigned done = add_acq_rel(p.exit_count, 1) + 1;
    if (done == (epoch + 1) * gridDim.x) atomicExch(p.epoch, epoch + 1);
  }
}
