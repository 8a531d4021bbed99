"""The worker's stacking of a prefix stage's rows into the engine's reused host buffers (`StageEngine.input_rows`,
`vla_rt.engine.host_inputs`): the same inputs as stacking them fresh, no row left from an earlier stage, and the
ring never handing out the set a stage just filled."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vla_rt.engine.host_inputs import HostInputRing
from vla_rt.inference import load_stages
from vla_rt.policy import PreparedObservation
from vla_rt.serve.worker import StageRunner


def _row(seed: int, *, views: int, size: int, prompt: int, action_dim: int, tokens: bool) -> PreparedObservation:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (1, views, size, size, 3), generator=g, dtype=torch.uint8)
    masks = torch.rand(1, views, generator=g) > 0.3
    ids = torch.randint(1, 100, (1, prompt), generator=g) if tokens else None
    mask = (torch.rand(1, prompt, generator=g) > 0.5) if tokens else None
    return PreparedObservation(images, masks, torch.randn(1, action_dim, generator=g), ids, mask, None)


def test_rows_stacked_into_the_reused_buffers_equal_a_fresh_stack_and_leave_nothing_behind() -> None:
    model = load_stages("random:tiny:4", num_views=2, chunk=4, prompt_len=3, expert_buckets=(1, 4),
                        prefix_buckets=(1, 4), num_steps=2)  # fmt: skip
    engine = model.stages
    runner = StageRunner(engine, prompt_len=3, seed=0)
    shape = dict(views=2, size=runner.size, prompt=3, action_dim=runner.action_dim)
    rows = [_row(i, tokens=i != 1, **shape) for i in range(3)]
    # the third stage reuses the first's set, its prompt-less row where the first had a prompt
    for first in (rows, rows[:2], [rows[1], rows[2], rows[0]]):
        x = runner._stack(first, None)
        assert x.images.shape[0] == len(first) and x.images.dtype == torch.uint8
        assert torch.equal(x.images, torch.cat([r.images for r in first]))
        assert torch.equal(x.state, torch.cat([r.state for r in first]))
        assert torch.equal(x.image_masks, torch.cat([r.image_masks for r in first]))
        for i, r in enumerate(first):  # a row without a prompt is all padding, whatever the set held before
            assert torch.equal(x.tokens[i], torch.zeros(3, dtype=torch.long) if r.tokens is None else r.tokens[0])
            assert torch.equal(
                x.token_mask[i], torch.zeros(3, dtype=torch.bool) if r.tokens is None else r.token_mask[0]
            )
    seeded = StageRunner(engine, prompt_len=3, seed=7)._stack(rows[:2], None).noise
    assert torch.equal(
        seeded, torch.randn(2, runner.chunk, runner.action_dim, generator=torch.Generator().manual_seed(7))
    )
    given = torch.randn(2, runner.chunk, runner.action_dim)
    assert torch.equal(runner._stack(rows[:2], given).noise, given)
    floats = [replace(r, images=r.images.float() / 127.5 - 1) for r in rows[:2]]  # a policy preparing float32 views
    x = runner._stack(floats, None)
    assert x.images.dtype == torch.float32 and torch.equal(x.images, torch.cat([r.images for r in floats]))


def test_the_ring_alternates_its_two_sets_and_refuses_a_stage_larger_than_its_rows() -> None:
    model = load_stages("random:tiny:4", num_views=1, chunk=4, prompt_len=0, expert_buckets=(2,),
                        prefix_buckets=(2,), num_steps=2)  # fmt: skip
    ring = HostInputRing(model.stages.cfg, rows=2, views=1, prompt=0, chunk=4, device=torch.device("cpu"))
    a, b, c = ring.take(2), ring.take(1), ring.take(2)
    assert a.images.data_ptr() != b.images.data_ptr() and a.images.data_ptr() == c.images.data_ptr()
    assert a.tokens.shape == (2, 0) and b.noise.shape == (1, 4, model.stages.cfg.action_dim)
    with pytest.raises(ValueError, match=r"input rows: expected 1\.\.2 .* found 3"):
        ring.take(3)
