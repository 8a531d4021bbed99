"""The Triton engine on the GPU in bf16 against the float32 reference (run with `pytest -m gpu` on the device).

The 100-draw accuracy report for the full π0 is `python -m vla_rt.bench.accuracy`; these tests are the quick gate.
"""

from __future__ import annotations

import pytest
import torch

from vla_rt import preset
from vla_rt.engine.static_engine import build_triton
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 2e-2


def _draw(cfg, views, prompt, chunk, g, device, batch=1):
    s = cfg.vision.image_size
    images = torch.rand(batch, views, s, s, 3, generator=g, device=device) * 2 - 1
    state = torch.randn(batch, cfg.action_dim, generator=g, device=device)
    tokens = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g, device=device) if prompt else None
    noise = torch.randn(batch, chunk, cfg.action_dim, generator=g, device=device)
    return images, state, tokens, noise


def _with_fp32_reference(name, views, prompt, chunk, seed):
    """(device, cfg, random weights, shapes, the float32 reference model) with TF32 off, for an accuracy test."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    cfg = preset(name)
    weights = random_weights(cfg, seed=seed, device=device)
    ref = build_pi0(weights, cfg, device=device, dtype=torch.float32, chunk=chunk)
    return device, cfg, weights, BuiltShapes(views, chunk, prompt or None, 1), ref


def _engines_by_pdl_mode(modes, weights, cfg, device, shapes) -> dict:
    """One bf16 Triton engine per PDL mode ("off" / "on"), each captured under its mode."""
    from vla_rt.triton_kernels.pdl import pdl_mode

    engines = {}
    for mode in modes:
        with pdl_mode(mode):
            engines[mode] = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
    return engines


@pytest.mark.parametrize("name,views,prompt,chunk", [("tiny", 2, 5, 9), ("pi0", 1, 0, 63), ("pi0", 3, 20, 50)])
def test_triton_engine_bf16_matches_fp32_reference(name, views, prompt, chunk) -> None:
    device, cfg, weights, shapes, ref = _with_fp32_reference(name, views, prompt, chunk, seed=3)
    engine = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
    g = torch.Generator(device=device).manual_seed(7)
    for _ in range(3):
        images, state, tokens, noise = _draw(cfg, views, prompt, chunk, g, device)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        out = engine(x, noise, 10)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref.sample_actions(images, state, tokens, noise)) <= BF16_TOL


def test_triton_engine_is_as_accurate_as_torch_ops_in_bf16() -> None:
    """The bound above is the spec's; this guards the engine's own level. cuBLAS taking SigLIP's residual GEMMs with
    a bias as two calls (two bf16 roundings) moved the median error from 7.6e-3 to 1.25e-2, inside 2e-2, so nothing
    failed (2026-12-04, docs/kernels.md). The Triton engine must stay within 1.3x of the same model on PyTorch ops
    in bf16 (`folded`: 7.5e-3 over 100 draws), median over 8 draws of the accuracy benchmark's case."""
    views, prompt, chunk = 2, 20, 50
    device, cfg, weights, shapes, ref = _with_fp32_reference("pi0", views, prompt, chunk, seed=0)
    engine = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
    folded = build_pi0(weights, cfg, backend="folded", device=device, dtype=torch.bfloat16, chunk=chunk)
    g = torch.Generator(device=device).manual_seed(1)
    ours, torch_ops = [], []
    for _ in range(8):
        images, state, tokens, noise = _draw(cfg, views, prompt, chunk, g, device)
        want = ref.sample_actions(images, state, tokens, noise)
        ours.append(rel_err(engine(check_model_inputs(cfg, shapes, images, state, tokens, noise), noise, 10), want))
        torch_ops.append(rel_err(folded.sample_actions(images, state, tokens, noise), want))
    ours_median, torch_median = sorted(ours)[4], sorted(torch_ops)[4]
    assert ours_median <= 1.3 * torch_median, f"triton {ours_median:.2e} vs folded {torch_median:.2e} (median)"


def test_graph_replay_is_deterministic_and_follows_inputs() -> None:
    device = torch.device("cuda")
    cfg = preset("pi0")
    weights = random_weights(cfg, seed=4, device=device)
    shapes = BuiltShapes(1, 63, None, 1)
    engine = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
    g = torch.Generator(device=device).manual_seed(8)
    a = _draw(cfg, 1, 0, 63, g, device)
    b = _draw(cfg, 1, 0, 63, g, device)
    xa = check_model_inputs(cfg, shapes, a[0], a[1], None, a[3])
    xb = check_model_inputs(cfg, shapes, b[0], b[1], None, b[3])
    first = engine(xa, a[3], 10)
    other = engine(xb, b[3], 10)
    again = engine(xa, a[3], 10)
    assert torch.equal(first, again)  # split-K and split-KV reductions run in a fixed order
    assert rel_err(other, first) > 0.1


@pytest.mark.parametrize("views,prompt,chunk,batch", [(1, 0, 63, 1), (3, 20, 50, 1), (2, 7, 50, 2)])
def test_pdl_engine_is_bitwise_equal_to_plain_launches(views, prompt, chunk, batch) -> None:
    """Programmatic dependent launch only moves when kernels start: with it every replay must give exactly the
    actions of the same engine captured without it. A kernel that touched another kernel's data before its
    `griddepcontrol.wait` (or a missing wait) shows up here as a mismatch on some replay."""
    device = torch.device("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    cfg = preset("pi0")
    weights = random_weights(cfg, seed=5, device=device)
    shapes = BuiltShapes(views, chunk, prompt or None, batch)
    engines = _engines_by_pdl_mode(("off", "on"), weights, cfg, device, shapes)
    g = torch.Generator(device=device).manual_seed(9)
    for _ in range(3):
        images, state, tokens, noise = _draw(cfg, views, prompt, chunk, g, device, batch)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        plain = engines["off"](x, noise, 10).clone()
        assert torch.isfinite(plain).all()
        for _ in range(4):
            assert torch.equal(engines["on"](x, noise, 10), plain)
