"""Property: whatever a robot sends `Pi0Policy.infer`, it ends in valid actions or one InputError naming the field.

Hypothesis builds observations from every part a robot can get wrong: keys (known, unknown, missing), images (None,
arrays of any dtype and rank, extreme sizes, strings, lists), state (numbers, NaN, strings, dicts, nested lists),
prompt tokens and noise. The model is a tiny random π0 (28 px images, one layer) so each example costs milliseconds.

Budget (CI, 2 cores): 150 examples for malformed observations, 50 for valid ones (each runs the model, ~20 ms), derandomized (the same examples every run), no example database;
HYPOTHESIS_PROFILE=explore runs 2000 fresh random ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from property_budget import budget

from vla_rt import Pi0Policy, build_pi0
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import GemmaConfig, Pi0Config, VisionConfig
from vla_rt.errors import InputError, VlaRtError
from vla_rt.model.weights import random_weights

BUDGET = budget(150, suppress=(HealthCheck.too_slow, HealthCheck.data_too_large))

SMALL = Pi0Config(
    vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=14, image_size=28),
    llm=GemmaConfig(width=32, depth=1, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
    expert=GemmaConfig(width=16, depth=1, mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=16),
    vocab_size=64,
    action_dim=8,
    chunk=4,
    max_token_len=6,
)
CAMERAS = ("base", "wrist")


@pytest.fixture(scope="module")
def policy():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one tiny inference per example: threads only add scheduling jitter on a busy machine
    model = build_pi0(random_weights(SMALL, seed=1), SMALL, backend="folded", num_views=2, chunk=4, prompt_len=6)
    rng = np.random.default_rng(0)
    stats = {
        "state": NormStats(mean=rng.normal(size=5), std=rng.uniform(0.5, 2, 5)),
        "actions": NormStats(mean=rng.normal(size=6), std=rng.uniform(0.5, 2, 6)),
    }
    yield Pi0Policy(model, camera_names=CAMERAS, norm_stats=stats, num_steps=1, seed=0)
    torch.set_num_threads(threads)


def _good_image():
    return hnp.arrays(np.uint8, st.tuples(st.integers(1, 64), st.integers(1, 64), st.just(3)))


_bad_images = st.one_of(
    st.none(),
    st.text(max_size=5),
    st.integers(),
    st.lists(st.integers(0, 255), max_size=4),
    hnp.arrays(
        st.sampled_from([np.uint8, np.float32, np.int64, np.bool_, np.float16]),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=8),
    ),
    st.tuples(st.sampled_from([1, 2]), st.sampled_from([5000, 8192, 8193, 9000])).map(
        lambda hw: np.zeros((*hw, 3), np.uint8)
    ),
    st.tuples(st.sampled_from([5000, 9000]), st.sampled_from([1, 2])).map(lambda hw: np.zeros((*hw, 3), np.uint8)),
)
_images = st.one_of(
    st.dictionaries(st.sampled_from(CAMERAS), st.one_of(_good_image(), _bad_images), max_size=2),
    st.dictionaries(st.sampled_from([*CAMERAS, "side", "", "Base"]), _good_image(), max_size=3),
    st.lists(st.one_of(_good_image(), _bad_images), max_size=3),
    _bad_images,
)
_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**6), 10**6))
_state = st.one_of(
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=5),  # valid
    st.lists(_numbers, max_size=12),
    hnp.arrays(
        st.sampled_from([np.float64, np.float32, np.int32, np.bool_, np.complex64]), hnp.array_shapes(max_dims=3)
    ),
    st.text(max_size=8),
    st.dictionaries(st.text(max_size=3), st.floats(), max_size=2),
    st.none(),
    st.lists(st.lists(st.floats(), max_size=3), max_size=3),
    _numbers,
)
_tokens = st.one_of(
    st.lists(st.integers(0, 63), max_size=6),  # valid
    st.lists(st.integers(-5, 10**4), max_size=9),
    st.lists(st.floats(), max_size=3),
    st.lists(st.booleans(), max_size=3),
    st.text(max_size=4),
    hnp.arrays(np.int64, hnp.array_shapes(max_dims=3)),
)
_noise = st.one_of(
    hnp.arrays(np.float32, st.just((4, 8)), elements=st.floats(-3, 3, width=32)),  # valid
    hnp.arrays(st.sampled_from([np.float32, np.float64, np.int64]), hnp.array_shapes(max_dims=3)),
    st.text(max_size=4),
)


@st.composite
def observations(draw):
    obs = {}
    if draw(st.booleans()) or draw(st.booleans()):
        obs["images"] = draw(_images)
    if draw(st.booleans()) or draw(st.booleans()):
        obs["state"] = draw(_state)
    if draw(st.integers(0, 3)) == 0:
        obs["prompt_tokens"] = draw(_tokens)
    if draw(st.integers(0, 5)) == 0:
        obs["prompt"] = draw(st.one_of(st.text(max_size=10), st.integers()))
    if draw(st.integers(0, 3)) == 0:
        obs["noise"] = draw(_noise)
    if draw(st.integers(0, 6)) == 0:
        obs[draw(st.text(min_size=1, max_size=6))] = draw(st.integers())
    return obs


@BUDGET
@given(obs=st.one_of(observations(), st.none(), st.lists(st.integers(), max_size=2), st.text(max_size=5)))
def test_any_observation_gives_actions_or_an_input_error(policy, obs):
    try:
        out = policy.infer(obs)
    except VlaRtError as err:
        assert isinstance(err, InputError), repr(err)
        msg = str(err)
        assert msg.startswith(f"{err.field}: expected ") and ", found " in msg and len(msg) < 600, msg
        return
    actions = out["actions"]
    assert actions.shape == (4, 6) and actions.dtype == np.float32 and np.isfinite(actions).all()


@settings(BUDGET, max_examples=BUDGET.max_examples // 3)
@given(image=_good_image(), state=st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=5))
def test_every_valid_observation_gives_finite_actions(policy, image, state):
    out = policy.infer({"images": {"base": image}, "state": state})
    assert out["actions"].shape == (4, 6) and np.isfinite(out["actions"]).all()
