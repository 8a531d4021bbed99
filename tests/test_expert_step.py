"""The plan's seam for the action expert (`vla_rt.engine.expert_step`): how an implementation is chosen, what it is
given (the device-selected time-bias row, the SM budget), and that the engines' actions come from it."""

from __future__ import annotations

import pytest
import torch

from vla_rt import preset
from vla_rt.engine import expert_step as seam
from vla_rt.engine.kernels import TorchKernels
from vla_rt.engine.static_engine import build_graphed_torch, build_triton
from vla_rt.engine.streaming_pi0 import StreamingPi0
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights

CPU = torch.device("cpu")


class RecordingStep:
    """An ExpertStep that delegates to the per-op step (or, `broken`, skips the Euler update) and records its calls."""

    name = "recording"

    def __init__(self, inner, sm_count, broken=False):
        self.inner, self.sm_count, self.broken, self.calls = inner, sm_count, broken, []

    def run(self, slot, xa, step, num_steps, time_bias=None):
        self.calls.append((step, num_steps, None if time_bias is None else time_bias.clone()))
        if not self.broken:
            self.inner.run(slot, xa, step, num_steps, time_bias)


def declines(kernels, weights, cfg, dims, workspace, *, device, sm_count):
    return "needs an sm_90 GPU"


def _recording(made: list, broken=False):
    def recording(kernels, weights, cfg, dims, workspace, *, device, sm_count):
        step = RecordingStep(seam.PerOpExpertStep(kernels, weights, cfg, dims, workspace), sm_count, broken)
        made.append(step)
        return step

    return recording


def _inputs(cfg, g, views=1, prompt=2, chunk=3):
    images = torch.rand(1, views, 224, 224, 3, generator=g) * 2 - 1
    state = torch.randn(1, cfg.action_dim, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=g)
    noise = torch.randn(1, chunk, cfg.action_dim, generator=g)
    return images, state, tokens, noise


def test_the_first_candidate_that_applies_is_chosen_and_the_others_say_why_not(monkeypatch) -> None:
    cfg = preset("tiny")
    weights = random_weights(cfg, seed=31)
    made: list = []
    monkeypatch.setattr(seam, "CANDIDATES", (declines, _recording(made)))
    engine = build_graphed_torch(weights, cfg, device=CPU, dtype=torch.float32, shapes=BuiltShapes(1, 3, 2, 1))
    assert engine.plan.expert is made[0] and engine.plan.expert_why == "declines: needs an sm_90 GPU"
    monkeypatch.setattr(seam, "CANDIDATES", (declines,))
    engine = build_graphed_torch(weights, cfg, device=CPU, dtype=torch.float32, shapes=BuiltShapes(1, 3, 2, 1))
    assert isinstance(engine.plan.expert, seam.PerOpExpertStep) and "sm_90" in engine.plan.expert_why


def test_one_shot_actions_come_from_the_chosen_step_and_a_broken_one_is_caught(monkeypatch) -> None:
    cfg = preset("tiny")
    weights = random_weights(cfg, seed=32)
    shapes = BuiltShapes(1, 3, 2, 1)
    images, state, tokens, noise = _inputs(cfg, torch.Generator().manual_seed(5))
    x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
    expected = build_pi0(weights, cfg).sample_actions(images, state, tokens, noise)
    for broken in (False, True):
        made: list = []
        monkeypatch.setattr(seam, "CANDIDATES", (_recording(made, broken),))
        engine = build_graphed_torch(weights, cfg, device=CPU, dtype=torch.float32, shapes=shapes)
        actions = engine(x, noise, 10)
        assert [c[:2] for c in made[0].calls] == [(i, 10) for i in range(10)]
        err = float((actions - expected).norm() / expected.norm())
        assert (err <= 1e-5) == (not broken), err


def test_streaming_passes_the_device_selected_time_bias_and_the_sm_budget(monkeypatch) -> None:
    """One step a call: the streaming engine hands the step the table row of the step it is on (selected on the
    device; `step` is 0) and its SM budget, and its actions equal the per-op engine's."""
    cfg = preset("tiny")
    weights = random_weights(cfg, seed=33)
    shapes = BuiltShapes(1, 3, 2, 1)
    images, state, tokens, noise = _inputs(cfg, torch.Generator().manual_seed(6))
    plain = StreamingPi0(weights, cfg, shapes, device=CPU, dtype=torch.float32, steps_per_call=1)
    plain.submit_observation(images, state, tokens)
    expected, _, _ = plain.next_actions(noise)
    made: list = []
    monkeypatch.setattr(seam, "CANDIDATES", (_recording(made),))
    engine = StreamingPi0(weights, cfg, shapes, device=CPU, dtype=torch.float32, steps_per_call=1,
                          expert_sm_count=40)  # fmt: skip
    engine.submit_observation(images, state, tokens)
    actions, _, _ = engine.next_actions(noise)
    step = made[0]
    assert step.sm_count == 40 and engine.plan.expert is step
    table = engine.weights.suffix.time_bias
    assert [c[0] for c in step.calls] == [0] * 10
    assert all(torch.equal(c[2], table[i]) for i, c in enumerate(step.calls))
    assert torch.equal(actions, expected)


