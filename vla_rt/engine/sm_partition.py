"""An SM partition through CUDA green contexts (driver API, CUDA 12.4+): a group of SMs kept for the expert steps and
a stream on the rest for the prefix stages.

Why: under the server's overlap scheduler a prefix stage runs on a low-priority stream beside the expert steps, and
a stream's priority only orders the blocks waiting for an SM. The prefix GEMMs' blocks fill every SM, so on the
H200 an expert step of 4 rows took 8.4 ms beside an 8-row prefix stage (31.5 ms at worst) against 1.34 ms alone
(`tools/overlap_probe.py`, docs/serving.md). A CUDA Graph's kernel nodes keep the context of the stream they were
captured on: graphs captured on the prefix stream here run on the rest of the SMs wherever they are replayed, and
the kept SMs always take the expert's blocks at once (same probe: 2.9 ms at worst, at the price of a slower prefix).

Through ctypes, as `vla_rt.cuda_kernels.driver` does: torch's own green-context wrapper differs by version.
"""

from __future__ import annotations

import ctypes

import torch

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 0x1
CU_STREAM_NON_BLOCKING = 0x1
RESOURCE_BYTES = 144  # sizeof(CUdevResource) in cuda.h 12.4..13.0: type, 92 bytes, a 40-byte union, a pointer
SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount


class SmPartition:
    """Two green contexts on one device: `expert_sms` SMs (the driver rounds up to its granularity: 8 on Hopper) and
    the rest, each with a non-blocking stream as a torch ExternalStream (`streams["expert"]`, `streams["prefix"]`).
    `sms` holds the SM counts the driver gave. The contexts live as long as the process (the engine's graphs hold
    kernel nodes in them)."""

    def __init__(self, device: torch.device, expert_sms: int):
        if isinstance(expert_sms, bool) or not isinstance(expert_sms, int) or expert_sms < 1:
            raise ValueError(f"expert_sms: expected a positive SM count, found {expert_sms!r}")
        if device.type != "cuda":
            raise ValueError(f"expert_sms: an SM partition needs a CUDA device, found {device}")
        total = torch.cuda.get_device_properties(device).multi_processor_count
        if expert_sms >= total:
            raise ValueError(f"expert_sms: expected fewer SMs than this GPU's {total}, found {expert_sms}")
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
            self.lib.cuGreenCtxCreate  # noqa: B018 (absent before CUDA 12.4: refuse here, not at the first launch)
        except (OSError, AttributeError) as e:
            raise RuntimeError(f"expert_sms: SM partitions need green contexts (a CUDA 12.4+ driver): {e}") from None
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
        whole = ctypes.create_string_buffer(RESOURCE_BYTES)
        self._check(self.lib.cuDeviceGetDevResource(dev, whole, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
        part, rest, groups = ctypes.create_string_buffer(RESOURCE_BYTES), ctypes.create_string_buffer(RESOURCE_BYTES), ctypes.c_uint(1)  # fmt: skip
        self._check(self.lib.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, 0, expert_sms),
                    f"cuDevSmResourceSplitByCount({expert_sms} SMs)")  # fmt: skip
        self.sms = {name: int.from_bytes(buf.raw[SM_COUNT_OFFSET : SM_COUNT_OFFSET + 4], "little")
                    for name, buf in (("expert", part), ("prefix", rest))}  # fmt: skip
        if groups.value != 1 or self.sms["prefix"] < 1:
            raise RuntimeError(f"expert_sms: the driver split {total} SMs into {groups.value} group(s) of "
                               f"{self.sms['expert']} and {self.sms['prefix']} left; ask for fewer")  # fmt: skip
        self.streams = {name: self._stream(dev, buf, device) for name, buf in (("expert", part), ("prefix", rest))}

    def _stream(self, dev: ctypes.c_int, resource: ctypes.Array, device: torch.device) -> torch.cuda.ExternalStream:
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "cuDevResourceGenerateDesc")
        self._check(self.lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, CU_GREEN_CTX_DEFAULT_STREAM),
                    "cuGreenCtxCreate")  # fmt: skip
        self._check(self.lib.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, CU_STREAM_NON_BLOCKING, 0),
                    "cuGreenCtxStreamCreate")  # fmt: skip
        return torch.cuda.ExternalStream(stream.value, device=device)

    def _check(self, res: int, what: str) -> None:
        if res != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(res, ctypes.byref(msg))
            raise RuntimeError(f"expert_sms: {what}: CUDA error {res} ({(msg.value or b'?').decode()})")
