"""`Pi0Policy` at its edges (issue 22): arguments and norm stats are checked when the policy is made, observations
at every `infer`; each mistake is one error type naming the field, and nothing reaches numpy / PIL / torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vla_rt import Pi0Policy, load_pi0
from vla_rt.checkpoints import save_native
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import preset
from vla_rt.errors import ArgumentError, CheckpointError, InputError, NormStatsError
from vla_rt.model.weights import random_weights

CAMERAS = ("base", "wrist")


@pytest.fixture(scope="module")
def model():
    return load_pi0("random:tiny:2", num_views=2, chunk=4, prompt_len=5)


def _stats(dim: int = 7, quantiles: bool = True, **changes) -> NormStats:
    rng = np.random.default_rng(dim)
    fields = {"mean": rng.normal(size=dim), "std": rng.uniform(0.5, 2, dim)}
    if quantiles:
        fields |= {"q01": -rng.uniform(1, 2, dim), "q99": rng.uniform(1, 2, dim)}
    return NormStats(**(fields | changes))


def _obs(h: int = 48, w: int = 64) -> dict:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return {"images": {"base": image, "wrist": image}, "state": rng.normal(size=7)}


# ----- arguments and norm stats: at construction --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field", "expected"),
    [
        ({"action_dim": 0}, "action_dim", "an integer in [1, 32] (the model's action width)"),
        ({"action_dim": -1}, "action_dim", "an integer in [1, 32]"),
        ({"action_dim": 33}, "action_dim", "an integer in [1, 32]"),
        ({"action_dim": 7.0}, "action_dim", "an integer"),
        ({"action_dim": True}, "action_dim", "an integer"),
        ({"num_steps": 0}, "num_steps", "an integer in [1, 1000]"),
        ({"num_steps": 2.5}, "num_steps", "an integer"),
        ({"seed": 1.5}, "seed", "an integer in [0, 9223372036854775807]"),
        ({"seed": "3"}, "seed", "an integer"),
        ({"seed": -1}, "seed", "an integer in [0,"),
        ({"seed": True}, "seed", "an integer"),
        ({"norm_mode": "minmax"}, "norm_mode", "'zscore' or 'quantile'"),
        ({"camera_names": "base"}, "camera_names", "a list of camera names"),  # would be 4 cameras 'b','a','s','e'
        ({"camera_names": ("base", "base")}, "camera_names", "distinct non-empty strings"),
        ({"camera_names": ("base", "")}, "camera_names", "distinct non-empty strings"),
        ({"camera_names": ("a", "b", "c")}, "camera_names", "2 names (the model's views)"),
        ({"prompt_len": -1}, "prompt_len", "an integer in [0, 2048]"),
        ({"prompt_len": 6}, "prompt_len", "None or 5 (the model was built for it)"),
        ({"tokenizer": "/no/such/file.model"}, "tokenizer", "the path of a SentencePiece .model file"),
    ],
)
def test_bad_policy_arguments(model, kwargs, field, expected):
    with pytest.raises(ArgumentError) as info:
        Pi0Policy(model, **{"camera_names": CAMERAS, **kwargs})
    assert info.value.field == field and expected in str(info.value), str(info.value)


def test_prompt_len_the_model_cannot_take_is_refused_at_construction():
    """The bug: the policy padded prompts to its own prompt_len and every infer with a prompt then failed inside the
    model with the padded length as the prompt's ('tokens: expected at most 0 tokens, found 48 tokens')."""
    with pytest.raises(ArgumentError, match=r"prompt_len: expected at most 48 \(the model's max_token_len"):
        Pi0Policy(load_pi0("random:tiny:2"), prompt_len=49)
    no_prompt = Pi0Policy(load_pi0("random:tiny:2", backend="folded", num_views=1, chunk=4, prompt_len=0))
    obs = {"images": [np.zeros((8, 8, 3), np.uint8)], "state": [0.0], "prompt_tokens": [1, 2, 3]}
    with pytest.raises(InputError, match=r"prompt_tokens: expected at most 0 tokens, found 3"):
        no_prompt.infer(obs)
    del obs["prompt_tokens"]
    assert no_prompt.prompt_len == 0 and no_prompt.infer(obs)["actions"].shape == (4, 32)


def test_model_must_be_a_built_model():
    with pytest.raises(ArgumentError, match="^model: expected a Pi0Inference"):
        Pi0Policy("random:tiny")  # type: ignore[arg-type]


def test_non_float_dtype_is_refused_not_constant_actions():
    """The bug: dtype=torch.int32 built an integer model whose actions were constant."""
    with pytest.raises(ArgumentError, match="^dtype: expected a floating-point dtype"):
        Pi0Policy.from_pretrained("random:tiny", dtype=torch.int32, device="cpu")


