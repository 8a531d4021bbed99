"""π0.5 at full size on the GPU (run with `pytest -m gpu tests/test_gpu_pi05.py` on the device).

The bf16 reference (openpi's serving precision) against the float32 reference over many random draws: the yardstick
that the triton engine's bf16 error is held to (issue 21: ≤ 2e-2), and a check that full-size π0.5 runs on CUDA;
then the bf16 Triton engine (100 draws, 1-3 views) and the streaming engine against the float32 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_rt import preset
from vla_rt.inference import build_pi0
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 2e-2


def test_full_pi05_reference_bf16_vs_fp32_over_draws():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    cfg = preset("pi05")
    weights = random_weights(cfg, seed=0, device=device)
    ref32 = build_pi0(weights, cfg, device=device, dtype=torch.float32, chunk=50)
    ref16 = build_pi0(weights, cfg, device=device, dtype=torch.bfloat16, chunk=50)
    del weights
    g = torch.Generator(device=device).manual_seed(1)
    errors = []
    for i in range(20):
        views = 1 + i % 3
        images = torch.rand(1, views, 224, 224, 3, generator=g, device=device) * 2 - 1
        state = torch.randn(1, cfg.action_dim, generator=g, device=device)
        tokens = torch.randint(0, cfg.vocab_size, (1, 48), generator=g, device=device)
        token_mask = (torch.arange(48, device=device) < 20 + i)[None]
        noise = torch.randn(1, 50, cfg.action_dim, generator=g, device=device)
        a32 = ref32.sample_actions(images, state, tokens, noise, token_mask=token_mask)
        a16 = ref16.sample_actions(images, state, tokens, noise, token_mask=token_mask)
        assert torch.isfinite(a16).all()
        errors.append(rel_err(a16, a32))
    print(f"π0.5 reference bf16 vs fp32: median {np.median(errors):.2e}, max {np.max(errors):.2e}")
    assert np.median(errors) <= BF16_TOL and max(errors) <= 2 * BF16_TOL


def _pi05_draw(cfg, views, prompt, g, device):
    images = torch.rand(1, views, 224, 224, 3, generator=g, device=device) * 2 - 1
    state = torch.randn(1, cfg.action_dim, generator=g, device=device)
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=g, device=device)
    token_mask = (torch.arange(prompt, device=device) < int(torch.randint(prompt // 4, prompt, (1,), generator=g,
                                                                          device=device)))[None]  # fmt: skip
    noise = torch.randn(1, 50, cfg.action_dim, generator=g, device=device)
    return images, state, tokens, token_mask, noise


def test_full_pi05_triton_engine_and_streaming_bf16_vs_fp32_reference():
    """Issue 21's gate: the bf16 Triton engine (one CUDA Graph) against the float32 reference over 100 draws at 1, 2
    and 3 views (a π0.5 prompt of 200 tokens, partly padded), median and max relative error each ≤ 2e-2; and the
    streaming engine (one-step graphs, the step's modulation row selected on the device) on the same footing."""
    from vla_rt.engine.static_engine import build_triton
    from vla_rt.engine.streaming_pi0 import StreamingPi0
    from vla_rt.inputs import BuiltShapes, check_model_inputs

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    cfg = preset("pi05")
    prompt = cfg.max_token_len
    weights = random_weights(cfg, seed=2, device=device)
    ref32 = build_pi0(weights, cfg, device=device, dtype=torch.float32, chunk=50)
    g = torch.Generator(device=device).manual_seed(3)
    errors: dict[int, list[float]] = {}
    for views in (1, 2, 3):
        shapes = BuiltShapes(views, 50, prompt, 1)
        engine = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
        assert engine.graph is not None and engine.plan.expert.name == "per-op-pi05"
        for _ in range(34 if views < 3 else 32):
            images, state, tokens, mask, noise = _pi05_draw(cfg, views, prompt, g, device)
            x = check_model_inputs(cfg, shapes, images, state, tokens, noise, None, mask)
            actions = engine(x, noise, 10)
            expected = ref32.sample_actions(images, state, tokens, noise, token_mask=mask)
            assert torch.isfinite(actions).all()
            errors.setdefault(views, []).append(rel_err(actions, expected))
        del engine
    every = [e for v in errors.values() for e in v]
    for views, errs in errors.items():
        print(f"π0.5 triton bf16 vs fp32, {views} view(s): median {np.median(errs):.2e}, max {np.max(errs):.2e}")
    print(f"π0.5 triton bf16 vs fp32, {len(every)} draws: median {np.median(every):.2e}, max {np.max(every):.2e}")
    assert len(every) == 100 and np.median(every) <= BF16_TOL and max(every) <= BF16_TOL  # the issue: both ≤ 2e-2

    shapes = BuiltShapes(2, 50, prompt, 1)
    for steps_per_call in (1, 10):
        streaming = StreamingPi0(weights, cfg, shapes, device=device, dtype=torch.bfloat16,
                                 steps_per_call=steps_per_call)  # fmt: skip
        stream_errors = []
        for frame in range(1, 6):
            images, state, tokens, mask, noise = _pi05_draw(cfg, 2, prompt, g, device)
            streaming.submit_observation(images, state, tokens, t_capture=float(frame), token_mask=mask)
            streaming.wait_ready(version=frame)
            actions, version, _ = streaming.next_actions(noise)
            assert version == frame
            expected = ref32.sample_actions(images, state, tokens, noise, token_mask=mask)
            stream_errors.append(rel_err(actions, expected))
        print(f"π0.5 streaming ({steps_per_call} step/call) bf16 vs fp32: max {max(stream_errors):.2e}")
        assert max(stream_errors) <= BF16_TOL
        del streaming
