"""Pi0Policy: openpi's pre/post-processing around the model, and clear errors for bad observations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_rt import Pi0Policy, load_pi0
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.policy import resize_with_pad


def _policy(**kw) -> Pi0Policy:
    model = load_pi0("random:tiny:2", num_views=2, chunk=6, prompt_len=5)
    return Pi0Policy(model, camera_names=("base", "wrist"), seed=0, **kw)


def _obs(rng: np.random.Generator, h=120, w=160) -> dict:
    return {
        "images": {
            "base": rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
            "wrist": rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
        },
        "state": rng.normal(size=7),
    }


def test_resize_with_pad_keeps_aspect_with_black_bars() -> None:
    img = np.full((100, 200, 3), 200, np.uint8)
    out = resize_with_pad(img, 224)
    assert out.shape == (224, 224, 3)
    assert (out[:56] == 0).all() and (out[-56:] == 0).all()  # 112 rows of picture centred in 224
    assert (out[60:160] == 200).all()
    assert resize_with_pad(np.zeros((224, 224, 3), np.uint8), 224).shape == (224, 224, 3)


def test_infer_returns_cropped_actions_and_timing() -> None:
    policy = _policy(action_dim=7)
    out = policy.infer(_obs(np.random.default_rng(0)))
    assert out["actions"].shape == (6, 7) and out["actions"].dtype == np.float32
    assert np.isfinite(out["actions"]).all()
    assert set(out["timing"]) == {"preprocess_ms", "model_ms", "postprocess_ms", "total_ms"}


def test_policy_equals_model_on_preprocessed_inputs() -> None:
    """The policy is exactly: resize+scale images, pad state, pad tokens with mask, model, crop."""
    policy = _policy(action_dim=7)
    rng = np.random.default_rng(1)
    obs = _obs(rng, 224, 224)
    obs["prompt_tokens"] = np.array([3, 9, 27])
    noise = rng.normal(size=(6, 32)).astype(np.float32)
    out = policy.infer({**obs, "noise": noise})["actions"]
    images = torch.from_numpy(np.stack([obs["images"]["base"], obs["images"]["wrist"]])[None]).float() / 255 * 2 - 1
    state = torch.zeros(1, 32)
    state[0, :7] = torch.from_numpy(obs["state"]).float()
    tokens = torch.tensor([[3, 9, 27, 0, 0]])
    mask = torch.tensor([[True, True, True, False, False]])
    ref = policy.model.sample_actions(images, state, tokens, torch.from_numpy(noise)[None], token_mask=mask)
    np.testing.assert_allclose(out, ref[0, :, :7].numpy(), rtol=1e-6, atol=1e-6)


def test_missing_camera_is_masked_not_zero_filled() -> None:
    """A missing view is excluded from attention: same actions as a model that never had that view."""
    policy = _policy()
    rng = np.random.default_rng(2)
    obs = _obs(rng, 224, 224)
    noise = rng.normal(size=(6, 32)).astype(np.float32)
    one_view = {"images": {"base": obs["images"]["base"]}, "state": obs["state"], "noise": noise}
    out = policy.infer(one_view)["actions"]
    single = load_pi0("random:tiny:2", chunk=6)
    images = torch.from_numpy(obs["images"]["base"][None, None]).float() / 255 * 2 - 1
    state = torch.zeros(1, 32)
    state[0, :7] = torch.from_numpy(obs["state"]).float()
    ref = single.sample_actions(images, state, None, torch.from_numpy(noise)[None])
    np.testing.assert_allclose(out, ref[0].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["zscore", "quantile"])
def test_norm_stats_normalize_state_and_unnormalize_actions(mode: str) -> None:
    rng = np.random.default_rng(3)
    stats = {
        "state": NormStats(
            mean=rng.normal(size=7), std=rng.uniform(0.5, 2, 7), q01=-rng.uniform(1, 2, 7), q99=rng.uniform(1, 2, 7)
        ),
        "actions": NormStats(
            mean=rng.normal(size=7), std=rng.uniform(0.5, 2, 7), q01=-rng.uniform(1, 2, 7), q99=rng.uniform(1, 2, 7)
        ),
    }
    plain, normed = _policy(action_dim=7), _policy(action_dim=7, norm_stats=stats, norm_mode=mode)
    obs = _obs(rng)
    noise = rng.normal(size=(6, 32)).astype(np.float32)
    quant = mode == "quantile"
    normalized_state = stats["state"].normalize(obs["state"], use_quantiles=quant)
    raw = plain.infer({**obs, "state": normalized_state, "noise": noise})["actions"]
    out = normed.infer({**obs, "noise": noise})["actions"]
    expected = stats["actions"].unnormalize(raw, use_quantiles=quant)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out, raw)


@pytest.mark.parametrize(
    ("obs_change", "match"),
    [
        (
            lambda o: o["images"].update(base=o["images"]["base"].astype(np.float32)),
            r"images\['base'\]: expected dtype uint8",
        ),
        (
            lambda o: o["images"].update(base=o["images"]["base"][:, :, 0]),
            r"images\['base'\]: expected shape \(H, W, 3\)",
        ),
        (lambda o: o["images"].update(side=o["images"]["base"]), "unknown"),
        (lambda o: o.update(images={}), "expected at least one"),
        (
            lambda o: o.update(state=np.array([1.0, np.nan, 0.0])),
            r"state: expected finite values, found NaN or inf at index \[1\]",
        ),
        (lambda o: o.update(state=np.zeros(40)), "at most 32 values"),
        (lambda o: o.update(prompt_tokens=np.arange(9)), "at most 5 tokens"),
        (lambda o: o.update(prompt="pick up the pen"), "needs a SentencePiece tokenizer"),
        (lambda o: o.pop("state"), "expected keys 'images' and 'state'"),
    ],
    ids=[
        "float-image",
        "gray-image",
        "unknown-camera",
        "no-camera",
        "nan-state",
        "long-state",
        "long-prompt",
        "text-no-tokenizer",
        "no-state",
    ],
)
def test_bad_observations_raise(obs_change, match: str) -> None:
    policy = _policy()
    obs = _obs(np.random.default_rng(4))
    obs_change(obs)
    with pytest.raises(ValueError, match=match):
        policy.infer(obs)


def test_camera_count_must_match_built_views() -> None:
    model = load_pi0("random:tiny:2", num_views=2)
    with pytest.raises(ValueError, match="camera_names: expected 2 names"):
        Pi0Policy(model, camera_names=("a", "b", "c"))
