"""Streaming inference: same actions as one-shot inference, the right observation version, both call modes.

On a CPU the scheduler runs its launches eagerly (every event complete at once), so these tests check the plan
and the bookkeeping; tests/test_gpu_streaming.py checks the two-stream ordering (torn reads) on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from vla_rt import preset
from vla_rt.engine.streaming_pi0 import StreamingPi0
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err


def _obs(cfg, g, views=2, prompt=3):
    images = torch.rand(1, views, 224, 224, 3, generator=g) * 2 - 1
    state = torch.randn(1, cfg.action_dim, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=g)
    return images, state, tokens


@pytest.mark.parametrize("steps_per_call", [1, 10])
def test_streaming_matches_one_shot_and_reports_the_frame(steps_per_call: int) -> None:
    cfg = preset("tiny")
    weights = random_weights(cfg, seed=21)
    engine = StreamingPi0(weights, cfg, BuiltShapes(2, 6, 3, 1), device=torch.device("cpu"), dtype=torch.float32,
                          steps_per_call=steps_per_call)  # fmt: skip
    ref = build_pi0(weights, cfg)
    g = torch.Generator().manual_seed(3)
    for frame in range(1, 4):
        images, state, tokens = _obs(cfg, g)
        version = engine.submit_observation(images, state, tokens, t_capture=0.5 * frame)
        assert version == frame
        noise = torch.randn(1, 6, cfg.action_dim, generator=g)
        actions, kv_version, t_capture = engine.next_actions(noise)
        assert (kv_version, t_capture) == (frame, 0.5 * frame)
        expected = ref.sample_actions(images, state, tokens, noise)
        assert rel_err(actions, expected) <= 1e-5


def test_single_step_calls_report_progress_and_finish_a_chunk() -> None:
    cfg = preset("tiny")
    engine = StreamingPi0(random_weights(cfg, seed=22), cfg, BuiltShapes(1, 4, None, 1), device=torch.device("cpu"),
                          dtype=torch.float32, num_steps=5, steps_per_call=1)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    images, state, _ = _obs(cfg, g, views=1)
    engine.submit_observation(images, state, None, t_capture=1.0)
    steps = [engine.expert_call() for _ in range(5)]
    assert [r.step for r in steps] == [1, 2, 3, 4, 5]
    assert all(r.actions is None for r in steps[:4]) and steps[4].actions.shape == (1, 4, cfg.action_dim)
    assert int(engine.step_index) == 0  # the device-side step counter wrapped for the next chunk


def test_expert_before_any_observation_is_an_error() -> None:
    cfg = preset("tiny")
    engine = StreamingPi0(random_weights(cfg, seed=23), cfg, BuiltShapes(1, 4, None, 1), device=torch.device("cpu"),
                          dtype=torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match="no observation processed yet"):
        engine.next_actions()
    with pytest.raises(ValueError, match="steps_per_call"):
        StreamingPi0(random_weights(cfg, seed=23), cfg, BuiltShapes(1, 4, None, 1), device=torch.device("cpu"),
                     dtype=torch.float32, steps_per_call=3)  # fmt: skip
