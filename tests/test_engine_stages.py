"""The stage engine (`vla_rt/engine/stages.py`): every row of a mixed batch, whatever joined or left beside it and
at whatever step, gets the actions of its own request run alone through `load_pi0(...).sample_actions`.

CPU, float32, the torch kernels: the tiny presets at 56 px (π0 and π0.5), 2 views with random camera masks, a
padded prompt, chunk 5. Rows join at every stage boundary (up to the prefix bucket and the free rows), so rows of
different robots sit in one expert stage at different step indices, leave from the middle of the pool and move.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_cases import random_case

from vla_rt.engine import stages as stages_module
from vla_rt.engine.kernels import TorchKernels
from vla_rt.engine.stages import StageEngine
from vla_rt.inference import Pi0Inference, build_pi0, load_stages
from vla_rt.inputs import BuiltShapes, ModelInputs, images_to_model_range
from vla_rt.numerics import rel_err

ROWS, VIEWS, PROMPT, CHUNK = 9, 2, 6, 5
SHAPES = BuiltShapes(VIEWS, CHUNK, PROMPT)


def _case(preset: str):
    cfg, weights, x = random_case(preset, 1, ROWS, VIEWS, PROMPT, CHUNK, 56)
    x["pixels"] = ((x["images"] + 1) * 127.5).round().to(torch.uint8)  # what a robot's camera sends
    return cfg, weights, x


def _row(x: dict, i: int, *, pixels: bool = False) -> ModelInputs:
    one = {k: v[i : i + 1] for k, v in x.items()}
    images = one["pixels"] if pixels else images_to_model_range(one["pixels"])
    return ModelInputs(images, one["state"], one["tokens"], one["noise"], one["image_masks"], one["token_mask"])


def _rows(x: dict, ids, *, pixels: bool = False) -> ModelInputs:
    rows = [_row(x, i, pixels=pixels) for i in ids]
    fields = ("images", "state", "tokens", "noise", "image_masks", "token_mask")
    return ModelInputs(*(torch.cat([getattr(r, f) for r in rows]) for f in fields))


def _engine(cfg, weights) -> StageEngine:
    return StageEngine(weights, cfg, SHAPES, expert_buckets=(1, 2, 4), prefix_buckets=(1, 2), kernels=TorchKernels(),
                       device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip


def _feed(engine: StageEngine, x: dict, ids, feed: str) -> ModelInputs:
    """The rows `ids` as a caller hands them to admit: "pixels" (uint8, stacked with torch.cat), "floats" (images
    already in [-1, 1]) or "input_rows" (uint8, copied into the engine's own host buffers, as the server does)."""
    if feed == "floats":
        return _rows(x, ids)
    rows = _rows(x, ids, pixels=True)
    if feed == "pixels":
        return rows
    assert feed == "input_rows", feed
    buffers = engine.input_rows(len(ids))
    for f in ("images", "state", "tokens", "noise", "image_masks", "token_mask"):
        getattr(buffers, f).copy_(getattr(rows, f))
    return buffers


def _serve(engine: StageEngine, x: dict, seed: int, *, overlap: bool = False, feed: str = "pixels"):
    """Runs all rows, admitting a random number of waiting rows at every boundary; returns the actions and the
    step mixes seen (the step indices of the rows in flight before each expert stage). `overlap`: through
    begin_admit / join, joining one or two expert stages after the launch (as the server does when the prefix
    stream is still busy). `feed`: how the rows reach admit (`_feed`)."""
    rng = np.random.default_rng(seed)
    waiting, out, mixes, join_in = list(range(ROWS)), {}, set(), 0
    while len(out) < ROWS:
        if engine.joining and (join_in == 0 or not engine.rows):
            engine.join()
        join_in -= 1
        k = int(rng.integers(0, min(engine.max_prefix, engine.free, len(waiting)) + 1)) if waiting else 0
        if k == 0 and not engine.rows and not engine.joining:
            k = 1
        if k and not engine.joining:
            ids, waiting = waiting[:k], waiting[k:]
            if overlap:
                engine.begin_admit(ids, _feed(engine, x, ids, feed))
                join_in = int(rng.integers(0, 3))
                if not engine.rows:
                    continue
            else:
                engine.admit(ids, _feed(engine, x, ids, feed))
        mixes.add(tuple(sorted(steps for _, steps in engine.row_steps())))
        out.update(engine.step())
    return out, mixes


@pytest.mark.parametrize("preset", ["tiny", "tiny_pi05"])
def test_every_row_of_a_mixed_batch_matches_its_request_alone(preset) -> None:
    cfg, weights, x = _case(preset)
    engine = _engine(cfg, weights)
    out, mixes = _serve(engine, x, seed=0)
    assert any(len(set(m)) > 1 for m in mixes), mixes  # rows at different steps shared expert stages
    alone = build_pi0(weights, cfg, backend="folded", num_views=VIEWS, chunk=CHUNK, prompt_len=PROMPT)
    for i in range(ROWS):
        r = _row(x, i)
        ref = alone.sample_actions(r.images, r.state, r.tokens, r.noise, image_masks=r.image_masks,
                                   token_mask=r.token_mask)[0]  # fmt: skip
        assert rel_err(out[i], ref) <= 1e-5, (i, rel_err(out[i], ref))
    assert engine.in_flight == 0 and engine.free == engine.capacity


@pytest.mark.parametrize("preset", ["tiny", "tiny_pi05"])
def test_rows_never_mix(preset) -> None:
    """Same schedule, other rows' inputs changed: a row's actions are bit-identical (shapes equal, rows apart)."""
    cfg, weights, x = _case(preset)
    engine = _engine(cfg, weights)
    first, _ = _serve(engine, x, seed=3)
    g = torch.Generator().manual_seed(9)
    other = {k: v.clone() for k, v in x.items()}
    other["pixels"][1:] = torch.randint(0, 256, other["pixels"][1:].shape, generator=g, dtype=torch.uint8)
    other["noise"][1:] = torch.randn(other["noise"][1:].shape, generator=g)
    other["tokens"][1:] = torch.randint(0, cfg.vocab_size, other["tokens"][1:].shape, generator=g)
    second, _ = _serve(engine, other, seed=3)
    assert torch.equal(first[0], second[0])
    assert not torch.allclose(first[1], second[1])


def test_whole_requests_through_load_stages(tmp_path) -> None:
    """The public loader: `sample_actions` on a stage model runs whole batches through the stages."""
    model = load_stages("random:tiny:4", num_views=1, chunk=4, prompt_len=3, expert_buckets=(1, 2, 4),
                        prefix_buckets=(1, 2))  # fmt: skip
    assert isinstance(model, Pi0Inference) and model.stages.capacity == 4 and model.stages.max_prefix == 2
    ref = build_pi0(*_random("tiny:4"), backend="folded", num_views=1, chunk=4, prompt_len=3)
    g = torch.Generator().manual_seed(0)
    images, state = torch.rand(3, 1, 224, 224, 3, generator=g) * 2 - 1, torch.randn(3, 32, generator=g)
    tokens, noise = torch.randint(0, 1024, (3, 3), generator=g), torch.randn(3, 4, 32, generator=g)
    got = model.sample_actions(images, state, tokens, noise)
    assert rel_err(got, ref.sample_actions(images, state, tokens, noise)) <= 1e-5
    with pytest.raises(ValueError, match="expected at most 4 rows on an idle engine, found 5 rows"):
        model.sample_actions(images[[0, 1, 2, 0, 1]], state[[0, 1, 2, 0, 1]], tokens[[0, 1, 2, 0, 1]])


def test_stage_arguments_are_checked_before_any_work() -> None:
    with pytest.raises(ValueError, match="backend: expected 'folded'"):
        load_stages("/nonexistent", backend="reference", num_views=1)
    with pytest.raises(ValueError, match="prefix_buckets: expected at most the pool's 2 rows"):
        load_stages("/nonexistent", num_views=1, expert_buckets=(1, 2), prefix_buckets=(4,))
    with pytest.raises(ValueError, match="expert_buckets: expected positive row counts"):
        load_stages("/nonexistent", num_views=1, expert_buckets=(0,))
    with pytest.raises(ValueError, match="expert_sms: expected an integer in"):
        load_stages("/nonexistent", num_views=1, expert_sms=-8)
    with pytest.raises(ValueError, match=r"expert_sms: expected 0 on a CPU \(an SM partition needs a CUDA device\)"):
        load_stages("/nonexistent", num_views=1, device="cpu", expert_sms=32)
    cfg, weights, _ = _case("tiny")
    for sms, why in ((32, "needs a CUDA device"), (0.5, "expected a positive SM count")):
        with pytest.raises(ValueError, match=why):
            StageEngine(weights, cfg, SHAPES, expert_buckets=(1,), prefix_buckets=(1,), kernels=TorchKernels(),
                        device=torch.device("cpu"), dtype=torch.float32, expert_sms=sms)  # fmt: skip
    model = build_pi0(*_random("tiny"), backend="folded")
    with pytest.raises(ValueError, match="model: expected a model built by vla_rt.inference.load_stages"):
        model.stages  # noqa: B018


def test_admit_and_step_refuse_what_does_not_fit() -> None:
    cfg, weights, x = _case("tiny")
    engine = _engine(cfg, weights)
    with pytest.raises(RuntimeError, match="no row in flight"):
        engine.step()
    with pytest.raises(ValueError, match=r"admit: expected 1..2 rows"):
        engine.admit([0, 1, 2], _rows(x, [0, 1, 2]))
    bad = _row(x, 0)
    bad.noise = bad.noise[:, :2]
    with pytest.raises(ValueError, match=r"noise: expected shape \(1, 5, 32\), found \(1, 2, 32\)"):
        engine.admit([0], bad)


def _random(spec: str):
    from vla_rt.checkpoints import load_checkpoint

    ckpt = load_checkpoint(f"random:{spec}")
    return ckpt.weights, ckpt.config


def test_per_row_steps_on_the_triton_kernels_in_the_interpreter() -> None:
    """π0.5's per-row modulation and π0's per-row time bias through the Triton kernels' contracts (the
    interpreter; bf16 on the GPU is tests/test_gpu_stages.py). π0.5: the path with the most per-row parts."""
    if torch.cuda.is_available():
        pytest.skip("covered in bf16 on the GPU by tests/test_gpu_stages.py")
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vla_rt.engine.kernels import triton_kernels

    cfg, weights, x = _case("tiny_pi05")
    engine = StageEngine(weights, cfg, SHAPES, expert_buckets=(1, 2, 4), prefix_buckets=(1, 2), num_steps=2,
                         kernels=triton_kernels(), device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    out, mixes = _serve(engine, x, seed=0)
    assert any(len(set(m)) > 1 for m in mixes)
    alone = build_pi0(weights, cfg, backend="folded", num_views=VIEWS, chunk=CHUNK, prompt_len=PROMPT)
    for i in range(ROWS):
        r = _row(x, i)
        ref = alone.sample_actions(r.images, r.state, r.tokens, r.noise, 2, image_masks=r.image_masks,
                                   token_mask=r.token_mask)[0]  # fmt: skip
        assert rel_err(out[i], ref) <= 1e-5, (i, rel_err(out[i], ref))


def test_an_expert_step_without_per_row_steps_serves_one_row_and_the_per_op_step_the_rest(monkeypatch) -> None:
    """A candidate that reads one time-bias row for all rows (the persistent kernel today) is kept where the stage
    has one row; larger buckets take the per-op step, and the plan says why."""
    import vla_rt.engine.expert_step as es

    class OneRow:
        name = "one-row"

        def __init__(self, inner):
            self.inner = inner

        def run(self, slot, xa, step, num_steps, time_bias=None):
            assert time_bias is None or time_bias.numel() == time_bias.shape[-1], "given rows at several steps"
            self.inner.run(slot, xa, step, num_steps, time_bias)

    def build(kernels, weights, cfg, dims, workspace, *, device, sm_count):
        return OneRow(es.PerOpExpertStep(kernels, weights, cfg, dims, workspace))

    monkeypatch.setattr(es, "CANDIDATES", (build,))
    cfg, weights, x = _case("tiny")
    engine = _engine(cfg, weights)
    assert engine.plans[1].expert.name == "one-row" and engine.plans[4].expert.name == "per-op"
    assert "one-row: one time-bias row for all rows" in engine.plans[4].expert_why
    out, _ = _serve(engine, x, seed=0)  # (OneRow would fail the run if it got rows at several steps)
    assert sorted(out) == list(range(ROWS))


def test_a_prefix_beside_the_expert_steps_gives_the_same_actions() -> None:
    """begin_admit / join (the prefix on its own stream, joined stages later) against admit: the same actions (not
    bit for bit: the rows meet in other mixes, so the expert GEMMs run at other row counts)."""
    cfg, weights, x = _case("tiny")
    plain, _ = _serve(_engine(cfg, weights), x, seed=5)
    engine = _engine(cfg, weights)
    overlapped, mixes = _serve(engine, x, seed=5, overlap=True)
    assert any(len(set(m)) > 1 for m in mixes), mixes
    assert max(rel_err(overlapped[i], plain[i]) for i in range(ROWS)) <= 1e-5
    assert engine.in_flight == engine.joining == 0 and engine.free == engine.capacity


def test_one_prefix_stage_at_a_time_and_its_rows_hold_their_pool_rows() -> None:
    cfg, weights, x = _case("tiny")
    engine = _engine(cfg, weights)
    engine.admit([0], _rows(x, [0]))
    engine.begin_admit([1, 2], _rows(x, [1, 2]))
    assert (engine.in_flight, engine.joining, engine.free) == (1, 2, 1) and engine.prefix_ready()
    with pytest.raises(RuntimeError, match="prefix stage of 2 rows has not joined"):
        engine.begin_admit([3], _rows(x, [3]))
    with pytest.raises(RuntimeError, match="has not joined"):
        engine.admit([3], _rows(x, [3]))
    assert engine.step() == [] and engine.row_steps() == [(0, 1)]  # the joining rows are not stepped
    assert engine.join() == [1, 2] and engine.row_steps() == [(0, 1), (1, 0), (2, 0)]
    with pytest.raises(RuntimeError, match="no prefix stage to join"):
        engine.join()
    engine.begin_admit([3], _rows(x, [3]))
    assert engine.cancel_admit() == [3] and engine.joining == 0 and engine.in_flight == 3  # only its own rows
    engine.begin_admit([3], _rows(x, [3]))
    assert sorted(engine.drop_all()) == [0, 1, 2, 3] and engine.free == engine.capacity and not engine.prefix_ready()


def test_stage_timing_is_none_on_a_cpu_and_changes_nothing() -> None:
    """`time_stages` (the cost model's CUDA events around each stage's kernels) has no events on a CPU: the GPU time
    is None rather than a made-up number, and the actions are those of an untimed engine."""
    cfg, weights, x = _case("tiny")
    plain, timed = _engine(cfg, weights), _engine(cfg, weights)
    timed.time_stages = True
    outs = []
    for engine in (plain, timed):
        engine.admit([0], _rows(x, [0], pixels=True))
        assert engine.last_stage_gpu_ms() is None
        done = {}
        while engine.rows:
            done.update(engine.step())
            assert engine.last_stage_gpu_ms() is None
        outs.append(done[0])
    assert torch.equal(outs[0], outs[1])


def _count_direct_loads(monkeypatch) -> list[int]:
    """Wraps the stage engine's `load_pinned` (rows copied straight into the prefix graph's inputs) with a counter."""
    calls, load = [0], stages_module.load_pinned

    def counted(*args):
        calls[0] += 1
        return load(*args)

    monkeypatch.setattr(stages_module, "load_pinned", counted)
    return calls


@pytest.mark.parametrize("overlap", [False, True])
def test_host_rows_load_straight_into_the_prefix_inputs_with_the_same_actions(overlap, monkeypatch) -> None:
    """uint8 rows on the host (`input_rows`' buffers, the server's path) are copied into the prefix's own input
    buffers and scaled there; float images take the upload path. Same schedule, bit-identical actions."""
    cfg, weights, x = _case("tiny")
    outs, direct = {}, {}
    for feed in ("input_rows", "floats"):
        calls = _count_direct_loads(monkeypatch)
        outs[feed], _ = _serve(_engine(cfg, weights), x, seed=2, overlap=overlap, feed=feed)
        direct[feed] = calls[0]
    assert direct["input_rows"] > 0 and direct["floats"] == 0, direct
    for i in range(ROWS):
        assert torch.equal(outs["input_rows"][i], outs["floats"][i]), (
            i,
            rel_err(outs["input_rows"][i], outs["floats"][i]),
        )


def test_capture_stage_names_what_it_cannot_capture() -> None:
    cfg, weights, _ = _case("tiny")
    engine = _engine(cfg, weights)
    with pytest.raises(ValueError, match="stage: expected 'prefix' or 'expert', found 'vlm'"):
        engine.capture_stage("vlm", 1)
    with pytest.raises(ValueError, match=r"rows: expected one of the prefix buckets \[1, 2\], found 4"):
        engine.capture_stage("prefix", 4)
    with pytest.raises(RuntimeError, match="need an engine on CUDA, this one runs on cpu"):
        engine.capture_stage("expert", 4)
