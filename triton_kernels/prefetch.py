"""Bulk L2 prefetch of weights ahead of the kernels that read them (sm_90 `cp.async.bulk.prefetch.L2`).

Why: in an action-expert layer the QKV GEMM, the attention and the O GEMM are latency-bound, so HBM idles while
they run, and then gate/up and down wait on HBM for their weights. One small kernel, launched as the layer starts,
asks the memory system to stream the layer's O, gate/up and down weights (and the next layer's QKV) into L2
meanwhile; the GEMMs then read them from L2. The expert's ~35 MB a layer fits the H200's 50 MB L2; the VLM's 67 MB
gate/up does not, so this is for the expert. Only a hint: no data dependency, results bit-identical.

The kernel runs on a side stream (forked from the current one, joined back by `prefetch_join`), because its
programs stay resident until their prefetches have landed: 18 µs for a layer's 35 MB on the H200, which in the
main stream's chain cost more than the L2 hits saved (measured: +0.2 ms an expert step).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .pdl import launch, pdl_enter, pdl_mode, prefetch_rows_l2

__all__ = ["prefetch_l2", "prefetch_join", "prefetch_chunks"]

CHUNK_BYTES = 32768  # one prefetch instruction's size (a multiple of 16; the instruction takes a 32-bit size)
BLOCK = 128  # prefetches a program issues: one a thread
MAX_TENSORS = 4


@triton.jit
def prefetch_l2_kernel(
    p0, p1, p2, p3, n0, n1, n2, n3, record_ptr,
    CHUNK: tl.constexpr,  # elements a prefetch
    BLOCK: tl.constexpr,
    RECORD: tl.constexpr,  # store (tensor, first element, elements) of each chunk instead of prefetching (tests)
    USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    """Chunk i of the concatenation [t0, t1, t2, t3] (n_s elements each; unused tensors have n_s = 0): one bulk L2
    prefetch of up to CHUNK elements per lane (then the PDL wait, if launched with PDL)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e1 = tl.cdiv(n0, CHUNK)
    e2 = e1 + tl.cdiv(n1, CHUNK)
    e3 = e2 + tl.cdiv(n2, CHUNK)
    total = e3 + tl.cdiv(n3, CHUNK)
    seg = (i >= e1).to(tl.int32) + (i >= e2).to(tl.int32) + (i >= e3).to(tl.int32)
    first = tl.where(seg == 0, 0, tl.where(seg == 1, e1, tl.where(seg == 2, e2, e3)))
    n = tl.where(seg == 0, n0, tl.where(seg == 1, n1, tl.where(seg == 2, n2, n3)))
    start = (i - first).to(tl.int64) * CHUNK
    count = tl.minimum(n - start, CHUNK)
    ok = i < total
    if RECORD:
        tl.store(record_ptr + i * 3, seg, mask=ok)
        tl.store(record_ptr + i * 3 + 1, start, mask=ok)
        tl.store(record_ptr + i * 3 + 2, count, mask=ok)
    else:
        base = tl.where(seg == 0, p0, tl.where(seg == 1, p1, tl.where(seg == 2, p2, p3)))
        elem_bytes: tl.constexpr = p0.dtype.element_ty.primitive_bitwidth // 8
        ptrs = tl.where(ok, base + start, p0)  # lanes past the end: 16 bytes of the first tensor again
        prefetch_rows_l2(ptrs, tl.where(ok, count * elem_bytes, 16).to(tl.int32))
    pdl_enter(USE_PDL)


def _check(tensors: Sequence[torch.Tensor]) -> None:
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"prefetch_l2 takes 1..{MAX_TENSORS} tensors, got {len(tensors)}")
    dtype = tensors[0].dtype
    for j, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if t.dtype != dtype or not t.is_contiguous() or nbytes % 16 or (t.is_cuda and t.data_ptr() % 16):
            raise ValueError(
                f"prefetch_l2: tensor {j} must be contiguous {dtype}, 16-byte aligned, a multiple of 16 bytes; got "
                f"{t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} bytes={nbytes}"
            )


def _args(tensors: Sequence[torch.Tensor]) -> tuple[tuple, int, int]:
    chunk = CHUNK_BYTES // tensors[0].element_size()
    padded = list(tensors) + [tensors[0]] * (MAX_TENSORS - len(tensors))
    sizes = [t.numel() for t in tensors] + [0] * (MAX_TENSORS - len(tensors))
    chunks = sum(triton.cdiv(n, chunk) for n in sizes)
    return (*padded, *sizes), chunk, chunks


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _active(like: torch.Tensor) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not like.is_cuda:
        return False
    return torch.cuda.get_device_capability(like.device)[0] >= 9


def prefetch_l2(tensors: Sequence[torch.Tensor]) -> None:
    """Ask the GPU to stream `tensors` (1..4, contiguous, one dtype, 16-byte aligned and sized) into L2, from a side
    stream that waits for what the current stream has queued so far; returns at once, graph-capturable (call
    `prefetch_join` before the capture ends). A no-op where the instruction does not exist (the CPU interpreter,
    GPUs before sm_90); on meta tensors (compile_check) a plain launch on the current stream."""
    _check(tensors)
    like = tensors[0]
    args, chunk, chunks = _args(tensors)
    stream = contextlib.nullcontext()  # meta tensors: a dry run, which `launch` skips or compile_check records
    if like.device.type != "meta":
        if not _active(like):
            return
        side = _side_stream(like.device)
        side.wait_stream(torch.cuda.current_stream(like.device))
        stream = torch.cuda.stream(side)
    with stream, pdl_mode("off"):  # no PDL: nothing on the side stream orders on it
        launch(prefetch_l2_kernel, (triton.cdiv(chunks, BLOCK),), like)(
            *args, like, CHUNK=chunk, BLOCK=BLOCK, RECORD=False, num_warps=BLOCK // 32
        )


def prefetch_join(like: torch.Tensor) -> None:
    """The current stream waits for the prefetches queued so far on `like`'s device (a graph capture must join its
    side stream before it ends); a no-op where `prefetch_l2` is one."""
    if _active(like) and (like.device.index or torch.cuda.current_device()) in _SIDE_STREAMS:
        torch.cuda.current_stream(like.device).wait_stream(_side_stream(like.device))


def prefetch_chunks(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(tensor, first element, elements) of every prefetch `prefetch_l2` issues for `tensors`, computed by the kernel
    itself in record mode: what tests check covers each tensor exactly once (runs anywhere the kernel runs)."""
    _check(tensors)
    args, chunk, chunks = _args(tensors)
    record = torch.full((triton.cdiv(chunks, BLOCK) * BLOCK, 3), -1, dtype=torch.int64, device=tensors[0].device)
    prefetch_l2_kernel[(triton.cdiv(chunks, BLOCK),)](*args, record, CHUNK=chunk, BLOCK=BLOCK, RECORD=True)
    return [tuple(r) for r in record[:chunks].tolist()]
