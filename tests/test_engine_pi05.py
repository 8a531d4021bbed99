"""π0.5 on the engine plan (static and streaming) against the eager reference, in float32 on the CPU.

The Triton kernels run in Triton's interpreter (slow: one tiny case, 56-px views); the torch kernel set (same plan,
same contracts) covers more shapes and the streaming engine's one-step graph, whose step row is copied out of the
packed modulation table by a device-side counter. A plan whose gate is applied as `1 + gate` (the plausible bug)
must fail the same tolerance. bf16 at full size on the GPU: tests/test_gpu_pi05.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from engine_cases import random_case

from vla_rt.engine.kernels import TorchKernels
from vla_rt.engine.static_engine import StaticPi0Engine, build_graphed_torch, build_triton
from vla_rt.engine.streaming_pi0 import StreamingPi0
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.numerics import rel_err

TOL = 1e-5  # float32 engine vs float32 reference (measured 3.9e-7 for the interpreter case below)
CPU = torch.device("cpu")


def _case(seed: int, b: int, v: int, p: int, h: int, image_size: int = 56):
    """(tiny π0.5 config, random weights, inputs): `engine_cases.random_case` of the `tiny_pi05` preset."""
    return random_case("tiny_pi05", seed, b, v, p, h, image_size)


def _reference(cfg, weights, x, steps):
    return build_pi0(weights, cfg).sample_actions(x["images"], x["state"], x["tokens"], x["noise"], steps,
                                                  image_masks=x["image_masks"], token_mask=x["token_mask"])  # fmt: skip


def _run(engine, cfg, shapes, x, steps):
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    return engine(inputs, x["noise"], steps)


def _gate_as_one_plus_gate(kernels) -> SimpleNamespace:
    """The kernel set with one plausible π0.5 bug: the residual gate applied as `x + y * (1 + gate)`."""

    def gemm(*args, out_scale=None, **kw):
        return kernels.gemm(*args, out_scale=None if out_scale is None else 1.0 + out_scale, **kw)

    names = ("attention", "layernorm", "rms_factor", "rmsnorm", "rope_qk", "patchify")
    return SimpleNamespace(name=kernels.name, gemm=gemm, **{n: getattr(kernels, n) for n in names})


def test_triton_engine_runs_pi05_in_the_interpreter_and_a_broken_gate_fails() -> None:
    """Batch 2 with per-row positions (a missing first view in one row, padded prompts), 3 steps."""
    if torch.cuda.is_available():
        pytest.skip("covered in bf16 on the GPU by tests/test_gpu_pi05.py")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vla_rt.engine.kernels import triton_kernels

    cfg, weights, x = _case(seed=31, b=2, v=2, p=5, h=4)
    x["image_masks"] = torch.tensor([[False, True], [True, True]])
    shapes, steps = BuiltShapes(2, 4, 5, 2), 2
    ref = _reference(cfg, weights, x, steps)
    engine = build_triton(weights, cfg, device=CPU, dtype=torch.float32, shapes=shapes, num_steps=steps)
    assert engine.plan.expert.name == "per-op-pi05"
    assert rel_err(_run(engine, cfg, shapes, x, steps), ref) <= TOL
    broken = StaticPi0Engine(weights, cfg, shapes, kernels=_gate_as_one_plus_gate(triton_kernels()), device=CPU,
                             dtype=torch.float32, num_steps=steps)  # fmt: skip
    assert rel_err(_run(broken, cfg, shapes, x, steps), ref) > 100 * TOL


@pytest.mark.parametrize("b,v,p,h,steps", [(1, 1, 2, 5, 10), (2, 3, 6, 9, 4)])
def test_torch_kernel_plan_runs_pi05(b, v, p, h, steps) -> None:
    cfg, weights, x = _case(seed=32 + b, b=b, v=v, p=p, h=h)
    shapes = BuiltShapes(v, h, p, b)
    engine = build_graphed_torch(weights, cfg, device=CPU, dtype=torch.float32, shapes=shapes, num_steps=steps)
    assert rel_err(_run(engine, cfg, shapes, x, steps), _reference(cfg, weights, x, steps)) <= TOL
    broken = StaticPi0Engine(weights, cfg, shapes, kernels=_gate_as_one_plus_gate(TorchKernels()), device=CPU,
                             dtype=torch.float32, num_steps=steps)  # fmt: skip
    assert rel_err(_run(broken, cfg, shapes, x, steps), _reference(cfg, weights, x, steps)) > 100 * TOL


def _counting_torch_kernels(calls: dict[str, int]) -> SimpleNamespace:
    """The torch kernel set, counting its calls by name into `calls` (a GEMM with RoPE as "gemm+rope")."""
    inner = TorchKernels()

    def counted(name):
        def call(*args, **kw):
            key = "gemm+rope" if name == "gemm" and kw.get("rope") is not None else name
            calls[key] = calls.get(key, 0) + 1
            return getattr(inner, name)(*args, **kw)

        return call

    names = ("gemm", "attention", "layernorm", "rms_factor", "rmsnorm", "rope_qk", "patchify")
    return SimpleNamespace(name="torch", **{n: counted(n) for n in names})


def test_pi05_step_launches() -> None:
    """Per step: action_in, per layer two RMSNorms (no rms_factor), four GEMMs with RoPE in the QKV one (no
    rope_qk), one attention; the final RMSNorm and the action GEMM."""
    cfg, weights, x = _case(seed=35, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    engine = build_graphed_torch(weights, cfg, device=CPU, dtype=torch.float32, shapes=shapes, num_steps=2)
    calls: dict[str, int] = {}
    engine.plan.expert.k = _counting_torch_kernels(calls)
    engine.plan.expert_step(engine.slot, engine.xa, 0, 2)
    depth = cfg.expert.depth
    assert calls == {"gemm": 2 + 3 * depth, "gemm+rope": depth, "rmsnorm": 2 * depth + 1,
                              "attention": depth}  # fmt: skip


def test_pi05_rows_at_their_own_steps_take_the_same_launches() -> None:
    """The stage engine's step over B rows, each at its own Euler step ((B, R) modulation rows): the single-row
    launches (the norms, GEMM epilogues and RoPE read each row's batch element), only `action_out_proj` once per
    batch element; no separate bias, gate or RoPE ops."""
    from vla_rt.engine.stages import StageEngine

    cfg, weights, _ = _case(seed=36, b=1, v=1, p=2, h=3)
    engine = StageEngine(weights, cfg, BuiltShapes(1, 3, 2), expert_buckets=(4,), prefix_buckets=(1,),
                         kernels=TorchKernels(), device=CPU, dtype=torch.float32, num_steps=2)  # fmt: skip
    calls: dict[str, int] = {}
    engine.plans[4].expert.k = _counting_torch_kernels(calls)
    engine.step_index.copy_(torch.tensor([0, 1, 1, 0]))
    engine._expert(4)
    depth = cfg.expert.depth
    assert calls == {"gemm": 1 + 3 * depth + 4, "gemm+rope": depth, "rmsnorm": 2 * depth + 1,
                     "attention": depth}  # fmt: skip


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_streaming_runs_pi05(steps_per_call: int) -> None:
    """One-step calls select the step's table row on the device (one graph for every step); whole-chunk calls
    index the table on the host."""
    cfg, weights, x = _case(seed=36, b=1, v=2, p=3, h=5)
    engine = StreamingPi0(weights, cfg, BuiltShapes(2, 5, 3, 1), device=CPU, dtype=torch.float32, num_steps=4,
                          steps_per_call=steps_per_call)  # fmt: skip
    assert engine.time_bias.shape == engine.weights.pi05.tables.shape[1:]
    ref = build_pi0(weights, cfg)
    g = torch.Generator().manual_seed(5)
    for frame in (1, 2):
        images = torch.rand(1, 2, 56, 56, 3, generator=g) * 2 - 1
        tokens = torch.randint(0, cfg.vocab_size, (1, 3), generator=g)
        engine.submit_observation(images, x["state"], tokens, t_capture=float(frame))
        noise = torch.randn(1, 5, cfg.action_dim, generator=g)
        actions, version, _ = engine.next_actions(noise)
        assert version == frame
        assert rel_err(actions, ref.sample_actions(images, x["state"], tokens, noise, 4)) <= TOL
