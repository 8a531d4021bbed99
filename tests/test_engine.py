"""The static engine's plan (buffers, strides, masks, RoPE rows, KV-cache offsets) against the reference.

The plan runs on two kernel sets with one contract: PyTorch ops (fast, checks the wiring) and the Triton kernels
(in Triton's CPU interpreter here; bf16 on the GPU in tests/test_gpu.py). Both must match the eager reference in
float32 on fresh random inputs with masked views and padded prompts.
"""

from __future__ import annotations

import os

import pytest
import torch

from vla_rt import preset
from vla_rt.engine.static_engine import build_graphed_torch, build_triton
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights

TOL = 1e-5


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _case(seed: int, b: int, v: int, p: int, h: int):
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(seed)
    x = dict(
        images=torch.rand(b, v, 224, 224, 3, generator=g) * 2 - 1,
        state=torch.randn(b, cfg.action_dim, generator=g),
        tokens=torch.randint(0, cfg.vocab_size, (b, p), generator=g),
        noise=torch.randn(b, h, cfg.action_dim, generator=g),
        image_masks=torch.rand(b, v, generator=g) > 0.3,
        token_mask=torch.arange(p)[None].expand(b, -1) < torch.randint(1, p + 1, (b, 1), generator=g),
    )
    x["image_masks"][:, 0] = True  # at least one view present
    return cfg, random_weights(cfg, seed=seed), x


def _reference(cfg, weights, x, steps):
    ref = build_pi0(weights, cfg)
    return ref.sample_actions(x["images"], x["state"], x["tokens"], x["noise"], steps,
                              image_masks=x["image_masks"], token_mask=x["token_mask"])  # fmt: skip


def test_torch_kernel_plan_matches_reference_batched() -> None:
    cfg, weights, x = _case(seed=11, b=2, v=3, p=6, h=9)
    shapes = BuiltShapes(3, 9, 6, 2)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    assert rel_err(engine(inputs, x["noise"], 10), _reference(cfg, weights, x, 10)) <= TOL


def test_prompt_changes_between_calls_without_rebuild() -> None:
    cfg, weights, x = _case(seed=12, b=1, v=1, p=4, h=5)
    shapes = BuiltShapes(1, 5, 4, 1)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes)
    for tokens, mask in ((x["tokens"], x["token_mask"]), (x["tokens"].flip(1), torch.ones(1, 4, dtype=torch.bool))):
        y = dict(x, tokens=tokens, token_mask=mask)
        inputs = check_model_inputs(cfg, shapes, y["images"], y["state"], tokens, y["noise"], y["image_masks"], mask)
        assert rel_err(engine(inputs, y["noise"], 10), _reference(cfg, weights, y, 10)) <= TOL


def test_step_count_is_part_of_the_plan() -> None:
    cfg, weights, x = _case(seed=13, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"])
    with pytest.raises(ValueError, match="num_steps: expected 10"):
        engine(inputs, x["noise"], 5)


def test_triton_kernel_plan_matches_reference_in_interpreter() -> None:
    if torch.cuda.is_available():
        pytest.skip("covered in bf16 on the GPU by tests/test_gpu.py")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg, weights, x = _case(seed=14, b=1, v=2, p=3, h=5)
    x["image_masks"] = torch.tensor([[False, True]])  # first view missing: positions must skip its tokens
    shapes = BuiltShapes(2, 5, 3, 1)
    engine = build_triton(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes, num_steps=2)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    assert rel_err(engine(inputs, x["noise"], 2), _reference(cfg, weights, x, 2)) <= TOL
