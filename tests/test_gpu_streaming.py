"""Two-stream ordering on the GPU: an expert call never sees a half-written KV cache.

A slow writer (the "VLM") fills a slot's cache layer by layer with its version number, sleeping on the GPU between
layers; a reader (the "expert") checks on the GPU that every layer of the slot it reads holds one and the same
version, and counts violations. With the scheduler's double buffering the count stays 0; with both slots aliased
to one buffer (no double buffering) the same check counts torn reads: the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from vla_rt.engine.streaming import TwoStreamScheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
LAYERS, WIDTH, SLEEP_CYCLES = 8, 1 << 16, 200_000  # ~0.1 ms of GPU time between layers


def _run(aliased: bool, frames: int = 60, calls_per_frame: int = 6) -> int:
    device = torch.device("cuda")
    caches = [torch.zeros(LAYERS, WIDTH, device=device) for _ in range(2)]
    if aliased:
        caches[1] = caches[0]
    version = torch.zeros(1, device=device)
    torn = torch.zeros(1, dtype=torch.int64, device=device)

    def vlm(slot: int) -> None:
        for layer in range(LAYERS):
            caches[slot][layer].copy_(version.expand(WIDTH))
            torch.cuda._sleep(SLEEP_CYCLES)

    def expert(slot: int) -> None:
        c = caches[slot]
        torn.add_((c != c[0, 0]).any(dim=1).sum())

    sched = TwoStreamScheduler(device, vlm, expert)
    for v in range(1, frames + 1):
        sched.submit(lambda v=v: version.fill_(v), v, float(v))
        if v == 1:
            sched.wait_ready()
        for _ in range(calls_per_frame):
            sched.refresh_front()
            sched.expert_call()
    torch.cuda.synchronize()
    return int(torn)


def test_double_buffered_slots_are_never_read_torn() -> None:
    assert _run(aliased=False) == 0


def test_single_buffer_would_be_read_torn() -> None:
    assert _run(aliased=True) > 0