@pytest.mark.parametrize(
    ("stats", "field", "expected"),
    [
        ({"state": "S"}, "norm_stats", "entries ['state', 'actions']"),
        ({"state": "S", "actions": "A40"}, "norm_stats['actions']", "at most 32 dims (the model's width)"),
        ({"state": "S40", "actions": "A"}, "norm_stats['state']", "at most 32 dims"),
        ({"actions": "A"}, "norm_stats", "(no ['state'])"),
        ([1, 2], "norm_stats", "a dict {key: NormStats}"),
        ({"state": "S", "actions": 3.0}, "norm_stats", "a dict {key: NormStats}"),
    ],
    ids=["no-actions", "wide-actions", "wide-state", "no-state", "a-list", "not-normstats"],
)
def test_bad_norm_stats_are_refused_at_load_not_at_infer(model, stats, field, expected):
    named = {"S": _stats(7), "A": _stats(7), "S40": _stats(40), "A40": _stats(40)}
    if isinstance(stats, dict):
        stats = {k: named.get(v, v) if isinstance(v, str) else v for k, v in stats.items()}
    with pytest.raises(NormStatsError) as info:
        Pi0Policy(model, camera_names=CAMERAS, norm_stats=stats)
    assert f"{field}: expected " in str(info.value) and expected in str(info.value), str(info.value)


def test_quantile_mode_without_quantiles_is_refused_at_load(model):
    stats = {"state": _stats(7, quantiles=False), "actions": _stats(7, quantiles=False)}
    with pytest.raises(NormStatsError, match=r"norm_stats\['state'\]: expected q01 and q99 \(norm_mode='quantile'\)"):
        Pi0Policy(model, camera_names=CAMERAS, norm_stats=stats, norm_mode="quantile")


def test_actions_are_cropped_to_the_stats_width_and_no_wider(model):
    stats = {"state": _stats(7), "actions": _stats(6)}
    policy = Pi0Policy(model, camera_names=CAMERAS, norm_stats=stats, seed=0)
    assert policy.infer(_obs())["actions"].shape == (4, 6)  # not 32 columns, 26 of them in normalised units
    with pytest.raises(ArgumentError, match=r"^action_dim: expected an integer in \[1, 6\] \(the actions norm stats"):
        Pi0Policy(model, camera_names=CAMERAS, norm_stats=stats, action_dim=7)


def test_state_wider_than_its_stats_names_the_stats(model):
    policy = Pi0Policy(model, camera_names=CAMERAS, norm_stats={"state": _stats(5), "actions": _stats(7)})
    with pytest.raises(InputError, match=r"^state: expected a 1-D vector of at most 5 values .*norm stats' width"):
        policy.infer(_obs())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("stat", ["mean", "std", "q01", "q99"])
def test_non_finite_norm_stats_are_blamed_on_the_stats(tmp_path, bad, stat):
    """The bug: NaN in the stats surfaced as 'state: expected finite values' at the first inference."""
    with pytest.raises(NormStatsError, match=f"^{stat}: expected finite values, found {bad} at index \\[2\\]"):
        _stats(4, **{stat: np.where(np.arange(4) == 2, bad, 0.5)})
    entry = _stats(4).to_json()
    entry[stat] = [0.5, 0.5, bad, 0.5]
    file = tmp_path / "norm_stats.json"
    file.write_text(json.dumps({"norm_stats": {"state": entry, "actions": _stats(4).to_json()}}))  # NaN is legal here
    with pytest.raises(NormStatsError) as info:
        Pi0Policy(load_pi0("random:tiny:2", num_views=2), camera_names=CAMERAS, norm_stats=str(file))
    assert str(info.value).startswith(f"{file}: norm_stats['state'].{stat}: expected finite values"), str(info.value)


def test_inconsistent_norm_stats_values(tmp_path):
    with pytest.raises(NormStatsError, match=r"^std: expected values >= 0, found negative at index \[1\]"):
        NormStats(mean=[0.0, 0.0], std=[1.0, -1.0])
    with pytest.raises(NormStatsError, match=r"^q01/q99: expected q01 <= q99 in every dim, found q01 > q99 at index"):
        NormStats(mean=[0.0], std=[1.0], q01=[2.0], q99=[1.0])
    with pytest.raises(NormStatsError, match=r"^mean: expected a non-empty 1-D vector, found shape \(0,\)"):
        NormStats(mean=[], std=[])


def test_bad_norm_stats_in_a_native_header_name_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    from vla_rt.checkpoints import load_checkpoint
    from vla_rt.checkpoints.files import check_safetensors

    cfg = preset("tiny")
    stats = {"state": _stats(4), "actions": _stats(4)}
    path = save_native(tmp_path / "m.safetensors", random_weights(cfg), cfg, source="t", norm_stats=stats)
    metadata = check_safetensors(path)["__metadata__"]
    header = json.loads(metadata["vla_rt"])
    header["norm_stats"]["norm_stats"]["actions"]["std"][1] = "wide"
    save_file(load_file(path), str(path), metadata={**metadata, "vla_rt": json.dumps(header)})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    msg = str(info.value)
    assert info.value.path == str(path) and "norm_stats['actions'].std: expected a 1-D vector of numbers" in msg, msg


