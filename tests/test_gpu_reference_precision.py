"""On CUDA in float32 the reference computes in IEEE float32: it agrees with `folded` float32 within 1e-5 relative.

`folded` computes the same function through matmuls only (the patch embedding as a GEMM), which PyTorch runs in
IEEE float32 by default; the reference's patch embedding is a cuDNN convolution, which PyTorch lets use TF32 by
default. Both run here under PyTorch's default switches (convolutions "tf32", matmuls "ieee"), as a user's process
would. Run on the device: `python -m pytest -q -m gpu tests/test_gpu_reference_precision.py`.

Bound: the two evaluate the same math in different orders (folded scales, fused QKV, the patch GEMM); on the CPU,
where nothing uses TF32, the tiny preset's actions differ by 2.2e-7, and emulating a TF32 patch embedding (inputs
rounded to 10 mantissa bits) moves them by 6.3e-5: 1e-5 lies between (the second test shows it catches TF32).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from vla_rt import preset
from vla_rt.inference import build_pi0
from vla_rt.model import precision, random_weights
from vla_rt.numerics import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FP32_TOL = 1e-5
DEFAULTS = {"cuda.matmul": "ieee", "cudnn.conv": "tf32"}  # PyTorch's defaults for float32 math on CUDA


@pytest.fixture
def default_switches():
    """PyTorch's default float32 switches for the test (other GPU tests turn TF32 off process-wide), restored after."""
    switches = precision.float32_switches()
    before = precision.float32_precisions()
    for name, value in DEFAULTS.items():
        switches[name].fp32_precision = value
    yield
    for name, backend in switches.items():
        backend.fp32_precision = before[name]


def reference_vs_folded(name: str, views: int, prompt: int, chunk: int, draws: int = 3) -> list[float]:
    device = torch.device("cuda")
    cfg = preset(name)
    weights = random_weights(cfg, seed=5, device=device)
    ref = build_pi0(weights, cfg, backend="reference", device=device, dtype=torch.float32, chunk=chunk)
    folded = build_pi0(weights, cfg, backend="folded", device=device, dtype=torch.float32, chunk=chunk)
    g = torch.Generator(device=device).manual_seed(11)
    s = cfg.vision.image_size
    errors = []
    for _ in range(draws):
        images = torch.rand(1, views, s, s, 3, generator=g, device=device) * 2 - 1
        state = torch.randn(1, cfg.action_dim, generator=g, device=device)
        tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=g, device=device) if prompt else None
        noise = torch.randn(1, chunk, cfg.action_dim, generator=g, device=device)
        errors.append(
            rel_err(
                ref.sample_actions(images, state, tokens, noise), folded.sample_actions(images, state, tokens, noise)
            )
        )
    return errors


@pytest.mark.parametrize("name,views,prompt,chunk", [("tiny", 2, 5, 9), ("pi0", 2, 20, 50)])
def test_reference_fp32_agrees_with_folded_fp32(name, views, prompt, chunk, default_switches) -> None:
    errors = reference_vs_folded(name, views, prompt, chunk)
    assert max(errors) <= FP32_TOL, errors
    assert precision.float32_precisions()["cudnn.conv"] == "tf32"  # the process's switch is untouched after


def test_the_bound_catches_a_tf32_patch_embedding(monkeypatch, default_switches) -> None:
    """The check can fail: without the reference's float32 scope its convolution runs in TF32 (the default)."""
    monkeypatch.setattr(precision, "ieee_float32", contextlib.nullcontext)
    errors = reference_vs_folded("pi0", 2, 20, 50)
    assert min(errors) > FP32_TOL, f"TF32 convolution within {FP32_TOL}: {errors} (is TF32 the cause?)"
