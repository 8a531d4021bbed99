"""Experiment: a warp-specialized Gluon GEMM for π0's 64-row action-expert GEMMs inside a PDL chain.

Hypothesis. The action expert's GEMMs (M = 64 rows, bf16, K 1024..4096, N 1024..8192) are latency-bound: each is
one kernel of a CUDA Graph launched with programmatic dependent launch (PDL), so a kernel may start while the
previous one finishes and must execute `griddepcontrol.wait` before it reads that kernel's output. The weights are
never written by any kernel, so a kernel may stream them into shared memory *before* the wait. Here a 1-warp TMA
loader partition fills a deep shared-memory ring of weight tiles, then waits, then TMA-loads the 64-row activation
slice A once; a 4-warp (one warpgroup) consumer runs wgmma over the ring. The pipeline fill then overlaps the
previous kernel's tail, which a plain Triton kernel (that must wait before its first load) cannot do.

Gated variant (`gated=True`, the kernel's GATED constexpr): π0's expert gate/up projection, the largest expert
GEMM: W = [gate; up] is (2N, K), out = gelu_tanh(A @ Wgᵀ) * (A @ Wuᵀ), N 4096, K 1024. Each ring stage holds the
gate tile and the up tile of one K step (two TMA copies on the stage's `ready` barrier, which expects both byte
counts), the consumer keeps two fp32 accumulators and applies the GeGLU in the epilogue (exp2 form of gelu_tanh).
With GATED False every branch is constexpr, so the plain kernel compiles to the same PTX as before it existed.

Split-K variant (`split_k` > 1, the kernel's SPLIT_K constexpr; `-splitk<S>` in the name): π0's expert down
projection has K = 4096, too long for a resident A slice (64 x 4096 bf16 = 512 KiB). The grid becomes (N /
BLOCK_N, SPLIT_K); program (n, s) runs the same pipeline on the K slice [s K / S, (s + 1) K / S) (K / S <= 1024:
A slice resident, the W ring still filled before the PDL wait) and stores its fp32 partial tile (rows < M) into a
(S, M, N) workspace (`splitk_workspace`: one per shape, allocated on the first, eager call; a first call inside
graph capture raises instead of allocating). A second kernel, `splitk_combine_kernel` (plain triton.jit, launched
with PDL, `griddepcontrol.wait` before its first load), sums the partials in split order (deterministic), adds the
residual (may alias out) and stores bf16. SPLIT_K == 1 is the single-kernel path, its PTX unchanged (checked:
the code sections of all 16 earlier compiles are identical before and after split-K).

What runs (`python tools/gluon_skinny_gemm.py --out DIR` on the H200):
  1. correctness of every Gluon variant against an fp32 torch reference at (M, N, K) = (64, 2560, 1024),
     (64, 1024, 1024), (51, 2560, 1024), with and without the residual add (relative error < 1e-2, else FAIL and a
     non-zero exit), and of the 36-launch chain below against the same chain run with torch (a PDL race would show
     up there: a kernel reading a stale activation); for the gated variants (and the baselines) at (M, N, K) =
     (64, 4096, 1024) and (51, 4096, 1024) against fp32 torch with F.gelu(approximate="tanh"), rel. err < 1e-2;
  2. timing of a 36-launch layer-like chain (y = x @ W1ᵀ, N 2560; x = x + y[:, :1024] @ W2ᵀ, N 1024; K 1024) captured
     as one CUDA Graph with every launch PDL, per-GEMM median / p90 over the replays, for each Gluon variant, the
     project's Triton `gemm` (its H200 launch table, PDL on by default on sm_90) and torch (cuBLAS, no PDL). One
     graph holds 18 layers = 132 MB of weights; to exceed 200 MB (L2 is ~50 MB), two graphs of the same structure
     over disjoint weight copies are captured and replayed in turn, each replay timed with CUDA events;
  2b. the gated chain, the same way: 18 layers of h = GeGLU(x @ Wguᵀ) (Wgu 8192 x 1024, h 64 x 4096) then
     x = x + h[:, :1024] @ Wdᵀ (N 1024, residual), 36 launches, 340 MB of weights in one graph; x is reset
     before every replay (outside the timed events: GeGLU is quadratic, x would overflow over hundreds of
     in-place replays). Gated Gluon variants run their down GEMM on DOWN_VARIANT (gluon-ws-n32k128s8-early);
     torch is cuBLAS then the GeGLU as torch ops; triton is `gemm(a, w, out, gated=True)`;
  2c. the "mlp" chain, the expert MLP as π0 runs it, the same way as 2b: 18 layers of h = GeGLU(x @ Wguᵀ) then
     x = x + h @ Wdᵀ with Wd 1024 x 4096 (the full K = 4096), 453 MB of weights in one graph, x reset before
     every replay; per GEMM (two a layer, whatever the launches) and per layer median / p90, roofline 16.8 + 8.4
     MB a layer at 4.2 TB/s = 6.0 µs. Checks first: the gated shapes of 1 and, for the down GEMM, (M, N, K) =
     (64, 1024, 2048) at split 2, (64, 1024, 4096) and (51, 1024, 4096) at split 4 (a split-K variant runs each
     check at that split, whatever its own), with and without the residual, rel. err < 1e-2. Split-K Gluon
     variants run gate/up on GATEUP_VARIANT (gluon-ws-gated-n32k128s4-early) and the down GEMM themselves
     (partial GEMM + combine: 3 launches a layer); torch is cuBLAS + the GeGLU as torch ops + addmm (down GEMM
     and residual in one call); triton is `gemm(x, wgu, h, gated=True)` then `gemm(h, wd, x, residual=x)` (its
     tuned H200 launch table, split-K and combine as it chooses). Which chains an implementation runs: torch and
     triton all three, a Gluon variant the one of its kind (split-K: mlp), restricted by `--chains`;
  3. the tables printed last (plain, gated, then mlp, each with its own roofline and "vs triton"), plus
     gluon_skinny_gemm_<gpu>.json (rows of all, each with "chain": "plain" / "gated" / "mlp") / .md under --out.
Each implementation runs in its own subprocess under a timeout (--timeout per chain it runs), so a variant that
deadlocks (a wrong mbarrier phase, or Triton 3.6's warp specialization stalling as it did in the project's tune) is
reported and the run goes on.

Run time: one 10-minute device call holds the default --budget 540 (implementations past it are skipped, as
error rows). The MLP comparison alone, five workers of one chain each (expected well under a minute apiece: the
first run's workers of one chain took under 75 s with --timeout 75), fits one call with room to spare:
  python tools/gluon_skinny_gemm.py --chains mlp --out DIR --only $ONLY
  ONLY=torch,triton,gluon-ws-n32k128s8-early-splitk4,gluon-ws-n64k128s4-early-splitk8,gluon-ws-n32k128s4-early-splitk8
Without --chains mlp, torch and triton also run the plain and gated chains (about three times their time).

`--compile-only` compiles every variant for sm_90 without a GPU (GluonASTSource + triton.compile; split-K ones at
K 4096 with their own split and at each split-K check's (K, split)) and the split-K combine kernel (ASTSource,
every split and residual flag in use), and prints shared memory, registers (cuobjdump from Triton's wheel) and
whether the PTX has griddepcontrol.wait, TMA loads (cp.async.bulk.tensor) and wgmma. It needs neither CUDA nor
vla_rt.

Status: every variant compiles for sm_90 without a GPU (Triton 3.6.0), warp-specialized ones included, so the
single-partition kernel (`ws=False`) ships as a control, not as a fallback. H200 runs
(`benchmarks/results/gluon_skinny_gemm_NVIDIA-H200.md`, every check passed): session 6 (commit 55401f3) per GEMM
in the plain chain triton 4.06 µs, gluon-ws-n32k128s8-early 3.61 µs (0.89x), the same kernel filling its ring
after the wait 4.12 µs; session 7 (commit 61509d2, ten implementations) plain triton 4.04 / Gluon 3.61 / cuBLAS
4.87, gated chain triton 6.15 / gluon-ws-gated-n32k128s4-early 5.10 (0.83x) / cuBLAS + torch GeGLU 10.72, mlp
chain per layer triton 12.78 / Gluon split-K 16.77-18.05 (slower: K = 4096 stays on `gemm`) / cuBLAS 25.26.
The production kernel built from this one is `triton_kernels/gluon_gemm.py` (QKV with RoPE and gate/up, the RMS
factor in-kernel); in the engine it is slower than the Triton GEMMs (docs/kernels.md says where and why).

Triton 3.6 Gluon notes (why the code looks as it does):
  - `gl.warp_specialize(functions_and_args, worker_num_warps, worker_num_regs)`: the first (function, args) pair is
    the default partition, run by the kernel's `num_warps` warps (here 4 = one warpgroup, the consumer); the others
    are workers (here the 1-warp loader). Later Triton versions changed this signature.
  - Gluon has no PDL builtin; `triton.language.extra.cuda.gdc_wait` is a `tl` extern, so this file emits
    `griddepcontrol.wait` / `.launch_dependents` with `gl.inline_asm_elementwise`. `launch_pdl=True` is a compile
    option of the common launcher, so Gluon kernels take it at launch like `triton.jit` kernels.
  - The loader and the consumer both execute the wait: it orders only the executing thread, and the consumer
    reads the residual and writes `out`, which earlier kernels read or write.
  - A TMA box may exceed the tensor (M < 64 rows): the rows past M are zero-filled and still count toward the
    mbarrier's expected bytes.
  - The host-side descriptor is `triton.experimental.gluon.nvidia.hopper.TensorDescriptor` (it carries the
    NVMMASharedLayout); its compile signature is `tensordesc<bf16[64,128],NVMMASharedLayout(...)>`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if "--compile-only" in sys.argv[1:]:  # Triton picks interpreter or compiler at import: this check needs the compiler
    os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_M = 64  # the wgmma M of one warpgroup; rows past M are TMA zero-fill
TILE_M = gl.constexpr(BLOCK_M)  # the same, as kernels may read a global only if it is a constexpr
MAX_K = 1024  # A (64 x K bf16) stays resident in shared memory: 128 KiB at K = 1024
SMEM_LIMIT = 227 * 1024  # sm_90 opt-in dynamic shared memory per block
HBM_BYTES_PER_S = 4.2e12  # the weight-bytes roofline
CHAIN_LAYERS = 18  # 2 GEMMs a layer: 36 launches a graph
D_MODEL, D_WIDE = 1024, 2560  # x: 64 x 1024; y: 64 x 2560 (GEMM 1: N 2560, GEMM 2: N 1024, both K 1024)
D_FF = 4096  # the gated chain: h = GeGLU(x @ Wguᵀ), 64 x 4096 (Wgu: 8192 x 1024 = [gate; up]); x += h[:, :1024] @ Wdᵀ
# gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u) = x / (1 + 2^(-2u log2 e)), u = sqrt(2/pi) (x + 0.044715 x^3):
# 2u log2(e) = x (GELU_C1 + GELU_C3 x^2)
GELU_C1 = gl.constexpr(2 * math.sqrt(2 / math.pi) * math.log2(math.e))
GELU_C3 = gl.constexpr(2 * math.sqrt(2 / math.pi) * math.log2(math.e) * 0.044715)
L2_DEFEAT_BYTES = 200e6  # H200 L2 is ~50 MB; weights per timed run must exceed this
REL_TOL = 1e-2
CHAIN_TOL = 3e-2  # 36 bf16 roundings each side: loose, but one stale input (a PDL race) is off by ~0.1
WORKER_TIMEOUT_S = 90  # per implementation and chain; normally 10-30 s (imports, compiles, capture, 200 replays)
RUN_BUDGET_S = 540  # the whole run stays inside one 10-minute device call; implementations past it are skipped


# ----------------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------------


@gluon.jit
def _gdc_wait():
    """`griddepcontrol.wait`: block until the previous grid completed and its writes are visible (no-op without
    PDL). Inline PTX because Triton 3.6 Gluon has no builtin for it."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    """`griddepcontrol.launch_dependents`: the next PDL kernel may be scheduled once every program issued this (or
    exited); the first issue in a program counts, so one partition issuing it is enough."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _issue_w_tile(
    w_desc, w_smem, ready, off_n, off_k, kt, STAGES: gl.constexpr, BLOCK_K: gl.constexpr, GATED: gl.constexpr
):  # fmt: skip
    """TMA-load weight tile `kt` (BLOCK_N x BLOCK_K at column off_k + kt * BLOCK_K; off_k is the constexpr 0 but
    under split-K) into ring slot kt % STAGES. GATED (W = [gate; up], 2N rows): the gate tile (rows off_n..) into
    buffer s and the up tile of the same K step (rows N + off_n.., N = half the descriptor's rows) into buffer
    STAGES + s, both on slot s's barrier, which then expects both boxes' bytes (a box past the tensor is
    zero-filled and still counts its full size)."""
    s = kt % STAGES
    if GATED:
        mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [off_n, off_k + kt * BLOCK_K], ready.index(s), w_smem.index(s))
        up_row = w_desc.shape[0] // 2 + off_n
        tma.async_copy_global_to_shared(
            w_desc, [up_row, off_k + kt * BLOCK_K], ready.index(s), w_smem.index(STAGES + s)
        )
    else:
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [off_n, off_k + kt * BLOCK_K], ready.index(s), w_smem.index(s))


