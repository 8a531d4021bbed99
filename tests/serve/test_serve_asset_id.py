"""`vla-rt serve --asset-id`: which openpi norm stats a server runs with. Without one, a checkpoint with several
assets is refused before any engine is built (the server used to log a warning and run raw states through the
model); with one where no checkpoint has assets, the flag is a usage error."""

from __future__ import annotations

import pytest

from vla_rt.cli import build_parser, main
from vla_rt.serve.cli_args import server_flags

NOT_OPENPI = "--asset-id: expected none for a random: checkpoint (only an openpi checkpoint has assets/<asset_id>/)"


@pytest.fixture
def nothing_is_built(monkeypatch):
    import vla_rt.serve.app as app
    import vla_rt.split.expert_file as expert_file
    import vla_rt.split.roles as roles

    def forbidden(*args, **kwargs):
        raise AssertionError("reached the engine build before refusing the options")

    header_read = expert_file.load_checkpoint

    def headers_only(*args, **kwargs):  # save_expert_file checks the assets from the header, then reads weights
        return header_read(*args, **kwargs) if kwargs.get("shapes_only") else forbidden()

    monkeypatch.setattr(app, "build_serving_model", forbidden)
    monkeypatch.setattr(roles, "load_checkpoint", forbidden)
    monkeypatch.setattr(roles, "load_expert_weights", forbidden)
    monkeypatch.setattr(expert_file, "load_checkpoint", headers_only)
    monkeypatch.setattr(expert_file, "write_atomically", forbidden)


@pytest.mark.parametrize("command", ["serve", "loadtest"])
def test_an_asset_id_for_a_checkpoint_without_assets_is_a_usage_error(command, capsys, nothing_is_built) -> None:
    assert main([command, "random:tiny", "--port", "0", "--asset-id", "droid"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"vla-rt {command}: error: {NOT_OPENPI}, found 'droid'"


def test_loadtest_passes_asset_id_to_the_server_it_starts() -> None:
    args = build_parser().parse_args(["loadtest", "/ckpt", "--asset-id", "droid"])
    flags = server_flags(args)
    assert flags[flags.index("--asset-id") + 1] == "droid"
    assert "--asset-id" not in server_flags(build_parser().parse_args(["loadtest", "/ckpt"]))


@pytest.fixture(scope="module")
def two_robots(tmp_path_factory):
    pytest.importorskip("orbax.checkpoint")
    from vla_rt.checkpoints import save_norm_stats, save_openpi
    from vla_rt.checkpoints.norm_stats import NormStats
    from vla_rt.config import preset
    from vla_rt.model.weights import random_weights

    cfg = preset("tiny")
    root = tmp_path_factory.mktemp("openpi") / "pi0_two_robots"
    droid = {"state": NormStats(mean=[0.5, 1.0], std=[2.0, 3.0]), "actions": NormStats(mean=[0.0], std=[1.0])}
    save_openpi(random_weights(cfg, seed=1), cfg, root, norm_stats=droid, asset_id="droid")
    save_norm_stats(root / "assets" / "libero", {k: NormStats(mean=[1.0] * 3, std=[2.0] * 3) for k in droid})
    return root, droid


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "0"],
        ["loadtest", "--port", "0"],
        ["serve", "--port", "0", "--role", "prefix", "--kv-port", "0"],
        ["serve", "--port", "0", "--role", "expert", "--prefix-server", "gpu-box:8001"],
        ["serve", "--role", "export-expert", "--out", "OUT"],
    ],
    ids=["serve", "loadtest", "prefix", "expert", "export-expert"],
)
def test_several_assets_and_none_chosen_are_refused_before_the_engine(
    argv, two_robots, capsys, nothing_is_built, tmp_path
) -> None:
    """The bug: the server logged 'no norm stats' and served raw states in, normalised actions out."""
    root, _ = two_robots
    argv = [a.replace("OUT", str(tmp_path / "expert.safetensors")) for a in argv]
    assert main([argv[0], str(root), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vla-rt {argv[0]}: error: --asset-id: expected one of ['droid', 'libero'] (the "
                          "checkpoint's assets/<asset_id>/norm_stats.json;"), err  # fmt: skip
    assert err.endswith("found none chosen") and "\n" not in err
    assert not (tmp_path / "expert.safetensors").exists()


def test_the_chosen_assets_norm_stats_reach_the_servers_policy(two_robots) -> None:
    from vla_rt.serve.app import ServeConfig, build_service
    from vla_rt.serve.scheduler import StageCosts, batch_buckets

    root, droid = two_robots
    cfg = ServeConfig(str(root), port=0, asset_id="droid", max_batch=1, device="cpu")
    costs = StageCosts.flat(1.0, 0.1, batch_buckets(1), batch_buckets(1))
    assert build_service(cfg, costs).policy.norm_stats == droid
