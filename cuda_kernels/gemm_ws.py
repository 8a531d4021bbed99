"""`gemm_ws(a, w, out=None, *, bias=None, residual=False, gated=False, ...)`: `out = epilogue(a @ w.T)` in bf16 by
`gemm_ws.cu`, the warp-specialized persistent Hopper GEMM (a TMA producer warp, two wgmma consumer warpgroups).

Why beside the Triton GEMMs: Triton 3.6 warp-specializes on Blackwell only, and the prefix's GEMMs are where the
server's time goes (docs/kernels.md, "A warp-specialized Hopper GEMM"). This module is the kernel's only door: it
checks every argument first (a bad call is one error naming the argument, expected vs found, never a fault inside
the kernel), builds each compile-time `Variant` once (build.py's cubin cache) and loads it once per device, keeps
the TMA descriptors per (pointer, shape), and launches on torch's current stream, so a CUDA Graph records it like
any other launch (the descriptors travel by value in the launch parameters).
"""

from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from vla_rt.cuda_kernels import build, driver

SOURCE = "gemm_ws.cu"
KERNEL = "gemm_ws_kernel"
BLOCK_M = 128
BLOCK_K = 64
THREADS = 384
SMEM_LIMIT = 232448  # Hopper's 227 KB of dynamic shared memory a block
MAP_CACHE = 256  # TMA descriptors kept (least recently used dropped)


@dataclass(frozen=True)
class Variant:
    """One compile-time form of the kernel: tile width, ring depth and epilogue."""

    block_n: int = 256
    stages: int = 4
    bias: bool = False
    residual: bool = False
    gated: bool = False

    @property
    def out_n(self) -> int:
        """Output columns a tile (gated: half the accumulator columns are the up projection)."""
        return self.block_n // 2 if self.gated else self.block_n

    @property
    def smem_bytes(self) -> int:
        """The ring, its barriers and 1 KB to align it to the swizzle's period."""
        return self.stages * (BLOCK_M + self.block_n) * BLOCK_K * 2 + 1024 + 2 * self.stages * 8

    def defines(self) -> dict[str, int]:
        return {"BLOCK_N": self.block_n, "STAGES": self.stages, "HAS_BIAS": int(self.bias),
                "RESIDUAL": int(self.residual), "GATED": int(self.gated)}  # fmt: skip

    def why_unsupported(self) -> str | None:
        if self.block_n not in (128, 256):
            return f"block_n: expected 128 or 256, found {self.block_n}"
        if not 2 <= self.stages <= 8:
            return f"stages: expected 2..8, found {self.stages}"
        if self.smem_bytes > SMEM_LIMIT:
            return (f"block_n={self.block_n} with stages={self.stages} needs {self.smem_bytes} bytes of shared "
                    f"memory, Hopper has {SMEM_LIMIT}")  # fmt: skip
        return None


