"""A warp-specialized Gluon GEMM for the action expert's 64-row QKV and gate/up projections (sm_90, Triton 3.6).

Why: every expert GEMM is one kernel of a CUDA Graph launched with programmatic dependent launch (PDL); a kernel
may start while the previous one finishes but must execute `griddepcontrol.wait` before it reads that kernel's
output. Weights are never written by a kernel, so here a 1-warp TMA loader fills a shared-memory ring with the
first weight tiles *before* the wait, then loads the 64-row activation slice A once (it stays resident: K <= 1024);
a 4-warp consumer runs wgmma over the ring. The pipeline fill overlaps the previous kernel's tail, which a Triton
`tl.dot` kernel (its loads all after the wait) cannot do. Measured on the H200 in a 36-launch PDL chain
(tools/gluon_skinny_gemm.py, benchmarks/results/gluon_skinny_gemm_NVIDIA-H200.md): 0.89x the project's `gemm`
per plain GEMM, 0.83x per gated gate/up GEMM. Split-K (for K > 1024: the expert's O and down) was slower than
`gemm`'s split-K there, so it is not offered here.

What it computes (`skinny_gemm`), rows < M <= 64, fp32 accumulation, one rounding at the store:
  - plain: out = rs * (a @ wᵀ) (+ residual);
  - gated: w = [gate; up] (2N, K), out = gelu_tanh(rs * a @ w_gᵀ) * (rs * a @ w_uᵀ);
  - rope: w = the fused [q; k; v] heads (heads * D, K), `gemm(..., rope=...)`'s contract: Q rotated (times
    q_scale) in place in `out`, K rotated and V copied into the KV cache rows cache_offset + t, with openpi's
    split-halves RoPE; each program pairs weight rows h*D + i and h*D + D/2 + i (two TMA boxes a stage, two
    accumulators), so both halves meet in one program with no layout change.
rs is 1, a given per-row `row_scale`, or with `rms_eps` the RMSNorm factor rsqrt(mean(a²) + eps) that the consumer
sums from the resident A tiles while the MMAs run (the norm weights are folded into w): no `rms_factor` launch.

The kernels need the NVIDIA backend (TMA, wgmma, mbarriers); `skinny_gemm_applies` says why a call cannot run
here (no sm_90 GPU, another Triton's Gluon, shapes), and the engine keeps `gemm` then. Written against Triton
3.6's Gluon API (`gl.warp_specialize([(fn, args), ...], worker_warps, worker_regs)`); docs/kernels.md has the
measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .pdl import pdl_settings

# Triton 3.6 names the TMA load async_copy_global_to_shared; later Gluon renamed it async_load (and made the old
# name raise). The GPU image runs 3.6; the CPU CI's compile check runs a later Triton.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

__all__ = ["SkinnyConfig", "skinny_config", "skinny_gemm", "skinny_gemm_applies"]

BLOCK_M = 64  # one warpgroup's wgmma M; rows past M are TMA zero-fill
TILE_M = gl.constexpr(BLOCK_M)  # the same, as kernels may read a global only if it is a constexpr
MAX_K = 1024  # A (64 x K) stays resident in shared memory: 128 KiB of bf16 at K = 1024
SMEM_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block
PAIR_NONE, PAIR_GATED, PAIR_ROPE = 0, 1, 2  # the kernel's PAIR: second weight box none / up rows / RoPE half
SCALE_NONE, SCALE_ROWS, SCALE_RMS = 0, 1, 2  # the kernel's SCALE: no row scale / given / RMS factor in-kernel
_PAIR_NONE, _PAIR_GATED, _PAIR_ROPE = gl.constexpr(PAIR_NONE), gl.constexpr(PAIR_GATED), gl.constexpr(PAIR_ROPE)
_SCALE_NONE, _SCALE_ROWS, _SCALE_RMS = gl.constexpr(SCALE_NONE), gl.constexpr(SCALE_ROWS), gl.constexpr(SCALE_RMS)
# gelu_tanh(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), as x / (1 + 2^(-x (C1 + C3 x^2))) with exp2
GELU_C1 = gl.constexpr(2 * math.sqrt(2 / math.pi) * math.log2(math.e))
GELU_C3 = gl.constexpr(2 * math.sqrt(2 / math.pi) * math.log2(math.e) * 0.044715)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration: output columns a program (per accumulator), K tile, ring depth."""

    block_n: int
    block_k: int = 128
    stages: int = 8
    loader_regs: int = 40

    def smem_bytes(self, k: int, paired: bool, itemsize: int = 2) -> int:
        ring = (2 if paired else 1) * self.stages * self.block_n * self.block_k * itemsize
        return BLOCK_M * k * itemsize + ring + 1024  # + barriers and alignment