# ----- observations: at every infer ---------------------------------------------------------------------------------
def _set(path: str, value):
    def change(obs: dict) -> dict:
        if path == "obs":
            return value
        if path.startswith("images."):
            obs["images"][path.split(".", 1)[1]] = value
        else:
            obs[path] = value
        return obs

    return change


BAD_OBS = [
    ("obs-none", _set("obs", None), "obs", "a dict with keys 'images' and 'state'"),
    ("obs-list", _set("obs", [1, 2]), "obs", "a dict"),
    ("obs-str", _set("obs", "images"), "obs", "a dict"),
    ("unknown-key", _set("observation/state", [0.0]), "obs", "keys from ['images', 'state', 'prompt'"),
    ("no-images", lambda o: {"state": o["state"]}, "obs", "keys 'images' and 'state'"),
    ("prompt-and-tokens", lambda o: o | {"prompt": "x", "prompt_tokens": [1]}, "obs", "one of 'prompt' and"),
    ("images-none", _set("images", None), "images", "a dict {camera name"),
    ("images-array", _set("images", np.zeros((48, 64, 3), np.uint8)), "images", "a dict {camera name"),
    ("images-str", _set("images", "base"), "images", "a dict"),
    ("extra-camera", _set("images.side", np.zeros((8, 8, 3), np.uint8)), "images", "camera names from"),
    ("extra-in-list", _set("images", [np.zeros((8, 8, 3), np.uint8)] * 3), "images", "at most 2 images"),
    ("no-camera", _set("images", {}), "images", "at least one of"),
    ("image-float", _set("images.base", np.zeros((8, 8, 3), np.float32)), "images['base']", "dtype uint8"),
    ("image-gray", _set("images.base", np.zeros((8, 8), np.uint8)), "images['base']", "shape (H, W, 3)"),
    ("image-rgba", _set("images.base", np.zeros((8, 8, 4), np.uint8)), "images['base']", "shape (H, W, 3)"),
    ("image-empty", _set("images.base", np.zeros((0, 8, 3), np.uint8)), "images['base']", "shape (H, W, 3)"),
    ("image-huge", _set("images.base", np.zeros((2, 9000, 3), np.uint8)), "images['base']", "at most 8192 pixels"),
    ("image-str", _set("images.base", "picture.png"), "images['base']", "dtype uint8"),
    ("image-ragged", _set("images.base", [[1, 2], [3]]), "images['base']", "a uint8 (H, W, 3) array"),
    ("state-none", _set("state", None), "state", "a 1-D vector of at most 32 values"),
    ("state-str", _set("state", "0.1 0.2"), "state", "a 1-D vector"),
    ("state-dict", _set("state", {"x": 1.0}), "state", "a 1-D vector"),
    ("state-empty", _set("state", []), "state", "at least one"),
    ("state-scalar", _set("state", 0.5), "state", "a 1-D vector"),
    ("state-2d", _set("state", np.zeros((2, 3))), "state", "a 1-D vector"),
    ("state-bool", _set("state", [True, False]), "state", "a 1-D vector"),
    ("state-complex", _set("state", np.ones(3, complex)), "state", "a 1-D vector"),
    ("state-object", _set("state", [1.0, "a"]), "state", "a 1-D vector"),
    ("state-ragged", _set("state", [[1.0], [1.0, 2.0]]), "state", "a 1-D vector"),
    ("state-long", _set("state", np.zeros(33)), "state", "at most 32 values"),
    ("state-nan", _set("state", [0.0, float("nan")]), "state", "finite values"),
    ("state-huge", _set("state", [0.0, 1e300]), "state", "within float32's range (±3.4e38) after normalisation"),
    ("prompt-int", _set("prompt", 5), "prompt", "a str"),
    ("prompt-text", _set("prompt", "pick up the pen"), "prompt", "needs a SentencePiece tokenizer"),
    ("tokens-float", _set("prompt_tokens", [1.5, 2.0]), "prompt_tokens", "integer token ids"),
    ("tokens-bool", _set("prompt_tokens", [True]), "prompt_tokens", "integer token ids"),
    ("tokens-2d", _set("prompt_tokens", [[1, 2]]), "prompt_tokens", "a 1-D array"),
    ("tokens-long", _set("prompt_tokens", list(range(6))), "prompt_tokens", "at most 5 tokens"),
    ("tokens-vocab", _set("prompt_tokens", [5000]), "prompt_tokens", "ids in [0, 1024)"),
    ("tokens-negative", _set("prompt_tokens", [-1]), "prompt_tokens", "ids in [0, 1024)"),
    ("noise-shape", _set("noise", np.zeros((3, 32))), "noise", "shape (4, 32)"),
    ("noise-nan", _set("noise", np.full((4, 32), np.nan)), "noise", "a finite float array"),
    ("noise-int", _set("noise", np.zeros((4, 32), np.int64)), "noise", "a finite float array"),
    ("noise-str", _set("noise", "gauss"), "noise", "a finite float array"),
]


