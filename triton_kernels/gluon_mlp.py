"""The action expert's whole MLP (RMSNorm factor, gate/up GeGLU, down, residual) as one Gluon kernel (sm_90).

Why: an expert layer's MLP moves 25 MB of weights (gate/up 16.8 MB, down 8.4 MB) for 64 rows, which the H200
streams in ~6 µs, but as `rms_factor` + gate/up + split-K down + combine it takes four latency-bound kernels
(~16 µs a layer without PDL). Weights never depend on activations, and 128 programs x 192 KiB of shared memory hold
the whole MLP's weights. So every program asks TMA for *all* of its weight tiles at its first instruction, before
`griddepcontrol.wait` (the previous kernel may still run), and HBM streams the layer's MLP weights in one go while
the program waits for its inputs, computes its gate/up columns, and waits for the h columns its down slice needs.

Work split (π0's expert: width 1024, MLP 4096, up to 64 rows), 128 programs, one per SM:
  - phase 1, program p: h[:, 32p .. 32p+32) = gelu_tanh(rs * x @ gateᵀ) * (rs * x @ upᵀ), rs = rsqrt(mean(x²) +
    eps) summed from the x tiles as they stream through a 4-deep TMA ring (the RMSNorm weight is folded into the
    gate/up rows). Then it publishes: its h stores, a proxy fence, one release increment of slice counter p // 32.
  - phase 2, program p: output columns 32 (p % 32) .. of x += h @ downᵀ over the K split p // 32 (1024 of the
    4096 h columns). It polls that slice's counter (ld.acquire) until the 32 producers of those h columns have
    published, then streams h through the same ring. The four splits of a column tile leave fp32 partials in the
    workspace; the last to arrive adds them in split order and the residual, and stores x (deterministic, as
    `gemm`'s split-K). The last arriver may overwrite x: every program has finished reading x by then (each split
    waited for its slice, i.e. for a quarter of the programs' phase 1, and the four splits cover all of them).
  - The last program to finish resets the slice counters (graph replays start at zero); a column tile's last
    split resets its own.

Phase 2 waits for other programs of the same grid, so all 128 programs must be resident at once: one per SM at
224 KiB of shared memory, on a GPU with >= 128 SMs (`expert_mlp_applies` checks). A program never waits for a
later kernel, and a PDL predecessor's programs always finish, so a program that is not yet resident is only late.

Numbers: docs/kernels.md ("The expert MLP in one kernel"); tests: tests/test_gluon_mlp_gpu.py (bf16 vs fp32 torch on
the GPU) and the sm_90 compile test in tests/test_kernels_compile_sm90.py.
"""

from __future__ import annotations

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

__all__ = ["MLP_PROGRAMS", "expert_mlp", "expert_mlp_applies"]

BLOCK_M = 64  # rows (one warpgroup's wgmma M); rows past M are TMA zero-fill
COLS = 32  # h columns a program makes in phase 1 = output columns it sums in phase 2
BLOCK_K = 64  # K step: one 128-byte-swizzled TMA box row of bf16
A_STAGES = 4  # the x / h ring (8 KiB a slot)
MLP_PROGRAMS = 128  # 4096 / COLS; also 1024 / COLS column tiles x 4 splits
_SLICE_WAIT = gl.constexpr(0)  # counters: [0, splits) slices, [splits, splits + tiles) column tiles, then exit


