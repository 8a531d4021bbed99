"""Which norm stats a policy runs with: `asset_id` reaches the checkpoint on every user path, a checkpoint with
several openpi assets and none chosen is refused (openpi never runs without its config's asset), and one with no
stats at all is said once. The openpi round trips are in test_checkpoints_asset_id.py (they need orbax)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import vla_rt.checkpoints
from vla_rt import Pi0Policy, load_pi0
from vla_rt.checkpoints import save_native
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import preset
from vla_rt.errors import ArgumentError
from vla_rt.inference import load_stages
from vla_rt.model.weights import random_weights

STATS = {"state": NormStats(mean=[0.5, 1.0], std=[2.0, 3.0]), "actions": NormStats(mean=[0.0], std=[1.0])}


@pytest.fixture
def nothing_loads(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the arguments were checked")

    monkeypatch.setattr(vla_rt.checkpoints, "load_checkpoint", forbidden)


@pytest.mark.parametrize(
    "load",
    [
        lambda path, **kw: load_pi0(path, **kw),
        lambda path, **kw: load_stages(path, num_views=1, **kw),
        lambda path, **kw: Pi0Policy.from_pretrained(path, device="cpu", **kw),
    ],
    ids=["load_pi0", "load_stages", "from_pretrained"],
)
def test_an_asset_id_where_no_checkpoint_has_assets_is_refused_before_reading(load, nothing_loads, tmp_path) -> None:
    """The bug: none of these took asset_id, so an openpi checkpoint's robot could not be chosen at all."""
    with pytest.raises(ArgumentError, match=r"asset_id: expected none for a random: checkpoint .*found 'droid'"):
        load("random:tiny", asset_id="droid")
    native = tmp_path / "m.safetensors"
    native.write_bytes(b"not read")
    with pytest.raises(ArgumentError, match=r"asset_id: expected none for a file \(native or LeRobot\)"):
        load(str(native), asset_id="droid")
    with pytest.raises(ArgumentError, match="asset_id: expected the name of a directory under"):
        load("random:tiny", asset_id="../droid")


def test_a_model_with_several_assets_and_none_chosen_is_refused_by_the_policy() -> None:
    """The bug: with norm stats for several assets and none chosen the policy ran without a word, raw states in and
    actions in normalised units out."""
    model = load_pi0("random:tiny")
    model.norm_stats_assets = ("droid", "libero")  # what an openpi checkpoint with two assets loads as
    with pytest.raises(ArgumentError) as e:
        Pi0Policy(model, camera_names=["base_0_rgb"])
    assert str(e.value).startswith("asset_id: expected one of ['droid', 'libero'] (the checkpoint's assets/")
    assert str(e.value).endswith("; or pass norm_stats=, found none chosen")
    policy = Pi0Policy(model, camera_names=["base_0_rgb"], norm_stats=STATS)  # the caller's stats: runs
    assert policy.norm_stats["state"].dim == 2 and policy.action_dim == 1


def test_a_checkpoint_without_norm_stats_is_said_once_and_runs(caplog) -> None:
    """The bug: Pi0Policy said nothing (only the server warned); raw units in and normalised units out, silently."""
    with caplog.at_level(logging.WARNING, logger="vla_rt.policy"):
        policy = Pi0Policy(load_pi0("random:tiny:2"), camera_names=["base_0_rgb"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["random:tiny:2 has no norm stats: states go to the model and actions come back unnormalized"]
    rng = np.random.default_rng(0)
    obs = {"images": {"base_0_rgb": rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)}, "state": np.zeros(4)}
    assert policy.infer(obs)["actions"].shape == (policy.model.chunk, 32)


def test_a_checkpoint_with_norm_stats_or_given_stats_warns_nothing(caplog, tmp_path) -> None:
    cfg = preset("tiny")
    path = save_native(tmp_path / "m.safetensors", random_weights(cfg, seed=1), cfg, source="t", norm_stats=STATS)
    with caplog.at_level(logging.WARNING, logger="vla_rt.policy"):
        Pi0Policy(load_pi0(str(path)), camera_names=["base_0_rgb"])
        Pi0Policy(load_pi0("random:tiny"), camera_names=["base_0_rgb"], norm_stats=STATS)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
