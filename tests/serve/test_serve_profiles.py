"""Robot profiles against openpi's transforms, computed by hand here from openpi's formulas.

Each test builds the model inputs the way openpi's pipeline does (robot transform, `Normalize`, `ResizeImages` with
openpi-client's own `resize_with_pad`, `TokenizePrompt`, `PadStatesAndActions`), runs the model on them with the
noise the server's worker draws, and undoes it the way openpi does (`Unnormalize` on the padded actions,
`AbsoluteActions`, the robot's output transform), then compares with what the server's path returns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from openpi_client.image_tools import resize_with_pad
from serve_helpers import flat_cost, run_alone

from vla_rt.serve.app import ServeConfig, build_service
from vla_rt.serve.profiles import ALOHA, DROID, GENERIC, LIBERO, ObservationError, get_profile

EPS = 1e-6
DELETE = object()
FLIP = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1], dtype=np.float64)


def _gripper_to_pi(x):  # openpi aloha_policy._gripper_to_angular, written out
    linear = x * (0.05800 - 0.01844) + 0.01844
    angle = np.arcsin(np.clip((0.022**2 + linear**2 - 0.036**2) / (2 * 0.022 * linear), -1, 1))
    return (angle - 0.5476) / (1.6296 - 0.5476)


def _gripper_from_pi(x):  # openpi aloha_policy._gripper_from_angular
    return (x + 0.5476 - -0.6213) / (1.4910 - -0.6213)


def _normalize(x, s, quantile):
    d = x.shape[-1]
    if quantile:
        return (x - s.q01[:d]) / (s.q99[:d] - s.q01[:d] + EPS) * 2.0 - 1.0
    return (x - s.mean[:d]) / (s.std[:d] + EPS)


def _unnormalize(x, s, quantile):
    d, n = x.shape[-1], s.dim
    if quantile:
        return np.concatenate([(x[..., :n] + 1.0) / 2.0 * (s.q99 - s.q01 + EPS) + s.q01, x[..., n:]], axis=-1)
    mean, std = np.pad(s.mean, (0, d - n)), np.pad(s.std, (0, d - n), constant_values=1.0)
    return x * (std + EPS) + mean


def _hwc(image):
    return np.transpose(image, (1, 2, 0)) if image.shape[0] == 3 else image


def _openpi_actions(service, views, state, tokens, noise, finish):
    """openpi's model inputs from (model views, policy-space state, prompt ids) -> actions through `finish`."""
    stats, quantile = service.policy.norm_stats, service.policy._use_quantiles
    model, size, p = service.policy.model, service.policy.model.config.vision.image_size, service.policy.prompt_len
    names = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")[: model.shapes.num_views]
    images = np.stack([resize_with_pad(views[n], size, size) if n in views else np.zeros((size, size, 3), np.uint8)
                       for n in names])  # fmt: skip
    state32 = np.zeros(32)
    state32[: state.shape[0]] = _normalize(state, stats["state"], quantile)
    ids = np.zeros((1, p), np.int64)
    ids[0, : len(tokens)] = tokens
    raw = model.sample_actions(
        torch.from_numpy(images[None]).float() / 255.0 * 2.0 - 1.0, torch.from_numpy(state32[None]).float(),
        torch.from_numpy(ids), noise, image_masks=torch.tensor([[n in views for n in names]]),
        token_mask=torch.arange(p)[None] < len(tokens))[0].numpy()  # fmt: skip
    return finish(_unnormalize(raw.astype(np.float64), stats["actions"], quantile), state)


def _served(service, obs, seed=7):
    """What the server's path computes: profile -> prepare -> the worker's stages -> finish; and the noise it drew."""
    inputs = service.profile.parse(obs, default_prompt=service.options.default_prompt)
    row = service.policy.prepare(inputs.policy_obs, uint8_images=True)
    raw = run_alone(service, row, seed)
    actions = service.profile.finish(service.policy.finish(raw), inputs.state, service.action_dim)
    noise = torch.randn(1, service.serving.chunk, 32, generator=torch.Generator().manual_seed(seed))
    return actions, noise


@pytest.fixture(scope="module")
def services(checkpoints, tokenizer_model):
    """{checkpoint key: RobotService} built lazily (no server, no cost measurement)."""
    built = {}

    def get(key: str, **settings):
        if key not in built:
            profile = key.removesuffix("_quantile")
            cfg = ServeConfig(str(checkpoints[key]), profile=profile, max_batch=2, chunk=6, prompt_len=24,
                              tokenizer=str(tokenizer_model), **settings)  # fmt: skip
            built[key] = build_service(cfg, flat_cost(cfg))
        return built[key]

    return get


