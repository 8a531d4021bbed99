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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 2e-2


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


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


def _engines_by_pdl_mode(modes, weights, cfg, device, shapes, **flags) -> dict:
    """One bf16 Triton engine per PDL mode ("off" / "on" / "early"), each captured under its mode."""
    from vla_rt.triton_kernels.pdl import pdl_mode

    engines = {}
    for mode in modes:
        with pdl_mode(mode):
            engines[mode] = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes, **flags)
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


@pytest.mark.parametrize("name,views,prompt,chunk", [("tiny", 2, 5, 9), ("pi0", 1, 0, 63), ("pi0", 3, 20, 50)])
def test_triton_engine_with_fusions_bf16_matches_fp32_reference(name, views, prompt, chunk) -> None:
    """fuse_rms + fuse_rope on both stages (RMS factor in the GEMMs, RoPE epilogue into the KV cache), captured in
    one CUDA Graph: within bf16 tolerance of the fp32 reference and of the unfused engine, replay deterministic."""
    device, cfg, weights, shapes, ref = _with_fp32_reference(name, views, prompt, chunk, seed=3)
    fused = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes, fuse_rms=True,
                         fuse_rope=True)  # fmt: skip
    g = torch.Generator(device=device).manual_seed(7)
    draws = [_draw(cfg, views, prompt, chunk, g, device) for _ in range(2)]
    outs = []
    for images, state, tokens, noise in draws:
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        out = fused(x, noise, 10)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref.sample_actions(images, state, tokens, noise)) <= BF16_TOL
        assert torch.equal(fused(x, noise, 10), out)  # split reductions in a fixed order
        outs.append(out)
    del fused
    unfused = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
    for (images, state, tokens, noise), out in zip(draws, outs):
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        assert rel_err(out, unfused(x, noise, 10)) <= BF16_TOL


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
    engines = _engines_by_pdl_mode(("off", "on", "early"), weights, cfg, device, shapes)
    g = torch.Generator(device=device).manual_seed(9)
    for _ in range(3):
        images, state, tokens, noise = _draw(cfg, views, prompt, chunk, g, device, batch)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        plain = engines["off"](x, noise, 10).clone()
        assert torch.isfinite(plain).all()
        for _ in range(4):
            assert torch.equal(engines["on"](x, noise, 10), plain)
            assert torch.equal(engines["early"](x, noise, 10), plain)


@pytest.mark.parametrize("views,prompt,chunk", [(1, 0, 63), (3, 20, 50)])
def test_l2_prefetch_changes_no_result(views, prompt, chunk) -> None:
    """The L2 prefetch is a hint: the engine with it gives bit-identical actions to the same engine without it, on
    every replay (a prefetch kernel that broke stream order under PDL would show up here)."""
    device = torch.device("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk L2 prefetch needs sm_90+")
    cfg = preset("pi0")
    weights = random_weights(cfg, seed=7, device=device)
    shapes = BuiltShapes(views, chunk, prompt or None, 1)
    plain = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes, l2_prefetch=False)
    hinted = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes, l2_prefetch=True)
    g = torch.Generator(device=device).manual_seed(11)
    for _ in range(2):
        images, state, tokens, noise = _draw(cfg, views, prompt, chunk, g, device)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        ref = plain(x, noise, 10).clone()
        assert torch.isfinite(ref).all()
        for _ in range(3):
            assert torch.equal(hinted(x, noise, 10), ref)


@pytest.mark.parametrize("fusion", ["rms_partials", "combine_rms", "skinny_gluon", "fused_mlp", "fused_mlp_o"])
@pytest.mark.parametrize("name,views,prompt,chunk", [("tiny", 2, 5, 9), ("pi0", 1, 0, 63), ("pi0", 3, 20, 50)])
def test_triton_engine_with_norm_fusions_bf16_matches_fp32_reference(
    fusion, name, views, prompt, chunk, monkeypatch
) -> None:
    """The norm fusions on both stages, with the default expert RoPE epilogue: rms_partials (the O / down GEMMs
    leave x's per-16-column sums of squares; the next norm's GEMM takes its RMS factor from them) and combine_rms
    (their split-K combine kernels write the factor itself), and skinny_gluon (the expert's QKV and gate/up GEMMs
    on the Gluon kernel, RMS factor in-kernel), and fused_mlp (the expert's MLP as one Gluon launch; fused_mlp_o:
    with the layer's O projection inside it). Within bf16 tolerance of the fp32 reference, replay bit-identical."""
    device, cfg, weights, shapes, ref = _with_fp32_reference(name, views, prompt, chunk, seed=6)
    if fusion == "fused_mlp_o":  # the MLP launch also does the layer's O projection (plan.MLP_WITH_O)
        from vla_rt.engine import plan as plan_module

        monkeypatch.setattr(plan_module, "MLP_WITH_O", True)
        fusion = "fused_mlp"
    engine = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes, **{fusion: True})
    if fusion == "skinny_gluon":  # π0's expert (width 1024, <= 64 rows) runs on it; tiny's width 32 does not
        assert engine.plan.skinny == (name == "pi0"), engine.plan.skinny_why
    if fusion == "fused_mlp":  # the same for the one-launch MLP (MLP = 4 x width, a width of 128s)
        assert engine.plan.fused_mlp == (name == "pi0"), engine.plan.mlp_why
    g = torch.Generator(device=device).manual_seed(10)
    for _ in range(2):
        images, state, tokens, noise = _draw(cfg, views, prompt, chunk, g, device)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        out = engine(x, noise, 10).clone()
        assert torch.isfinite(out).all()
        assert rel_err(out, ref.sample_actions(images, state, tokens, noise)) <= BF16_TOL
        assert torch.equal(engine(x, noise, 10), out)


@pytest.mark.parametrize("views,prompt,chunk,batch", [(1, 0, 63, 1), (3, 20, 50, 1), (2, 7, 5, 2)])
def test_triton_engine_with_expert_layer_kernel_bf16_matches_fp32_reference(views, prompt, chunk, batch) -> None:
    """expert_layer: every action-expert layer as one persistent kernel (grid barriers, in-kernel merges), captured
    in the CUDA Graph with PDL on and off: within bf16 tolerance of the fp32 reference, replays bit-identical (the
    merges run in a fixed order, the barrier counters reset themselves), and PDL changes no bit."""
    device, cfg, weights, _, ref = _with_fp32_reference("pi0", views, prompt, chunk, seed=8)
    shapes = BuiltShapes(views, chunk, prompt or None, batch)
    engines = _engines_by_pdl_mode(("on", "off"), weights, cfg, device, shapes, expert_layer=True)
    assert engines["on"].plan.expert_layer
    g = torch.Generator(device=device).manual_seed(12)
    for _ in range(2):
        images, state, tokens, noise = _draw(cfg, views, prompt, chunk, g, device, batch)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        out = engines["on"](x, noise, 10).clone()
        assert torch.isfinite(out).all()
        assert rel_err(out, ref.sample_actions(images, state, tokens, noise)) <= BF16_TOL
        for _ in range(3):
            assert torch.equal(engines["on"](x, noise, 10), out)
        assert torch.equal(engines["off"](x, noise, 10), out)
