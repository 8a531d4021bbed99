"""The few CUDA driver API calls the kernels need, through ctypes: load a cubin, set its shared-memory limit, launch
it on a stream (so CUDA Graph capture records it like any other launch), and encode TMA tensor maps.

PyTorch's primary context must be current on the calling thread before any of these run: it is once torch has put
a tensor on the GPU (`torch.cuda.init()` alone does not make it current). `Kernel` says so instead of failing with
the driver's "invalid device context".
"""

from __future__ import annotations

import ctypes
import functools

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
TENSOR_MAP_BYTES = 128


class DriverError(RuntimeError):
    pass


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig, for cuOccupancyMaxActiveClusters
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]  # fmt: skip


@functools.cache
def _lib() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise DriverError(f"libcuda.so.1 not loadable: {e}") from e


def _check(res: int, what: str) -> None:
    if res != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(res, ctypes.byref(msg))
        raise DriverError(f"{what} failed: CUDA error {res} ({(msg.value or b'?').decode()})")


class Kernel:
    """One function of a loaded cubin."""

    def __init__(self, cubin: bytes, name: str, dynamic_smem: int):
        lib = _lib()
        context = ctypes.c_void_p()
        _check(lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            raise DriverError(f"loading {name}: no CUDA context is current on this thread; put a torch tensor on the "
                              "GPU first (torch.cuda.init() does not make one current)")  # fmt: skip
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # kept alive with the module
        self.module = ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(self.module), self._image), "cuModuleLoadData")
        self.function = ctypes.c_void_p()
        _check(lib.cuModuleGetFunction(ctypes.byref(self.function), self.module, name.encode()), "cuModuleGetFunction")
        _check(lib.cuFuncSetAttribute(self.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      ctypes.c_int(dynamic_smem)), "cuFuncSetAttribute")  # fmt: skip
        self.dynamic_smem = dynamic_smem

    def max_active_clusters(self, grid: int, block: int) -> int:
        """How many of this kernel's thread-block clusters (its compiled `__cluster_dims__`) can be resident at once
        with `block` threads and its dynamic shared memory; the negated CUDA error code where the driver refuses."""
        n = ctypes.c_int(-1)
        cfg = LaunchConfig(grid, 1, 1, block, 1, 1, self.dynamic_smem, None, None, 0)
        res = _lib().cuOccupancyMaxActiveClusters(ctypes.byref(n), self.function, ctypes.byref(cfg))
        return n.value if res == 0 else -res

    def launch(self, grid: int, block: int, params: ctypes.Structure, stream: int) -> None:
        """Launches with one by-value parameter struct on `stream` (a CUstream handle, e.g. torch's
        `current_stream().cuda_stream`)."""
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
        _check(_lib().cuLaunchKernel(self.function, grid, 1, 1, block, 1, 1, self.dynamic_smem,
                                     ctypes.c_void_p(stream), args, None), "cuLaunchKernel")  # fmt: skip


def tensor_map_3d_bf16(address: int, dims: tuple[int, int, int], strides_bytes: tuple[int, int],
                       box: tuple[int, int, int]) -> bytes:  # fmt: skip
    """A TMA descriptor of a bf16 tensor (dims innermost first; strides of dims 1 and 2 in bytes), boxes of `box`
    elements, 128-byte swizzle, out-of-bounds elements read as zeros."""
    tmap = (ctypes.c_uint64 * 16)()
    gdim = (ctypes.c_uint64 * 3)(*dims)
    gstride = (ctypes.c_uint64 * 2)(*strides_bytes)
    bdim = (ctypes.c_uint32 * 3)(*box)
    estride = (ctypes.c_uint32 * 3)(1, 1, 1)
    _check(_lib().cuTensorMapEncodeTiled(tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, ctypes.c_void_p(address), gdim,
                                         gstride, bdim, estride, 0, CU_TENSOR_MAP_SWIZZLE_128B,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 0), "cuTensorMapEncodeTiled")  # fmt: skip
    return bytes(tmap)
