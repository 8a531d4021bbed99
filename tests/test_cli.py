"""`vla-rt convert` and `vla-rt info`, called in-process through `main([...])`."""

import json

import pytest
import torch

from vla_rt.checkpoints import load_checkpoint, save_openpi
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.cli import COMMANDS, main
from vla_rt.config import preset
from vla_rt.model.weights import param_shapes, random_weights

TINY = preset("tiny")


def _info(capsys, path) -> dict:
    assert main(["info", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_convert_random_then_info(tmp_path, capsys):
    dst = tmp_path / "tiny.safetensors"
    assert main(["convert", "random:tiny:5", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "converted random checkpoint random:tiny:5" in out and "314,368 parameters" in out
    summary = _info(capsys, dst)
    total = sum(torch.Size(s).numel() for s in param_shapes(TINY).values())
    assert summary["format"] == "native" and summary["origin"] == "random:tiny:5"
    assert summary["total_parameters"] == total == sum(summary["parameters"].values())
    assert summary["bytes"] == {"bfloat16": 2 * total, "float32": 4 * total}
    assert summary["parameters"]["embeddings"] == TINY.vocab_size * TINY.llm.width
    assert summary["stored_dtypes"] == {"float32": len(param_shapes(TINY))}
    assert summary["config"] == TINY.to_dict()
    assert main(["info", str(dst)]) == 0
    text = capsys.readouterr().out
    assert "format:     native" in text and "suffix heads" in text and "norm stats: none" in text


def test_convert_openpi_with_norm_stats_to_bf16(tmp_path, capsys):
    pytest.importorskip("orbax.checkpoint")
    weights = random_weights(TINY, seed=41)
    stats = {"state": NormStats(mean=[1.0, 2.0], std=[0.5, 0.5]), "actions": NormStats(mean=[0.0], std=[2.0])}
    save_openpi(weights, TINY, tmp_path / "openpi", norm_stats=stats, asset_id="robot")
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(tmp_path / "openpi"), str(dst), "--dtype", "bfloat16"]) == 0
    assert "norm stats: actions, state" in capsys.readouterr().out
    loaded = load_checkpoint(dst, dtype=None)
    assert loaded.norm_stats == stats and loaded.config == TINY
    assert all(torch.equal(loaded.weights[k], v.to(torch.bfloat16)) for k, v in weights.items())
    summary = _info(capsys, dst)
    assert summary["stored_dtypes"] == {"bfloat16": len(weights)}
    assert summary["norm_stats"] == {"state": {"dim": 2, "quantiles": False}, "actions": {"dim": 1, "quantiles": False}}


def test_user_errors_exit_2_with_a_message(tmp_path, capsys):
    dst = tmp_path / "x.safetensors"
    assert main(["convert", "random:tiny", str(dst)]) == 0
    capsys.readouterr()
    assert main(["convert", "random:tiny", str(dst)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["convert", "random:tiny", str(dst), "--force"]) == 0
    assert main(["convert", "random:tiny", str(tmp_path / "x.bin")]) == 2
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "not a checkpoint vla-rt can read" in capsys.readouterr().err


def test_subcommands_are_registered_and_help_works(capsys):
    assert {"convert", "info"} <= COMMANDS.keys()
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "convert" in capsys.readouterr().out
