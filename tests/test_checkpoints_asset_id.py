"""An openpi checkpoint with norm stats for two robots (`assets/droid/`, `assets/libero/`), written as openpi writes
one: every user path takes `asset_id`, and none runs a policy without the robot's stats chosen."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("orbax.checkpoint")

from vla_rt import Pi0Policy, load_pi0  # noqa: E402
from vla_rt.checkpoints import load_checkpoint, load_native, save_norm_stats, save_openpi  # noqa: E402
from vla_rt.checkpoints.norm_stats import NormStats  # noqa: E402
from vla_rt.cli import main  # noqa: E402
from vla_rt.config import preset  # noqa: E402
from vla_rt.errors import ArgumentError  # noqa: E402
from vla_rt.inference import load_stages  # noqa: E402
from vla_rt.model.weights import random_weights  # noqa: E402
from vla_rt.split import expert_file  # noqa: E402

DROID = {"state": NormStats(mean=[0.5, 1.0], std=[2.0, 3.0]), "actions": NormStats(mean=[0.0], std=[1.0])}
LIBERO = {"state": NormStats(mean=[1.0, 2.0, 3.0], std=[1.0, 1.0, 1.0]), "actions": NormStats(mean=[1.0], std=[2.0])}
REFUSED = "asset_id: expected one of ['droid', 'libero'] (the checkpoint's assets/<asset_id>/norm_stats.json"


@pytest.fixture(scope="module")
def two_robots(tmp_path_factory):
    cfg = preset("tiny")
    root = tmp_path_factory.mktemp("openpi") / "pi0_two_robots"
    save_openpi(random_weights(cfg, seed=1), cfg, root, norm_stats=DROID, asset_id="droid")
    save_norm_stats(root / "assets" / "libero", LIBERO)
    return root


def test_the_loader_records_the_assets_to_choose_from(two_robots) -> None:
    ckpt = load_checkpoint(two_robots, shapes_only=True)
    assert ckpt.norm_stats is None and ckpt.norm_stats_assets == ("droid", "libero")
    chosen = load_checkpoint(two_robots, shapes_only=True, asset_id="libero")
    assert chosen.norm_stats == LIBERO and chosen.norm_stats_assets == ("droid", "libero")


def test_a_policy_without_a_chosen_asset_is_refused(two_robots) -> None:
    """The bug: load_pi0 / Pi0Policy.from_pretrained had no asset_id and ran with no norm stats, without a word."""
    model = load_pi0(str(two_robots))
    assert model.norm_stats is None and model.norm_stats_assets == ("droid", "libero")
    with pytest.raises(ArgumentError) as e:
        Pi0Policy(model, camera_names=["base_0_rgb"])
    assert str(e.value).startswith(REFUSED) and str(e.value).endswith("found none chosen")
    with pytest.raises(ArgumentError, match=r"asset_id: expected one of \['droid', 'libero'\]"):
        Pi0Policy.from_pretrained(str(two_robots), device="cpu", camera_names=["base_0_rgb"])
    assert Pi0Policy(model, camera_names=["base_0_rgb"], norm_stats=DROID).norm_stats == DROID  # given: runs


def test_asset_id_reaches_the_checkpoint_on_every_path(two_robots) -> None:
    assert load_pi0(str(two_robots), asset_id="libero").norm_stats == LIBERO
    policy = Pi0Policy.from_pretrained(str(two_robots), device="cpu", camera_names=["base_0_rgb"], asset_id="droid")
    assert policy.norm_stats == DROID and policy.action_dim == 1
    stages = load_stages(str(two_robots), num_views=1, asset_id="libero")
    assert stages.norm_stats == LIBERO and stages.norm_stats_assets == ("droid", "libero")


def test_info_lists_the_assets_and_convert_needs_a_choice(two_robots, tmp_path, capsys) -> None:
    """convert without --asset-id wrote a file with no stats and no trace that there had been any: every policy on it
    then ran in normalised units with only the no-stats warning. It is refused from the header, nothing written."""
    assert main(["info", str(two_robots), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["norm_stats_assets"] == ["droid", "libero"] and summary["norm_stats"] is None
    assert main(["convert", str(two_robots), str(tmp_path / "none.safetensors")]) == 2
    assert "--asset-id: expected one of ['droid', 'libero']" in capsys.readouterr().err
    assert not (tmp_path / "none.safetensors").exists()
    assert main(["convert", str(two_robots), str(tmp_path / "d.safetensors"), "--asset-id", "droid"]) == 0
    assert load_native(tmp_path / "d.safetensors").norm_stats == DROID


def test_save_expert_file_needs_a_chosen_asset_before_reading_weights(two_robots, tmp_path, monkeypatch) -> None:
    """The bug: only `vla-rt serve --role export-expert` refused; `save_expert_file` called from Python wrote an
    expert file with no norm stats, so the robot's expert ran raw states in and normalised actions out."""
    out = tmp_path / "expert.safetensors"
    header_read = expert_file.load_checkpoint

    def headers_only(*args, **kwargs):
        assert kwargs.get("shapes_only"), "read the weights before refusing"
        return header_read(*args, **kwargs)

    monkeypatch.setattr(expert_file, "load_checkpoint", headers_only)
    with pytest.raises(ArgumentError) as e:
        expert_file.save_expert_file(out, str(two_robots))
    assert str(e.value).startswith(REFUSED) and str(e.value).endswith("found none chosen")
    assert not out.exists()
    monkeypatch.undo()
    expert_file.save_expert_file(out, str(two_robots), asset_id="libero")
    assert expert_file.load_expert_weights(str(out)).norm_stats == LIBERO
