"""The action expert's whole MLP (RMSNorm factor, gate/up GeGLU, down, residual) as one Gluon kernel (sm_90).

Why: an expert layer's MLP moves 25 MB of weights (gate/up 16.8 MB, down 8.4 MB) for 64 rows, which the H200
streams in ~6 µs, but as `rms_factor` + gate/up + split-K down + combine it is four latency-bound kernels (~16 µs
of a layer's wall time in the engine, PDL overlaps included). Weights never depend on activations, so a 1-warp TMA
loader per program streams the program's weight slices (gate/up, then down) through a shared-memory ring from its
first instruction, before `griddepcontrol.wait`, and keeps it full across both phases: the down weights land
while phase 1 still computes. A 4-warp consumer runs wgmma.

Work split (π0's expert: width 1024, MLP 4096, up to 64 rows), 128 programs, one per SM:
  - phase 1, program p: h[:, 32p .. 32p+32) = gelu_tanh(rs * x @ gateᵀ) * (rs * x @ upᵀ), rs = rsqrt(mean(x²) +
    eps) summed from the x tiles as they stream through the activation ring (the RMSNorm weight is folded into the
    gate/up rows). Then it publishes: its h stores, a proxy fence, one release increment of slice counter p // 32.
  - phase 2, program p: output columns 32 (p % 32) .. of x += h @ downᵀ over the K split p // 32 (1024 of the
    4096 h columns). Its loader polls that slice's counter (ld.acquire) until the 32 producers of those h columns
    have published, then streams h through the activation ring. The four splits of a column tile leave fp32
    partials in the workspace; the last to arrive adds them in split order and the residual, and stores x
    (deterministic, as `gemm`'s split-K). It may overwrite x: every program has finished reading x by then (each
    split waited for its slice, i.e. for a quarter of the programs' phase 1, and the four splits cover all).
  - The last program to finish resets the slice counters (graph replays start at zero); a column tile's last
    split resets its own.

Phase 2 waits for other programs of the same grid, so all 128 programs must be resident at once: one per SM (the
rings take ~200 KiB), on a GPU with >= 128 SMs (`expert_mlp_applies` checks). A program never waits for a later
kernel, and a PDL predecessor's programs always finish, so a program that is not yet resident is only late.
The first version (commit 2df4640: no loader warp, all 192 KiB of weights requested at once, a 4-deep x ring
refilled by the consumer) was correct but 27 µs a layer in the engine: the activations (128 KiB of x, then of h,
per program from L2) came through a ring too shallow for L2's latency.

Measured slower than the separate kernels in the engine (docs/kernels.md, "The expert MLP in one Gluon launch":
phase 1 is bound by each SM's share of HBM, and the publish / h reads / split-K tail adds ~6 µs). Tests: tests/test_gluon_mlp_gpu.py (bf16 vs fp32 torch on
the GPU) and the sm_90 compile test in tests/test_kernels_compile_sm90.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_gemm import (
    _GL_DTYPES,
    SMEM_LIMIT,
    TILE_M,
    _gdc_launch_dependents,
    _gdc_wait,
    _gelu_tanh,
    _gluon_api_ok,
    _tma_load,
)
from .pdl import pdl_settings
from .workspace import Workspace, default_workspace

__all__ = ["MlpConfig", "expert_mlp", "expert_mlp_applies"]

BLOCK_M = 64  # rows (one warpgroup's wgmma M); rows past M are TMA zero-fill
COLS = 32  # h columns a program makes in phase 1 = output columns it sums in phase 2
BLOCK_K = 64  # K step: one 128-byte-swizzled TMA box row of bf16


@dataclass(frozen=True)
class MlpConfig:
    """Ring depths: weight items (8 KiB: a K step's gate and up boxes, or two K steps of down) and activation tiles
    (8 KiB: 64 rows x 64 columns of x or h); registers of the 1-warp loader."""

    w_stages: int = 12
    a_stages: int = 12
    loader_regs: int = 40
    stagger: bool = True  # programs start their K loops at different columns (see _mlp_loader)

    def smem_bytes(self, itemsize: int = 2) -> int:
        return (self.w_stages * 2 * COLS + self.a_stages * BLOCK_M) * BLOCK_K * itemsize + 1024


DEFAULT_CONFIG = MlpConfig()


def _split_counts(width: int, mlp: int) -> tuple[int, int]:
    """(column tiles, K splits) of phase 2."""
    tiles = width // COLS
    return tiles, (mlp // COLS) // tiles


# Triton 3.6's Gluon calls the CTA-wide barrier thread_barrier, later ones barrier (as with the TMA load's name)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _load_acquire(ptr):
    """`ld.acquire.gpu` of an int32 (every thread): polls the counter in L2 without a read-modify-write."""
    return gl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _fence_proxy_async():
    """`fence.proxy.async.global`: orders this thread's generic-proxy accesses of global memory with async-proxy
    (TMA) ones. The writer of h executes it after its stores, the reader after its acquire, before TMA reads h."""
    gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stamp(dbg_ptr, pid, i: gl.constexpr, TIMING: gl.constexpr):
    """(TIMING only) the global nanosecond timer into dbg[pid, i]: where a program's time goes (tools/probe_mlp.py)."""
    if TIMING:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(dbg_ptr + pid * 8 + i, t)


@gluon.jit
def _issue_w(wgu_desc, wd_desc, w_smem, w_ready, w_empty, n, pid, tile, split, rot1, rot2, MLP: gl.constexpr,
             K_SPLIT: gl.constexpr, KT1: gl.constexpr, KT2: gl.constexpr, COLS: gl.constexpr, BLOCK_K: gl.constexpr,
             W_STAGES: gl.constexpr):  # fmt: skip
    """Weight item n into slot n % W_STAGES (two boxes, one barrier): n < KT1 the gate and up rows of K step
    (n + rot1) % KT1, else the down rows of K steps 2i and 2i + 1 of this program's split, i = (n - KT1 + rot2) %
    (KT2 / 2). The rotations stagger which activation columns the programs read at a time (see _mlp_loader)."""
    s = n % W_STAGES
    if n >= W_STAGES:  # the slot's previous item must have been consumed
        mbarrier.wait(w_empty.index(s), ((n // W_STAGES) & 1) ^ 1)
    mbarrier.expect(w_ready.index(s), 2 * wgu_desc.block_type.nbytes)
    if n < KT1:
        k1 = ((n + rot1) % KT1) * BLOCK_K
        _tma_load(wgu_desc, [pid * COLS, k1], w_ready.index(s), w_smem.index(2 * s))
        _tma_load(wgu_desc, [MLP + pid * COLS, k1], w_ready.index(s), w_smem.index(2 * s + 1))
    else:
        k0 = split * K_SPLIT + 2 * ((n - KT1 + rot2) % (KT2 // 2)) * BLOCK_K
        _tma_load(wd_desc, [tile * COLS, k0], w_ready.index(s), w_smem.index(2 * s))
        _tma_load(wd_desc, [tile * COLS, k0 + BLOCK_K], w_ready.index(s), w_smem.index(2 * s + 1))


@gluon.jit
def _issue_a(desc, a_smem, a_ready, a_empty, col, n, A_STAGES: gl.constexpr):
    """Activation item n (a 64 x BLOCK_K tile of x or h at column col) into slot n % A_STAGES."""
    s = n % A_STAGES
    if n >= A_STAGES:
        mbarrier.wait(a_empty.index(s), ((n // A_STAGES) & 1) ^ 1)
    mbarrier.expect(a_ready.index(s), desc.block_type.nbytes)
    _tma_load(desc, [0, col], a_ready.index(s), a_smem.index(s))


@gluon.jit
def _mlp_loader(x_desc, h_desc, wgu_desc, wd_desc, w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, sync_ptr,
                pid, tile, split, MLP: gl.constexpr, K_SPLIT: gl.constexpr, KT1: gl.constexpr, KT2: gl.constexpr,
                COLS: gl.constexpr, BLOCK_K: gl.constexpr, W_STAGES: gl.constexpr, A_STAGES: gl.constexpr,
                PRODUCERS: gl.constexpr, USE_PDL: gl.constexpr, STAGGER: gl.constexpr):  # fmt: skip
    """The 1-warp producer. Items go in the order the consumer takes them, each weight item W_STAGES - 1 ahead of
    the x tile of its step, so the loader only ever waits for a slot whose item the consumer can already finish
    (tests/test_gluon_mlp_schedule.py replays this order against the consumer's releases for every accepted config).
    STAGGER: program p walks phase 1's K steps from p % KT1 and phase 2's from its column tile's offset, so the
    programs do not all ask L2 for the same activation lines at once (128 readers of every x line, 32 of every h
    line); the sums are the same in another order, fixed per program."""
    W_ITEMS: gl.constexpr = KT1 + KT2 // 2
    rot1 = (pid % KT1) * STAGGER
    rot2 = (tile % (KT2 // 2)) * STAGGER
    for n in gl.static_range(W_STAGES):  # before the PDL wait: weights are never written by a kernel
        _issue_w(wgu_desc, wd_desc, w_smem, w_ready, w_empty, n, pid, tile, split, rot1, rot2, MLP, K_SPLIT, KT1, KT2,
                 COLS, BLOCK_K, W_STAGES)  # fmt: skip
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    for k in range(KT1):  # phase 1: x tile k, then weight item k + W_STAGES - 1 (all down items by the end)
        _issue_a(x_desc, a_smem, a_ready, a_empty, ((k + rot1) % KT1) * BLOCK_K, k, A_STAGES)
        # its slot frees when the consumer releases item k - 1, which it does once it has issued step k's MMAs
        # (one step late when pipelined): x tile k is already on its way, so this wait always ends
        if k >= 1 and k + W_STAGES - 1 < W_ITEMS:
            _issue_w(wgu_desc, wd_desc, w_smem, w_ready, w_empty, k + W_STAGES - 1, pid, tile, split, rot1, rot2, MLP,
                     K_SPLIT, KT1, KT2, COLS, BLOCK_K, W_STAGES)  # fmt: skip
    # phase 2: once the PRODUCERS programs that make this split's h columns have published them
    seen = _load_acquire(sync_ptr + split)
    while seen < PRODUCERS:
        seen = _load_acquire(sync_ptr + split)
    _fence_proxy_async()  # the acquire before the TMA (async proxy) reads of h
    for j in range(KT2):  # item KT1 + j: K step 2i + j % 2 of the split, i = (j // 2 + rot2) % (KT2 / 2)
        col = split * K_SPLIT + (2 * ((j // 2 + rot2) % (KT2 // 2)) + j % 2) * BLOCK_K
        _issue_a(h_desc, a_smem, a_ready, a_empty, col, KT1 + j, A_STAGES)


@gluon.jit
def _mlp_consumer(w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, x_ptr, h_ptr, part_ptr, sync_ptr, dbg_ptr,
                  scale_ptr, M, stride_x, stride_h, eps, pid, nprog, tile, split, WIDTH: gl.constexpr, KT1: gl.constexpr,
                  KT2: gl.constexpr, TILES: gl.constexpr, SPLITS: gl.constexpr, PRODUCERS: gl.constexpr,
                  COLS: gl.constexpr, BLOCK_K: gl.constexpr, W_STAGES: gl.constexpr, A_STAGES: gl.constexpr,
                  USE_PDL: gl.constexpr, TIMING: gl.constexpr, ROW_SCALE: gl.constexpr):  # fmt: skip
    """The default partition, one warpgroup: phase 1 (gate/up, RMS, GeGLU, publish h), phase 2 (down over this
    program's split), the split-K merge by the last split of a column tile, the counters' reset by the last program."""
    _stamp(dbg_ptr, pid, 0, TIMING)
    if USE_PDL:  # it writes h, x and the workspace, which earlier kernels read
        _gdc_wait()
        _gdc_launch_dependents()
    _stamp(dbg_ptr, pid, 1, TIMING)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, COLS, 16]
    )
    a_regs: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [gl.num_warps(), 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    rows = gl.arange(0, TILE_M, layout=row_layout)
    cols = gl.arange(0, COLS, layout=col_layout)
    row_ok = (rows < M)[:, None] & (cols < COLS)[None, :]

    # ---- phase 1: this program's h columns; the RMS factor given, or summed from the x tiles ----------------
    acc_g = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
    acc_u = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
    if ROW_SCALE:  # only MMAs: one K step's pair in flight, each step's slots released once the next is issued
        rs = gl.load(scale_ptr + rows, mask=rows < M, other=1.0).to(gl.float32)
        for k in range(KT1):
            sa = k % A_STAGES
            sw = k % W_STAGES
            mbarrier.wait(a_ready.index(sa), (k // A_STAGES) & 1)
            if k == 0:
                _stamp(dbg_ptr, pid, 2, TIMING)
            mbarrier.wait(w_ready.index(sw), (k // W_STAGES) & 1)
            a = a_smem.index(sa)
            wg = w_smem.index(2 * sw)
            wu = w_smem.index(2 * sw + 1)
            acc_g = warpgroup_mma(a, wg.permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a, wu.permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u, _, _, _ = warpgroup_mma_wait(2, deps=[acc_g, acc_u, a, wg, wu])
            if k > 0:  # <= 2 groups in flight: the previous step's pair has retired
                mbarrier.arrive(a_empty.index((k - 1) % A_STAGES))
                mbarrier.arrive(w_empty.index((k - 1) % W_STAGES))
        acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
        mbarrier.arrive(a_empty.index((KT1 - 1) % A_STAGES))
        mbarrier.arrive(w_empty.index((KT1 - 1) % W_STAGES))
        _stamp(dbg_ptr, pid, 3, TIMING)
    else:
        ssq = gl.zeros([TILE_M], gl.float32, gl.SliceLayout(1, a_regs))
        for k in range(KT1):
            sa = k % A_STAGES
            sw = k % W_STAGES
            mbarrier.wait(a_ready.index(sa), (k // A_STAGES) & 1)
            if k == 0:
                _stamp(dbg_ptr, pid, 2, TIMING)
            a = a_smem.index(sa)
            xa = a.load(a_regs).to(gl.float32)
            ssq += gl.sum(xa * xa, axis=1)
            mbarrier.wait(w_ready.index(sw), (k // W_STAGES) & 1)
            acc_g = warpgroup_mma(a, w_smem.index(2 * sw).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a, w_smem.index(2 * sw + 1).permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
            _cta_barrier()  # every warp's shared-memory reads of the x tile are done before its slot is refilled
            mbarrier.arrive(a_empty.index(sa))
            mbarrier.arrive(w_empty.index(sw))
        _stamp(dbg_ptr, pid, 3, TIMING)
        rs = gl.convert_layout(gl.rsqrt(ssq / WIDTH + eps), row_layout)
    hval = _gelu_tanh(acc_g * rs[:, None]) * (acc_u * rs[:, None])
    h_cols = pid * COLS + cols
    gl.store(h_ptr + rows[:, None] * stride_h + h_cols[None, :], hval.to(h_ptr.dtype.element_ty), mask=row_ok)
    _fence_proxy_async()  # these generic-proxy stores before other programs' TMA reads of h
    _cta_barrier()  # every thread's h stores issued before the (one-thread) release
    gl.atomic_add(sync_ptr + pid // PRODUCERS, 1, sem="release", scope="gpu")
    _stamp(dbg_ptr, pid, 4, TIMING)

    # ---- phase 2: x[:, tile] += h[:, split] @ down[tile, split]ᵀ, two K steps a weight item -----------------
    acc = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
    for i in range(KT2 // 2):  # one iteration's two MMAs in flight; the previous iteration's slots released
        n0 = KT1 + 2 * i
        s0 = n0 % A_STAGES
        s1 = (n0 + 1) % A_STAGES
        sw = (KT1 + i) % W_STAGES
        mbarrier.wait(a_ready.index(s0), (n0 // A_STAGES) & 1)
        if i == 0:
            _stamp(dbg_ptr, pid, 5, TIMING)
        mbarrier.wait(a_ready.index(s1), ((n0 + 1) // A_STAGES) & 1)
        mbarrier.wait(w_ready.index(sw), ((KT1 + i) // W_STAGES) & 1)
        a0 = a_smem.index(s0)
        a1 = a_smem.index(s1)
        w0 = w_smem.index(2 * sw)
        w1 = w_smem.index(2 * sw + 1)
        acc = warpgroup_mma(a0, w0.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a1, w1.permute((1, 0)), acc, is_async=True)
        acc, _, _, _, _ = warpgroup_mma_wait(2, deps=[acc, a0, a1, w0, w1])
        if i > 0:
            mbarrier.arrive(a_empty.index((n0 - 2) % A_STAGES))
            mbarrier.arrive(a_empty.index((n0 - 1) % A_STAGES))
            mbarrier.arrive(w_empty.index((KT1 + i - 1) % W_STAGES))
    acc = warpgroup_mma_wait(0, deps=[acc])  # (the last items' slots are never refilled)
    _stamp(dbg_ptr, pid, 6, TIMING)

    out_cols = tile * COLS + cols
    x_ptrs = x_ptr + rows[:, None] * stride_x + out_cols[None, :]
    part = part_ptr + rows[:, None] * WIDTH + out_cols[None, :]
    gl.store(part + split * (TILE_M * WIDTH), acc)
    _cta_barrier()
    arrived = gl.atomic_add(sync_ptr + SPLITS + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:  # the last split: partials in split order, then the residual
        total = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
        for sp in gl.static_range(SPLITS):
            total += gl.load(part + sp * (TILE_M * WIDTH), cache_modifier=".cg")
        res = gl.load(x_ptrs, mask=row_ok, other=0.0, cache_modifier=".cg").to(gl.float32)
        gl.store(x_ptrs, (total + res).to(x_ptr.dtype.element_ty), mask=row_ok)
        gl.atomic_xchg(sync_ptr + SPLITS + tile, 0, sem="relaxed", scope="gpu")

    # the last program out resets the slice counters: every loader has passed its slice wait by then
    _cta_barrier()
    done = gl.atomic_add(sync_ptr + SPLITS + TILES, 1, sem="acq_rel", scope="gpu")
    if done == nprog - 1:
        for sp in gl.static_range(SPLITS):
            gl.atomic_xchg(sync_ptr + sp, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr + SPLITS + TILES, 0, sem="relaxed", scope="gpu")
    _stamp(dbg_ptr, pid, 7, TIMING)


@gluon.jit
def expert_mlp_kernel(
    x_desc, h_desc, wgu_desc, wd_desc, x_ptr, h_ptr, part_ptr, sync_ptr, dbg_ptr, scale_ptr, M, stride_x, stride_h,
    eps, WIDTH: gl.constexpr, MLP: gl.constexpr, COLS: gl.constexpr, BLOCK_K: gl.constexpr, W_STAGES: gl.constexpr,
    A_STAGES: gl.constexpr, USE_PDL: gl.constexpr, TIMING: gl.constexpr, LOADER_REGS: gl.constexpr,
    STAGGER: gl.constexpr, ROW_SCALE: gl.constexpr,
):  # fmt: skip
    """x (M x WIDTH, updated in place), h (M x MLP scratch), wgu [gate; up] (2 MLP x WIDTH), wd (WIDTH x MLP);
    part: SPLITS x 64 x WIDTH fp32; sync: SPLITS + TILES + 1 zeroed int32 counters; dbg: (TIMING) programs x 8
    int64. Grid: MLP // COLS programs, all resident at once."""
    KT1: gl.constexpr = WIDTH // BLOCK_K  # phase-1 K steps
    TILES: gl.constexpr = WIDTH // COLS  # phase-2 output column tiles
    SPLITS: gl.constexpr = (MLP // COLS) // TILES  # phase-2 K splits (programs = TILES * SPLITS)
    K_SPLIT: gl.constexpr = MLP // SPLITS
    KT2: gl.constexpr = K_SPLIT // BLOCK_K
    PRODUCERS: gl.constexpr = K_SPLIT // COLS  # phase-1 programs that make one split's h columns
    gl.static_assert(W_STAGES >= KT2 // 2 + 1, "the loader issues every down item during phase 1")
    gl.static_assert(W_STAGES <= KT1 + KT2 // 2, "no more weight slots than weight items")
    gl.static_assert(A_STAGES <= KT1, "no more activation slots than x tiles")
    gl.static_assert(A_STAGES >= 4, "phase 2 holds two iterations' two h tiles while it releases a step late")
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tile = pid % TILES
    split = pid // TILES

    dtype: gl.constexpr = x_desc.dtype
    w_smem = gl.allocate_shared_memory(dtype, [2 * W_STAGES, COLS, BLOCK_K], wgu_desc.layout)
    a_smem = gl.allocate_shared_memory(dtype, [A_STAGES, TILE_M, BLOCK_K], x_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
    for i in gl.static_range(A_STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _mlp_consumer,
                (w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, x_ptr, h_ptr, part_ptr, sync_ptr, dbg_ptr,
                 scale_ptr, M, stride_x, stride_h, eps, pid, nprog, tile, split, WIDTH, KT1, KT2, TILES, SPLITS,
                 PRODUCERS, COLS, BLOCK_K, W_STAGES, A_STAGES, USE_PDL, TIMING, ROW_SCALE),
            ),
            (
                _mlp_loader,
                (x_desc, h_desc, wgu_desc, wd_desc, w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, sync_ptr, pid,
                 tile, split, MLP, K_SPLIT, KT1, KT2, COLS, BLOCK_K, W_STAGES, A_STAGES, PRODUCERS, USE_PDL, STAGGER),
            ),
        ],
        [1],
        [LOADER_REGS],
    )  # fmt: skip
    for i in gl.static_range(W_STAGES):
        mbarrier.invalidate(w_ready.index(i))
        mbarrier.invalidate(w_empty.index(i))
    for i in gl.static_range(A_STAGES):
        mbarrier.invalidate(a_ready.index(i))
        mbarrier.invalidate(a_empty.index(i))


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def ring_why(cfg: MlpConfig, width: int, mlp: int, itemsize: int = 2) -> str | None:
    """None if the config's rings serve width x MLP without deadlock and fit shared memory, else why not: every down
    weight item issued during phase 1 (w_stages > half the split's K steps), two phase-2 iterations' h tiles
    (a_stages >= 4), no more slots than items (tests/test_gluon_mlp_schedule.py replays the protocol)."""
    k1 = width // BLOCK_K
    k2 = (mlp // (mlp // width)) // BLOCK_K
    if not (k2 // 2 + 1 <= cfg.w_stages <= k1 + k2 // 2 and 4 <= cfg.a_stages <= k1):
        return f"{cfg}: needs {k2 // 2 + 1} <= w_stages <= {k1 + k2 // 2}, 4 <= a_stages <= {k1}"
    if cfg.smem_bytes(itemsize) > SMEM_LIMIT:
        return f"{cfg} needs {cfg.smem_bytes(itemsize)} bytes of shared memory a program"
    return None


def expert_mlp_applies(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       config: MlpConfig | None = None) -> str | None:  # fmt: skip
    """None if `expert_mlp` runs here, else why not (the caller keeps the separate GEMMs): an sm_90 CUDA device with
    enough SMs for every program at once, Triton 3.6's Gluon, bf16/fp16, M <= 64, gate/up (2 MLP x width) and down
    (width x MLP) with MLP = 4 x width (one program per 32 h columns = 4 splits of every 32 output columns), width a
    multiple of 128, unit column strides and 16-byte rows (TMA), and the config's shared memory."""
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        return f"needs an sm_90 CUDA device (TMA + wgmma), found {x.device}"
    why = _gluon_api_ok()
    if why:
        return why
    cfg = config or DEFAULT_CONFIG
    m, width = x.shape
    if x.dtype not in _GL_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        return f"x and weights must all be bf16 or fp16, found {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}"
    mlp = w_down.shape[1] if w_down.dim() == 2 else -1
    if m > BLOCK_M or tuple(w_gate_up.shape) != (2 * mlp, width) or tuple(w_down.shape) != (width, mlp):
        return (f"needs M <= {BLOCK_M}, gate/up (2 MLP, width) and down (width, MLP): x {tuple(x.shape)}, "
                f"gate/up {tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}")  # fmt: skip
    if width % (2 * BLOCK_K) or mlp != 4 * width:
        return f"needs width a multiple of {2 * BLOCK_K} and MLP = 4 x width, found {width} and {mlp}"
    why = ring_why(cfg, width, mlp)
    if why:
        return why
    programs = mlp // COLS
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if programs > sms:
        return f"its {programs} programs wait for each other, so they must all be resident: {sms} SMs"
    for name, t in (("x", x), ("gate/up", w_gate_up), ("down", w_down)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"TMA needs unit column strides, 16-byte rows and 16-byte alignment: {name} {t.stride()}"
    return None


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, *,
               rms_eps: float | None = None, row_scale: torch.Tensor | None = None, workspace: Workspace | None = None,
               config: MlpConfig | None = None, timing: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x += down(gelu_tanh(rs·x @ gateᵀ) · rs·x @ upᵀ) in place, with rs per row either `row_scale` (M,) fp32 or,
    with `rms_eps`, rsqrt(mean(x²) + rms_eps) summed in-kernel (the expert's RMSNorm, its weight folded into the
    gate/up rows): `gemm(x, w_gate_up, h, gated=True, rms_eps=eps)` then `gemm(h, w_down, x, residual=x)` in one
    launch. h (M x MLP) is scratch the kernel writes. `timing`
    (programs x 8 int64, profiling): each program's global-timer stamps (tools/probe_mlp.py reads them).
    Launch-only (graph-capturable once the workspace holds its partials); raises ValueError where
    `expert_mlp_applies` says no."""
    cfg = config or DEFAULT_CONFIG
    if (row_scale is None) == (rms_eps is None):
        raise ValueError("expert_mlp: give rms_eps or row_scale, exactly one")
    why = expert_mlp_applies(x, w_gate_up, w_down, cfg)
    if why:
        raise ValueError(f"expert_mlp: {why}")
    m, width = x.shape
    if row_scale is not None and (
        row_scale.shape != (m,) or row_scale.dtype != torch.float32 or row_scale.stride(0) != 1
    ):
        raise ValueError(f"expert_mlp: row_scale must be contiguous ({m},) fp32, found {tuple(row_scale.shape)}")
    mlp = w_down.shape[1]
    if tuple(h.shape) != (m, mlp) or h.dtype != x.dtype or h.stride(1) != 1 or (h.stride(0) * h.element_size()) % 16:
        raise ValueError(f"expert_mlp: h must be a ({m}, {mlp}) {x.dtype} TMA-able buffer, found {tuple(h.shape)}")
    programs = mlp // COLS
    if timing is not None and (timing.dtype != torch.int64 or timing.numel() < programs * 8):
        raise ValueError(f"expert_mlp: timing must hold {programs} x 8 int64, found {timing.dtype} {timing.numel()}")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tiles, splits = _split_counts(width, mlp)
    ws = workspace or default_workspace(x.device)
    part = ws.floats(splits * BLOCK_M * width)
    sync = ws.counters(splits + tiles + 1)
    dtype = _GL_DTYPES[x.dtype]
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    w_layout = gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_K], dtype)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [BLOCK_M, BLOCK_K], a_layout)
    h_desc = TensorDescriptor(h, list(h.shape), list(h.stride()), [BLOCK_M, BLOCK_K], a_layout)
    wgu_desc = TensorDescriptor(w_gate_up, list(w_gate_up.shape), list(w_gate_up.stride()), [COLS, BLOCK_K], w_layout)
    wd_desc = TensorDescriptor(w_down, list(w_down.shape), list(w_down.stride()), [COLS, BLOCK_K], w_layout)
    use_pdl, _ = pdl_settings(x)
    extra = {"launch_pdl": True} if use_pdl else {}
    expert_mlp_kernel[(programs,)](
        x_desc, h_desc, wgu_desc, wd_desc, x, h, part, sync, timing if timing is not None else sync,
        row_scale if row_scale is not None else part, m, x.stride(0), h.stride(0), float(rms_eps or 0.0),
        WIDTH=width, MLP=mlp, COLS=COLS, BLOCK_K=BLOCK_K, W_STAGES=cfg.w_stages, A_STAGES=cfg.a_stages,
        USE_PDL=bool(use_pdl), TIMING=timing is not None, LOADER_REGS=cfg.loader_regs, STAGGER=cfg.stagger,
        ROW_SCALE=row_scale is not None, num_warps=4, **extra,
    )  # fmt: skip
    return x


def compile_sm90(*, width: int = 1024, mlp: int = 4096, pdl: bool = True, timing: bool = False,
                 config: MlpConfig | None = None, row_scale: bool = False):  # fmt: skip
    """Compile `expert_mlp_kernel` for sm_90 without a GPU, as `expert_mlp` launches it on bf16 (π0's expert dims by
    default); returns the compiled kernel. Needs TRITON_INTERPRET unset (the real compiler)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or DEFAULT_CONFIG
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_K], gl.bfloat16)
    signature = {
        "x_desc": f"tensordesc<bf16[{BLOCK_M},{BLOCK_K}],{a_layout!r}>",
        "h_desc": f"tensordesc<bf16[{BLOCK_M},{BLOCK_K}],{a_layout!r}>",
        "wgu_desc": f"tensordesc<bf16[{COLS},{BLOCK_K}],{w_layout!r}>",
        "wd_desc": f"tensordesc<bf16[{COLS},{BLOCK_K}],{w_layout!r}>",
        "x_ptr": "*bf16", "h_ptr": "*bf16", "part_ptr": "*fp32", "sync_ptr": "*i32",
        "dbg_ptr": "*i64" if timing else "*i32", "scale_ptr": "*fp32", "M": "i32", "stride_x": "i32", "stride_h": "i32", "eps": "fp32",
    }  # fmt: skip
    constexprs = dict(WIDTH=width, MLP=mlp, COLS=COLS, BLOCK_K=BLOCK_K, W_STAGES=cfg.w_stages, A_STAGES=cfg.a_stages,
                      USE_PDL=pdl, TIMING=timing, LOADER_REGS=cfg.loader_regs, STAGGER=cfg.stagger,
                      ROW_SCALE=row_scale)  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = expert_mlp_kernel.arg_names
    aligned = ("x_ptr", "h_ptr", "part_ptr", "sync_ptr", "dbg_ptr", "scale_ptr", "stride_x", "stride_h")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    src = GluonASTSource(expert_mlp_kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
