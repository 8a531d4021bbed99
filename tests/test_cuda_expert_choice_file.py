"""`tools/cuda_expert_check.py bench --write-choice` writes the persistent-expert choice rows beside, not over, the
Triton launch table a `tune` part of the same device call leaves in $OUT as <GPU>.json (on 2026-12-06 it read that
table as its own and stopped with KeyError 'steps'), and keeps the rows of shapes it did not measure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vla_rt.cuda_kernels import choice

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def check_tool():
    spec = importlib.util.spec_from_file_location("cuda_expert_check_tool", ROOT / "tools" / "cuda_expert_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # imports torch, never touches a GPU
    yield module
    sys.modules.pop(spec.name, None)


def _row(model: str, batch: int, ms: float) -> dict:
    return dict(model=model, batch=batch, prefix=256, chunk=63, tiling={}, persistent_ms=ms, per_op_ms=0.6)


def test_choice_lands_beside_the_launch_table_and_keeps_other_rows(check_tool, tmp_path, monkeypatch) -> None:
    gpu = "Test GPU"
    configs = tmp_path / "configs"
    configs.mkdir()
    monkeypatch.setattr(choice, "CONFIG_DIR", configs)
    (configs / "Test-GPU.json").write_text(
        json.dumps({"gpu": gpu, "steps": [_row("pi0", 1, 0.9), _row("pi05", 1, 1.2)]})
    )
    out = tmp_path / "out"
    out.mkdir()
    launch_table = {"gpu": gpu, "gemm": {}, "attention": {}}
    (out / "Test-GPU.json").write_text(json.dumps(launch_table))  # what a tune part of the same call leaves

    path = check_tool.write_choice(out, gpu, [_row("pi0", 1, 0.8)])

    assert path.name == "cuda_expert_choice_Test-GPU.json"
    assert json.loads((out / "Test-GPU.json").read_text()) == launch_table
    rows = {(r["model"], r["batch"]): r["persistent_ms"] for r in json.loads(path.read_text())["steps"]}
    assert rows == {("pi0", 1): 0.8, ("pi05", 1): 1.2}  # the measured row replaced, the committed π0.5 row kept

    check_tool.write_choice(out, gpu, [_row("pi0", 4, 3.1)])  # a second shape in the same call adds to this file
    rows = {(r["model"], r["batch"]): r["persistent_ms"] for r in json.loads(path.read_text())["steps"]}
    assert rows == {("pi0", 1): 0.8, ("pi05", 1): 1.2, ("pi0", 4): 3.1}