def smem_bytes(width: int, mlp: int, itemsize: int = 2) -> int:
    """A program's shared memory: its gate/up and down weight slices, the ring, the barriers."""
    tiles, splits = _split_counts(width, mlp)
    weights = 2 * COLS * width + COLS * (mlp // splits)  # gate + up rows over the width, down rows over one split
    return (weights + A_STAGES * BLOCK_M * BLOCK_K) * itemsize + 1024


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
def _ring_load(desc, ring, bars, row, col, j, A_STAGES: gl.constexpr):
    s = j % A_STAGES
    mbarrier.expect(bars.index(s), desc.block_type.nbytes)
    _tma_load(desc, [row, col], bars.index(s), ring.index(s))


@gluon.jit
def expert_mlp_kernel(
    x_desc, h_desc, wgu_desc, wd_desc, x_ptr, h_ptr, part_ptr, sync_ptr, M, stride_x, stride_h, eps,
    WIDTH: gl.constexpr, MLP: gl.constexpr, COLS: gl.constexpr, BLOCK_K: gl.constexpr, A_STAGES: gl.constexpr,
    USE_PDL: gl.constexpr,
):  # fmt: skip
    """x (M x WIDTH, updated in place), h (M x MLP scratch), wgu [gate; up] (2 MLP x WIDTH), wd (WIDTH x MLP);
    part: SPLITS x 64 x WIDTH fp32; sync: SPLITS + TILES + 1 zeroed int32 counters. Grid: MLP // COLS programs."""
    KT1: gl.constexpr = WIDTH // BLOCK_K  # phase-1 K steps
    TILES: gl.constexpr = WIDTH // COLS  # phase-2 output column tiles
    SPLITS: gl.constexpr = (MLP // COLS) // TILES  # phase-2 K splits (programs = TILES * SPLITS)
    K_SPLIT: gl.constexpr = MLP // SPLITS
    KT2: gl.constexpr = K_SPLIT // BLOCK_K
    PRODUCERS: gl.constexpr = K_SPLIT // COLS  # phase-1 programs that make one slice of h
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tile = pid % TILES
    split = pid // TILES

    dtype: gl.constexpr = x_desc.dtype
    wgu = gl.allocate_shared_memory(dtype, [2 * KT1, COLS, BLOCK_K], wgu_desc.layout)
    wd = gl.allocate_shared_memory(dtype, [KT2, COLS, BLOCK_K], wd_desc.layout)
    ring = gl.allocate_shared_memory(dtype, [A_STAGES, TILE_M, BLOCK_K], x_desc.layout)
    wgu_bar = gl.allocate_shared_memory(gl.int64, [KT1, 1], mbarrier.MBarrierLayout())
    wd_bar = gl.allocate_shared_memory(gl.int64, [KT2, 1], mbarrier.MBarrierLayout())
    ring_bar = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(KT1):
        mbarrier.init(wgu_bar.index(i), count=1)
    for i in gl.static_range(KT2):
        mbarrier.init(wd_bar.index(i), count=1)
    for i in gl.static_range(A_STAGES):
        mbarrier.init(ring_bar.index(i), count=1)
    fence_async_shared()

    # every weight tile of this program in flight before the PDL wait: gate/up first (phase 1 reads them first)
    for kt in gl.static_range(KT1):
        mbarrier.expect(wgu_bar.index(kt), 2 * wgu_desc.block_type.nbytes)
        _tma_load(wgu_desc, [pid * COLS, kt * BLOCK_K], wgu_bar.index(kt), wgu.index(kt))
        _tma_load(wgu_desc, [MLP + pid * COLS, kt * BLOCK_K], wgu_bar.index(kt), wgu.index(KT1 + kt))
    for kt in gl.static_range(KT2):
        mbarrier.expect(wd_bar.index(kt), wd_desc.block_type.nbytes)
        _tma_load(wd_desc, [tile * COLS, split * K_SPLIT + kt * BLOCK_K], wd_bar.index(kt), wd.index(kt))
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, COLS, 16]
    )
    a_regs: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [gl.num_warps(), 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    rows = gl.arange(0, TILE_M, layout=row_layout)
    cols = gl.arange(0, COLS, layout=col_layout)
    row_ok = (rows < M)[:, None]

    # ---- phase 1: this program's 32 h columns, the RMS factor summed from the x tiles -------------------------
    for p0 in gl.static_range(A_STAGES):
        _ring_load(x_desc, ring, ring_bar, 0, p0 * BLOCK_K, p0, A_STAGES)
    acc_g = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
    acc_u = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
    ssq = gl.zeros([TILE_M], gl.float32, gl.SliceLayout(1, a_regs))
    for kt in range(KT1):
        s = kt % A_STAGES
        mbarrier.wait(ring_bar.index(s), (kt // A_STAGES) & 1)
        a = ring.index(s)
        xa = a.load(a_regs).to(gl.float32)
        ssq += gl.sum(xa * xa, axis=1)
        mbarrier.wait(wgu_bar.index(kt), 0)
        acc_g = warpgroup_mma(a, wgu.index(kt).permute((1, 0)), acc_g, is_async=True)
        acc_u = warpgroup_mma(a, wgu.index(KT1 + kt).permute((1, 0)), acc_u, is_async=True)
        acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
        _cta_barrier()  # every warp is done with slot s (its loads and its wgmma) before TMA refills it
        if kt + A_STAGES < KT1:
            _ring_load(x_desc, ring, ring_bar, 0, (kt + A_STAGES) * BLOCK_K, kt + A_STAGES, A_STAGES)
    rs = gl.convert_layout(gl.rsqrt(ssq / WIDTH + eps), row_layout)
    hval = _gelu_tanh(acc_g * rs[:, None]) * (acc_u * rs[:, None])
    h_cols = pid * COLS + cols
    gl.store(h_ptr + rows[:, None] * stride_h + h_cols[None, :], hval.to(h_ptr.dtype.element_ty), mask=row_ok)
    _fence_proxy_async()
    _cta_barrier()  # all threads' h stores issued before the (one-thread) release
    gl.atomic_add(sync_ptr + pid // PRODUCERS, 1, sem="release", scope="gpu")

    # ---- phase 2: x[:, tile] += h[:, split] @ down[tile, split]ᵀ -------------------------------------------
    seen = _load_acquire(sync_ptr + split)
    while seen < PRODUCERS:
        seen = _load_acquire(sync_ptr + split)
    _fence_proxy_async()
    _cta_barrier()
    for p0 in gl.static_range(A_STAGES):  # ring slots continue: KT1 is a multiple of A_STAGES, phases line up
        _ring_load(h_desc, ring, ring_bar, 0, split * K_SPLIT + p0 * BLOCK_K, KT1 + p0, A_STAGES)
    acc = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
    for kt in range(KT2):
        j = KT1 + kt
        s = j % A_STAGES
        mbarrier.wait(ring_bar.index(s), (j // A_STAGES) & 1)
        mbarrier.wait(wd_bar.index(kt), 0)
        a = ring.index(s)
        acc = warpgroup_mma(a, wd.index(kt).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _cta_barrier()
        if kt + A_STAGES < KT2:
            _ring_load(h_desc, ring, ring_bar, 0, split * K_SPLIT + (kt + A_STAGES) * BLOCK_K, j + A_STAGES, A_STAGES)

    out_cols = tile * COLS + cols
    x_ptrs = x_ptr + rows[:, None] * stride_x + out_cols[None, :]
    if SPLITS == 1:
        res = gl.load(x_ptrs, mask=row_ok, other=0.0).to(gl.float32)
        gl.store(x_ptrs, (acc + res).to(x_ptr.dtype.element_ty), mask=row_ok)
    else:
        part = part_ptr + rows[:, None] * WIDTH + out_cols[None, :]
        gl.store(part + split * (TILE_M * WIDTH), acc)
        _cta_barrier()
        arrived = gl.atomic_add(sync_ptr + SPLITS + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the last split: partials in split order, then the residual
            total = gl.zeros([TILE_M, COLS], gl.float32, acc_layout)
            for i in gl.static_range(SPLITS):
                total += gl.load(part + i * (TILE_M * WIDTH), cache_modifier=".cg")
            res = gl.load(x_ptrs, mask=row_ok, other=0.0, cache_modifier=".cg").to(gl.float32)
            gl.store(x_ptrs, (total + res).to(x_ptr.dtype.element_ty), mask=row_ok)
            gl.atomic_xchg(sync_ptr + SPLITS + tile, 0, sem="relaxed", scope="gpu")

    # the last program out resets the slice counters: every program has passed its slice wait by then
    _cta_barrier()
    done = gl.atomic_add(sync_ptr + SPLITS + TILES, 1, sem="acq_rel", scope="gpu")
    if done == nprog - 1:
        for i in gl.static_range(SPLITS):
            gl.atomic_xchg(sync_ptr + i, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr + SPLITS + TILES, 0, sem="relaxed", scope="gpu")

    for i in gl.static_range(KT1):
        mbarrier.invalidate(wgu_bar.index(i))
    for i in gl.static_range(KT2):
        mbarrier.invalidate(wd_bar.index(i))
    for i in gl.static_range(A_STAGES):
        mbarrier.invalidate(ring_bar.index(i))


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def _split_counts(width: int, mlp: int) -> tuple[int, int]:
    """(column tiles, K splits) of phase 2."""
    tiles = width // COLS
    return tiles, (mlp // COLS) // tiles


def expert_mlp_applies(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> str | None:
    """None if `expert_mlp` runs here, else why not (the caller keeps the separate GEMMs): an sm_90 CUDA device with
    enough SMs for every program at once, Triton 3.6's Gluon, bf16/fp16, M <= 64, gate/up (2 MLP x width) and down
    (width x MLP) with MLP = 4 x width (one program per 32 h columns = 4 splits of every 32 output columns), width a
    multiple of 128, unit column strides and 16-byte rows (TMA)."""
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        return f"needs an sm_90 CUDA device (TMA + wgmma), found {x.device}"
    why = _gluon_api_ok()
    if why:
        return why
    m, width = x.shape
    if x.dtype not in _GL_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        return f"x and weights must all be bf16 or fp16, found {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}"
    mlp = w_down.shape[1] if w_down.dim() == 2 else -1
    if m > BLOCK_M or tuple(w_gate_up.shape) != (2 * mlp, width) or tuple(w_down.shape) != (width, mlp):
        return (f"needs M <= {BLOCK_M}, gate/up (2 MLP, width) and down (width, MLP): x {tuple(x.shape)}, "
                f"gate/up {tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}")  # fmt: skip
    if width % (2 * BLOCK_K) or mlp != 4 * width:
        return f"needs width a multiple of {2 * BLOCK_K} and MLP = 4 x width, found {width} and {mlp}"
    programs = mlp // COLS
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if programs > sms:
        return f"its {programs} programs wait for each other, so they must all be resident: {sms} SMs"
    if smem_bytes(width, mlp, x.element_size()) > SMEM_LIMIT:
        return f"needs {smem_bytes(width, mlp, x.element_size())} bytes of shared memory a program at width {width}"
    for name, t in (("x", x), ("gate/up", w_gate_up), ("down", w_down)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"TMA needs unit column strides, 16-byte rows and 16-byte alignment: {name} {t.stride()}"
    return None


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, *, rms_eps: float,
               workspace: Workspace | None = None) -> torch.Tensor:  # fmt: skip
    """x += down(gelu_tanh(rs·x @ gateᵀ) · rs·x @ upᵀ) in place, rs = rsqrt(mean(x²) + rms_eps) per row (the
    expert's RMSNorm, its weight folded into the gate/up rows): `gemm(x, w_gate_up, h, gated=True, rms_eps=eps)`
    then `gemm(h, w_down, x, residual=x)` in one launch. h (M x MLP) is scratch the kernel writes. Launch-only
    (graph-capturable once the workspace holds its partials); raises ValueError where `expert_mlp_applies` says no."""
    why = expert_mlp_applies(x, w_gate_up, w_down)
    if why:
        raise ValueError(f"expert_mlp: {why}")
    m, width = x.shape
    mlp = w_down.shape[1]
    if tuple(h.shape) != (m, mlp) or h.dtype != x.dtype or h.stride(1) != 1 or (h.stride(0) * h.element_size()) % 16:
        raise ValueError(f"expert_mlp: h must be a ({m}, {mlp}) {x.dtype} TMA-able buffer, found {tuple(h.shape)}")
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
    expert_mlp_kernel[(mlp // COLS,)](
        x_desc, h_desc, wgu_desc, wd_desc, x, h, part, sync, m, x.stride(0), h.stride(0), float(rms_eps),
        WIDTH=width, MLP=mlp, COLS=COLS, BLOCK_K=BLOCK_K, A_STAGES=A_STAGES, USE_PDL=bool(use_pdl), num_warps=4,
        **extra,
    )  # fmt: skip
    return x


def compile_sm90(*, width: int = 1024, mlp: int = 4096, pdl: bool = True):
    """Compile `expert_mlp_kernel` for sm_90 without a GPU, as `expert_mlp` launches it on bf16 (π0's expert dims by
    default); returns the compiled kernel. Needs TRITON_INTERPRET unset (the real compiler)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_K], gl.bfloat16)
    signature = {
        "x_desc": f"tensordesc<bf16[{BLOCK_M},{BLOCK_K}],{a_layout!r}>",
        "h_desc": f"tensordesc<bf16[{BLOCK_M},{BLOCK_K}],{a_layout!r}>",
        "wgu_desc": f"tensordesc<bf16[{COLS},{BLOCK_K}],{w_layout!r}>",
        "wd_desc": f"tensordesc<bf16[{COLS},{BLOCK_K}],{w_layout!r}>",
        "x_ptr": "*bf16", "h_ptr": "*bf16", "part_ptr": "*fp32", "sync_ptr": "*i32", "M": "i32", "stride_x": "i32",
        "stride_h": "i32", "eps": "fp32",
    }  # fmt: skip
    constexprs = dict(WIDTH=width, MLP=mlp, COLS=COLS, BLOCK_K=BLOCK_K, A_STAGES=A_STAGES, USE_PDL=pdl)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = expert_mlp_kernel.arg_names
    aligned = ("x_ptr", "h_ptr", "part_ptr", "sync_ptr", "stride_x", "stride_h")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    src = GluonASTSource(expert_mlp_kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
