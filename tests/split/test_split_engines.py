"""The split engines against the monolithic engine: with a fresh prefix, the robot-side expert (built from the
expert's weights alone) gives the monolithic engine's actions bit for bit on the same device and dtype, and stays
within 1e-5 of the folded backend in float32 on the CPU, for π0 and π0.5 (masked views, padded prompts)."""

from __future__ import annotations

import pytest
import torch
from split_cases import engine_case

from vla_rt.engine.split_engines import ExpertEngine, PrefixEngine, expert_subset
from vla_rt.engine.static_engine import build_graphed_torch
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.numerics import rel_err

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.mark.parametrize("preset_name", ["tiny", "tiny_pi05"])
@pytest.mark.parametrize("only_valid_rows", [False, True])
def test_expert_on_a_fresh_prefix_equals_the_monolithic_engine(preset_name: str, only_valid_rows: bool) -> None:
    cfg, weights, x, shapes = engine_case(preset_name, seed=31, views=2, prompt=5, chunk=6)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    monolithic = build_graphed_torch(weights, cfg, device=CPU, dtype=F32, shapes=shapes)(inputs, x["noise"], 10)

    prefix = PrefixEngine(weights, cfg, shapes, device=CPU, dtype=F32)
    prefix.run(inputs)
    kv, mask = prefix.export()
    expert = ExpertEngine.from_expert_weights(expert_subset(weights, cfg), cfg, shapes, device=CPU, dtype=F32)
    assert not any(k.startswith(("vision.", "llm.")) for k in expert_subset(weights, cfg))
    rows = mask[0].nonzero()[:, 0] if only_valid_rows else None
    expert.import_prefix(1, kv if rows is None else kv[:, :, :, rows], mask, rows, version=7)
    state = None if cfg.pi05 else x["state"]
    actions = expert.run_chunk(1, state, x["noise"])
    assert torch.equal(actions, monolithic)

    folded = build_pi0(weights, cfg, backend="folded").sample_actions(
        x["images"], x["state"], x["tokens"], x["noise"], image_masks=x["image_masks"], token_mask=x["token_mask"]
    )
    assert rel_err(actions, folded) <= 1e-5


def test_relay_on_the_prefix_engines_slot_equals_the_robot_side_expert() -> None:
    cfg, weights, x, shapes = engine_case("tiny", seed=32, views=1, prompt=3, chunk=4)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"])
    prefix = PrefixEngine(weights, cfg, shapes, device=CPU, dtype=F32)
    relay = ExpertEngine.on_weights(prefix.weights, cfg, shapes, device=CPU, dtype=F32, slots=[prefix.slot])
    robot = ExpertEngine.from_expert_weights(expert_subset(weights, cfg), cfg, shapes, device=CPU, dtype=F32)
    prefix.run(inputs)
    robot.import_prefix(0, *prefix.export())
    assert torch.equal(relay.run_chunk(0, x["state"], x["noise"]), robot.run_chunk(0, x["state"], x["noise"]))


def test_a_new_prefix_lands_between_two_steps_without_touching_the_chunk_in_flight() -> None:
    cfg, weights, x, shapes = engine_case("tiny", seed=33, views=1, prompt=3, chunk=4)
    y = engine_case("tiny", seed=34, views=1, prompt=3, chunk=4)[2]
    prefix = PrefixEngine(weights, cfg, shapes, device=CPU, dtype=F32)
    expert = ExpertEngine.from_expert_weights(expert_subset(weights, cfg), cfg, shapes, device=CPU, dtype=F32)
    kvs = []
    for obs in (x, y):
        prefix.run(check_model_inputs(cfg, shapes, obs["images"], obs["state"], obs["tokens"], obs["noise"]))
        kvs.append(tuple(t.clone() for t in prefix.export()))
    expert.import_prefix(0, *kvs[0])
    expected_old = expert.run_chunk(0, x["state"], x["noise"])
    expert.start_chunk(0, x["state"], x["noise"])
    for step in range(10):
        if step == 4:
            with pytest.raises(RuntimeError, match="a chunk is running on it"):
                expert.import_prefix(0, *kvs[1])
            expert.import_prefix(1, *kvs[1])  # the other slot: the chunk in flight keeps its own prefix
        done = expert.step()
    assert done and torch.equal(expert.actions(), expected_old)
    expert.import_prefix(0, *kvs[1])
    assert torch.equal(expert.run_chunk(1, x["state"], x["noise"]), expert.run_chunk(0, x["state"], x["noise"]))


def test_expert_weights_must_be_complete() -> None:
    cfg, weights, _, shapes = engine_case("tiny", seed=35, views=1, prompt=0, chunk=4)
    subset = expert_subset(weights, cfg)
    del subset["expert.layers.1.down_proj.weight"]
    with pytest.raises(ValueError, match="1 missing"):
        ExpertEngine.from_expert_weights(subset, cfg, shapes, device=CPU, dtype=F32)


def test_split_engines_run_batch_one_only() -> None:
    cfg, weights, _, _ = engine_case("tiny", seed=36, views=1, prompt=0, chunk=4)
    with pytest.raises(ValueError, match="batch_size: expected 1"):
        PrefixEngine(weights, cfg, BuiltShapes(1, 4, 0, 2), device=CPU, dtype=F32)


def test_triton_kernel_set_split_equals_the_monolithic_triton_engine_in_the_interpreter() -> None:
    """The Triton kernels under both split engines (workspaces, the RoPE epilogue into another slot) against the
    monolithic Triton engine, in Triton's interpreter on a CPU: bit for bit."""
    if torch.cuda.is_available():
        pytest.skip("covered in bf16 on the GPU by test_split_gpu.py")
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vla_rt.engine.kernels import triton_kernels
    from vla_rt.engine.static_engine import build_triton

    cfg, weights, x, shapes = engine_case("tiny", seed=37, views=2, prompt=3, chunk=4, image_size=56)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    monolithic = build_triton(weights, cfg, device=CPU, dtype=F32, shapes=shapes, num_steps=2)(inputs, x["noise"], 2)
    kernels = triton_kernels()
    prefix = PrefixEngine(weights, cfg, shapes, device=CPU, dtype=F32, num_steps=2, kernels=kernels)
    prefix.run(inputs)
    expert = ExpertEngine.from_expert_weights(expert_subset(weights, cfg), cfg, shapes, device=CPU, dtype=F32,
                                              num_steps=2, kernels=kernels)  # fmt: skip
    expert.import_prefix(1, *prefix.export())
    assert torch.equal(expert.run_chunk(1, x["state"], x["noise"]), monolithic)


def test_a_prefix_engine_on_another_engines_weights_gives_the_same_kv() -> None:
    cfg, weights, x, shapes = engine_case("tiny", seed=38, views=1, prompt=3, chunk=4)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"])
    monolithic = build_graphed_torch(weights, cfg, device=CPU, dtype=F32, shapes=shapes)
    shared = PrefixEngine(monolithic.weights, cfg, shapes, device=CPU, dtype=F32)
    own = PrefixEngine(weights, cfg, shapes, device=CPU, dtype=F32)
    assert shared.weights is monolithic.weights
    shared.run(inputs), own.run(inputs)
    assert all(torch.equal(a, b) for a, b in zip(shared.export(), own.export()))