def test_per_op_step_without_candidates() -> None:
    cfg = preset("tiny")
    weights = random_weights(cfg, seed=34)
    engine = build_graphed_torch(weights, cfg, device=CPU, dtype=torch.float32, shapes=BuiltShapes(1, 3, 2, 1))
    step, why = seam.choose_expert_step(TorchKernels(), engine.weights, cfg, engine.dims, device=CPU, candidates=())
    assert isinstance(step, seam.PerOpExpertStep) and why == ""


def test_the_persistent_step_is_taken_only_where_it_measured_faster(monkeypatch) -> None:
    """`cuda_kernels.choice`: the Triton engine swaps in the persistent kernel only at a shape its GPU's table says
    it wins; otherwise one line says why (here: every reason short of building the kernel, which needs a GPU)."""
    from vla_rt.cuda_kernels import choice

    cfg = preset("tiny")
    weights = random_weights(cfg, seed=35)
    engine = build_graphed_torch(weights, cfg, device=CPU, dtype=torch.float32, shapes=BuiltShapes(1, 3, 2, 1))
    w, dims = engine.weights, engine.dims

    class Triton:
        name = "triton"

    assert "kernel set's own" in choice.persistent_expert_step(TorchKernels(), w, cfg, dims, device=CPU)
    assert choice.persistent_expert_step(Triton(), w, cfg, dims, device=CPU) == "needs a CUDA device"
    import vla_rt.cuda_kernels.expert_step as kernel_step

    monkeypatch.setattr(kernel_step, "why_not", lambda *a, **k: None)  # as on an H200 with nvcc
    monkeypatch.setattr(choice.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    key = ("pi0", dims.batch, dims.prefix, dims.chunk)
    monkeypatch.setattr(choice, "measured", lambda gpu: {})
    assert "not measured on NVIDIA H200 for pi0 at B=1" in choice.persistent_expert_step(
        Triton(), w, cfg, dims, device=CPU
    )
    slower = {key: {"tiling": {}, "persistent_ms": 0.9, "per_op_ms": 0.6}}
    monkeypatch.setattr(choice, "measured", lambda gpu: slower)
    why = choice.persistent_expert_step(Triton(), w, cfg, dims, device=CPU)
    assert why == "measured slower on NVIDIA H200 at this shape (0.900 vs 0.600 ms a step)"
    built = []
    monkeypatch.setattr(kernel_step, "PersistentExpertStep", lambda *a, **k: built.append(k) or "the kernel's step")
    faster = {key: {"tiling": {"cluster": 4}, "persistent_ms": 0.2, "per_op_ms": 0.6}}
    monkeypatch.setattr(choice, "measured", lambda gpu: faster)
    assert choice.persistent_expert_step(Triton(), w, cfg, dims, device=CPU, sm_count=100) == "the kernel's step"
    assert built == [{"sm_count": 100, "tiling": {"cluster": 4}}]


def test_measured_tables_are_read_by_gpu_name(tmp_path, monkeypatch) -> None:
    import json

    from vla_rt.cuda_kernels import choice

    monkeypatch.setattr(choice, "CONFIG_DIR", tmp_path)
    choice.measured.cache_clear()
    row = {"batch": 1, "prefix": 256, "chunk": 63, "tiling": {"cluster": 2}, "persistent_ms": 0.3, "per_op_ms": 0.6}
    (tmp_path / "Some-GPU.json").write_text(json.dumps({"gpu": "Some GPU", "steps": [row]}))
    assert choice.measured("Some GPU") == {("pi0", 1, 256, 63): row}
    assert choice.measured("Other GPU") == {}
    choice.measured.cache_clear()


@pytest.mark.parametrize(
    ("per_row_steps", "build"),
    [(False, build_graphed_torch), (True, build_graphed_torch), (True, build_triton)],  # triton: ~50 s interpreted
    ids=["one step for all rows", "a step per row", "a step per row, triton kernels"],
)
def test_the_batched_suffix_launches_match_the_per_row_ones(per_row_steps, build) -> None:
    """At B > 1 the per-op step embeds the action rows and applies the Euler update in a few launches for all rows
    (`_embed_batched`, `_update_batched`) instead of three a batch element: the same update, in float32, whether
    every row is at one step or each at its own (the stage engine's time-bias rows)."""
    cfg = preset("tiny")
    batch, chunk = 3, 4
    engine = build(random_weights(cfg, seed=7), cfg, device=CPU, dtype=torch.float32,
                   shapes=BuiltShapes(1, chunk, 2, batch))  # fmt: skip
    g = torch.Generator().manual_seed(8)
    rows = [_inputs(cfg, g, chunk=chunk) for _ in range(batch)]
    images, state, tokens, noise = (torch.cat(t) for t in zip(*rows))
    engine(check_model_inputs(cfg, engine.shapes, images, state, tokens, noise), noise, engine.num_steps)  # the KV
    step = engine.plan.expert
    assert isinstance(step, seam.PerOpExpertStep) and step._batched_suffix
    table = engine.weights.suffix.time_bias
    time_bias = table[torch.tensor([0, 4, 9])] if per_row_steps else None
    x0 = torch.randn(engine.xa.x_t.shape, generator=g)
    updates = {}
    for batched in (True, False):
        step._batched_suffix = batched
        engine.xa.x_t.copy_(x0)
        step.run(engine.slot, engine.xa, 2, engine.num_steps, time_bias=time_bias)
        updates[batched] = engine.xa.x_t - x0
    rel = (updates[True] - updates[False]).norm() / updates[False].norm()
    assert updates[False].norm() > 0 and rel < 1e-5, rel