class Params(ctypes.Structure):
    """gemm_ws.cu's `Params`, field for field: two 128-byte TMA descriptors, pointers, sizes, padded to 320 bytes
    (the struct's 64-byte alignment)."""

    _fields_ = [("a_map", ctypes.c_uint8 * 128), ("w_map", ctypes.c_uint8 * 128), ("out", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("m", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int),
                ("group_m", ctypes.c_int), ("pad", ctypes.c_uint8 * 32)]  # fmt: skip


def tile_order(tiles_m: int, tiles_n: int, group_m: int) -> list[tuple[int, int]]:
    """(row tile, column tile) of tile t = 0, 1, ...: the kernel's grouped raster (`tile_at`), group_m row tiles
    sweeping the columns together. CTA b runs tiles b, b + grid, ..."""
    order = []
    for t in range(tiles_m * tiles_n):
        per_group = group_m * tiles_n
        first_m = t // per_group * group_m
        rows = min(tiles_m - first_m, group_m)
        local = t % per_group
        order.append((first_m + local % rows, local // rows))
    return order


def _fail(name: str, expected: str, found: object) -> None:
    raise ValueError(f"gemm_ws: {name}: expected {expected}, found {found}")


def _check_matrix(name: str, t: object, rows: int | None, cols: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gemm_ws: {name}: expected a torch.Tensor, found {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        _fail(name, "torch.bfloat16", t.dtype)
    if t.dim() != 2:
        _fail(name, "a 2-D tensor", f"shape {tuple(t.shape)}")
    if (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
        _fail(name, f"shape ({rows if rows is not None else '*'}, {cols})", tuple(t.shape))
    if not t.is_contiguous():
        _fail(name, "a contiguous tensor", f"strides {t.stride()}")


def check_args(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, bias: torch.Tensor | None,
               residual: bool, gated: bool) -> tuple[int, int, int]:  # fmt: skip
    """(M, N, K) of a valid call; otherwise a ValueError / TypeError naming the argument (no GPU needed)."""
    _check_matrix("a", a, None, None)
    m, k = a.shape
    _check_matrix("w", w, None, k)
    if k == 0 or k % 8:
        _fail("K (a.shape[1])", "a positive multiple of 8 (TMA's 16-byte row stride)", k)
    if gated and w.shape[0] % 2:
        _fail("w.shape[0]", "an even number of rows (gate rows, then up rows) with gated=True", w.shape[0])
    n = w.shape[0] // 2 if gated else w.shape[0]
    if n == 0 or n % 8:
        _fail("N (output columns)", "a positive multiple of 8", n)
    if out is not None:
        _check_matrix("out", out, m, n)
    elif residual:
        _fail("out", "the residual tensor (residual=True adds into out)", None)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"gemm_ws: bias: expected a torch.Tensor, found {type(bias).__name__}")
        want = 2 * n if gated else n
        if bias.dtype != torch.bfloat16 or tuple(bias.shape) != (want,) or not bias.is_contiguous():
            _fail("bias", f"contiguous torch.bfloat16 of shape ({want},)", f"{bias.dtype} {tuple(bias.shape)}")
    tensors = {"a": a, "w": w, "out": out, "bias": bias}
    for name, t in tensors.items():
        if t is not None and t.device != a.device:
            _fail(f"{name}.device", str(a.device), t.device)
        if t is not None and t.data_ptr() % 16:
            _fail(f"{name}.data_ptr()", "16-byte alignment", hex(t.data_ptr()))
    return m, n, k


def why_not(device: torch.device) -> str | None:
    """None if the kernel can run on `device`, else one line saying why not (cached: the launcher asks every call)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA tensors"
    return _why_not_cuda(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _why_not_cuda(index: int) -> str | None:
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        return f"needs an sm_90 GPU (Hopper), found sm_{cap[0]}{cap[1]}"
    if build.find_nvcc() is None:
        return "no nvcc (CUDA toolkit or the nvidia-cuda-nvcc wheel) to build the kernel"
    return None


_kernels: dict[tuple[Variant, int], driver.Kernel] = {}
_resources: dict[Variant, build.Resources] = {}
_maps: OrderedDict[tuple[int, int, int, int], bytes] = OrderedDict()
_sm_counts: dict[int, int] = {}


def kernel(variant: Variant, device: torch.device) -> driver.Kernel:
    """The loaded kernel of `variant` on `device` (compiled at first use, then from build.py's cache)."""
    key = (variant, device.index or 0)
    if key not in _kernels:
        cubin, log = build.compile_cubin(SOURCE, variant.defines())
        _resources[variant] = build.Resources.parse(log)
        with torch.cuda.device(device):
            _kernels[key] = driver.Kernel(cubin, KERNEL, variant.smem_bytes)
    return _kernels[key]


def resources(variant: Variant) -> build.Resources:
    """What ptxas reported for `variant` (compiling it if needed; no GPU needed)."""
    if variant not in _resources:
        _resources[variant] = build.Resources.parse(build.compile_cubin(SOURCE, variant.defines(), quiet=True)[1])
    return _resources[variant]


def _tensor_map(t: torch.Tensor, box_rows: int) -> bytes:
    """TMA descriptor of a contiguous (rows, K) bf16 matrix as a (K, rows, 1) tensor, boxes of 64 x box_rows."""
    rows, k = t.shape
    key = (t.data_ptr(), rows, k, box_rows)
    if key in _maps:
        _maps.move_to_end(key)
        return _maps[key]
    tmap = driver.tensor_map_3d_bf16(t.data_ptr(), (k, rows, 1), (k * 2, rows * k * 2), (BLOCK_K, box_rows, 1))
    _maps[key] = tmap
    if len(_maps) > MAP_CACHE:
        _maps.popitem(last=False)
    return tmap


def gemm_ws(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
            residual: bool = False, gated: bool = False, block_n: int = 256, stages: int = 4,
            sm_count: int | None = None, group_m: int = 8) -> torch.Tensor:  # fmt: skip
    """out (M, N) bf16 = a (M, K) bf16 @ w (N, K) bf16 .T in fp32, then `+ bias` (N,), or with `gated` (w = [gate
    rows; up rows], (2N, K); bias (2N,)) `gelu_tanh(gate + b_gate) * (up + b_up)`, then with `residual` `+ out` (out
    is read, then overwritten). K a multiple of 8, N of 8. Launched on the current stream (graph-capturable);
    `sm_count` caps the persistent grid (default: every SM)."""
    m, n, k = check_args(a, w, out, bias, residual, gated)
    variant = Variant(block_n, stages, bias is not None, residual, gated)
    why = variant.why_unsupported() or why_not(a.device)
    if why:
        raise ValueError(f"gemm_ws: {why}")
    if group_m < 1:
        _fail("group_m", "at least 1", group_m)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if dev not in _sm_counts:
        _sm_counts[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    tiles = -(-m // BLOCK_M) * -(-n // variant.out_n)
    grid = min(sm_count or _sm_counts[dev], _sm_counts[dev], tiles)
    w_box = block_n // 2 if gated else block_n
    p = Params(out=out.data_ptr(), bias=0 if bias is None else bias.data_ptr(), m=m, n=n, k=k, group_m=group_m)
    ctypes.memmove(p.a_map, _tensor_map(a, BLOCK_M), 128)
    ctypes.memmove(p.w_map, _tensor_map(w, w_box), 128)
    device = torch.device("cuda", dev)
    kernel(variant, device).launch(grid, THREADS, p, torch.cuda.current_stream(device).cuda_stream)
    return out
