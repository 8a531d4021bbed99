"""Bad and edge input through LeRobot's own API: each gets one clear error naming the field, or the right actions."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

pytest.importorskip(
    "lerobot", reason="LeRobot is not installed (it needs Python >= 3.12; .ci/run runs these in its venv)"
)

import lerobot_tiny as lt  # noqa: E402
import torch  # noqa: E402
from lerobot.policies.factory import make_policy, make_pre_post_processors  # noqa: E402
from lerobot_policy_vla_rt import VlaRtConfig, VlaRtPolicy  # noqa: E402

from vla_rt.errors import ArgumentError, CheckpointError, InputError  # noqa: E402


def _prompt_tokens(pre, obs: dict) -> int:
    return int(pre(dict(obs))["observation.language.attention_mask"].sum())


@pytest.mark.parametrize(("name", "limit", "model"), [("pi05", 200, r"π0\.5"), ("pi0", 48, "π0")])
def test_task_cut_by_lerobots_tokenizer_is_refused(checkpoints, name, limit, model):
    """LeRobot's tokenizer step cuts a prompt to tokenizer_max_length (π0.5: 200, whose pre-processor writes the state
    into it; π0: 48): a long task lost the state (π0.5: a new state gave the old actions) or its end (π0: half an
    instruction), silently. Now the policy refuses it, naming `task` with the limit, the count and the row; a prompt
    that fills the limit exactly still runs."""
    _, folder = checkpoints[name]
    cfg = VlaRtConfig(checkpoint=str(folder), device="cpu")
    policy = VlaRtPolicy(cfg)
    pre, _ = make_pre_post_processors(cfg, pretrained_path=str(folder))
    obs = lt.observations(1, seed=1)[0]
    words = limit - _prompt_tokens(pre, obs)  # each extra word of the word-level tokenizer is one token
    exact = obs | {"task": ["pick up the pen" + " pen" * words]}
    assert _prompt_tokens(pre, exact) == limit
    assert policy.select_action(pre(dict(exact))).shape == (1, lt.ACTION_DIM)
    policy.reset()
    long = obs | {"task": ["pick up the pen" + " pen" * (words + 5)]}
    match = rf"^task: expected a {model} prompt of at most {limit} tokens .* found {limit + 5} tokens in row 0$"
    with pytest.raises(InputError, match=match):
        policy.select_action(pre(dict(long)))
    torch.manual_seed(0)
    assert policy.predict_action_chunk(pre(dict(obs))).shape == (1, lt.CHUNK, lt.ACTION_DIM)


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_state_of_another_size_than_the_checkpoints_is_refused_by_the_preprocessor(checkpoints, name, tmp_path):
    """An env or robot whose state has 2 values on a checkpoint of 14: the pre-processor's normaliser failed with
    torch's bare 'The size of tensor a (2) must match the size of tensor b (14)', naming no field. Now the
    pre-processor refuses it first, naming observation.state with both sizes, from `--policy.checkpoint` and from a
    dir the plugin saved (`--policy.path`); the right size still runs."""
    _, folder = checkpoints[name]
    cfg = lt.parse_eval_cli(["--env.type=aloha", "--policy.type=vla_rt", f"--policy.checkpoint={folder}",
                             "--policy.device=cpu"])  # fmt: skip
    policy = make_policy(cfg.policy, env_cfg=cfg.env)
    pre, _ = make_pre_post_processors(cfg.policy, pretrained_path=cfg.policy.pretrained_path)
    policy.save_pretrained(tmp_path / "saved")
    saved = lt.parse_eval_cli(["--env.type=aloha", f"--policy.path={tmp_path / 'saved'}", "--policy.device=cpu"])
    pre_saved, _ = make_pre_post_processors(saved.policy, pretrained_path=saved.policy.pretrained_path)
    obs = lt.observations(1, seed=3)[0]
    wrong = obs | {"observation.state": torch.randn(1, 2)}
    for pipeline in (pre, pre_saved):
        with pytest.raises(InputError, match=r"^observation\.state: expected 14 values a row \(the checkpoint's state "
                           r"size.*, found 2 \(shape \(1, 2\)\)$"):  # fmt: skip
            pipeline(dict(wrong))
        assert policy.select_action(pipeline(dict(obs))).shape == (1, lt.ACTION_DIM)
        policy.reset()


def test_relative_actions_checkpoint_through_policy_checkpoint(checkpoints, tmp_path):
    """A LeRobot π0 trained with use_relative_actions: `--policy.checkpoint` loaded its processors without linking
    the post-processor's absolute step to the pre-processor's relative step, so every action raised LeRobot's
    'AbsoluteActionsProcessorStep requires a paired RelativeActionsProcessorStep'. Now both ways of naming the dir
    give the same absolute actions."""
    from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors

    folder = tmp_path / "pi0_relative"  # `checkpoints` puts the offline PaliGemma tokenizer in place
    lerobot_policy = lt.lerobot_policy(False, chunk=lt.CHUNK, n_action_steps=lt.N_ACTION_STEPS, seed=4)
    lerobot_policy.config.use_relative_actions = True
    lerobot_policy.save_pretrained(folder)
    for pipeline in make_pi0_pre_post_processors(lerobot_policy.config, dataset_stats=lt.dataset_stats(4)):
        pipeline.save_pretrained(folder)
    cfg = VlaRtConfig(checkpoint=str(folder), device="cpu")
    policy = VlaRtPolicy(cfg)
    obs = lt.observations(lt.N_ACTION_STEPS + 1, seed=5)
    loaded_by_lerobot = lt.rollout(policy, *make_pre_post_processors(cfg, pretrained_path=str(folder)), obs, 0)
    plugins = lt.rollout(policy, *make_pre_post_processors(cfg), obs, seed=0)  # --policy.checkpoint's way
    assert torch.equal(plugins, loaded_by_lerobot)


def test_relative_actions_checkpoint_without_processor_files(checkpoints, tmp_path):
    """A LeRobot π0 trained with use_relative_actions, saved without its processor files (config.json and weights):
    the plugin rebuilt LeRobot's pipelines with relative actions off, so every action was the model's delta taken as
    an absolute position, silently. Now the rebuilt processors take use_relative_actions, relative_exclude_joints and
    action_feature_names from config.json: the actions are those of LeRobot's own pipelines for that config."""
    from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors

    folder = tmp_path / "pi0_relative_bare"  # `checkpoints` puts the offline PaliGemma tokenizer in place
    lerobot_policy = lt.lerobot_policy(False, chunk=lt.CHUNK, n_action_steps=lt.N_ACTION_STEPS, seed=4)
    lerobot_policy.config.use_relative_actions = True
    lerobot_policy.config.action_feature_names = [f"joint_{i}" for i in range(lt.ACTION_DIM - 1)] + ["gripper"]
    lerobot_policy.save_pretrained(folder)
    assert not list(folder.glob("policy_*processor*"))
    stats = lt.dataset_stats(4)
    cfg = VlaRtConfig(checkpoint=str(folder), device="cpu")
    policy = VlaRtPolicy(cfg)
    obs = lt.observations(lt.N_ACTION_STEPS + 1, seed=5)
    lerobots = lt.rollout(policy, *make_pi0_pre_post_processors(lerobot_policy.config, dataset_stats=stats), obs, 0)
    plugins = lt.rollout(policy, *make_pre_post_processors(cfg, dataset_stats=stats), obs, seed=0)
    assert torch.equal(plugins, lerobots)


