"""The L2 prefetch kernel's chunking, run in record mode (the kernel stores what it would prefetch), in Triton's
interpreter on the CPU: every byte of every tensor asked for exactly once, in order, in instruction-sized chunks.
The prefetch itself is a hint with no result to compare; its PTX is compiled for sm_90 in
test_kernels_compile_sm90.py and its effect on results (none) checked on the GPU in test_gpu_engine.py."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from vla_rt.triton_kernels.prefetch import CHUNK_BYTES, prefetch_chunks, prefetch_l2  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _covered(tensors, chunks) -> list[list[tuple[int, int]]]:
    per = [[] for _ in tensors]
    for seg, start, count in chunks:
        per[seg].append((start, start + count))
    return per


@pytest.mark.parametrize(
    "sizes",
    [[1024 * 2560], [2048 * 1024, 8192 * 1024, 1024 * 4096, 2560 * 1024], [8, 16392, 16384, 24], [40]],
    ids=["one", "expert_layer", "odd_tails", "tiny"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chunks_cover_every_tensor_once_in_order(sizes, dtype):
    tensors = [torch.zeros(n, dtype=dtype, device=DEVICE) for n in sizes]
    chunks = prefetch_chunks(tensors)
    elems = CHUNK_BYTES // tensors[0].element_size()
    assert [c[0] for c in chunks] == sorted(c[0] for c in chunks)  # tensor by tensor
    for t, spans in zip(tensors, _covered(tensors, chunks)):
        assert spans[0][0] == 0 and spans[-1][1] == t.numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap, no gap
        assert all(0 < e - s <= elems for s, e in spans)
        assert all((e - s) * t.element_size() % 16 == 0 for s, e in spans)


def test_coverage_check_can_fail():
    """The check above catches a plan that drops the last tensor's tail or repeats a chunk."""
    tensors = [torch.zeros(n, dtype=torch.bfloat16, device=DEVICE) for n in (40000, 24)]
    chunks = prefetch_chunks(tensors)
    dropped = _covered(tensors, chunks[:-1])
    assert not dropped[1] or dropped[1][-1][1] != 24
    repeated = _covered(tensors, chunks[:1] + chunks)
    assert not all(a[1] == b[0] for a, b in zip(repeated[0], repeated[0][1:]))


def test_bad_tensors_are_refused():
    t = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="takes 1..4 tensors"):
        prefetch_l2([t] * 5)
    with pytest.raises(ValueError, match="tensor 1 must be contiguous"):
        prefetch_l2([t, t[:, :16]])
    with pytest.raises(ValueError, match="tensor 1 must be contiguous"):
        prefetch_l2([t, t.float()])
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        prefetch_l2([torch.zeros(3, dtype=torch.bfloat16, device=DEVICE)])
    prefetch_l2([t, t.T.contiguous()])  # valid: returns at once (a no-op on the CPU)
