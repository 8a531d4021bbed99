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
  - Counters only grow within a launch (a meeting's last split is every SPLITS-th arrival); the last program to
    finish zeroes them all, so graph replays start at zero.

Optional phase 0 (`attn`, `w_o`): the layer's O projection x += attn @ w_oᵀ first, split like phase 2 (program p:
32 columns, a quarter of attn's K), its split-K meeting storing x's columns and counting them; the loaders fetch
x's tiles once all 32 column tiles are in. Its weights stream through the same ring ahead of gate/up's.
Optional `layers` > 1 (a probe): stacked layers one after the other in the same launch, the weights streaming
across layer boundaries, a layer-done counter gating each layer's activations. Both measured on the H200 in
session 9, both correct and neither faster (docs/kernels.md: phases wait for activations and hand-offs, not
weights).

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
    tma_descriptor,
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
def _stamp(dbg_ptr, pid, i: gl.constexpr, TIMING: gl.constexpr, when=True):
    """(TIMING only, and when) the global nanosecond timer into dbg[pid, i]: where a program's time goes
    (tools/probe_mlp.py)."""
    if TIMING:
        if when:
            t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                          pack=1)  # fmt: skip
            gl.store(dbg_ptr + pid * 8 + i, t)


@gluon.jit
def _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, n, pid, tile, split, rot1, rot2,
             WIDTH: gl.constexpr, MLP: gl.constexpr, K_SPLIT: gl.constexpr, K0_SPLIT: gl.constexpr,
             WO: gl.constexpr, KT1: gl.constexpr, KT2: gl.constexpr, COLS: gl.constexpr, BLOCK_K: gl.constexpr,
             W_STAGES: gl.constexpr, W_TOTAL: gl.constexpr):  # fmt: skip
    """Weight item n < W_TOTAL (else nothing) into slot n % W_STAGES (two boxes, one barrier). A layer's items, j =
    n mod W_ITEMS: j < WO the O rows of K steps 2j, 2j + 1 of this program's split of the O projection; then the
    gate and up rows of K step (j - WO + rot1) % KT1; then the down rows of K steps 2i and 2i + 1 of this program's
    split, i = (j - WO - KT1 + rot2) % (KT2 / 2). Layer n // W_ITEMS reads the rows of that layer in the stacked
    weights. The rotations stagger which activation columns the programs read at a time (see _mlp_loader)."""
    W_ITEMS: gl.constexpr = WO + KT1 + KT2 // 2
    if n < W_TOTAL:
        s = n % W_STAGES
        layer = n // W_ITEMS
        j = n - layer * W_ITEMS
        if n >= W_STAGES:  # the slot's previous item must have been consumed
            mbarrier.wait(w_empty.index(s), ((n // W_STAGES) & 1) ^ 1)
        mbarrier.expect(w_ready.index(s), 2 * wgu_desc.block_type.nbytes)
        if j < WO:
            k0 = split * K0_SPLIT + 2 * j * BLOCK_K
            row = layer * WIDTH + tile * COLS
            _tma_load(wo_desc, [row, k0], w_ready.index(s), w_smem.index(2 * s))
            _tma_load(wo_desc, [row, k0 + BLOCK_K], w_ready.index(s), w_smem.index(2 * s + 1))
        elif j < WO + KT1:
            k1 = ((j - WO + rot1) % KT1) * BLOCK_K
            row = layer * (2 * MLP) + pid * COLS
            _tma_load(wgu_desc, [row, k1], w_ready.index(s), w_smem.index(2 * s))
            _tma_load(wgu_desc, [row + MLP, k1], w_ready.index(s), w_smem.index(2 * s + 1))
        else:
            k0 = split * K_SPLIT + 2 * ((j - WO - KT1 + rot2) % (KT2 // 2)) * BLOCK_K
            row = layer * WIDTH + tile * COLS
            _tma_load(wd_desc, [row, k0], w_ready.index(s), w_smem.index(2 * s))
            _tma_load(wd_desc, [row, k0 + BLOCK_K], w_ready.index(s), w_smem.index(2 * s + 1))


@gluon.jit
def _issue_a(desc, a_smem, a_ready, a_empty, col, n, A_STAGES: gl.constexpr):
    """Activation item n (a 64 x BLOCK_K tile of attn, x or h at column col) into slot n % A_STAGES."""
    s = n % A_STAGES
    if n >= A_STAGES:
        mbarrier.wait(a_empty.index(s), ((n // A_STAGES) & 1) ^ 1)
    mbarrier.expect(a_ready.index(s), desc.block_type.nbytes)
    _tma_load(desc, [0, col], a_ready.index(s), a_smem.index(s))


@gluon.jit
def _poll_at_least(ptr, target):
    """Poll an int32 counter (ld.acquire) until it reaches target, then order the acquire before TMA reads."""
    seen = _load_acquire(ptr)
    while seen < target:
        seen = _load_acquire(ptr)
    _fence_proxy_async()


@gluon.jit
def _mlp_loader(attn_desc, x_desc, h_desc, wo_desc, wgu_desc, wd_desc, w_smem, a_smem, w_ready, w_empty, a_ready,
                a_empty, sync_ptr, pid, tile, split, WIDTH: gl.constexpr, MLP: gl.constexpr, K_SPLIT: gl.constexpr,
                K0_SPLIT: gl.constexpr, KT0: gl.constexpr, KT1: gl.constexpr, KT2: gl.constexpr,
                TILES: gl.constexpr, SPLITS: gl.constexpr, COLS: gl.constexpr, BLOCK_K: gl.constexpr,
                W_STAGES: gl.constexpr, A_STAGES: gl.constexpr, PRODUCERS: gl.constexpr, USE_PDL: gl.constexpr,
                STAGGER: gl.constexpr, LAYERS: gl.constexpr):  # fmt: skip
    """The 1-warp producer. Items go in the order the consumer takes them. One rule for every consumer step that
    takes weight item w: the loader issues item w + W_STAGES - 1, whose slot frees when the consumer releases item
    w - 1, after that step's activation items (the consumer releases w - 1 once it has issued step w's MMAs), or,
    for a phase's first step, before the phase's wait for other programs (w - 1 is then the previous phase's last
    item, released when that phase ends): the loader only ever waits for a slot whose item the consumer can
    already finish (tests/test_gluon_mlp_schedule.py replays this order against the consumer's releases for every
    accepted config). So the weights run W_STAGES - 1 items ahead of the consumer across phases and layers.
    STAGGER: program p walks phase 1's K steps from p % KT1 and phase 2's from its column tile's offset, so the
    programs do not all ask L2 for the same activation lines at once (128 readers of every x line, 32 of every h
    line); the sums are the same in another order, fixed per program. KT0 > 0: phase 0 (x += attn @ w_oᵀ) first,
    and x's tiles only once every column tile of it landed. LAYERS > 1: a layer's activations only once every
    column tile of the previous layer's phase 2 landed."""
    WO: gl.constexpr = KT0 // 2
    W_ITEMS: gl.constexpr = WO + KT1 + KT2 // 2
    W_TOTAL: gl.constexpr = LAYERS * W_ITEMS
    A_ITEMS: gl.constexpr = KT0 + KT1 + KT2
    X_DONE: gl.constexpr = SPLITS + TILES + 1
    LAYER_DONE: gl.constexpr = SPLITS + TILES + 2
    rot1 = (pid % KT1) * STAGGER
    rot2 = (tile % (KT2 // 2)) * STAGGER
    for n in gl.static_range(W_STAGES):  # before the PDL wait: weights are never written by a kernel
        _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, n, pid, tile, split, rot1, rot2, WIDTH, MLP,
                 K_SPLIT, K0_SPLIT, WO, KT1, KT2, COLS, BLOCK_K, W_STAGES, W_TOTAL)  # fmt: skip
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    for layer in range(LAYERS):
        bw = layer * W_ITEMS  # this layer's first weight item and activation item
        ba = layer * A_ITEMS
        if layer > 0:  # the layer's first step's item, then its activations wait for the previous layer's x
            _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, bw + W_STAGES - 1, pid, tile, split, rot1,
                     rot2, WIDTH, MLP, K_SPLIT, K0_SPLIT, WO, KT1, KT2, COLS, BLOCK_K, W_STAGES, W_TOTAL)  # fmt: skip
            _poll_at_least(sync_ptr + LAYER_DONE, layer * TILES)
        if KT0 > 0:  # phase 0: attn tiles 2i, 2i + 1 of this program's split, then weight item i + W_STAGES - 1
            for i in range(WO):
                col = split * K0_SPLIT + 2 * i * BLOCK_K
                _issue_a(attn_desc, a_smem, a_ready, a_empty, col, ba + 2 * i, A_STAGES)
                _issue_a(attn_desc, a_smem, a_ready, a_empty, col + BLOCK_K, ba + 2 * i + 1, A_STAGES)
                if i >= 1:
                    _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, bw + i + W_STAGES - 1, pid, tile,
                             split, rot1, rot2, WIDTH, MLP, K_SPLIT, K0_SPLIT, WO, KT1, KT2, COLS, BLOCK_K, W_STAGES,
                             W_TOTAL)  # fmt: skip
            _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, bw + WO + W_STAGES - 1, pid, tile, split,
                     rot1, rot2, WIDTH, MLP, K_SPLIT, K0_SPLIT, WO, KT1, KT2, COLS, BLOCK_K, W_STAGES,
                     W_TOTAL)  # fmt: skip
            _poll_at_least(sync_ptr + X_DONE, (layer + 1) * TILES)  # every column tile of x += O(attn) stored
        for k in range(KT1):  # phase 1: x tile k, then weight item WO + k + W_STAGES - 1
            _issue_a(x_desc, a_smem, a_ready, a_empty, ((k + rot1) % KT1) * BLOCK_K, ba + KT0 + k, A_STAGES)
            if k >= 1:
                _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, bw + WO + k + W_STAGES - 1, pid, tile,
                         split, rot1, rot2, WIDTH, MLP, K_SPLIT, K0_SPLIT, WO, KT1, KT2, COLS, BLOCK_K, W_STAGES,
                         W_TOTAL)  # fmt: skip
        # phase 2: its first step's item, then, once the PRODUCERS programs that make this split's h columns have
        # published them, h's tiles (K step 2i + j % 2 of the split, i = (j // 2 + rot2) % (KT2 / 2))
        _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, bw + WO + KT1 + W_STAGES - 1, pid, tile,
                 split, rot1, rot2, WIDTH, MLP, K_SPLIT, K0_SPLIT, WO, KT1, KT2, COLS, BLOCK_K, W_STAGES,
                 W_TOTAL)  # fmt: skip
        _poll_at_least(sync_ptr + split, (layer + 1) * PRODUCERS)
        for j in range(KT2):
            col = split * K_SPLIT + (2 * ((j // 2 + rot2) % (KT2 // 2)) + j % 2) * BLOCK_K
            _issue_a(h_desc, a_smem, a_ready, a_empty, col, ba + KT0 + KT1 + j, A_STAGES)
            if j % 2 == 1 and j >= 3:
                _issue_w(wo_desc, wgu_desc, wd_desc, w_smem, w_ready, w_empty, bw + WO + KT1 + j // 2 + W_STAGES - 1,
                         pid, tile, split, rot1, rot2, WIDTH, MLP, K_SPLIT, K0_SPLIT, WO, KT1, KT2, COLS, BLOCK_K,
                         W_STAGES, W_TOTAL)  # fmt: skip


@gluon.jit
def _pair_steps(w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, acc, A0, W0, STEPS: gl.constexpr,
                W_STAGES: gl.constexpr, A_STAGES: gl.constexpr, dbg_ptr, pid, STAMP: gl.constexpr,
                TIMING: gl.constexpr, when=True):  # fmt: skip
    """acc += A items A0 + 2i, A0 + 2i + 1 times weight item W0 + i's two boxes, i < STEPS: one step's two MMAs in
    flight, each step's items released once the next step's MMAs are issued, the last step's at the end. (TIMING:
    stamp STAMP when the first tile is in.)"""
    for i in range(STEPS):
        n0 = A0 + 2 * i
        s0 = n0 % A_STAGES
        s1 = (n0 + 1) % A_STAGES
        sw = (W0 + i) % W_STAGES
        mbarrier.wait(a_ready.index(s0), (n0 // A_STAGES) & 1)
        if i == 0:
            _stamp(dbg_ptr, pid, STAMP, TIMING, when)
        mbarrier.wait(a_ready.index(s1), ((n0 + 1) // A_STAGES) & 1)
        mbarrier.wait(w_ready.index(sw), ((W0 + i) // W_STAGES) & 1)
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
            mbarrier.arrive(w_empty.index((W0 + i - 1) % W_STAGES))
    acc = warpgroup_mma_wait(0, deps=[acc])
    last = A0 + 2 * STEPS - 2
    mbarrier.arrive(a_empty.index(last % A_STAGES))
    mbarrier.arrive(a_empty.index((last + 1) % A_STAGES))
    mbarrier.arrive(w_empty.index((W0 + STEPS - 1) % W_STAGES))
    return acc


@gluon.jit
def _meet_splits(acc, part_ptr, count_ptr, x_ptr, rows, out_cols, row_ok, stride_x, split, WIDTH: gl.constexpr,
                 SPLITS: gl.constexpr):  # fmt: skip
    """The split-K meeting of one column tile: leave this split's fp32 partial; the last split to arrive (the
    counter only grows within a launch: every SPLITS-th arrival) adds all of them in split order and the residual
    and stores x's columns. Returns whether this program was that last one."""
    part = part_ptr + rows[:, None] * WIDTH + out_cols[None, :]
    gl.store(part + split * (TILE_M * WIDTH), acc)
    _cta_barrier()
    arrived = gl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived % SPLITS == SPLITS - 1
    if last:
        total = gl.zeros_like(acc)
        for sp in gl.static_range(SPLITS):
            total += gl.load(part + sp * (TILE_M * WIDTH), cache_modifier=".cg")
        x_ptrs = x_ptr + rows[:, None] * stride_x + out_cols[None, :]
        res = gl.load(x_ptrs, mask=row_ok, other=0.0, cache_modifier=".cg").to(gl.float32)
        gl.store(x_ptrs, (total + res).to(x_ptr.dtype.element_ty), mask=row_ok)
    return last


@gluon.jit
def _mlp_consumer(w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, x_ptr, h_ptr, part_ptr, sync_ptr, dbg_ptr,
                  scale_ptr, M, stride_x, stride_h, eps, pid, nprog, tile, split, WIDTH: gl.constexpr,
                  KT0: gl.constexpr, KT1: gl.constexpr, KT2: gl.constexpr, TILES: gl.constexpr, SPLITS: gl.constexpr,
                  PRODUCERS: gl.constexpr, COLS: gl.constexpr, BLOCK_K: gl.constexpr, W_STAGES: gl.constexpr,
                  A_STAGES: gl.constexpr, USE_PDL: gl.constexpr, TIMING: gl.constexpr, ROW_SCALE: gl.constexpr,
                  LAYERS: gl.constexpr):  # fmt: skip
    """The default partition, one warpgroup, per layer: phase 0 (KT0 > 0: x += O(attn), split-K meeting, publish
    the tile), phase 1 (gate/up, RMS, GeGLU, publish h), phase 2 (down over this program's split, split-K meeting;
    LAYERS > 1: publish the tile for the next layer); at the end the counters' reset by the last program. Counters
    only grow within a launch, so a layer waits for (layer + 1) x its count. (TIMING: the middle layer's stamps.)"""
    WO: gl.constexpr = KT0 // 2
    W_ITEMS: gl.constexpr = WO + KT1 + KT2 // 2
    A_ITEMS: gl.constexpr = KT0 + KT1 + KT2
    DONE: gl.constexpr = SPLITS + TILES  # counter: programs finished
    X_DONE: gl.constexpr = SPLITS + TILES + 1  # counter: column tiles of phase 0 stored
    LAYER_DONE: gl.constexpr = SPLITS + TILES + 2  # counter: column tiles of phase 2 stored
    COUNTERS: gl.constexpr = SPLITS + TILES + 3
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
    out_cols = tile * COLS + cols
    h_cols = pid * COLS + cols

    for layer in range(LAYERS):
        bw = layer * W_ITEMS  # this layer's first weight item and activation item
        ba = layer * A_ITEMS
        stamp = layer == LAYERS // 2
        # ---- phase 0 (KT0 > 0): x[:, tile] += attn[:, split] @ o[tile, split]ᵀ ------------------------------
        if KT0 > 0:
            acc = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
            acc = _pair_steps(w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, acc, ba, bw, WO, W_STAGES,
                              A_STAGES, dbg_ptr, pid, 1, False)  # fmt: skip
            if _meet_splits(acc, part_ptr, sync_ptr + SPLITS + tile, x_ptr, rows, out_cols, row_ok, stride_x, split,
                            WIDTH, SPLITS):  # fmt: skip
                _fence_proxy_async()  # x's new columns before other programs' TMA reads of them
                _cta_barrier()
                gl.atomic_add(sync_ptr + X_DONE, 1, sem="release", scope="gpu")

        # ---- phase 1: this program's h columns; the RMS factor given, or summed from the x tiles ------------
        acc_g = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
        acc_u = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
        a1 = ba + KT0  # phase 1's first activation item and weight item
        w1 = bw + WO
        if ROW_SCALE:  # only MMAs: one K step's pair in flight, each step's slots released once the next is issued
            rs = gl.load(scale_ptr + rows, mask=rows < M, other=1.0).to(gl.float32)
            for k in range(KT1):
                sa = (a1 + k) % A_STAGES
                sw = (w1 + k) % W_STAGES
                mbarrier.wait(a_ready.index(sa), ((a1 + k) // A_STAGES) & 1)
                if k == 0:
                    _stamp(dbg_ptr, pid, 2, TIMING, stamp)
                mbarrier.wait(w_ready.index(sw), ((w1 + k) // W_STAGES) & 1)
                a = a_smem.index(sa)
                wg = w_smem.index(2 * sw)
                wu = w_smem.index(2 * sw + 1)
                acc_g = warpgroup_mma(a, wg.permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(a, wu.permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u, _, _, _ = warpgroup_mma_wait(2, deps=[acc_g, acc_u, a, wg, wu])
                if k > 0:  # <= 2 groups in flight: the previous step's pair has retired
                    mbarrier.arrive(a_empty.index((a1 + k - 1) % A_STAGES))
                    mbarrier.arrive(w_empty.index((w1 + k - 1) % W_STAGES))
            acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
            mbarrier.arrive(a_empty.index((a1 + KT1 - 1) % A_STAGES))
            mbarrier.arrive(w_empty.index((w1 + KT1 - 1) % W_STAGES))
            _stamp(dbg_ptr, pid, 3, TIMING, stamp)
        else:
            ssq = gl.zeros([TILE_M], gl.float32, gl.SliceLayout(1, a_regs))
            for k in range(KT1):
                sa = (a1 + k) % A_STAGES
                sw = (w1 + k) % W_STAGES
                mbarrier.wait(a_ready.index(sa), ((a1 + k) // A_STAGES) & 1)
                if k == 0:
                    _stamp(dbg_ptr, pid, 2, TIMING, stamp)
                a = a_smem.index(sa)
                xa = a.load(a_regs).to(gl.float32)
                ssq += gl.sum(xa * xa, axis=1)
                mbarrier.wait(w_ready.index(sw), ((w1 + k) // W_STAGES) & 1)
                acc_g = warpgroup_mma(a, w_smem.index(2 * sw).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(a, w_smem.index(2 * sw + 1).permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
                _cta_barrier()  # every warp's shared-memory reads of the x tile are done before its slot is refilled
                mbarrier.arrive(a_empty.index(sa))
                mbarrier.arrive(w_empty.index(sw))
            _stamp(dbg_ptr, pid, 3, TIMING, stamp)
            rs = gl.convert_layout(gl.rsqrt(ssq / WIDTH + eps), row_layout)
        hval = _gelu_tanh(acc_g * rs[:, None]) * (acc_u * rs[:, None])
        gl.store(h_ptr + rows[:, None] * stride_h + h_cols[None, :], hval.to(h_ptr.dtype.element_ty), mask=row_ok)
        _fence_proxy_async()  # these generic-proxy stores before other programs' TMA reads of h
        _cta_barrier()  # every thread's h stores issued before the (one-thread) release
        gl.atomic_add(sync_ptr + pid // PRODUCERS, 1, sem="release", scope="gpu")
        _stamp(dbg_ptr, pid, 4, TIMING, stamp)

        # ---- phase 2: x[:, tile] += h[:, split] @ down[tile, split]ᵀ, two K steps a weight item -------------
        acc = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
        acc = _pair_steps(w_smem, a_smem, w_ready, w_empty, a_ready, a_empty, acc, a1 + KT1, w1 + KT1, KT2 // 2,
                          W_STAGES, A_STAGES, dbg_ptr, pid, 5, TIMING, stamp)  # fmt: skip
        _stamp(dbg_ptr, pid, 6, TIMING, stamp)
        if _meet_splits(acc, part_ptr, sync_ptr + SPLITS + tile, x_ptr, rows, out_cols, row_ok, stride_x, split,
                        WIDTH, SPLITS):  # fmt: skip
            if LAYERS > 1:  # the next layer's x tiles (TMA) and residual reads wait for every column tile
                _fence_proxy_async()
                _cta_barrier()
                gl.atomic_add(sync_ptr + LAYER_DONE, 1, sem="release", scope="gpu")

    # the last program out resets every counter: every loader has passed its waits by then, and the next launch
    # (the next graph node, or a PDL dependent past its wait) sees the stores once this grid has finished
    _cta_barrier()
    done = gl.atomic_add(sync_ptr + DONE, 1, sem="acq_rel", scope="gpu")
    if done == nprog - 1:
        c_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        for base in gl.static_range(0, COUNTERS, 32):
            c = base + gl.arange(0, 32, layout=c_layout)
            gl.store(sync_ptr + c, gl.zeros_like(c), mask=c < COUNTERS)
    _stamp(dbg_ptr, pid, 7, TIMING)


@gluon.jit
def expert_mlp_kernel(
    attn_desc, x_desc, h_desc, wo_desc, wgu_desc, wd_desc, x_ptr, h_ptr, part_ptr, sync_ptr, dbg_ptr, scale_ptr, M,
    stride_x, stride_h, eps, WIDTH: gl.constexpr, MLP: gl.constexpr, K_O: gl.constexpr, COLS: gl.constexpr,
    BLOCK_K: gl.constexpr, W_STAGES: gl.constexpr, A_STAGES: gl.constexpr, USE_PDL: gl.constexpr,
    TIMING: gl.constexpr, LOADER_REGS: gl.constexpr, STAGGER: gl.constexpr, ROW_SCALE: gl.constexpr,
    LAYERS: gl.constexpr,
):  # fmt: skip
    """x (M x WIDTH, updated in place), h (M x MLP scratch), wgu [gate; up] (2 MLP x WIDTH), wd (WIDTH x MLP);
    K_O > 0: attn (M x K_O) and wo (WIDTH x K_O), x += attn @ woᵀ first. LAYERS > 1: the weights hold that many
    layers stacked along their rows, run one after the other (the same attn each layer). part: SPLITS x 64 x WIDTH
    fp32; sync: SPLITS + TILES + 3 zeroed int32 counters; dbg: (TIMING) programs x 8 int64. Grid: MLP // COLS
    programs, all resident at once."""
    KT1: gl.constexpr = WIDTH // BLOCK_K  # phase-1 K steps
    TILES: gl.constexpr = WIDTH // COLS  # phase-0 and phase-2 output column tiles
    SPLITS: gl.constexpr = (MLP // COLS) // TILES  # their K splits (programs = TILES * SPLITS)
    K_SPLIT: gl.constexpr = MLP // SPLITS
    KT2: gl.constexpr = K_SPLIT // BLOCK_K
    K0_SPLIT: gl.constexpr = K_O // SPLITS
    KT0: gl.constexpr = K0_SPLIT // BLOCK_K  # phase-0 K steps (0: no phase 0)
    PRODUCERS: gl.constexpr = K_SPLIT // COLS  # phase-1 programs that make one split's h columns
    gl.static_assert(W_STAGES >= 2, "a step's weight item and the one the loader issues after it")
    gl.static_assert(W_STAGES <= KT0 // 2 + KT1 + KT2 // 2, "no more weight slots than a layer's weight items")
    gl.static_assert(A_STAGES <= KT1, "no more activation slots than x tiles")
    gl.static_assert(A_STAGES >= 4, "phases 0 and 2 hold two steps' two tiles while they release a step late")
    gl.static_assert(KT0 % 2 == 0, "phase 0 takes two K steps a weight item")
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
                 scale_ptr, M, stride_x, stride_h, eps, pid, nprog, tile, split, WIDTH, KT0, KT1, KT2, TILES, SPLITS,
                 PRODUCERS, COLS, BLOCK_K, W_STAGES, A_STAGES, USE_PDL, TIMING, ROW_SCALE, LAYERS),
            ),
            (
                _mlp_loader,
                (attn_desc, x_desc, h_desc, wo_desc, wgu_desc, wd_desc, w_smem, a_smem, w_ready, w_empty, a_ready,
                 a_empty, sync_ptr, pid, tile, split, WIDTH, MLP, K_SPLIT, K0_SPLIT, KT0, KT1, KT2, TILES, SPLITS,
                 COLS, BLOCK_K, W_STAGES, A_STAGES, PRODUCERS, USE_PDL, STAGGER, LAYERS),
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


def ring_why(cfg: MlpConfig, width: int, mlp: int, itemsize: int = 2, k_o: int = 0) -> str | None:
    """None if the config's rings serve width x MLP (and, k_o > 0, the O projection's K) without deadlock and fit
    shared memory, else why not: a step's weight item and the one the loader issues after it (w_stages >= 2), two
    steps' tiles of phases 0 and 2 (a_stages >= 4), no more slots than a layer's items
    (tests/test_gluon_mlp_schedule.py replays the protocol)."""
    _, splits = _split_counts(width, mlp)
    k1 = width // BLOCK_K
    k2 = (mlp // splits) // BLOCK_K
    w_items = (k_o // splits) // BLOCK_K // 2 + k1 + k2 // 2
    if not (2 <= cfg.w_stages <= w_items and 4 <= cfg.a_stages <= k1):
        return f"{cfg}: needs 2 <= w_stages <= {w_items}, 4 <= a_stages <= {k1}"
    if cfg.smem_bytes(itemsize) > SMEM_LIMIT:
        return f"{cfg} needs {cfg.smem_bytes(itemsize)} bytes of shared memory a program"
    return None


def expert_mlp_applies(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       config: MlpConfig | None = None, attn: torch.Tensor | None = None,
                       w_o: torch.Tensor | None = None, layers: int = 1) -> str | None:  # fmt: skip
    """None if `expert_mlp` runs here, else why not (the caller keeps the separate GEMMs): an sm_90 CUDA device with
    enough SMs for every program at once, Triton 3.6's Gluon, bf16/fp16, M <= 64, gate/up (2 MLP x width) and down
    (width x MLP) with MLP = 4 x width (one program per 32 h columns = 4 splits of every 32 output columns), width a
    multiple of 128, unit column strides and 16-byte rows (TMA), and the config's shared memory; with the O
    projection (`attn` (M x K_O), `w_o` (width x K_O)) K_O a multiple of 4 x 128; `layers` > 1: every weight holds
    that many layers stacked along its rows."""
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
    if layers < 1:
        return f"layers must be >= 1, found {layers}"
    n = layers
    if m > BLOCK_M or tuple(w_gate_up.shape) != (n * 2 * mlp, width) or tuple(w_down.shape) != (n * width, mlp):
        return (f"needs M <= {BLOCK_M}, gate/up ({n} x 2 MLP, width) and down ({n} x width, MLP): x {tuple(x.shape)}, "
                f"gate/up {tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}")  # fmt: skip
    if width % (2 * BLOCK_K) or mlp != 4 * width:
        return f"needs width a multiple of {2 * BLOCK_K} and MLP = 4 x width, found {width} and {mlp}"
    k_o = 0
    if (attn is None) != (w_o is None):
        return "the O projection needs both attn and w_o"
    if attn is not None:
        k_o = attn.shape[1] if attn.dim() == 2 else -1
        if (
            tuple(attn.shape) != (m, k_o)
            or tuple(w_o.shape) != (n * width, k_o)
            or k_o % ((mlp // width) * 2 * BLOCK_K)
        ):
            return (f"the O projection needs attn (M, K_O) and w_o ({n} x width, K_O), K_O a multiple of "
                    f"{(mlp // width) * 2 * BLOCK_K}: attn {tuple(attn.shape)}, w_o {tuple(w_o.shape)}")  # fmt: skip
        if attn.dtype != x.dtype or w_o.dtype != x.dtype:
            return f"attn and w_o must be {x.dtype}, found {attn.dtype} and {w_o.dtype}"
    why = ring_why(cfg, width, mlp, x.element_size(), k_o)
    if why:
        return why
    programs = mlp // COLS
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if programs > sms:
        return f"its {programs} programs wait for each other, so they must all be resident: {sms} SMs"
    named = [("x", x), ("gate/up", w_gate_up), ("down", w_down)] + ([("attn", attn), ("w_o", w_o)] if k_o else [])
    for name, t in named:
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"TMA needs unit column strides, 16-byte rows and 16-byte alignment: {name} {t.stride()}"
    return None


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, *,
               rms_eps: float | None = None, row_scale: torch.Tensor | None = None, attn: torch.Tensor | None = None,
               w_o: torch.Tensor | None = None, layers: int = 1, workspace: Workspace | None = None,
               config: MlpConfig | None = None, timing: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x += down(gelu_tanh(rs·x @ gateᵀ) · rs·x @ upᵀ) in place, with rs per row either `row_scale` (M,) fp32 or,
    with `rms_eps`, rsqrt(mean(x²) + rms_eps) summed in-kernel (the expert's RMSNorm, its weight folded into the
    gate/up rows): `gemm(x, w_gate_up, h, gated=True, rms_eps=eps)` then `gemm(h, w_down, x, residual=x)` in one
    launch. With `attn` (M x K_O) and `w_o` (width x K_O) it first does `gemm(attn, w_o, x, residual=x)` (the
    layer's O projection) in the same launch (phase 0; the RMS factor then has to be summed in-kernel). h (M x MLP)
    is scratch the kernel writes. `layers` > 1 (a probe of a kernel that walks the layers itself, not the
    engine's path): w_gate_up, w_down (and w_o) hold that many layers stacked along their rows, and the launch runs
    them one after the other, each layer's work waiting for every column tile of the previous layer's x, as the
    QKV and attention between them would (the same attn every layer). `timing` (programs x 8 int64, profiling): each program's global-timer stamps
    (tools/probe_mlp.py reads them).
    Launch-only (graph-capturable once the workspace holds its partials); raises ValueError where
    `expert_mlp_applies` says no."""
    cfg = config or DEFAULT_CONFIG
    if (row_scale is None) == (rms_eps is None):
        raise ValueError("expert_mlp: give rms_eps or row_scale, exactly one")
    if attn is not None and row_scale is not None:
        raise ValueError("expert_mlp: with the O projection the RMS factor of the new x is summed in-kernel (rms_eps)")
    why = expert_mlp_applies(x, w_gate_up, w_down, cfg, attn, w_o, layers)
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
    tiles, splits = _split_counts(width, mlp)
    ws = workspace or default_workspace(x.device)
    part = ws.floats(splits * BLOCK_M * width)
    sync = ws.counters(splits + tiles + 3)
    tile_a, tile_w = [BLOCK_M, BLOCK_K], [COLS, BLOCK_K]  # activation and weight boxes
    x_desc, h_desc = tma_descriptor(x, tile_a), tma_descriptor(h, tile_a)
    wgu_desc, wd_desc = tma_descriptor(w_gate_up, tile_w), tma_descriptor(w_down, tile_w)
    attn_desc, wo_desc = x_desc, wd_desc  # stand-ins without phase 0
    if attn is not None:
        attn_desc, wo_desc = tma_descriptor(attn, tile_a), tma_descriptor(w_o, tile_w)
    use_pdl, _ = pdl_settings(x)
    extra = {"launch_pdl": True} if use_pdl else {}
    expert_mlp_kernel[(programs,)](
        attn_desc, x_desc, h_desc, wo_desc, wgu_desc, wd_desc, x, h, part, sync,
        timing if timing is not None else sync, row_scale if row_scale is not None else part, m, x.stride(0),
        h.stride(0), float(rms_eps or 0.0),
        WIDTH=width, MLP=mlp, K_O=0 if attn is None else attn.shape[1], COLS=COLS, BLOCK_K=BLOCK_K,
        W_STAGES=cfg.w_stages, A_STAGES=cfg.a_stages, USE_PDL=bool(use_pdl), TIMING=timing is not None, LOADER_REGS=cfg.loader_regs, STAGGER=cfg.stagger,
        ROW_SCALE=row_scale is not None, LAYERS=layers, num_warps=4, **extra,
    )  # fmt: skip
    return x


def compile_sm90(*, width: int = 1024, mlp: int = 4096, pdl: bool = True, timing: bool = False,
                 config: MlpConfig | None = None, row_scale: bool = False, k_o: int = 0, layers: int = 1):  # fmt: skip
    """Compile `expert_mlp_kernel` for sm_90 without a GPU, as `expert_mlp` launches it on bf16 (π0's expert dims by
    default); returns the compiled kernel. Needs TRITON_INTERPRET unset (the real compiler)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or DEFAULT_CONFIG
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_K], gl.bfloat16)
    signature = {
        "attn_desc": f"tensordesc<bf16[{BLOCK_M},{BLOCK_K}],{a_layout!r}>",
        "x_desc": f"tensordesc<bf16[{BLOCK_M},{BLOCK_K}],{a_layout!r}>",
        "h_desc": f"tensordesc<bf16[{BLOCK_M},{BLOCK_K}],{a_layout!r}>",
        "wo_desc": f"tensordesc<bf16[{COLS},{BLOCK_K}],{w_layout!r}>",
        "wgu_desc": f"tensordesc<bf16[{COLS},{BLOCK_K}],{w_layout!r}>",
        "wd_desc": f"tensordesc<bf16[{COLS},{BLOCK_K}],{w_layout!r}>",
        "x_ptr": "*bf16", "h_ptr": "*bf16", "part_ptr": "*fp32", "sync_ptr": "*i32",
        "dbg_ptr": "*i64" if timing else "*i32", "scale_ptr": "*fp32", "M": "i32", "stride_x": "i32", "stride_h": "i32", "eps": "fp32",
    }  # fmt: skip
    constexprs = dict(WIDTH=width, MLP=mlp, K_O=k_o, COLS=COLS, BLOCK_K=BLOCK_K, W_STAGES=cfg.w_stages, A_STAGES=cfg.a_stages,
                      USE_PDL=pdl, TIMING=timing, LOADER_REGS=cfg.loader_regs, STAGGER=cfg.stagger,
                      ROW_SCALE=row_scale, LAYERS=layers)  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = expert_mlp_kernel.arg_names
    aligned = ("x_ptr", "h_ptr", "part_ptr", "sync_ptr", "dbg_ptr", "scale_ptr", "stride_x", "stride_h")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    src = GluonASTSource(expert_mlp_kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
