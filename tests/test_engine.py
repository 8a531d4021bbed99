"""The static engine's plan (buffers, strides, masks, RoPE rows, KV-cache offsets) against the reference.

The plan runs on two kernel sets with one contract: PyTorch ops (fast, checks the wiring) and the Triton kernels
(in Triton's CPU interpreter here; bf16 on the GPU in tests/test_gpu.py). Both must match the eager reference in
float32 on fresh random inputs with masked views and padded prompts.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_cases import random_case

from vla_rt.engine.static_engine import StaticPi0Engine, build_graphed_torch, build_triton
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.numerics import rel_err

TOL = 1e-5


def _case(seed: int, b: int, v: int, p: int, h: int, image_size: int = 224):
    """(tiny π0 config, random weights, inputs): `engine_cases.random_case` of the `tiny` preset."""
    return random_case("tiny", seed, b, v, p, h, image_size)


def _reference(cfg, weights, x, steps):
    ref = build_pi0(weights, cfg)
    return ref.sample_actions(x["images"], x["state"], x["tokens"], x["noise"], steps,
                              image_masks=x["image_masks"], token_mask=x["token_mask"])  # fmt: skip


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
    """The Triton kernels under the plan, batch 2 with per-row positions (a missing first view in one row, padded
    prompts), in the interpreter."""
    if torch.cuda.is_available():
        pytest.skip("covered in bf16 on the GPU by tests/test_gpu_engine.py")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg, weights, x = _case(seed=14, b=2, v=2, p=3, h=4, image_size=56)
    x["image_masks"] = torch.tensor([[False, True], [True, True]])  # positions must skip the missing view's tokens
    shapes = BuiltShapes(2, 4, 3, 2)
    engine = build_triton(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes, num_steps=2)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    assert rel_err(engine(inputs, x["noise"], 2), _reference(cfg, weights, x, 2)) <= TOL


def test_torch_kernel_plan_matches_reference_batched() -> None:
    cfg, weights, x = _case(seed=11, b=2, v=3, p=6, h=9)
    shapes = BuiltShapes(3, 9, 6, 2)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    assert rel_err(engine(inputs, x["noise"], 10), _reference(cfg, weights, x, 10)) <= TOL


class CountingKernels:
    """A kernel set that counts launches per kernel and forwards to another set."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, {}

    def __getattr__(self, kernel):
        fn = getattr(self.inner, kernel)

        def call(*args, **kwargs):
            self.calls[kernel] = self.calls.get(kernel, 0) + 1
            if kernel == "gemm" and kwargs.get("rope") is not None:
                self.calls["gemm+rope"] = self.calls.get("gemm+rope", 0) + 1
            return fn(*args, **kwargs)

        return call


def test_the_plan_launches_what_the_docs_say() -> None:
    """Per expert step: 2 rms_factor a layer and the final norm, RoPE in every QKV GEMM's epilogue (no rope_qk),
    7 GEMMs a layer and 4 around them at batch 1; per VLM prefix: RoPE as its own launch, no MLP in the pruned
    last layer."""
    from vla_rt.engine.kernels import TorchKernels

    cfg, weights, _ = _case(seed=15, b=1, v=1, p=2, h=3)
    kernels = CountingKernels(TorchKernels())
    engine = StaticPi0Engine(weights, cfg, BuiltShapes(1, 3, 2, 1), kernels=kernels, device=torch.device("cpu"),
                             dtype=torch.float32)  # fmt: skip
    engine.plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)
    step = dict(kernels.calls)
    kernels.calls.clear()
    engine.plan.prefix(engine.obs, engine.slot, engine.act)
    vlm = dict(kernels.calls)
    layers, vlm_layers = cfg.expert.depth, cfg.llm.depth
    assert step == {"gemm": 4 * layers + 4, "gemm+rope": layers, "rms_factor": 2 * layers + 1,
                    "attention": layers}  # fmt: skip
    assert vlm == {"gemm": 4 * vlm_layers - 3, "rms_factor": 2 * vlm_layers - 1, "rope_qk": vlm_layers,
                   "attention": vlm_layers - 1}  # fmt: skip
    assert engine.plan.expert.name == "per-op"
    assert engine.plan.expert_why == ("persistent_expert_step: the per-op step is this kernel set's own (only the "
                                      "Triton engine swaps it)")  # fmt: skip


def test_a_broken_rope_epilogue_fails_the_plan_test() -> None:
    """The plan tests must catch a RoPE epilogue (the action expert's QKV GEMM) that rotates the wrong pairs
    (adjacent (2j, 2j+1), the interleaved convention): the same engine with such a kernel set misses the reference
    by far."""
    from vla_rt.engine.kernels import TorchKernels

    class AdjacentPairsRope(TorchKernels):
        """The fused GEMM with the rotation on pairs (2j, 2j+1) of each head: what a permuted-weight scheme does when
        the weight permutation is forgotten (Q and K both rotated the same wrong way; V untouched)."""

        @staticmethod
        def gemm(a, w, out, *, rope=None, **kw):
            TorchKernels.gemm(a, w, out, **kw)
            if rope is None:
                return out
            hq, hkv, d, off = rope["num_q_heads"], rope["num_kv_heads"], rope["head_dim"], rope["cache_offset"]
            b = rope["k_cache"].shape[0]
            t = out.shape[0] // b
            y = out.view(b, t, hq + 2 * hkv, d).float()
            c, s = (tab.expand(b, t, -1)[:, :, None] for tab in (rope["cos"], rope["sin"]))
            ev, od = y[..., 0::2], y[..., 1::2]
            rot = torch.stack([ev * c - od * s, od * c + ev * s], dim=-1).flatten(-2)
            out.view(b, t, -1, d)[:, :, :hq] = rot[:, :, :hq] * rope.get("q_scale", 1.0)
            rope["k_cache"][:, off : off + t] = rot[:, :, hq : hq + hkv]
            rope["v_cache"][:, off : off + t] = y[:, :, hq + hkv :]
            return out

    cfg, weights, x = _case(seed=16, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    ref = _reference(cfg, weights, x, 10)
    for kernels, ok in ((TorchKernels(), True), (AdjacentPairsRope(), False)):
        engine = StaticPi0Engine(weights, cfg, shapes, kernels=kernels, device=torch.device("cpu"),
                                 dtype=torch.float32)  # fmt: skip
        err = rel_err(engine(inputs, x["noise"], 10), ref)
        assert (err <= TOL) == ok, err