@pytest.mark.parametrize(("case", "change", "field", "expected"), BAD_OBS, ids=[c[0] for c in BAD_OBS])
def test_bad_observations_are_input_errors_naming_the_field(model, case, change, field, expected):
    policy = Pi0Policy(model, camera_names=CAMERAS, seed=0)
    obs = change(_obs())
    with pytest.raises(InputError) as info:
        policy.infer(obs)
    msg = str(info.value)
    assert info.value.field == field and msg.startswith(f"{field}: expected ") and expected in msg, msg
    assert len(msg) < 600, msg  # a found value is summarised, never dumped


@pytest.mark.parametrize("shape", [(10, 5000, 3), (1, 5000, 3), (5000, 1, 3), (8192, 2, 3)])
def test_extreme_aspect_images_give_actions(model, shape):
    """The bug: a 5000-pixel-wide image resized to zero rows and PIL raised."""
    policy = Pi0Policy(model, camera_names=CAMERAS, seed=0)
    obs = _obs()
    obs["images"]["base"] = np.full(shape, 255, np.uint8)
    out = policy.infer(obs)["actions"]
    assert out.shape == (4, 32) and np.isfinite(out).all()


def test_a_list_of_images_in_camera_order_still_works(model):
    policy = Pi0Policy(model, camera_names=CAMERAS, seed=0)
    obs = _obs()
    noise = np.random.default_rng(1).normal(size=(4, 32)).astype(np.float32)
    by_name = policy.infer({**obs, "noise": noise})["actions"]
    by_list = policy.infer({**obs, "images": [obs["images"]["base"], obs["images"]["wrist"]], "noise": noise})
    np.testing.assert_array_equal(by_name, by_list["actions"])


# ----- prompts: never cut -------------------------------------------------------------------------------------------
class _CharTokenizer:
    """A stand-in for SentencePiece (one id per character): the policy's prompt logic without the package."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([1] if add_bos else []) + [4 + ord(c) % 100 for c in text]


def test_a_pi05_prompt_longer_than_prompt_len_is_refused_not_cut():
    """The bug: the text was cut to prompt_len with a log line, dropping the state from the prompt, so a new state
    gave the same actions as the old one."""
    from types import SimpleNamespace

    from vla_rt import build_pi0

    cfg = preset("tiny_pi05").replace(chunk=4)
    policy = Pi0Policy(build_pi0(random_weights(cfg, seed=1), cfg, prompt_len=40), camera_names=["base"], seed=0)
    policy.tokenizer = SimpleNamespace(sp=_CharTokenizer())
    obs = {"images": {"base": np.zeros((8, 8, 3), np.uint8)}, "state": np.zeros(3), "prompt": "pick up the pen"}
    with pytest.raises(InputError) as info:
        policy.infer(obs)
    msg = str(info.value)
    assert info.value.field == "prompt" and "at most 40 tokens with the state written in" in msg, msg
    assert "found 52 tokens" in msg, msg
    obs["prompt"] = "go"  # BOS + "Task: go, State: 127 127 127;\nAction: ": 39 ids
    assert int(policy.prepare(obs).token_mask.sum()) == 39
    noise = np.zeros((4, 32), np.float32)
    moved = {**obs, "state": np.full(3, 0.7), "noise": noise}
    assert not np.array_equal(policy.infer({**obs, "noise": noise})["actions"], policy.infer(moved)["actions"])


def test_a_pi0_text_prompt_too_long_names_the_prompt():
    """The bug: the error named 'prompt_tokens', a field the robot never sent."""
    from vla_rt.policy import SentencePieceTokenizer

    policy = Pi0Policy(load_pi0("random:tiny:2", num_views=1, chunk=4, prompt_len=5))
    policy.tokenizer = SentencePieceTokenizer.__new__(SentencePieceTokenizer)
    policy.tokenizer.sp = _CharTokenizer()
    obs = {"images": [np.zeros((8, 8, 3), np.uint8)], "state": [0.0], "prompt": "pick up the pen"}
    with pytest.raises(InputError) as info:
        policy.infer(obs)
    assert info.value.field == "prompt" and str(info.value) == "prompt: expected at most 5 tokens, found 17"
    assert int(policy.prepare({**obs, "prompt": "go"}).token_mask.sum()) == 4  # BOS, 'g', 'o', then '\n'