def _copy_with_config(folder, dest, **settings):
    """A copy of a LeRobot checkpoint dir whose config.json carries `settings`."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config | settings, indent=2))
    return dest


def test_checkpoints_num_inference_steps_is_the_default_num_steps(checkpoints, tmp_path, caplog):
    """A LeRobot checkpoint's num_inference_steps (LeRobot's π0 denoises that many steps) was ignored: the plugin ran
    its own 10. Now it is num_steps when num_steps is unset; an explicit num_steps that differs runs, with a warning
    naming both."""
    _, folder = checkpoints["pi0"]
    three = _copy_with_config(folder, tmp_path / "pi0_3_steps", num_inference_steps=3)
    cfg = VlaRtConfig(checkpoint=str(three), device="cpu")
    pre, post = make_pre_post_processors(cfg)
    obs = lt.observations(1, seed=2)
    got = lt.rollout(VlaRtPolicy(cfg), pre, post, obs, seed=0)
    explicit = VlaRtConfig(checkpoint=str(three), device="cpu", num_steps=3)
    assert torch.equal(got, lt.rollout(VlaRtPolicy(explicit), pre, post, obs, seed=0))
    with caplog.at_level(logging.WARNING):
        ten = VlaRtConfig(checkpoint=str(three), device="cpu", num_steps=10)
    assert "policy.num_steps=10 overrides the checkpoint's num_inference_steps=3" in caplog.text
    assert not torch.equal(got, lt.rollout(VlaRtPolicy(ten), pre, post, obs, seed=0))


def test_bad_num_inference_steps_in_the_checkpoint_names_the_file(checkpoints, tmp_path):
    _, folder = checkpoints["pi0"]
    bad = _copy_with_config(folder, tmp_path / "pi0_bad_steps", num_inference_steps=0)
    with pytest.raises(CheckpointError, match=r"config\.json: num_inference_steps is 0, expected an integer in \[1, "):
        VlaRtPolicy(VlaRtConfig(checkpoint=str(bad), device="cpu"))  # make_policy raises it (draccus hides it)


def test_checkpoint_naming_the_dirs_model_safetensors_keeps_its_config_and_processors(checkpoints):
    """`--policy.checkpoint=<LeRobot dir>/model.safetensors` (vla-rt reads that file as the dir): the dir's config.json
    and processor files were ignored, so n_action_steps was the whole chunk (10, not 4), the cameras the env's, and
    the processors rebuilt from stats with the hub's tokenizer. Now it is the same policy as the dir."""
    _, folder = checkpoints["pi0"]
    cfg = VlaRtConfig(checkpoint=str(folder / "model.safetensors"), device="cpu")
    assert cfg.n_action_steps == lt.N_ACTION_STEPS and list(cfg.image_features) == [lt.CAMERA]
    by_dir = VlaRtConfig(checkpoint=str(folder), device="cpu")
    assert cfg.lerobot_checkpoint_dir() == folder
    obs = lt.observations(lt.N_ACTION_STEPS + 1, seed=6)
    pre, post = make_pre_post_processors(cfg)
    first = lt.rollout(VlaRtPolicy(cfg), pre, post, obs, seed=0)
    assert torch.equal(first, lt.rollout(VlaRtPolicy(by_dir), *make_pre_post_processors(by_dir), obs, seed=0))


