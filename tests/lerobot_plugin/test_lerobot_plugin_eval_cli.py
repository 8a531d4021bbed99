"""The real `lerobot-eval` command runs the plugin end to end: LeRobot's PushT simulator, its rollout loop, the
checkpoint's processors, `select_action` on vla-rt, the video and the metrics file. (integrations/lerobot/test.sh
installs `lerobot[pusht]` for it.)"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "lerobot", reason="LeRobot is not installed (it needs Python >= 3.12; .ci/run runs these in its venv)"
)

import lerobot_tiny as lt  # noqa: E402


def test_lerobot_eval_runs_a_pusht_episode_on_the_plugin(tmp_path):
    tokenizer = lt.write_tokenizer(tmp_path / "tokenizer")
    with lt.offline_paligemma_tokenizer(tokenizer):
        lt.write_lerobot_checkpoint(tmp_path / "pi0", False, chunk=10, n_action_steps=10, seed=3, robot=lt.PUSHT)
    lt.use_local_tokenizer(tmp_path / "pi0", tokenizer)  # a separate process: no patching there
    exe = shutil.which("lerobot-eval", path=str(Path(sys.executable).parent)) or shutil.which("lerobot-eval")
    assert exe, "lerobot-eval is not on PATH"
    out = tmp_path / "eval"
    cmd = [exe, "--env.type=pusht", "--env.episode_length=20", "--eval.n_episodes=1", "--eval.batch_size=1",
           "--policy.type=vla_rt", f"--policy.checkpoint={tmp_path / 'pi0'}", "--policy.device=cpu",
           f"--output_dir={out}", "--seed=0"]  # fmt: skip
    env = os.environ | {"SDL_VIDEODRIVER": "dummy", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stderr + run.stdout
    assert "Imported third-party plugin: lerobot_policy_vla_rt" in log and "'pusht_vla_rt'" in log  # the job name
    info = json.loads((out / "eval_info.json").read_text())
    overall = info["overall"]
    assert overall["n_episodes"] == 1 and math.isfinite(overall["avg_sum_reward"])
    assert Path(overall["video_paths"][0]).stat().st_size > 0