# From the chain measurements (tools/gluon_skinny_gemm.py on the H200): 32-column programs (80 for the QKV width
# 2560, 128 for the gate/up's 4096), the whole 32 x 1024 plain slice or half the paired one in flight before the wait
DEFAULT_CONFIGS = {
    "plain": SkinnyConfig(32, 128, 8),
    "gated": SkinnyConfig(32, 128, 4),
    "rope": SkinnyConfig(16, 128, 8),  # 16 pair columns = 32 output columns a program: 80 programs at 2560
}


def skinny_config(mode: str) -> SkinnyConfig:
    return DEFAULT_CONFIGS[mode]


def _call_config(gated: bool, rope: dict | None, config: SkinnyConfig | None) -> SkinnyConfig:
    """`config`, or the default of the call's mode ("gated", "rope" or "plain")."""
    return config or skinny_config("gated" if gated else "rope" if rope is not None else "plain")


# ----------------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------------


@gluon.jit
def _gdc_wait():
    """`griddepcontrol.wait` (inline PTX: Triton 3.6's Gluon has no builtin): the previous grid has completed and
    its writes are visible. It orders only the executing thread, so every partition that touches another kernel's
    data executes it."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    """`griddepcontrol.launch_dependents`: the next PDL kernel may be scheduled once every program issued it."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _issue_w_tile(w_desc, w_smem, ready, row0, row1, kt, STAGES: gl.constexpr, BLOCK_K: gl.constexpr,
                  PAIRED: gl.constexpr):  # fmt: skip
    """TMA-load K step kt of this program's weight rows into ring slot kt % STAGES: rows row0.. (and, PAIRED, rows
    row1.. into buffer STAGES + slot, on the same barrier, which then expects both boxes' bytes)."""
    s = kt % STAGES
    if PAIRED:
        mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
        _tma_load(w_desc, [row0, kt * BLOCK_K], ready.index(s), w_smem.index(s))
        _tma_load(w_desc, [row1, kt * BLOCK_K], ready.index(s), w_smem.index(STAGES + s))
    else:
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
        _tma_load(w_desc, [row0, kt * BLOCK_K], ready.index(s), w_smem.index(s))


