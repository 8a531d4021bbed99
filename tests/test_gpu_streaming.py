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


@pytest.mark.parametrize("steps_per_call", [1, 10])
def test_streaming_matches_one_shot_engine_in_bf16(steps_per_call: int) -> None:
    """Same weights, observation and noise: the two-stream engine gives the one-shot engine's actions."""
    from vla_rt import preset
    from vla_rt.engine.static_engine import build_triton
    from vla_rt.engine.streaming_pi0 import StreamingPi0
    from vla_rt.inputs import BuiltShapes, check_model_inputs
    from vla_rt.model import random_weights

    device = torch.device("cuda")
    cfg = preset("pi0")
    weights = random_weights(cfg, seed=5, device=device)
    shapes = BuiltShapes(2, 50, None, 1)
    one_shot = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
    streaming = StreamingPi0(weights, cfg, shapes, device=device, dtype=torch.bfloat16, steps_per_call=steps_per_call)
    g = torch.Generator(device=device).manual_seed(9)
    for frame in range(1, 4):
        images = torch.rand(1, 2, 224, 224, 3, generator=g, device=device) * 2 - 1
        state = torch.randn(1, cfg.action_dim, generator=g, device=device)
        noise = torch.randn(1, 50, cfg.action_dim, generator=g, device=device)
        streaming.submit_observation(images, state, None, t_capture=float(frame))
        streaming.wait_ready(version=frame)
        actions, version, t_capture = streaming.next_actions(noise)
        expected = one_shot(check_model_inputs(cfg, shapes, images, state, None, noise), noise, 10)
        assert (version, t_capture) == (frame, float(frame))
        assert float((actions - expected).norm() / expected.norm()) <= 2e-2