def _prompt_ids(tokenizer_model, prompt: str) -> list[int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    cleaned = prompt.strip().replace("_", " ").replace("\n", " ")  # openpi PaligemmaTokenizer (π0 format)
    return sp.encode(cleaned, add_bos=True) + sp.encode("\n")


@pytest.mark.parametrize("key", ["aloha", "aloha_quantile"])
def test_aloha_matches_openpi(services, tokenizer_model, key) -> None:
    service = services(key)
    rng = np.random.default_rng(0)
    obs = ALOHA.example(rng, prompt="  fold_the towel\n")
    del obs["images"]["cam_right_wrist"]  # a missing camera is a zero view with mask False
    state = FLIP * obs["state"]
    state[[6, 13]] = _gripper_to_pi(state[[6, 13]])
    views = {"base_0_rgb": _hwc(obs["images"]["cam_high"]), "left_wrist_0_rgb": _hwc(obs["images"]["cam_left_wrist"])}

    def finish(actions, state):
        actions[:, :14] += np.where([True] * 6 + [False] + [True] * 6 + [False], state, 0.0)  # AbsoluteActions
        out = FLIP * actions[:, :14]
        out[:, [6, 13]] = _gripper_from_pi(out[:, [6, 13]])
        return out

    served, noise = _served(service, obs)
    expected = _openpi_actions(service, views, state, _prompt_ids(tokenizer_model, obs["prompt"]), noise, finish)
    assert served.shape == (6, 14) and served.dtype == np.float32
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", ["droid", "droid_quantile"])
def test_droid_matches_openpi(services, tokenizer_model, key) -> None:
    service = services(key)
    rng = np.random.default_rng(1)
    obs = DROID.example(rng, size=100)
    obs["observation/gripper_position"] = np.float64(0.3)  # openpi accepts a scalar gripper
    obs["observation/wrist_image_left"] = rng.uniform(0, 1, (3, 80, 120)).astype(np.float32)  # LeRobot's float CHW
    wrist = (255 * _hwc(obs["observation/wrist_image_left"])).astype(np.uint8)
    views = {"base_0_rgb": obs["observation/exterior_image_1_left"], "left_wrist_0_rgb": wrist}
    state = np.concatenate([obs["observation/joint_position"], [0.3]])
    served, noise = _served(service, obs)
    expected = _openpi_actions(service, views, state, _prompt_ids(tokenizer_model, obs["prompt"]), noise,
                               lambda a, s: a[:, :8])  # fmt: skip
    assert served.shape == (6, 8)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)


def test_libero_matches_openpi_with_token_ids(services) -> None:
    service = services("libero")
    rng = np.random.default_rng(2)
    ids = np.array([2, 9, 4, 17, 3, 0, 0, 0])
    obs = LIBERO.example(rng, prompt=ids)
    obs["tokenized_prompt_mask"] = ids > 0  # openpi's padded layout: the valid ids, then a False mask
    views = {"base_0_rgb": obs["observation/image"], "left_wrist_0_rgb": obs["observation/wrist_image"]}

    def finish(actions, state):  # pi0_libero: extra delta transform on the 6 joints, gripper absolute
        actions[:, :7] += np.where([True] * 6 + [False], state[:7], 0.0)
        return actions[:, :7]

    served, noise = _served(service, obs)
    expected = _openpi_actions(service, views, obs["observation/state"], ids[:5], noise, finish)
    assert served.shape == (6, 7)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)


def test_generic_matches_the_policy_contract(services, tokenizer_model) -> None:
    service = services("generic")
    rng = np.random.default_rng(3)
    obs = get_profile("generic", 3).example(rng, size=64, prompt="wipe the table")
    obs["state"] = obs["state"][:6]
    del obs["images"]["right_wrist_0_rgb"]
    views = dict(obs["images"])
    served, noise = _served(service, obs)
    expected = _openpi_actions(service, views, obs["state"], _prompt_ids(tokenizer_model, "wipe the table"), noise,
                               lambda a, s: a[:, :6])  # fmt: skip
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)