@gluon.jit
def _issue_a(a_desc, a_smem, a_bar, off_k, K_TILES: gl.constexpr, BLOCK_K: gl.constexpr):
    """TMA-load the whole activation slice (64 x K_TILES * BLOCK_K from column off_k) once, K_TILES boxes on one
    barrier."""
    mbarrier.expect(a_bar, K_TILES * a_desc.block_type.nbytes)
    for kt in gl.static_range(K_TILES):
        tma.async_copy_global_to_shared(a_desc, [0, off_k + kt * BLOCK_K], a_bar, a_smem.index(kt))


@gluon.jit
def _fill_prologue(
    a_desc, w_desc, a_smem, w_smem, a_bar, ready, off_n, off_k,
    K_TILES: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr, EARLY: gl.constexpr,
    GATED: gl.constexpr,
):  # fmt: skip
    """Request the first STAGES weight tiles (before `griddepcontrol.wait` with EARLY: no kernel writes weights),
    wait for the previous kernel, then request A (its output) — the part both kernel shapes share."""
    if EARLY:
        for kt in gl.static_range(STAGES):
            _issue_w_tile(w_desc, w_smem, ready, off_n, off_k, kt, STAGES, BLOCK_K, GATED)
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    _issue_a(a_desc, a_smem, a_bar, off_k, K_TILES, BLOCK_K)
    if not EARLY:
        for kt in gl.static_range(STAGES):
            _issue_w_tile(w_desc, w_smem, ready, off_n, off_k, kt, STAGES, BLOCK_K, GATED)


