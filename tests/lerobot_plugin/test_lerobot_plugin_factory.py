"""LeRobot finds, parses and builds the plugin through its own discovery, CLI parser and factory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip(
    "lerobot", reason="LeRobot is not installed (it needs Python >= 3.12; .ci/run runs these in its venv)"
)

import lerobot_tiny as lt  # noqa: E402
import torch  # noqa: E402
from lerobot.policies.factory import get_policy_class, make_policy, make_pre_post_processors  # noqa: E402
from lerobot_policy_vla_rt import VlaRtConfig, VlaRtPolicy, make_vla_rt_pre_post_processors  # noqa: E402

from vla_rt.errors import ArgumentError  # noqa: E402
from vla_rt.numerics import rel_err  # noqa: E402


def test_lerobots_plugin_discovery_imports_the_distribution():
    """In a fresh interpreter, `vla_rt` is unknown until LeRobot's own discovery imports installed plugins."""
    code = (
        "from lerobot.configs.policies import PreTrainedConfig\n"
        "from lerobot.utils.import_utils import register_third_party_plugins\n"
        "before = 'vla_rt' in PreTrainedConfig.get_known_choices()\n"
        "register_third_party_plugins()\n"
        "print(before, 'vla_rt' in PreTrainedConfig.get_known_choices())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


def test_cli_type_builds_the_plugin_through_the_factory(checkpoints):
    lerobot_policy, folder = checkpoints["pi0"]
    cfg = lt.parse_eval_cli(
        ["--env.type=aloha", "--policy.type=vla_rt", f"--policy.checkpoint={folder}", "--policy.device=cpu",
         "--policy.num_steps=5", f"--policy.n_action_steps={lt.N_ACTION_STEPS}"]
    )  # fmt: skip
    assert type(cfg.policy) is VlaRtConfig and cfg.policy.type == "vla_rt"
    assert (cfg.policy.num_steps, cfg.policy.n_action_steps, cfg.policy.backend) == (5, lt.N_ACTION_STEPS, None)
    assert list(cfg.policy.image_features) == [lt.CAMERA]  # the checkpoint's cameras, in its order
    assert get_policy_class("vla_rt") is VlaRtPolicy
    policy = make_policy(cfg.policy, env_cfg=cfg.env)
    assert isinstance(policy, VlaRtPolicy)
    assert (policy.engine.backend, policy.engine.dtype, policy.engine.device.type) == ("folded", torch.float32, "cpu")
    pre, post = make_pre_post_processors(cfg.policy, pretrained_path=cfg.policy.pretrained_path)
    pre_lr, post_lr = make_pre_post_processors(lerobot_policy.config, pretrained_path=str(folder))
    names = [type(step).__name__ for step in pre.steps]
    lerobots = [type(step).__name__ for step in pre_lr.steps]  # LeRobot's π0 pipeline, plus the plugin's state check
    check = names.index("StateSizeCheckStep")
    assert names[check + 1 :] == ["RelativeActionsProcessorStep", "NormalizerProcessorStep"]
    assert names[:check] + names[check + 1 :] == lerobots and "TokenizerProcessorStep" in names
    assert [type(s).__name__ for s in post.steps] == [type(s).__name__ for s in post_lr.steps]


def test_pretrained_path_alone_keeps_the_checkpoints_n_action_steps_and_cameras(checkpoints):
    """`--policy.pretrained_path=<LeRobot dir>` names the checkpoint as `--policy.checkpoint` does: its
    n_action_steps (4, of a chunk of 10) and cameras are the defaults (before: the whole chunk, silently)."""
    _, folder = checkpoints["pi0"]
    cfg = lt.parse_eval_cli(["--env.type=aloha", "--policy.type=vla_rt", f"--policy.pretrained_path={folder}",
                             "--policy.device=cpu"])  # fmt: skip
    assert cfg.policy.checkpoint is None and cfg.policy.n_action_steps == lt.N_ACTION_STEPS
    assert list(cfg.policy.image_features) == [lt.CAMERA]
    assert make_policy(cfg.policy, env_cfg=cfg.env).n_action_steps == lt.N_ACTION_STEPS


def test_pretrained_path_and_a_saved_plugin_dir_load_the_same_policy(checkpoints, tmp_path):
    """`--policy.type=vla_rt --policy.pretrained_path=<LeRobot dir>` (LeRobot loads that dir's processors itself),
    and `--policy.path=<dir the plugin saved>` (config.json of type vla_rt + processors) give the same actions."""
    _, folder = checkpoints["pi05"]
    common = ["--env.type=aloha", "--policy.device=cpu", f"--policy.n_action_steps={lt.N_ACTION_STEPS}"]
    cfg = lt.parse_eval_cli([*common, "--policy.type=vla_rt", f"--policy.pretrained_path={folder}"])
    policy = make_policy(cfg.policy, env_cfg=cfg.env)
    pre, post = make_pre_post_processors(cfg.policy, pretrained_path=cfg.policy.pretrained_path)
    obs = lt.observations(lt.N_ACTION_STEPS + 1, seed=9)
    first = lt.rollout(policy, pre, post, obs, seed=0)

    policy.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["type"] == "vla_rt" and saved["checkpoint"] == str(folder.resolve())
    cfg2 = lt.parse_eval_cli([*common, f"--policy.path={tmp_path / 'saved'}"])
    assert type(cfg2.policy) is VlaRtConfig
    policy2 = make_policy(cfg2.policy, env_cfg=cfg2.env)
    pre2, post2 = make_pre_post_processors(cfg2.policy, pretrained_path=cfg2.policy.pretrained_path)
    assert rel_err(lt.rollout(policy2, pre2, post2, obs, seed=0), first) == 0.0
    for path in (folder, tmp_path / "saved"):  # from Python, without LeRobot's CLI
        direct = VlaRtPolicy.from_pretrained(path)
        assert rel_err(lt.rollout(direct, pre, post, obs, seed=0), first) == 0.0


def test_select_action_queue_computes_one_chunk_per_n_action_steps(checkpoints):
    _, folder = checkpoints["pi0"]
    cfg = VlaRtConfig(checkpoint=str(folder), device="cpu", n_action_steps=3)
    policy = VlaRtPolicy(cfg)
    pre, _ = make_vla_rt_pre_post_processors(cfg)
    chunks = []
    real = policy.predict_action_chunk
    policy.predict_action_chunk = lambda batch: chunks.append(1) or real(batch)
    batch = pre(lt.observations(1, seed=1)[0])
    torch.manual_seed(0)
    actions = [policy.select_action(batch) for _ in range(7)]
    assert len(chunks) == 3 and actions[0].shape == (1, lt.ACTION_DIM)
    policy.reset()
    policy.select_action(batch)
    assert len(chunks) == 4  # reset drops the queue


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"backend": "tensorrt"}, "policy.backend"),
        ({"dtype": "float64"}, "policy.dtype"),
        ({"num_steps": 0}, "policy.num_steps"),
        ({"n_action_steps": 11}, "policy.n_action_steps"),  # the checkpoint's chunk is 10
        ({"backend": "triton"}, "policy.backend"),  # no CUDA here
        ({"checkpoint": None}, "policy.checkpoint"),
    ],
)
def test_bad_settings_name_the_field(checkpoints, overrides, field):
    _, folder = checkpoints["pi0"]
    settings = {"checkpoint": str(folder), "device": "cpu"} | overrides
    if field == "policy.backend" and overrides["backend"] == "triton" and torch.cuda.is_available():
        pytest.skip("CUDA is present: triton is a valid backend here")
    with pytest.raises(ArgumentError, match=field.replace(".", r"\.")):
        cfg = VlaRtConfig(**settings)
        if field == "policy.checkpoint":
            cfg.input_features, cfg.output_features = lt.features()
        VlaRtPolicy(cfg)


def test_training_is_refused_with_the_way_to_train(checkpoints):
    _, folder = checkpoints["pi0"]
    config = VlaRtConfig(checkpoint=str(folder), device="cpu")
    assert config.n_action_steps == lt.N_ACTION_STEPS  # unset: the LeRobot checkpoint's own
    policy = VlaRtPolicy(config)
    with pytest.raises(NotImplementedError, match="--policy.type=pi0 or pi05"):
        policy.forward({})