def test_env_whose_action_differs_from_the_checkpoints_is_refused_at_make_policy(checkpoints):
    """An ALOHA checkpoint (14 action dims) on the PushT env (2), its camera renamed: make_policy set the env's action
    and the policy returned the first 2 of 14 model dims, until the checkpoint's post-processor failed on the first
    action with torch's 'The size of tensor a (2) must match the size of tensor b (14)'. Now make_policy refuses it,
    naming the field, the checkpoint's shape and the env's."""
    _, folder = checkpoints["pi0"]
    cfg = lt.parse_eval_cli(["--env.type=pusht", "--policy.type=vla_rt", f"--policy.checkpoint={folder}",
                             "--policy.device=cpu", '--rename_map={"observation.image": "observation.images.top"}'])  # fmt: skip
    with pytest.raises(ArgumentError, match=r"^policy\.output_features\['action'\]: expected shape \(14,\).* found "
                       r"shape \(2,\) \(from the env or dataset\)$"):  # fmt: skip
        make_policy(cfg.policy, env_cfg=cfg.env, rename_map=cfg.rename_map)


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--policy.dtype=fp16", r"^policy\.dtype: expected one of \['float32', 'bfloat16', 'float16'\] or unset, found 'fp16'$"),
        ("--policy.n_action_steps=0", r"^policy\.n_action_steps: expected an integer >= 1, found 0$"),
        ("--policy.backend=tensorrt", r"^policy\.backend: expected one of .*, found 'tensorrt'$"),
    ],
)  # fmt: skip
def test_bad_setting_on_lerobots_cli_names_the_field(checkpoints, arg, message):
    """On the command line these printed only draccus's "Couldn't instantiate class VlaRtConfig using the given
    arguments" (it swallows a ValueError raised while it builds the config). Now the config parses and make_policy
    raises the field's own error."""
    _, folder = checkpoints["pi0"]
    cfg = lt.parse_eval_cli(["--env.type=aloha", "--policy.type=vla_rt", f"--policy.checkpoint={folder}",
                             "--policy.device=cpu", arg])  # fmt: skip
    with pytest.raises(ArgumentError, match=message):
        make_policy(cfg.policy, env_cfg=cfg.env)


def test_select_action_with_another_batch_size_mid_queue_is_refused(checkpoints):
    """Two envs fill the queue with (2, action_dim) actions; a batch of one without reset() got the next queued
    (2, action_dim) action, rows computed for other observations. Now it is refused until reset()."""
    _, folder = checkpoints["pi0"]
    cfg = VlaRtConfig(checkpoint=str(folder), device="cpu")
    policy = VlaRtPolicy(cfg)
    pre, _ = make_pre_post_processors(cfg, pretrained_path=str(folder))
    one = lt.observations(2, seed=7)
    two = {k: torch.cat([one[0][k], one[1][k]]) if k != "task" else one[0][k] * 2 for k in one[0]}
    assert policy.select_action(pre(dict(two))).shape == (2, lt.ACTION_DIM)
    with pytest.raises(InputError, match=r"^batch: expected 2 rows, .* found 1 rows$"):
        policy.select_action(pre(dict(one[0])))
    policy.reset()
    assert policy.select_action(pre(dict(one[0]))).shape == (1, lt.ACTION_DIM)