def test_a_broken_transform_is_caught(services, tokenizer_model) -> None:
    """The comparison can fail: openpi's Aloha output without the gripper conversion differs."""
    service = services("aloha")
    obs = ALOHA.example(np.random.default_rng(4))
    state = FLIP * obs["state"]
    state[[6, 13]] = _gripper_to_pi(state[[6, 13]])
    views = {"base_0_rgb": _hwc(obs["images"]["cam_high"]), "left_wrist_0_rgb": _hwc(obs["images"]["cam_left_wrist"]),
             "right_wrist_0_rgb": _hwc(obs["images"]["cam_right_wrist"])}  # fmt: skip

    def finish_without_gripper(actions, state):
        actions[:, :14] += np.where([True] * 6 + [False] + [True] * 6 + [False], state, 0.0)
        return FLIP * actions[:, :14]

    served, noise = _served(service, obs)
    wrong = _openpi_actions(service, views, state, _prompt_ids(tokenizer_model, obs["prompt"]), noise,
                            finish_without_gripper)  # fmt: skip
    assert not np.allclose(served, wrong, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.delete(served, [6, 13], axis=1), np.delete(wrong, [6, 13], axis=1), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_text_prompt_is_tokenized_like_openpi(services, tokenizer_model) -> None:
    policy = services("generic").policy
    ids = _prompt_ids(tokenizer_model, " open_the\ndrawer ")
    tokens = policy.tokenizer(" open_the\ndrawer ")
    assert tokens.tolist() == ids and ids[0] == 1 and ids[-1] == 3  # BOS first, the "\n" symbol last
    row = policy.prepare({"images": {"base_0_rgb": np.zeros((8, 8, 3), np.uint8)}, "state": np.zeros(2),
                          "prompt": " open_the\ndrawer "})  # fmt: skip
    assert row.tokens[0, : len(ids)].tolist() == ids and row.token_mask[0].tolist() == [True] * len(ids) + [
        False] * (24 - len(ids))  # fmt: skip


@pytest.mark.parametrize(
    "profile, change, message",
    [
        (
            ALOHA,
            {"extra": 1},
            "observation: expected keys from ['images', 'state', 'prompt', 'tokenized_prompt', "
            "'tokenized_prompt_mask'] (aloha profile), found unknown ['extra']",
        ),
        (ALOHA, {"state": None}, "state: expected a numeric vector of 14 values, found NoneType"),
        (ALOHA, {"state": np.zeros(13)}, "state: expected shape (14,), found shape (13,)"),
        (
            ALOHA,
            {"state": np.array([np.nan] + [0.0] * 13)},
            "state: expected finite values, found NaN or inf at index [0]",
        ),
        (ALOHA, {"state": np.zeros(14, np.bool_)}, "state: expected a numeric vector of 14 values, found bool array"),
        (
            ALOHA,
            {"images": {"cam_low": np.zeros((3, 8, 8), np.uint8)}},
            "images: expected cameras ['cam_high'] (aloha profile), found missing ['cam_high']",
        ),
        (
            ALOHA,
            {"images": {"cam_high": np.zeros((8, 8, 3), np.uint8)}},
            "images['cam_high']: expected shape (3, H, W), found shape (8, 8, 3)",
        ),
        (
            ALOHA,
            {"images": {"cam_high": np.zeros((3, 8, 8), np.int16)}},
            "images['cam_high']: expected an RGB image array of uint8 (or float in [0, 1]), found int16",
        ),
        (
            ALOHA,
            {"images": {"cam_high": np.full((3, 8, 8), 2.0)}},
            "images['cam_high']: expected float values in [0, 1] (or uint8), found range [2, 2]",
        ),
        (
            ALOHA,
            {"images": {"cam_high": np.zeros((3, 8, 8), np.uint8), "cam_top": 1}},
            "images: expected camera names from",
        ),
        (ALOHA, {"images": [1, 2]}, "images: expected a map of camera name -> image, found list"),
        (ALOHA, {"prompt": DELETE}, "prompt: expected a 'prompt' string or 'tokenized_prompt' ids"),
        (ALOHA, {"prompt": 5}, "prompt: expected a string, found int"),
        (ALOHA, {"prompt": b"\xff"}, "prompt: expected UTF-8 text, found bytes that are not UTF-8"),
        (
            ALOHA,
            {"tokenized_prompt": np.array([1, 2])},
            "prompt: expected either 'prompt' (text) or 'tokenized_prompt' (ids), found both",
        ),
        (
            DROID,
            {"observation/joint_position": np.zeros(6)},
            "observation/joint_position: expected shape (7,), found shape (6,)",
        ),
        (
            DROID,
            {"observation/wrist_image_left": np.zeros((8, 8), np.uint8)},
            "observation/wrist_image_left: expected shape (H, W, 3) or (3, H, W)",
        ),
        (DROID, {"observation/exterior_image_1_left": None}, "expected an RGB image array"),
        (LIBERO, {"observation/state": np.zeros((2, 4))}, "observation/state: expected shape (8,), found shape (2, 4)"),
        (GENERIC, {"images": {"left_wrist_0_rgb": np.zeros((3, 8, 8), np.uint8)}}, "expected shape (H, W, 3)"),
    ],
)
def test_bad_observations_name_the_key(profile, change, message) -> None:
    obs = {**profile.example(np.random.default_rng(0), size=8), **change}
    obs = {k: v for k, v in obs.items() if v is not DELETE}
    with pytest.raises(ObservationError) as err:
        profile.parse(obs)
    assert message in str(err.value)


def test_token_ids_are_checked() -> None:
    obs = LIBERO.example(np.random.default_rng(0), size=8, prompt=[1, 2, 3])
    with pytest.raises(ObservationError, match=r"tokenized_prompt: expected a 1-D array of integer token ids, found "
                                               r"float64 array of shape \(3,\)"):  # fmt: skip
        LIBERO.parse({**obs, "tokenized_prompt": np.array([1.0, 2.0, 3.0])})
    with pytest.raises(ObservationError, match=r"tokenized_prompt_mask: expected a bool array of shape \(3,\)"):
        LIBERO.parse({**obs, "tokenized_prompt_mask": np.array([True, False])})
    with pytest.raises(ObservationError, match="tokenized_prompt: expected at least one valid token id, found none"):
        LIBERO.parse({**obs, "tokenized_prompt_mask": np.zeros(3, bool)})
    assert LIBERO.parse({**obs, "tokenized_prompt": [4, 5]}).policy_obs["prompt_tokens"].tolist() == [4, 5]


def test_default_prompt_is_injected_only_when_none_is_sent() -> None:
    obs = ALOHA.example(np.random.default_rng(0), size=8, prompt=None)
    assert ALOHA.parse(obs, default_prompt="fold the towel").policy_obs["prompt"] == "fold the towel"
    assert ALOHA.parse({**obs, "prompt": "open"}, default_prompt="fold the towel").policy_obs["prompt"] == "open"
    assert "prompt" not in GENERIC.parse(GENERIC.example(np.random.default_rng(0), size=8, prompt=None)).policy_obs


def test_served_actions_match_the_eager_reference_model(checkpoints) -> None:
    """The stages (folded kernels) against the spec in code: the same row through `load_pi0(backend="reference")`."""
    from vla_rt.inference import load_pi0
    from vla_rt.inputs import images_to_model_range

    obs = DROID.example(np.random.default_rng(6), prompt=[3, 1, 4, 1, 5])
    cfg = ServeConfig(str(checkpoints["droid"]), profile="droid", max_batch=2, prompt_len=8)
    service = build_service(cfg, flat_cost(cfg))
    served, noise = _served(service, obs)
    inputs = service.profile.parse(obs)
    row = service.policy.prepare(inputs.policy_obs, uint8_images=True)
    reference = load_pi0(str(checkpoints["droid"]), num_views=2, chunk=10, prompt_len=8)
    raw = reference.sample_actions(images_to_model_range(row.images), row.state, row.tokens, noise,
                                   image_masks=row.image_masks, token_mask=row.token_mask)[0].numpy()  # fmt: skip
    expected = service.profile.finish(service.policy.finish(raw), inputs.state, service.action_dim)
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-4)


def test_pi05_checkpoints_get_openpi_pi05_configs() -> None:
    assert get_profile("libero").for_model(pi05=True).delta_mask is None  # pi05_libero: no extra delta transform
    assert get_profile("libero").for_model(pi05=False).delta_mask == (True,) * 6 + (False,)
    assert (get_profile("droid").for_model(True).chunk, get_profile("droid").for_model(False).chunk) == (15, 10)
    assert get_profile("aloha").for_model(True) == get_profile("aloha")  # pi05_aloha: the same transforms
