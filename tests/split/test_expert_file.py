"""The robot's half of a checkpoint: `--role export-expert` writes the expert's tensors alone with the norm stats
and the whole checkpoint's fingerprint; an expert started from that file pairs with a prefix server started from the
whole checkpoint, and one from another checkpoint does not. CLI mistakes end in one line, exit code 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from split_harness import observation, running_expert, running_prefix

from vla_rt.checkpoints import load_checkpoint
from vla_rt.cli import main
from vla_rt.engine.split_engines import expert_subset
from vla_rt.errors import CheckpointError
from vla_rt.split.expert_file import fingerprint, load_expert_weights


def test_export_expert_keeps_the_expert_alone_and_pairs_with_its_checkpoint(checkpoint, tmp_path, capsys) -> None:
    path = tmp_path / "expert.safetensors"
    assert main(["serve", str(checkpoint), "--role", "export-expert", "--out", str(path)]) == 0
    assert "wrote the expert half" in capsys.readouterr().out
    ckpt, ew = load_checkpoint(str(checkpoint)), load_expert_weights(str(path))
    expected = expert_subset(ckpt.weights, ckpt.config)
    assert set(ew.weights) == set(expected) and all(torch.equal(ew.weights[k], v) for k, v in expected.items())
    assert ew.config == ckpt.config and ew.fingerprint == fingerprint(ckpt.weights)
    assert ew.norm_stats is not None and np.allclose(ew.norm_stats["state"].mean, ckpt.norm_stats["state"].mean)
    with running_prefix(checkpoint) as (_, kv_port), running_expert(path, kv_port) as expert:
        answer = WebsocketClientPolicy("127.0.0.1", expert.port).infer(observation(np.random.default_rng(0)))
        assert answer["kv_age_ms"] < 2000 and answer["actions"].shape == (4, 6)


def test_a_truncated_expert_file_names_the_missing_tensor(checkpoint, tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "expert.safetensors"
    main(["serve", str(checkpoint), "--role", "export-expert", "--out", str(path)])
    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    del tensors["expert.layers.0.down_proj.weight"]
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="expert.layers.0.down_proj.weight.*found missing"):
        load_expert_weights(str(path))


def test_an_expert_file_with_a_non_finite_weight_or_cut_short_is_one_error_naming_it(checkpoint, tmp_path) -> None:
    """The expert file goes through the checkpoints' own file layer: NaN / inf named by tensor, truncation by bytes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "expert.safetensors"
    main(["serve", str(checkpoint), "--role", "export-expert", "--out", str(path)])
    data = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["expert.layers.0.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="expert.layers.0.down_proj.weight.*non-finite"):
        load_expert_weights(str(path))
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_expert_weights(str(path))


@pytest.mark.parametrize(("argv", "needle"), [
    (["--role", "expert"], "--prefix-server: expected HOST:PORT"),
    (["--role", "export-expert"], "--out: expected the .safetensors file"),
    (["--role", "expert", "--prefix-server", "h:1", "--max-kv-age-ms", "0"], "--max-kv-age-ms: expected a positive"),
])  # fmt: skip
def test_split_flags_are_checked_before_anything_loads(checkpoint, capsys, argv, needle) -> None:
    assert main(["serve", str(checkpoint), *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--prefix-server", "gpu-box:8001"], "--prefix-server: expected --role expert (--role all does not use it), "
                                          "found 'gpu-box:8001'"),
    (["--kv-port", "9001"], "--kv-port: expected --role prefix (--role all does not use it), found 9001"),
    (["--role", "prefix", "--max-kv-age-ms", "100"], "--max-kv-age-ms: expected --role expert (--role prefix"),
    (["--role", "prefix", "--kv-format", "fp8"], "--kv-format: expected --role expert"),
    (["--role", "expert", "--prefix-server", "h:1", "--kv-port", "9"], "--kv-port: expected --role prefix"),
    (["--link-mbps", "100"], "--link-mbps: expected --role prefix or --role expert"),
    (["--role", "prefix", "--out", "e.safetensors"], "--out: expected --role export-expert"),
])  # fmt: skip
def test_a_split_flag_the_role_ignores_is_refused(checkpoint, capsys, monkeypatch, argv, needle) -> None:
    """The bug: `vla-rt serve CKPT --prefix-server gpu-box:8001` (no `--role expert`) served the whole model here,
    the flag silently ignored; every split flag given to a role that does not use it is now refused by name."""
    from vla_rt.serve import cli_args

    def started(*_args) -> None:
        raise AssertionError("a server started")

    for name in ("build_server", "run_role", "serve_until_signalled"):
        monkeypatch.setattr(cli_args, name, started)
    assert main(["serve", str(checkpoint), *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--role", "expert", "--prefix-server", "gpu-box"], "--prefix-server: expected HOST:PORT of the prefix server's "
                                                         "KV link, a port in [1, 65535], found 'gpu-box'"),
    (["--role", "expert", "--prefix-server", "gpu-box:99999"], "found 'gpu-box:99999'"),
    (["--role", "expert", "--prefix-server", ":8001"], "found ':8001'"),
    (["--role", "prefix", "--kv-port", "70000"], "--kv-port: expected a port in [0, 65535], found 70000"),
    (["--role", "prefix", "--kv-port", "-1"], "--kv-port: expected a port in [0, 65535], found -1"),
    (["--role", "expert", "--prefix-server", "h:1", "--max-kv-age-ms", "nan"], "--max-kv-age-ms: expected a positive"),
    (["--role", "expert", "--prefix-server", "h:1", "--link-latency-ms", "nan"],
     "--link-latency-ms / --link-mbps: expected a finite latency >= 0 ms and bandwidth > 0 Mb/s, found nan ms"),
    (["--role", "prefix", "--link-mbps", "inf"], "found None ms, inf Mb/s"),
])  # fmt: skip
def test_a_split_flag_with_a_bad_value_is_refused_before_anything_loads(checkpoint, capsys, monkeypatch, argv,
                                                                        needle) -> None:  # fmt: skip
    """The bug: `--prefix-server gpu-box` (no port) dialled port 80 forever, `--kv-port 70000` was an internal error
    after the model and cost model were built, a NaN `--max-kv-age-ms` meant no KV was ever too old."""
    from vla_rt.serve import cli_args

    def started(*_args) -> None:
        raise AssertionError("a server started")

    for name in ("build_server", "run_role", "serve_until_signalled"):
        monkeypatch.setattr(cli_args, name, started)
    assert main(["serve", str(checkpoint), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_export_expert_out_is_checked_before_the_checkpoint_is_read(checkpoint, tmp_path, capsys, monkeypatch) -> None:
    """The bug: `--out expert.json` was written (and the expert role then refused it as no checkpoint), `--out` under
    a regular file ended in '[Errno 17] File exists' after the whole checkpoint was read, and `--out` naming the
    checkpoint itself replaced the model by its expert half."""
    import shutil

    from vla_rt.serve import cli_args

    def exported(*_args) -> None:
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(cli_args, "run_role", exported)
    own = shutil.copy(checkpoint, tmp_path / "own.safetensors")
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    for out, needle in [
        (tmp_path / "expert.json", "--out: expected a file name ending in .safetensors (the expert role reads no "
                                   f"other), found '{tmp_path / 'expert.json'}'"),
        (blocker / "e.safetensors", f"--out: expected a path under a directory, found {blocker / 'e.safetensors'}, "
                                    f"but {blocker} is a file"),
        (tmp_path, "--out: expected a file name ending in .safetensors"),
        (own, "--out: expected a different file than the checkpoint"),
    ]:  # fmt: skip
        assert main(["serve", str(own), "--role", "export-expert", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert load_checkpoint(str(own)).weights.keys() == load_checkpoint(str(checkpoint)).weights.keys()


@pytest.mark.parametrize("as_expert_file", [True, False], ids=["expert file", "whole checkpoint"])
def test_a_pi05_expert_role_without_a_tokenizer_is_refused_before_its_weights_are_read(
    tmp_path, monkeypatch, as_expert_file
) -> None:
    """π0.5 reads its state from a text prompt, so the robot-side expert needs --tokenizer. The role finds that out
    from the file's header (a split-expert file's own, or the checkpoint's), not after loading its weights."""
    from split_harness import serve_config, write_checkpoint

    from vla_rt.errors import ArgumentError
    from vla_rt.split import roles
    from vla_rt.split.expert_file import read_expert_config

    path = write_checkpoint(tmp_path / "tiny_pi05.safetensors", "tiny_pi05", seed=4)
    if as_expert_file:
        expert = tmp_path / "expert_pi05.safetensors"
        assert main(["serve", str(path), "--role", "export-expert", "--out", str(expert)]) == 0
        path = expert
    assert read_expert_config(str(path)) == load_expert_weights(str(path)).config
    assert read_expert_config(str(path)).pi05

    def no_weights(path):
        raise AssertionError(f"read the weights of {path} before refusing")

    monkeypatch.setattr(roles, "load_expert_weights", no_weights)
    split = roles.SplitConfig("expert", prefix_server="127.0.0.1:1")
    with pytest.raises(ArgumentError, match="--tokenizer"):
        roles.build_expert_role(serve_config(path), split)