@gluon.jit
def _loader_partition(
    a_desc, w_desc, a_smem, w_smem, a_bar, ready, empty, off_n, off_k,
    K_TILES: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr, EARLY: gl.constexpr,
    GATED: gl.constexpr,
):  # fmt: skip
    """The 1-warp producer. With EARLY the first STAGES weight tiles are requested before `griddepcontrol.wait`
    (weights are never written by a kernel, so this is safe under PDL); A, the previous kernel's output, only after.
    Later tiles refill a slot once the consumer released it (`empty`)."""
    _fill_prologue(a_desc, w_desc, a_smem, w_smem, a_bar, ready, off_n, off_k, K_TILES, BLOCK_K, STAGES, USE_PDL,
                   EARLY, GATED)  # fmt: skip
    for kt in range(STAGES, K_TILES):
        # the (kt // STAGES)-th refill of this slot waits for the consumer's (kt // STAGES - 1)-th release of it
        mbarrier.wait(empty.index(kt % STAGES), ((kt // STAGES) & 1) ^ 1)
        _issue_w_tile(w_desc, w_smem, ready, off_n, off_k, kt, STAGES, BLOCK_K, GATED)


@gluon.jit
def _epilogue(
    acc, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n, HAS_RES: gl.constexpr, PARTIAL: gl.constexpr
):  # fmt: skip
    """out = acc (+ residual, read in fp32), bf16, rows < M and columns < N only, in the accumulator's layout (the
    tile is 64 x BLOCK_N: a layout conversion through shared memory would cost more than the scattered stores).
    PARTIAL (split-K): out_ptr is this split's fp32 (M, N) slice of the workspace, acc is stored as is."""
    layout: gl.constexpr = acc.type.layout
    rows = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if PARTIAL:
        gl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=mask)
    else:
        if HAS_RES:
            res = gl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            acc = acc + res.to(gl.float32)
        gl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def _gelu_tanh(x):
    """gelu_tanh(x) in fp32 as x * sigmoid(2u) with exp2 (no tanh): x / (1 + 2^(-x (C1 + C3 x^2))). Saturates
    cleanly: for x -> -inf the denominator -> inf and the result -> -0; for x -> +inf it -> x."""
    return x / (1.0 + gl.exp2(-x * (GELU_C1 + GELU_C3 * x * x)))


@gluon.jit
def _consumer_partition(
    a_smem, w_smem, a_bar, ready, empty, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n,
    BLOCK_N: gl.constexpr, K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_RES: gl.constexpr,
    USE_PDL: gl.constexpr, GATED: gl.constexpr, PARTIAL: gl.constexpr,
):  # fmt: skip
    """The default partition, one warpgroup: wgmma over the ring with one MMA in flight, releasing each slot as soon
    as the MMA that read it retired, then the epilogue. It executes the PDL wait itself because the wait orders
    only its own thread and this partition reads the residual / writes `out`."""
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
    )
    if GATED:
        # two accumulators (gate, up), 2 x BLOCK_N / 4 fp32 registers a thread; each async wgmma is one commit
        # group, so "<= 2 groups in flight" after issuing tile kt's pair means tile kt - 1's pair has retired
        acc_g = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
        acc_u = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
        mbarrier.wait(a_bar, 0)
        for kt in range(K_TILES):
            s = kt % STAGES
            mbarrier.wait(ready.index(s), (kt // STAGES) & 1)
            a_tile = a_smem.index(kt)
            g_tile = w_smem.index(s)
            u_tile = w_smem.index(STAGES + s)
            acc_g = warpgroup_mma(a_tile, g_tile.permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a_tile, u_tile.permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u, _, _, _ = warpgroup_mma_wait(2, deps=[acc_g, acc_u, a_tile, g_tile, u_tile])
            if kt > 0:
                mbarrier.arrive(empty.index((kt - 1) % STAGES))
        acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
        _epilogue(_gelu_tanh(acc_g) * acc_u, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n, HAS_RES, PARTIAL)
    else:
        acc = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
        mbarrier.wait(a_bar, 0)
        for kt in range(K_TILES):
            s = kt % STAGES
            mbarrier.wait(ready.index(s), (kt // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(kt), w_smem.index(s).permute((1, 0)), acc, is_async=True)
            # <= 1 in flight: the MMA of tile kt - 1 has retired, its slot may be refilled
            acc, _, _ = warpgroup_mma_wait(1, deps=[acc, a_smem.index(kt), w_smem.index(s)])
            if kt > 0:
                mbarrier.arrive(empty.index((kt - 1) % STAGES))
        acc = warpgroup_mma_wait(0, deps=[acc])
        _epilogue(acc, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n, HAS_RES, PARTIAL)


@gluon.jit
def _single_partition(
    a_desc, w_desc, a_smem, w_smem, a_bar, ready, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n, off_k,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr, STAGES: gl.constexpr,
    HAS_RES: gl.constexpr, USE_PDL: gl.constexpr, EARLY: gl.constexpr, GATED: gl.constexpr, PARTIAL: gl.constexpr,
):  # fmt: skip
    """The same pipeline without warp specialization (the fallback and a control): the warpgroup issues the TMA
    ring itself (before the PDL wait with EARLY), waits, loads A, and refills a slot after the MMA reading it."""
    _fill_prologue(a_desc, w_desc, a_smem, w_smem, a_bar, ready, off_n, off_k, K_TILES, BLOCK_K, STAGES, USE_PDL,
                   EARLY, GATED)  # fmt: skip
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
    mbarrier.wait(a_bar, 0)
    for kt in gl.static_range(K_TILES):
        slot = w_smem.index(kt % STAGES)
        mbarrier.wait(ready.index(kt % STAGES), (kt // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(kt), slot.permute((1, 0)), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=[acc, a_smem.index(kt), slot])
        if kt + STAGES < K_TILES:
            gl.thread_barrier()  # every warp's MMA on this slot retired before the TMA overwrites it
            _issue_w_tile(w_desc, w_smem, ready, off_n, off_k, kt + STAGES, STAGES, BLOCK_K, GATED)
    _epilogue(acc, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n, HAS_RES, PARTIAL)


@gluon.jit
def skinny_gemm_kernel(
    a_desc, w_desc, out_ptr, res_ptr, M, N, stride_om, stride_rm,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr, STAGES: gl.constexpr,
    HAS_RES: gl.constexpr, USE_PDL: gl.constexpr, EARLY: gl.constexpr, WS: gl.constexpr, LOADER_REGS: gl.constexpr,
    GATED: gl.constexpr, SPLIT_K: gl.constexpr,
):  # fmt: skip
    """out[:M, n0:n0+BLOCK_N] = A[:M, :K] @ W[n0:n0+BLOCK_N, :K]ᵀ (+ residual), one program per column tile; with
    GATED, W = [gate; up] has 2N rows and out = gelu_tanh(A @ Wgᵀ) * (A @ Wuᵀ) (+ residual), fp32 until the store.

    a_desc: TMA descriptor of A (M x K, box 64 x BLOCK_K); w_desc: of W (N x K, box BLOCK_N x BLOCK_K); K =
    K_TILES * BLOCK_K. A stays resident (K_TILES boxes), W streams through a STAGES-deep ring. USE_PDL: execute
    the PDL wait (launch with launch_pdl=True); EARLY: request the first STAGES weight tiles before it; WS: a 1-warp
    loader partition + this warpgroup as consumer, else one partition does both (not with GATED). GATED: the ring
    holds 2 * STAGES weight buffers, gate tiles in 0..STAGES-1 and the up tiles of the same K steps in STAGES..;
    the barriers stay one per stage.

    SPLIT_K > 1 (grid (column tiles, SPLIT_K), not with GATED or HAS_RES): program (n, s) multiplies the K slice
    [s * K_TILES * BLOCK_K, (s + 1) * K_TILES * BLOCK_K) (K = SPLIT_K * K_TILES * BLOCK_K; the ring is still filled
    before the PDL wait) and stores its fp32 partial tile, rows < M, into out_ptr = a (SPLIT_K, M, N) fp32
    workspace with row stride stride_om; `splitk_combine_kernel` sums the partials. SPLIT_K == 1: off_k is the
    constexpr 0, so the kernel compiles exactly as without split-K."""
    gl.static_assert(WS or not GATED, "GATED runs only warp-specialized")
    gl.static_assert(SPLIT_K == 1 or not (GATED or HAS_RES), "split-K: no GATED, the residual is the combine's")
    W_BUFS: gl.constexpr = 2 * STAGES if GATED else STAGES
    PARTIAL: gl.constexpr = SPLIT_K > 1
    off_n = gl.program_id(0) * BLOCK_N
    if PARTIAL:
        split = gl.program_id(1)
        off_k = split * (K_TILES * BLOCK_K)
        out_ptr = out_ptr + split * M * stride_om
    else:
        off_k: gl.constexpr = 0
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [K_TILES, TILE_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [W_BUFS, BLOCK_N, BLOCK_K], w_desc.layout)
    a_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(a_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()  # barrier init visible to the async proxy (TMA) before the first copy
    if WS:
        gl.warp_specialize(
            [
                (
                    _consumer_partition,
                    (a_smem, w_smem, a_bar, ready, empty, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n,
                     BLOCK_N, K_TILES, STAGES, HAS_RES, USE_PDL, GATED, PARTIAL),
                ),
                (
                    _loader_partition,
                    (a_desc, w_desc, a_smem, w_smem, a_bar, ready, empty, off_n, off_k, K_TILES, BLOCK_K, STAGES,
                     USE_PDL, EARLY, GATED),
                ),
            ],
            [1],
            [LOADER_REGS],
        )  # fmt: skip
    else:
        _single_partition(
            a_desc, w_desc, a_smem, w_smem, a_bar, ready, out_ptr, res_ptr, M, N, stride_om, stride_rm, off_n, off_k,
            BLOCK_N, BLOCK_K, K_TILES, STAGES, HAS_RES, USE_PDL, EARLY, GATED, PARTIAL,
        )  # fmt: skip
    mbarrier.invalidate(a_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


COMBINE_ROWS, COMBINE_COLS = 8, 128  # the combine's tile: 8 x 8 = 64 programs at (M, N) = (64, 1024)


@triton.jit
def splitk_combine_kernel(
    part_ptr, out_ptr, res_ptr, M, N, stride_om, stride_rm,
    SPLIT_K: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out = sum over s = 0..SPLIT_K-1, in that order, of part[s] (+ residual), bf16; part: the (SPLIT_K, M, N)
    fp32 workspace (contiguous) the split-K GEMM kernel just wrote; residual may alias out (each element is read
    and written by the same thread). Deterministic: fixed summation order, no atomics. Under PDL every load
    follows `griddepcontrol.wait` (the partials are the previous kernel's output)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = rows[:, None] * N + cols[None, :]
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc = acc + tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_RES:
        acc = acc + tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(tl.bfloat16), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Variants and host wrapper
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One launch configuration of `skinny_gemm_kernel` (the sweep)."""

    block_n: int
    block_k: int
    stages: int
    ws: bool = True  # warp-specialized (1-warp loader + 4-warp consumer)
    early: bool = True  # weight ring requested before griddepcontrol.wait
    pdl: bool = True  # USE_PDL and launch_pdl
    loader_regs: int = 40
    gated: bool = False  # W = [gate; up] (2N rows), out = gelu_tanh(A Wgᵀ) * (A Wuᵀ); warp-specialized only
    split_k: int = 1  # > 1: K split over grid axis 1, fp32 partials, then splitk_combine_kernel; not with gated

    @property
    def name(self) -> str:
        return (f"gluon-{'ws' if self.ws else 'single'}{'-gated' if self.gated else ''}"
                f"-n{self.block_n}k{self.block_k}s{self.stages}"
                f"-{'early' if self.early else 'late'}{'' if self.pdl else '-nopdl'}"
                f"{f'-splitk{self.split_k}' if self.split_k > 1 else ''}")  # fmt: skip


# The sweep. The control for the hypothesis is the same kernel with the ring filled after the wait ("late"), and
# the same kernel without PDL; "single" separates warp specialization from the early TMA ring.
VARIANTS: tuple[Variant, ...] = (
    Variant(32, 128, 8),  # the whole 32 x 1024 weight slice requested before the wait; grids 80 + 32 programs
    Variant(32, 128, 8, early=False),
    Variant(32, 128, 8, pdl=False),
    Variant(32, 128, 8, ws=False),
    Variant(32, 64, 8),  # half of the slice before the wait, finer tiles
    Variant(16, 128, 8),  # 160 + 64 programs: more SMs streaming, two waves on the wide GEMM
    Variant(64, 128, 4),  # 40 + 16 programs, half the slice before the wait
    # gated (π0's expert gate/up, N 4096 from 8192 weight rows): 128 programs, one wave on 132 SMs; each stage
    # holds a gate and an up tile (32 KiB), so 4 stages = 64 KiB + A 128 KiB; half of a program's 2 x 32 x 1024
    # weight slice is requested before the wait
    Variant(32, 128, 4, gated=True),
    Variant(32, 64, 8, gated=True),  # the same bytes before the wait in finer tiles (8 ready barriers)
    # split-K (π0's expert down projection, N 1024, K 4096; the "mlp" chain): partial GEMM + combine kernel
    Variant(32, 128, 8, split_k=4),  # 32 x 4 = 128 programs, each its whole 32 x 1024 slice before the wait
    Variant(64, 128, 4, split_k=8),  # 16 x 8 = 128 programs, K 512 each: the whole 64 x 512 slice before the wait
    Variant(32, 128, 4, split_k=8),  # 32 x 8 = 256 programs of 96 KiB shared memory: two per SM, one wave
)
DOWN_VARIANT = VARIANTS[0]  # the gated chain's down projection, for every gated variant (the first run's best)
GATEUP_VARIANT = next(v for v in VARIANTS if v.gated)  # the mlp chain's gate/up, for every split-K variant


def _nvmma_layout() -> Any:
    # bf16 rows of 64 or 128 elements are >= 128 bytes: the 128-byte swizzle (what get_default_for picks)
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


_WORKSPACES: dict[tuple[Any, int, int, int], Any] = {}  # (device, split_k, M, N) -> fp32 (split_k, M, N)


def splitk_workspace(split_k: int, m: int, n: int, device: Any) -> Any:
    """The fp32 (split_k, M, N) partials buffer of one shape, allocated on first use and reused by every later
    launch of that shape (kernels of a stream are ordered, under PDL too: each one writes it only after its
    griddepcontrol.wait). First use must be outside CUDA Graph capture (the chains run once eagerly first)."""
    import torch

    key = (torch.device(device), split_k, m, n)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"splitk_workspace: first use of {key} inside graph capture; run the shape eagerly first"
            )
        ws = _WORKSPACES[key] = torch.empty(split_k, m, n, dtype=torch.float32, device=device)
    return ws


def skinny_gemm(a: Any, w: Any, out: Any, variant: Variant, residual: Any = None) -> Any:
    """out = a @ wᵀ (+ residual) with `variant`. a: (M <= 64, K) bf16, last stride 1 (any 16-byte-aligned row
    stride, so a column slice of a wider activation works); w: (N, K) bf16; out / residual: (M, N) bf16, last
    stride 1, residual may alias out. K / split_k <= 1024 and a multiple of block_k. Launch-only (after a first
    call per shape, which allocates a split-K workspace): graph-capturable.
    A gated variant: w is (2N, K) = [gate; up] and out = gelu_tanh(a @ w[:N]ᵀ) * (a @ w[N:]ᵀ), no residual.
    split_k > 1: two launches, the GEMM kernel on grid (N / block_n, split_k) writing fp32 partials into
    `splitk_workspace`, then `splitk_combine_kernel` (sum in split order, + residual, bf16), both with PDL if the
    variant has it."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, k = a.shape
    split = variant.split_k
    n = w.shape[0] // 2 if variant.gated else w.shape[0]
    k_split = k // split
    if (m > BLOCK_M or k % (split * variant.block_k) or k_split > MAX_K or w.shape[1] != k
            or tuple(out.shape) != (m, n)):  # fmt: skip
        raise ValueError(
            f"skinny_gemm: unsupported shapes a {tuple(a.shape)} w {tuple(w.shape)} out {tuple(out.shape)} "
            f"(split_k {split}, block_k {variant.block_k})"
        )
    if variant.gated and (w.shape[0] % 2 or residual is not None or split > 1):
        raise ValueError(
            f"skinny_gemm: gated needs an even number of weight rows, no residual, no split-K (w {tuple(w.shape)})"
        )
    layout = _nvmma_layout()
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [BLOCK_M, variant.block_k], layout)
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [variant.block_n, variant.block_k], layout)
    k_tiles = k_split // variant.block_k
    extra = {"launch_pdl": True} if variant.pdl else {}
    n_tiles = -(-n // variant.block_n)
    if split == 1:
        res = out if residual is None else residual
        skinny_gemm_kernel[(n_tiles,)](
            a_desc, w_desc, out, res, m, n, out.stride(0), res.stride(0),
            BLOCK_N=variant.block_n, BLOCK_K=variant.block_k, K_TILES=k_tiles, STAGES=min(variant.stages, k_tiles),
            HAS_RES=residual is not None, USE_PDL=variant.pdl, EARLY=variant.early, WS=variant.ws,
            LOADER_REGS=variant.loader_regs, GATED=variant.gated, SPLIT_K=1, num_warps=4, **extra,
        )  # fmt: skip
        return out
    part = splitk_workspace(split, m, n, out.device)
    skinny_gemm_kernel[(n_tiles, split)](
        a_desc, w_desc, part, part, m, n, n, n,
        BLOCK_N=variant.block_n, BLOCK_K=variant.block_k, K_TILES=k_tiles, STAGES=min(variant.stages, k_tiles),
        HAS_RES=False, USE_PDL=variant.pdl, EARLY=variant.early, WS=variant.ws,
        LOADER_REGS=variant.loader_regs, GATED=False, SPLIT_K=split, num_warps=4, **extra,
    )  # fmt: skip
    res = out if residual is None else residual
    splitk_combine_kernel[(-(-m // COMBINE_ROWS), -(-n // COMBINE_COLS))](
        part, out, res, m, n, out.stride(0), res.stride(0),
        SPLIT_K=split, HAS_RES=residual is not None, USE_PDL=variant.pdl, BLOCK_R=COMBINE_ROWS,
        BLOCK_C=COMBINE_COLS, num_warps=4, **extra,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------
# --compile-only (no GPU)
# ----------------------------------------------------------------------------------------------------------------


def _cuobjdump_regs(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) from the cuobjdump in Triton's wheel, as triton_kernels/compile_check.py does."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def _resources(compiled: Any, t0: float) -> dict[str, Any]:
    """What --compile-only prints of one compiled kernel."""
    regs, stack = _cuobjdump_regs(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    return {
        "shared_bytes": compiled.metadata.shared,
        "registers": regs,
        "stack_bytes": stack,
        "griddepcontrol_wait": "griddepcontrol.wait" in ptx,
        "tma_load": "cp.async.bulk.tensor" in ptx,
        "wgmma": "wgmma" in ptx,
        # warp specialization: per-partition register budgets (the cubin's REG count is then just the cap)
        "setmaxnreg": sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "warps": compiled.metadata.num_warps,  # Triton 3.6 pads 4 + 1 loader warps to 8 (whole warpgroups)
        "compile_s": round(time.perf_counter() - t0, 2),
    }


def compile_variant(
    variant: Variant, k: int = MAX_K, has_res: bool = True, split_k: int | None = None
) -> dict[str, Any]:
    """Compile `variant` for sm_90 without a GPU: the signature a launch at K = k would specialize to (split-K:
    the partial GEMM kernel at K = k over `split_k` splits, default the variant's; it takes no residual)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    split = variant.split_k if split_k is None else split_k
    layout = repr(_nvmma_layout())
    k_tiles = k // split // variant.block_k
    out_ty = "*fp32" if split > 1 else "*bf16"
    signature = {
        "a_desc": f"tensordesc<bf16[{BLOCK_M},{variant.block_k}],{layout}>",
        "w_desc": f"tensordesc<bf16[{variant.block_n},{variant.block_k}],{layout}>",
        "out_ptr": out_ty, "res_ptr": out_ty, "M": "i32", "N": "i32", "stride_om": "i32", "stride_rm": "i32",
    }  # fmt: skip
    constexprs = dict(
        BLOCK_N=variant.block_n, BLOCK_K=variant.block_k, K_TILES=k_tiles, STAGES=min(variant.stages, k_tiles),
        HAS_RES=has_res and split == 1, USE_PDL=variant.pdl, EARLY=variant.early, WS=variant.ws,
        LOADER_REGS=variant.loader_regs, GATED=variant.gated, SPLIT_K=split,
    )  # fmt: skip
    for name in constexprs:
        signature[name] = "constexpr"
    names = skinny_gemm_kernel.arg_names
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("out_ptr", "res_ptr", "stride_om", "stride_rm")}
    src = GluonASTSource(skinny_gemm_kernel, signature, constexprs, attrs)
    options = {"num_warps": 4, "launch_pdl": variant.pdl}
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return {"variant": variant.name, **_resources(compiled, t0)}


def compile_combine(split_k: int, has_res: bool, pdl: bool = True) -> dict[str, Any]:
    """Compile `splitk_combine_kernel` for sm_90 without a GPU, as `skinny_gemm` launches it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"part_ptr": "*fp32", "out_ptr": "*bf16", "res_ptr": "*bf16", "M": "i32", "N": "i32",
                 "stride_om": "i32", "stride_rm": "i32"}  # fmt: skip
    constexprs = dict(SPLIT_K=split_k, HAS_RES=has_res, USE_PDL=pdl, BLOCK_R=COMBINE_ROWS, BLOCK_C=COMBINE_COLS)
    for name in constexprs:
        signature[name] = "constexpr"
    names = splitk_combine_kernel.arg_names
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("part_ptr", "out_ptr", "res_ptr", "N")}
    attrs.update({(names.index(p),): [["tt.divisibility", 16]] for p in ("stride_om", "stride_rm")})
    src = ASTSource(splitk_combine_kernel, signature, constexprs, attrs)
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
    return {"variant": f"splitk-combine-s{split_k}", **_resources(compiled, t0)}


def compile_only() -> int:
    """Compile every shipped variant (with and without the residual; gated and split-K ones without, as they take
    none; split-K ones at the mlp chain's K = 4096 and at every split-K check's (K, split)), and the split-K combine
    kernel for every split and residual flag in use, and print the resources; 1 if any fails, spills or overflows
    shared memory."""
    jobs: list[tuple[str, Any]] = []
    for variant in VARIANTS:
        if variant.split_k > 1:
            configs = dict.fromkeys([(D_FF, variant.split_k), *((k, sk) for _, _, k, sk in SPLITK_CHECK_SHAPES)])
            for k, sk in configs:
                jobs.append((f"K {k} split {sk}", lambda v=variant, k=k, sk=sk: compile_variant(v, k, False, sk)))
        else:
            for has_res in (False,) if variant.gated else (False, True):
                jobs.append((f"res={int(has_res)}", lambda v=variant, r=has_res: compile_variant(v, has_res=r)))
    splits = sorted({v.split_k for v in VARIANTS if v.split_k > 1} | {sk for *_, sk in SPLITK_CHECK_SHAPES})
    for sk in splits:
        for has_res in (False, True):
            jobs.append((f"res={int(has_res)}", lambda sk=sk, r=has_res: compile_combine(sk, r)))
    bad = 0
    for label, job in jobs:
        try:
            r = job()
        except Exception as e:  # report and go on: the point is to see which variants this Triton accepts
            print(f"{label} COMPILE ERROR {type(e).__name__}: {str(e)[:2000]}")
            bad += 1
            continue
        over = r["shared_bytes"] > SMEM_LIMIT
        bad += over or r["stack_bytes"] > 0
        print(
            f"{r['variant']:<38} {label:<16} smem {r['shared_bytes'] / 1024:6.1f} KiB  regs "
            f"{r['registers']:3d}  stack {r['stack_bytes']}  gdc.wait {'y' if r['griddepcontrol_wait'] else 'n'}"
            f"  tma {'y' if r['tma_load'] else 'n'}  wgmma {'y' if r['wgmma'] else 'n'}"
            f"  warps {r['warps']}  setmaxnreg {'/'.join(map(str, r['setmaxnreg'])) or '-'}  {r['compile_s']}s" + ("  SMEM-OVERFLOW" if over else ""),
            flush=True,
        )  # fmt: skip
    print(f"{len(jobs)} compiles for sm_90, {bad} failed, overflowed or spilled")
    return 1 if bad else 0


# ----------------------------------------------------------------------------------------------------------------
# GPU: correctness, chain timing (one implementation per worker process)
# ----------------------------------------------------------------------------------------------------------------

CHECK_SHAPES = ((64, 2560, 1024), (64, 1024, 1024), (51, 2560, 1024))
GATED_CHECK_SHAPES = ((64, D_FF, D_MODEL), (51, D_FF, D_MODEL))  # (M, N, K): W has 2N rows, out N columns
# (M, N, K, split_k): a split-K variant runs each at this split (K / split = 1024, whatever its own split)
SPLITK_CHECK_SHAPES = ((64, D_MODEL, 2048, 2), (64, D_MODEL, D_FF, 4), (51, D_MODEL, D_FF, 4))
CHAINS = ("plain", "gated", "mlp")


def _variant(impl: str) -> Variant:
    return next(v for v in VARIANTS if v.name == impl)


def _chains_of(impl: str, wanted: tuple[str, ...] = CHAINS) -> tuple[str, ...]:
    """The chains `impl` runs, among `wanted`: the baselines all, a Gluon variant the one of its kind (split-K:
    the mlp chain)."""
    if impl in ("torch", "triton"):
        return tuple(c for c in CHAINS if c in wanted)
    v = _variant(impl)
    own = "gated" if v.gated else "mlp" if v.split_k > 1 else "plain"
    return (own,) if own in wanted else ()


def _rand(*shape: int, scale: float = 1.0, gen: Any = None) -> Any:
    """Random bf16 on the GPU, never all zeros (a zero input hides a missing load)."""
    import torch

    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def _rel_err(got: Any, ref: Any) -> float:
    """The project's relative error (imported here: the --compile-only path runs without vla_rt)."""
    from vla_rt.bench.accuracy import rel_err

    return rel_err(got, ref)


def _geglu_ref(p: Any) -> Any:
    """gelu_tanh(gate) * up of an fp32 (M, 2N) product, in fp32."""
    import torch.nn.functional as F

    n = p.shape[1] // 2
    return F.gelu(p[:, :n], approximate="tanh") * p[:, n:]


def _launcher(impl: str) -> Any:
    """A function (a, w, out, residual=None, gated=False, split_k=0) -> None launching one GEMM with
    implementation `impl`; gated: w = [gate; up] (2N rows), out = gelu_tanh(a @ w[:N]ᵀ) * (a @ w[N:]ᵀ), no
    residual; split_k > 0: a split-K variant runs at that split instead of its own (the baselines ignore it)."""
    import torch

    if impl == "torch":

        def run(a: Any, w: Any, out: Any, residual: Any = None, gated: bool = False, split_k: int = 0) -> None:
            if gated:  # cuBLAS has no GeGLU epilogue: the product, then the GeGLU as torch ops
                if residual is not None:
                    raise ValueError("gated: no residual")
                out.copy_(_geglu_ref(torch.mm(a, w.T).float()))
            elif residual is None:
                torch.mm(a, w.T, out=out)
            elif residual.data_ptr() == out.data_ptr():
                out.addmm_(a, w.T)  # one cuBLAS call, C = A Bᵀ + C
            else:
                torch.add(residual, a @ w.T, out=out)

        return run
    if impl == "triton":
        from vla_rt.triton_kernels import gemm

        def run(a: Any, w: Any, out: Any, residual: Any = None, gated: bool = False, split_k: int = 0) -> None:
            gemm(a, w, out, residual=residual, gated=gated)  # gated: gelu_tanh, its default activation

        return run
    variant = _variant(impl)

    def run(a: Any, w: Any, out: Any, residual: Any = None, gated: bool = False, split_k: int = 0) -> None:
        if gated and not (variant.gated or variant.split_k > 1):
            raise ValueError(f"{impl} is neither a gated nor a split-K variant")
        if gated == variant.gated:
            v = replace(variant, split_k=split_k) if split_k and variant.split_k > 1 else variant
        else:  # a gated variant's down GEMM on DOWN_VARIANT; a split-K variant's gate/up on GATEUP_VARIANT
            v = GATEUP_VARIANT if gated else DOWN_VARIANT
        skinny_gemm(a, w, out, v, residual=residual)

    return run


def check_shapes(run: Any) -> list[dict[str, Any]]:
    """The single-GEMM checks of the brief: relative error against an fp32 reference, with/without residual."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, n, k in CHECK_SHAPES:
        for with_res in (False, True):
            a = _rand(m, k, gen=gen)
            w = _rand(n, k, scale=k**-0.5, gen=gen)
            out = _rand(m, n, gen=gen)  # the residual aliases out, as in the chain
            ref = a.float() @ w.float().T + (out.float() if with_res else 0.0)
            run(a, w, out, residual=out if with_res else None)
            torch.cuda.synchronize()
            err = _rel_err(out, ref)
            rows.append({"m": m, "n": n, "k": k, "residual": with_res, "rel_err": err, "ok": err < REL_TOL})
    return rows


def check_gated_shapes(run: Any) -> list[dict[str, Any]]:
    """The gated GEMM against fp32 torch (F.gelu tanh of the gate product times the up product)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for m, n, k in GATED_CHECK_SHAPES:
        a = _rand(m, k, gen=gen)
        w = _rand(2 * n, k, scale=k**-0.5, gen=gen)
        out = _rand(m, n, gen=gen)  # random, not zeros: a missing store shows
        ref = _geglu_ref(a.float() @ w.float().T)
        run(a, w, out, gated=True)
        torch.cuda.synchronize()
        err = _rel_err(out, ref)
        rows.append({"m": m, "n": n, "k": k, "gated": True, "residual": False, "rel_err": err, "ok": err < REL_TOL})
    return rows


def check_splitk_shapes(run: Any) -> list[dict[str, Any]]:
    """The long-K GEMMs (the expert's down projection, K up to 4096) against fp32 torch, with/without the residual
    (aliasing out); a split-K variant runs each at the shape's split (the baselines as they choose)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for m, n, k, split in SPLITK_CHECK_SHAPES:
        for with_res in (False, True):
            a = _rand(m, k, gen=gen)
            w = _rand(n, k, scale=k**-0.5, gen=gen)
            out = _rand(m, n, gen=gen)
            ref = a.float() @ w.float().T + (out.float() if with_res else 0.0)
            run(a, w, out, residual=out if with_res else None, split_k=split)
            torch.cuda.synchronize()
            err = _rel_err(out, ref)
            rows.append({"m": m, "n": n, "k": k, "split_k": split, "residual": with_res, "rel_err": err,
                         "ok": err < REL_TOL})  # fmt: skip
    return rows


class Chain:
    """The timed workload: `layers` layers of y = x @ W1ᵀ; x = x + y[:, :1024] @ W2ᵀ on one (x, y) pair, each
    launch reading the previous one's output, over this chain's own weight copies. kind "gated": y = GeGLU(x @
    W1ᵀ) with W1 = [gate; up] (8192 x 1024, y 64 x 4096), the expert's gate/up projection; the second GEMM as
    before. kind "mlp": the expert MLP as π0 runs it, the gated GEMM then x = x + y @ W2ᵀ with W2 1024 x 4096 (the
    down projection over the full K = 4096)."""

    def __init__(self, layers: int, gen: Any, kind: str = "plain") -> None:
        import torch

        self.kind = kind
        self.gated = kind != "plain"
        wide = D_FF if self.gated else D_WIDE
        self.down_k = D_FF if kind == "mlp" else D_MODEL
        self.x = torch.empty(BLOCK_M, D_MODEL, dtype=torch.bfloat16, device="cuda")
        self.y = torch.empty(BLOCK_M, wide, dtype=torch.bfloat16, device="cuda")
        # W2 scaled down so x does not blow up over hundreds of replays (the graph keeps updating it in place)
        w1_rows = 2 * wide if self.gated else wide
        self.w1 = [_rand(w1_rows, D_MODEL, scale=D_MODEL**-0.5, gen=gen) for _ in range(layers)]
        self.w2 = [_rand(D_MODEL, self.down_k, scale=0.1 * self.down_k**-0.5, gen=gen) for _ in range(layers)]

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.w1 + self.w2)

    @property
    def launches(self) -> int:
        return 2 * len(self.w1)

    def run(self, gemm: Any) -> None:
        for w1, w2 in zip(self.w1, self.w2):
            gemm(self.x, w1, self.y, gated=self.gated)
            gemm(self.y[:, : self.down_k], w2, self.x, residual=self.x)


def _chain_reference(chain: Chain, x0: Any) -> Any:
    """The chain in torch with the same bf16 roundings at each stored activation (fp32 accumulation)."""
    import torch

    x = x0.clone()
    for w1, w2 in zip(chain.w1, chain.w2):
        p = x.float() @ w1.float().T
        y = (_geglu_ref(p) if chain.gated else p).to(torch.bfloat16)
        x = (x.float() + y[:, : chain.down_k].float() @ w2.float().T).to(torch.bfloat16)
    return x.float()


def time_chains(run: Any, replays: int, warmup: int, kind: str = "plain") -> dict[str, Any]:
    """Capture each chain of `kind` as one CUDA Graph, check one replay against torch, then time replays
    round-robin over the graphs (so every replay finds its weights evicted from L2). Per-GEMM (two a layer, however
    many launches an implementation makes of them) and per-layer median / p90 in µs. The gated and mlp chains (one
    graph of 340 / 453 MB already defeats L2): x is reset before every replay, outside the timed events, as GeGLU
    is quadratic in x and x would overflow over hundreds of in-place replays."""
    import torch

    gated = kind != "plain"
    gen = torch.Generator(device="cuda").manual_seed(1)
    probe = Chain(CHAIN_LAYERS, gen, kind)
    graphs_needed = max(1, math.ceil(L2_DEFEAT_BYTES / probe.weight_bytes))
    chains = [probe] + [Chain(CHAIN_LAYERS, gen, kind) for _ in range(graphs_needed - 1)]
    x0 = _rand(BLOCK_M, D_MODEL, gen=gen)
    stream = torch.cuda.Stream()
    graphs = []
    with torch.cuda.stream(stream):
        for c in chains:  # eager run first: compiles and autotunes outside capture
            c.x.copy_(x0)
            c.run(run)
        stream.synchronize()
        for c in chains:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                c.run(run)
            graphs.append(g)
    torch.cuda.synchronize()
    chains[0].x.copy_(x0)
    torch.cuda.synchronize()
    graphs[0].replay()
    torch.cuda.synchronize()
    chain_err = _rel_err(chains[0].x, _chain_reference(chains[0], x0))
    for i in range(warmup):
        if gated:
            chains[i % len(chains)].x.copy_(x0)
        graphs[i % len(graphs)].replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for i, (start, end) in enumerate(events):
        if gated:
            chains[i % len(chains)].x.copy_(x0)
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
    torch.cuda.synchronize()
    per_gemm = sorted(s.elapsed_time(e) * 1e3 / chains[0].launches for s, e in events)
    total_bytes = sum(c.weight_bytes for c in chains)
    layers = len(chains[0].w1)
    return {
        "chain_rel_err": chain_err,
        "chain_ok": chain_err < CHAIN_TOL,
        "median_us": per_gemm[len(per_gemm) // 2],
        "p90_us": per_gemm[min(len(per_gemm) - 1, int(0.9 * len(per_gemm)))],
        "min_us": per_gemm[0],
        "median_layer_us": per_gemm[len(per_gemm) // 2] * chains[0].launches / layers,
        "p90_layer_us": per_gemm[min(len(per_gemm) - 1, int(0.9 * len(per_gemm)))] * chains[0].launches / layers,
        "graphs": len(graphs),
        "launches_per_graph": chains[0].launches,
        "weight_bytes_total": total_bytes,
        "roofline_us": chains[0].weight_bytes / chains[0].launches / HBM_BYTES_PER_S * 1e6,
        "roofline_layer_us": chains[0].weight_bytes / layers / HBM_BYTES_PER_S * 1e6,
        "replays": replays,
    }


def worker(impl: str, replays: int, warmup: int, wanted: tuple[str, ...] = CHAINS) -> None:
    """Everything for one implementation, in this (child) process: per chain it runs (the baselines all), the
    single-GEMM checks of that kind (mlp: the gated and the long-K ones), then the chain timing; each chain's row
    printed as a 'RESULT ' line as soon as it is done, so a crash in a later one keeps the earlier."""
    run = _launcher(impl)
    for chain in _chains_of(impl, wanted):
        row: dict[str, Any] = {"impl": impl, "chain": chain}
        # the baselines too: a wrong baseline would make the timing moot
        if chain == "plain":
            row["checks"] = check_shapes(run)
        elif chain == "gated":
            row["checks"] = check_gated_shapes(run)
        else:
            row["checks"] = check_gated_shapes(run) + check_splitk_shapes(run)
        row["checks_ok"] = all(r["ok"] for r in row["checks"])
        for r in row["checks"]:
            kind = " gated" if r.get("gated") else f" split {r['split_k']}" if "split_k" in r else ""
            print(f"  {impl} {r['m']}x{r['n']}x{r['k']}{kind} res={int(r['residual'])} "
                  f"rel_err {r['rel_err']:.2e}" + ("" if r["ok"] else "  FAIL"), flush=True)  # fmt: skip
        row.update(time_chains(run, replays, warmup, kind=chain))
        print("RESULT " + json.dumps(row), flush=True)


def _run_worker(impl: str, args: argparse.Namespace, log: Path, timeout: float) -> list[dict[str, Any]]:
    """Run `impl` in a child process under `timeout` s; its 'RESULT ' lines are its rows, one per chain. A chain
    without one gets an error row."""
    cmd = [sys.executable, __file__, "--worker", impl, "--replays", str(args.replays), "--warmup", str(args.warmup),
           "--chains", ",".join(_wanted(args))]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                    os.environ.get("PYTHONPATH", "")])))  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # a hung kernel (deadlocked mbarrier, stalled partition)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text, rc = out + f"\nTIMEOUT after {timeout:.0f}s", -1
    with log.open("a") as f:
        f.write(f"===== {impl} (rc {rc}, {time.perf_counter() - t0:.0f}s)\n{text}\n")
    for line in text.splitlines():
        if not line.startswith("RESULT "):
            print(line, flush=True)
    done = {r["chain"]: r for r in (json.loads(line[len("RESULT ") :]) for line in text.splitlines()
                                     if line.startswith("RESULT "))}  # fmt: skip
    tail = " | ".join(text.strip().splitlines()[-3:])[-400:]
    return [done.get(c) or {"impl": impl, "chain": c, "error": f"rc {rc}: {tail}"}
            for c in _chains_of(impl, _wanted(args))]  # fmt: skip


def _wanted(args: argparse.Namespace) -> tuple[str, ...]:
    """The chains --chains asks for (all by default)."""
    wanted = tuple(c for c in args.chains.split(",") if c) if args.chains else CHAINS
    unknown = set(wanted) - set(CHAINS)
    if unknown:
        raise SystemExit(f"--chains: unknown chain(s) {sorted(unknown)}; known: {', '.join(CHAINS)}")
    return wanted


def _table(rows: list[dict[str, Any]], gpu: str, chain: str = "plain") -> str:
    """The Markdown table of one chain's rows (also printed last)."""
    if chain == "mlp":
        return _mlp_table(rows, gpu)
    gated = chain == "gated"
    if gated:
        title = (f"### Gated skinny GEMM chain on {gpu}: 64 x 1024 -> GeGLU 4096 (8192 weight rows) -> 1024 "
                 "layers, 36 launches a graph (PDL but torch)")  # fmt: skip
        sizes = (("gate/up", 2 * D_FF), ("down", D_MODEL))
    else:
        title = (f"### Skinny GEMM chain on {gpu}: 64 x 1024 -> 2560 -> 1024 layers, 36 launches a graph "
                 "(PDL but torch and -nopdl)")  # fmt: skip
        sizes = ((f"N {D_WIDE}", D_WIDE), (f"N {D_MODEL}", D_MODEL))
    lines = [
        title,
        "",
        "| impl | median µs/GEMM | p90 µs/GEMM | vs triton | roofline µs | checks | chain rel err |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    note = ", ".join(f"{label}: {rows_w * D_MODEL * 2 / HBM_BYTES_PER_S * 1e6:.2f} µs" for label, rows_w in sizes)
    if gated:
        footer = [
            "",
            f"Roofline: weight bytes at {HBM_BYTES_PER_S / 1e12:.1f} TB/s, the chain's mean per GEMM ({note}; "
            f"{2 * D_FF * D_MODEL * 2 / 1e6:.1f} and {D_MODEL * D_MODEL * 2 / 1e6:.1f} MB). Gated Gluon rows run the "
            f"down GEMM on {DOWN_VARIANT.name}; torch's gate/up is cuBLAS then the GeGLU as torch ops (extra "
            "kernels, inside the per-GEMM time); triton is `gemm(..., gated=True)`. x is reset before every "
            "replay, outside the timed events.",
        ]  # fmt: skip
    else:
        footer = [
            "",
            f"Roofline: weight bytes at {HBM_BYTES_PER_S / 1e12:.1f} TB/s, the chain's mean per GEMM ({note}). "
            "Read early vs late (weights fetched before / after griddepcontrol.wait), ws vs single (warp "
            "specialization), nopdl (no overlap at all), and every row against triton (the project's kernel).",
        ]
    rows = [r for r in rows if r.get("chain", "plain") == chain]
    base = next((r.get("median_us") for r in rows if r["impl"] == "triton"), None)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | error | | | | {r['error'][:120].replace('|', '/')} | |")
            continue
        checks, chain_err, rel = _verdicts(r, base)
        lines.append(f"| {r['impl']} | {r['median_us']:.2f} | {r['p90_us']:.2f} | {rel} | {r['roofline_us']:.2f} "
                     f"| {checks} | {chain_err} |")  # fmt: skip
    return "\n".join(lines + footer)


def _verdicts(r: dict[str, Any], base: float | None) -> tuple[str, str, str]:
    """A timed row's check verdict, chain error (with FAIL) and its time against triton's, as table cells."""
    checks = "ok" if r["checks_ok"] else "FAIL"
    chain_err = f"{r['chain_rel_err']:.1e}" + ("" if r["chain_ok"] else " FAIL")
    return checks, chain_err, f"{r['median_us'] / base:.2f}x" if base else ""


def _mlp_table(rows: list[dict[str, Any]], gpu: str) -> str:
    """The mlp chain's table: per GEMM (two a layer) and per layer."""
    gate_up, down = 2 * D_FF * D_MODEL * 2, D_MODEL * D_FF * 2  # weight bytes a layer: 16.8 MB + 8.4 MB
    layer_roof = (gate_up + down) / HBM_BYTES_PER_S * 1e6
    lines = [
        f"### Expert MLP chain on {gpu}: {CHAIN_LAYERS} layers of h = GeGLU(x @ Wguᵀ) (Wgu {2 * D_FF} x {D_MODEL}), "
        f"x = x + h @ Wdᵀ (Wd {D_MODEL} x {D_FF}, K {D_FF}), 64 rows, one CUDA Graph (PDL but torch)",
        "",
        "| impl | median µs/GEMM | p90 µs/GEMM | median µs/layer | p90 µs/layer | vs triton | roofline µs/layer "
        "| checks | chain rel err |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]  # fmt: skip
    rows = [r for r in rows if r.get("chain") == "mlp"]
    base = next((r.get("median_us") for r in rows if r["impl"] == "triton"), None)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | error | | | | | | {r['error'][:120].replace('|', '/')} | |")
            continue
        checks, chain_err, rel = _verdicts(r, base)
        cells = [f"{r[key]:.2f}" for key in ("median_us", "p90_us", "median_layer_us", "p90_layer_us")]
        lines.append(f"| {r['impl']} | {' | '.join(cells)} | {rel} | {r['roofline_layer_us']:.2f} | {checks} "
                     f"| {chain_err} |")  # fmt: skip
    lines += [
        "",
        f"Roofline: weight bytes at {HBM_BYTES_PER_S / 1e12:.1f} TB/s, {gate_up / 1e6:.1f} MB (gate/up, "
        f"{gate_up / HBM_BYTES_PER_S * 1e6:.2f} µs) + {down / 1e6:.1f} MB (down, {down / HBM_BYTES_PER_S * 1e6:.2f} "
        f"µs) = {layer_roof:.2f} µs a layer. Per GEMM = per layer / 2, whatever the launches. Gluon rows: gate/up on "
        f"{GATEUP_VARIANT.name}, down on the row's split-K variant (GEMM kernel + combine kernel, 3 launches a "
        "layer); torch: cuBLAS, the GeGLU as torch ops, addmm for the down GEMM + residual; triton: `gemm(x, wgu, "
        "h, gated=True)`, `gemm(h, wd, x, residual=x)` (its H200 launch table). x is reset before every replay, "
        "outside the timed events.",
    ]  # fmt: skip
    return "\n".join(lines)


def _tables(rows: list[dict[str, Any]], gpu: str) -> str:
    """The plain chain's table, the gated chain's, then the mlp chain's (each only if it has rows)."""
    chains = [c for c in CHAINS if any(r.get("chain", "plain") == c for r in rows)]
    return "\n\n".join(_table(rows, gpu, c) for c in chains)


def _label(r: dict[str, Any]) -> str:
    return r["impl"] if r.get("chain", "plain") == "plain" else f"{r['impl']} ({r['chain']} chain)"


def _failures(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(implementations with wrong results, implementations without a result), per chain."""
    failed = [_label(r) for r in rows if r.get("checks_ok") is False or r.get("chain_ok") is False]
    return failed, [_label(r) for r in rows if "error" in r]


def _write_results(stem: Path, meta: dict[str, Any], rows: list[dict[str, Any]], gpu: str) -> None:
    failed, errors = _failures(rows)
    stem.with_suffix(".json").write_text(
        json.dumps({**meta, "failed": failed, "errors": errors, "rows": rows}, indent=1)
    )
    stem.with_suffix(".md").write_text(_tables(rows, gpu) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gluon_skinny_gemm_out", help="directory for the JSON / Markdown / log")
    p.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90, no GPU needed")
    p.add_argument("--replays", type=int, default=200, help="timed graph replays (>= 50)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--timeout", type=int, default=WORKER_TIMEOUT_S, help="seconds per implementation and chain")
    p.add_argument("--budget", type=int, default=RUN_BUDGET_S, help="seconds for the whole run")
    p.add_argument("--only", default="", help="comma-separated implementation names (torch, triton, gluon-...)")
    p.add_argument("--chains", default="", help=f"comma-separated chains to run (default all: {','.join(CHAINS)})")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.compile_only:
        return compile_only()

    import torch
    import triton

    if not triton.__version__.startswith("3.6"):  # gl.warp_specialize's signature changed after 3.6
        print(f"gluon_skinny_gemm: written for Triton 3.6's Gluon API, found {triton.__version__}", flush=True)
    if not torch.cuda.is_available():
        print("gluon_skinny_gemm: needs CUDA (an sm_90 GPU); use --compile-only to check the kernels without one")
        return 0
    if args.worker:
        worker(args.worker, max(50, args.replays), args.warmup, _wanted(args))  # a 'RESULT ' line per chain
        return 0

    gpu = torch.cuda.get_device_name()
    gpu_tag = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"gluon_skinny_gemm_{gpu_tag}"
    log = stem.with_suffix(".log")
    log.write_text("")
    meta = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "variants": [asdict(v) | {"name": v.name} for v in VARIANTS],
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "gated_down_variant": DOWN_VARIANT.name,
        "mlp_gateup_variant": GATEUP_VARIANT.name,
    }
    impls = ["torch", "triton", *(v.name for v in VARIANTS)]
    if args.only:
        unknown = set(args.only.split(",")) - set(impls)
        if unknown:
            print(f"gluon_skinny_gemm: --only names no implementation: {', '.join(sorted(unknown))}", flush=True)
        impls = [i for i in impls if i in set(args.only.split(","))]
    impls = [i for i in impls if _chains_of(i, _wanted(args))]  # e.g. --chains mlp drops the plain variants
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.budget
    for impl in impls:
        left = deadline - time.monotonic()
        chains = _chains_of(impl, _wanted(args))
        if left < 15:
            skipped = f"skipped: the {args.budget}s run budget is spent"
            rows.extend({"impl": impl, "chain": c, "error": skipped} for c in chains)
        else:
            print(f"--- {impl}", flush=True)
            new = _run_worker(impl, args, log, min(args.timeout * len(chains), left))
            rows.extend(new)
            for r in new:
                timing = "error" not in r and f"median {r['median_us']:.2f} µs/GEMM, p90 {r['p90_us']:.2f}"
                print(f"    {r['chain']} chain: {timing or r['error']}", flush=True)
        _write_results(stem, meta, rows, gpu)  # after every implementation: a run cut short keeps its results

    failed, errors = _failures(rows)
    print()
    print(_tables(rows, gpu))
    if failed:
        print(f"FAIL (wrong results): {', '.join(failed)}")
    if errors:  # crashed, hung or skipped: no result at all, also a failure of the experiment
        print(f"FAIL (no result, see {log.name}): {', '.join(errors)}")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