@gluon.jit
def _loader(a_desc, w_desc, a_smem, w_smem, a_bar, ready, empty, row0, row1,
            K_TILES: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
            PAIRED: gl.constexpr):  # fmt: skip
    """The 1-warp producer: the first STAGES weight tiles before `griddepcontrol.wait` (no kernel writes weights),
    then A (the previous kernel's output) once, then each later tile as soon as the consumer released its slot."""
    for kt in gl.static_range(STAGES):
        _issue_w_tile(w_desc, w_smem, ready, row0, row1, kt, STAGES, BLOCK_K, PAIRED)
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    mbarrier.expect(a_bar, K_TILES * a_desc.block_type.nbytes)
    for kt in gl.static_range(K_TILES):
        _tma_load(a_desc, [0, kt * BLOCK_K], a_bar, a_smem.index(kt))
    for kt in range(STAGES, K_TILES):
        # the (kt // STAGES)-th refill of a slot waits for the consumer's (kt // STAGES - 1)-th release of it
        mbarrier.wait(empty.index(kt % STAGES), ((kt // STAGES) & 1) ^ 1)
        _issue_w_tile(w_desc, w_smem, ready, row0, row1, kt, STAGES, BLOCK_K, PAIRED)


@gluon.jit
def _gelu_tanh(x):
    return x / (1.0 + gl.exp2(-x * (GELU_C1 + GELU_C3 * x * x)))


@gluon.jit
def _store_rows(ptr, rows, cols, mask, stride, value):
    gl.store(ptr + rows[:, None] * stride + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _consumer(
    a_smem, w_smem, a_bar, ready, empty, out_ptr, res_ptr, scale_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    M, N, stride_om, stride_rm, eps, rope_t, cache_offset, q_scale, stride_cos_b, stride_cos_t, stride_kv_b,
    stride_kv_t, stride_kv_h, col0,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr, STAGES: gl.constexpr,
    PAIR: gl.constexpr, SCALE: gl.constexpr, HAS_RES: gl.constexpr, ROPE_HALF: gl.constexpr,
    Q_HEADS: gl.constexpr, KV_HEADS: gl.constexpr, USE_PDL: gl.constexpr,
):  # fmt: skip
    """The default partition, one warpgroup. After the PDL wait (it reads the row scale / residual / RoPE tables
    and writes `out` and the cache, which earlier kernels read or write; the wait orders only its own threads) it
    loads the epilogue's operands while the weight ring fills; with SCALE_RMS, once A has landed, the rows' sums of
    squares from the resident A tiles (before any MMA: the MMAs wait for weights anyway, and a shared-memory read
    between an async wgmma and its wait would serialize the pipeline); then wgmma over the ring (one K step in
    flight), each slot released as soon as the MMA reading it retired; then the epilogue."""
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
    )
    a_regs: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [gl.num_warps(), 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    PAIRED: gl.constexpr = PAIR != _PAIR_NONE
    acc = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
    acc2 = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)  # the up / second-half accumulator (PAIRED)

    # the epilogue's operands, loaded while the weights stream in
    rows = gl.arange(0, TILE_M, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    row_ok = rows < M
    rs = gl.load(scale_ptr + rows, mask=row_ok & (SCALE == _SCALE_ROWS), other=1.0).to(gl.float32)
    b = rows // rope_t
    t = rows % rope_t
    i = col0 % ROPE_HALF + cols if PAIR == _PAIR_ROPE else col0 + cols  # pair index in the head / output column
    if PAIR == _PAIR_ROPE:  # pair columns col0.. lie in one head (BLOCK_N divides ROPE_HALF)
        mask = row_ok[:, None] & (i < ROPE_HALF)[None, :]
        tab = (b * stride_cos_b + t * stride_cos_t)[:, None] + i[None, :]
        cos = gl.load(cos_ptr + tab, mask=mask, other=0.0).to(gl.float32)
        sin = gl.load(sin_ptr + tab, mask=mask, other=0.0).to(gl.float32)
        res = acc
    else:
        mask = row_ok[:, None] & (i < N)[None, :]
        cos = acc
        sin = acc
        res = gl.load(res_ptr + rows[:, None] * stride_rm + i[None, :], mask=mask & HAS_RES, other=0.0)

    mbarrier.wait(a_bar, 0)
    if SCALE == _SCALE_RMS:
        ssq = gl.zeros([TILE_M], gl.float32, gl.SliceLayout(1, a_regs))
        for kt in gl.static_range(K_TILES):
            a = a_smem.index(kt).load(a_regs).to(gl.float32)
            ssq += gl.sum(a * a, axis=1)
        rs = gl.convert_layout(gl.rsqrt(ssq / (K_TILES * BLOCK_K) + eps), row_layout)
    for kt in range(K_TILES):
        s = kt % STAGES
        mbarrier.wait(ready.index(s), (kt // STAGES) & 1)
        a_tile = a_smem.index(kt)
        w_tile = w_smem.index(s)
        if PAIRED:
            w2_tile = w_smem.index(STAGES + s)
            acc = warpgroup_mma(a_tile, w_tile.permute((1, 0)), acc, is_async=True)
            acc2 = warpgroup_mma(a_tile, w2_tile.permute((1, 0)), acc2, is_async=True)
            # each wgmma is one commit group: <= 2 in flight means the previous step's pair has retired
            acc, acc2, _, _, _ = warpgroup_mma_wait(2, deps=[acc, acc2, a_tile, w_tile, w2_tile])
        else:
            acc = warpgroup_mma(a_tile, w_tile.permute((1, 0)), acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(1, deps=[acc, a_tile, w_tile])
        if kt > 0:
            mbarrier.arrive(empty.index((kt - 1) % STAGES))
    if PAIRED:
        acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
    else:
        acc = warpgroup_mma_wait(0, deps=[acc])

    if SCALE != _SCALE_NONE:
        acc = acc * rs[:, None]
        acc2 = acc2 * rs[:, None]
    if PAIR == _PAIR_ROPE:  # x1 = columns h*D + i, x2 = h*D + D/2 + i of head h
        head = col0 // ROPE_HALF
        r1 = acc * cos - acc2 * sin
        r2 = acc2 * cos + acc * sin
        if head < Q_HEADS:
            q_cols = head * (2 * ROPE_HALF) + i
            _store_rows(out_ptr, rows, q_cols, mask, stride_om, r1 * q_scale)
            _store_rows(out_ptr, rows, q_cols + ROPE_HALF, mask, stride_om, r2 * q_scale)
        else:
            cache_rows = b * stride_kv_b + (cache_offset + t) * stride_kv_t
            if head < Q_HEADS + KV_HEADS:
                kv_cols = (head - Q_HEADS) * stride_kv_h + i
                _store_rows(k_cache_ptr, cache_rows, kv_cols, mask, 1, r1)
                _store_rows(k_cache_ptr, cache_rows, kv_cols + ROPE_HALF, mask, 1, r2)
            else:
                kv_cols = (head - Q_HEADS - KV_HEADS) * stride_kv_h + i
                _store_rows(v_cache_ptr, cache_rows, kv_cols, mask, 1, acc)
                _store_rows(v_cache_ptr, cache_rows, kv_cols + ROPE_HALF, mask, 1, acc2)
    else:
        if PAIR == _PAIR_GATED:
            acc = _gelu_tanh(acc) * acc2
        if HAS_RES:
            acc = acc + res.to(gl.float32)
        _store_rows(out_ptr, rows, i, mask, stride_om, acc)


@gluon.jit
def skinny_gemm_kernel(
    a_desc, w_desc, out_ptr, res_ptr, scale_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    M, N, stride_om, stride_rm, eps, rope_t, cache_offset, q_scale, stride_cos_b, stride_cos_t, stride_kv_b,
    stride_kv_t, stride_kv_h,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr, STAGES: gl.constexpr,
    PAIR: gl.constexpr, SCALE: gl.constexpr, HAS_RES: gl.constexpr, ROPE_HALF: gl.constexpr,
    Q_HEADS: gl.constexpr, KV_HEADS: gl.constexpr, USE_PDL: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """One program per BLOCK_N output (pair) columns. a_desc: A (M x K, box 64 x BLOCK_K, K = K_TILES * BLOCK_K);
    w_desc: W (rows x K, box BLOCK_N x BLOCK_K). Program p's weight rows: plain p*BLOCK_N..; gated those and the up
    rows N + p*BLOCK_N..; rope pair columns c0 = p*BLOCK_N of head h = c0 // HALF, rows h*D + c0 % HALF.. and
    HALF rows further."""
    PAIRED: gl.constexpr = PAIR != _PAIR_NONE
    col0 = gl.program_id(0) * BLOCK_N
    if PAIR == _PAIR_ROPE:
        row0 = (col0 // ROPE_HALF) * (2 * ROPE_HALF) + col0 % ROPE_HALF
        row1 = row0 + ROPE_HALF
    else:
        row0 = col0
        row1 = col0 + N  # gated: the up rows
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [K_TILES, TILE_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES if PAIRED else STAGES, BLOCK_N, BLOCK_K],
                                       w_desc.layout)  # fmt: skip
    a_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(a_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()  # barrier init visible to the async proxy (TMA) before the first copy
    gl.warp_specialize(
        [
            (
                _consumer,
                (a_smem, w_smem, a_bar, ready, empty, out_ptr, res_ptr, scale_ptr, cos_ptr, sin_ptr, k_cache_ptr,
                 v_cache_ptr, M, N, stride_om, stride_rm, eps, rope_t, cache_offset, q_scale, stride_cos_b,
                 stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h, col0, BLOCK_N, BLOCK_K, K_TILES, STAGES, PAIR,
                 SCALE, HAS_RES, ROPE_HALF, Q_HEADS, KV_HEADS, USE_PDL),
            ),
            (
                _loader,
                (a_desc, w_desc, a_smem, w_smem, a_bar, ready, empty, row0, row1, K_TILES, BLOCK_K, STAGES, USE_PDL,
                 PAIRED),
            ),
        ],
        [1],
        [LOADER_REGS],
    )  # fmt: skip
    mbarrier.invalidate(a_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def tma_descriptor(t: torch.Tensor, block: list[int]):
    """A host TMA descriptor of the 2-D bf16/fp16 tensor t with box `block`, in the NVMMA shared layout wgmma reads
    (the layout Gluon picks for that box and dtype)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _gluon_api_ok() -> str | None:
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 6):  # (compiles for sm_90 on 3.9 too, tests/test_gluon_gemm.py; runs on 3.6 in the image)
        return f"needs Triton >= 3.6's Gluon API, found Triton {triton.__version__}"
    return None


def skinny_gemm_applies(a: torch.Tensor, w: torch.Tensor, *, gated: bool = False, rope: dict | None = None,
                        config: SkinnyConfig | None = None) -> str | None:  # fmt: skip
    """None if `skinny_gemm(a, w, ...)` runs here, else why not (the caller keeps `gemm`): an sm_90 CUDA device,
    Triton 3.6, bf16/fp16, M <= 64, K <= 1024 and a multiple of the K tile, 16-byte-aligned rows (TMA), the config's
    shared memory, and for RoPE a K/V head count and column tile that divide the heads."""
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device)[0] != 9:
        return f"needs an sm_90 CUDA device (TMA + wgmma), found {a.device}"
    why = _gluon_api_ok()
    if why:
        return why
    cfg = _call_config(gated, rope, config)
    m, k = a.shape
    if a.dtype not in _GL_DTYPES or w.dtype != a.dtype:
        return f"a and w must both be bf16 or fp16, found {a.dtype} and {w.dtype}"
    if m > BLOCK_M or k > MAX_K or k % cfg.block_k or w.shape[1] != k:
        return f"needs M <= {BLOCK_M}, K <= {MAX_K} a multiple of {cfg.block_k}: a {tuple(a.shape)}, w {tuple(w.shape)}"
    if a.stride(1) != 1 or w.stride(1) != 1 or (a.stride(0) * a.element_size()) % 16 or w.stride(0) != k:
        return f"TMA needs unit column strides and 16-byte row strides: a {a.stride()}, w {w.stride()}"
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        return "TMA needs 16-byte-aligned a and w"
    if cfg.smem_bytes(k, gated or rope is not None, a.element_size()) > SMEM_LIMIT:
        return f"{cfg} needs more than {SMEM_LIMIT} bytes of shared memory at K {k}"
    if rope is not None:
        half = rope["head_dim"] // 2
        if half % cfg.block_n or rope.get("num_kv_heads", 1) < 1:
            return f"RoPE needs block_n ({cfg.block_n}) to divide the half head ({half})"
    return None


def skinny_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, row_scale: torch.Tensor | None = None,
                rms_eps: float | None = None, gated: bool = False, rope: dict | None = None,
                residual: torch.Tensor | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:  # fmt: skip
    """`gemm(a, w, out, ...)` for M <= 64, K <= 1024 with the options the expert's QKV and gate/up GEMMs use:
    `row_scale` (M,) or `rms_eps` (the RMSNorm factor of a's rows, summed in-kernel), `gated`, `rope` (gemm's
    RoPE dict: cos, sin, k_cache, v_cache, cache_offset, num_q_heads, num_kv_heads, head_dim, q_scale), `residual`
    (plain only; may alias out). Launch-only, so graph-capturable; raises ValueError where `skinny_gemm_applies`
    says no."""
    if row_scale is not None and rms_eps is not None:
        raise ValueError("skinny_gemm: give row_scale or rms_eps, not both")
    if (gated or rope is not None) and residual is not None:
        raise ValueError("skinny_gemm: a residual only on the plain GEMM")
    if gated and rope is not None:
        raise ValueError("skinny_gemm: gated and rope exclude each other")
    cfg = _call_config(gated, rope, config)
    why = skinny_gemm_applies(a, w, gated=gated, rope=rope, config=cfg)
    if why:
        raise ValueError(f"skinny_gemm: {why}")
    m, k = a.shape
    rows_w = w.shape[0]
    if gated:
        if rows_w % 2:
            raise ValueError(f"skinny_gemm: gated needs [gate; up] weights (an even row count), found {rows_w}")
        n = rows_w // 2
    else:
        n = rows_w
    if rope is None and tuple(out.shape) != (m, n):
        raise ValueError(f"skinny_gemm: out must be ({m}, {n}), found {tuple(out.shape)}")
    if residual is not None and tuple(residual.shape) != (m, n):
        raise ValueError(f"skinny_gemm: residual must be ({m}, {n}), found {tuple(residual.shape)}")
    if row_scale is not None and (row_scale.shape != (m,) or row_scale.stride(0) != 1):
        raise ValueError(f"skinny_gemm: row_scale must be contiguous ({m},), found {tuple(row_scale.shape)}")
    a_desc = tma_descriptor(a, [BLOCK_M, cfg.block_k])
    w_desc = tma_descriptor(w, [cfg.block_n, cfg.block_k])

    scale = SCALE_RMS if rms_eps is not None else SCALE_ROWS if row_scale is not None else SCALE_NONE
    res = residual if residual is not None else out
    rope_args = dict(cos=out, sin=out, k_cache=out, v_cache=out, cache_offset=0, q_scale=1.0)  # unused
    half = q_heads = kv_heads = 0
    rope_t, s_cos_b, s_cos_t, s_kv_b, s_kv_t, s_kv_h = 1, 0, 0, 0, 0, 0
    if rope is not None:
        rope_args = {**rope_args, **rope}
        cos, kc = rope_args["cos"], rope_args["k_cache"]
        half, q_heads, kv_heads = rope["head_dim"] // 2, rope["num_q_heads"], rope.get("num_kv_heads", 1)
        if rows_w != (q_heads + 2 * kv_heads) * rope["head_dim"]:
            raise ValueError(f"skinny_gemm: rope weights must have (q + 2 kv heads) x head_dim rows, found {rows_w}")
        if cos.dim() == 2:  # (t, half): one table for every batch row
            rope_t, s_cos_b, s_cos_t = cos.shape[0], 0, cos.stride(0)
        else:  # (b, t, half)
            rope_t, s_cos_b, s_cos_t = cos.shape[1], cos.stride(0), cos.stride(1)
        if m % rope_t or rope_args["sin"].stride() != cos.stride() or cos.stride(-1) != 1:
            raise ValueError(f"skinny_gemm: rope tables {tuple(cos.shape)} do not match {m} rows")
        if kc.stride(-1) != 1 or rope_args["v_cache"].stride() != kc.stride():
            raise ValueError("skinny_gemm: K and V caches need the same strides, unit last stride")
        s_kv_b, s_kv_t, s_kv_h = kc.stride(0), kc.stride(1), kc.stride(2)
        n = rows_w // 2  # pair columns
    use_pdl, _ = pdl_settings(out)
    extra = {"launch_pdl": True} if use_pdl else {}
    grid = (triton.cdiv(n, cfg.block_n),)
    skinny_gemm_kernel[grid](
        a_desc, w_desc, out, res, row_scale if row_scale is not None else out, rope_args["cos"], rope_args["sin"],
        rope_args["k_cache"], rope_args["v_cache"], m, n, out.stride(0), res.stride(0),
        0.0 if rms_eps is None else float(rms_eps), rope_t, rope_args["cache_offset"], float(rope_args["q_scale"]),
        s_cos_b, s_cos_t, s_kv_b, s_kv_t, s_kv_h,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_TILES=k // cfg.block_k, STAGES=min(cfg.stages, k // cfg.block_k),
        PAIR=PAIR_GATED if gated else PAIR_ROPE if rope is not None else PAIR_NONE, SCALE=scale,
        HAS_RES=residual is not None, ROPE_HALF=half, Q_HEADS=q_heads, KV_HEADS=kv_heads, USE_PDL=bool(use_pdl),
        LOADER_REGS=cfg.loader_regs, num_warps=4, **extra,
    )  # fmt: skip
    return out


def compile_sm90(mode: str, *, scale: int = SCALE_RMS, has_res: bool = False, k: int = MAX_K,
                 config: SkinnyConfig | None = None, pdl: bool = True):  # fmt: skip
    """Compile `skinny_gemm_kernel` for sm_90 without a GPU, as `skinny_gemm` launches it in `mode` ("plain",
    "gated", "rope" at π0's expert heads: 8 Q + 1 K + 1 V of 256) on bf16 at K = k; returns the compiled kernel
    (`compile_check.gluon_report` reads its resources). Needs TRITON_INTERPRET unset (the real compiler)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or skinny_config(mode)
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, cfg.block_k], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], gl.bfloat16)
    signature = {
        "a_desc": f"tensordesc<bf16[{BLOCK_M},{cfg.block_k}],{a_layout!r}>",
        "w_desc": f"tensordesc<bf16[{cfg.block_n},{cfg.block_k}],{w_layout!r}>",
        "out_ptr": "*bf16", "res_ptr": "*bf16", "scale_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
        "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "M": "i32", "N": "i32", "stride_om": "i32",
        "stride_rm": "i32", "eps": "fp32", "rope_t": "i32", "cache_offset": "i32", "q_scale": "fp32",
        "stride_cos_b": "i32", "stride_cos_t": "i32", "stride_kv_b": "i32", "stride_kv_t": "i32", "stride_kv_h": "i32",
    }  # fmt: skip
    k_tiles = k // cfg.block_k
    constexprs = dict(
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_TILES=k_tiles, STAGES=min(cfg.stages, k_tiles),
        PAIR={"plain": PAIR_NONE, "gated": PAIR_GATED, "rope": PAIR_ROPE}[mode], SCALE=scale, HAS_RES=has_res,
        ROPE_HALF=128 if mode == "rope" else 0, Q_HEADS=8 if mode == "rope" else 0, KV_HEADS=1 if mode == "rope" else 0,
        USE_PDL=pdl, LOADER_REGS=cfg.loader_regs,
    )  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = skinny_gemm_kernel.arg_names
    aligned = ("out_ptr", "res_ptr", "scale_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr", "v_cache_ptr", "stride_om",
               "stride_rm")  # fmt: skip
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    src = GluonASTSource(skinny_gemm_kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
