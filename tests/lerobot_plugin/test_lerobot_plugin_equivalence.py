"""The plugin's actions against LeRobot's own π0 / π0.5 on the same checkpoint, observations and noise.

Both run in float32 on the CPU behind the same processors (the checkpoint's own, loaded by LeRobot's factory for
LeRobot's policy and by the plugin for itself), over 9 `select_action` calls = 3 chunks of 4 actions. Same noise:
LeRobot's π0 draws each chunk's noise from torch's global generator inside `sample_actions`, and the plugin draws
it with that same sampler, once per chunk, so seeding torch before each rollout gives both the same draws; a
rollout with another seed shows the noise is not a no-op. The tolerance: ‖Δ‖/‖a‖ ≤ 1e-4 (measured ~4e-6 for π0,
~4e-7 for π0.5: float32 rounding in a different operation order).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "lerobot", reason="LeRobot is not installed (it needs Python >= 3.12; .ci/run runs these in its venv)"
)

import lerobot_tiny as lt  # noqa: E402
import torch  # noqa: E402
from lerobot.policies.factory import make_policy, make_pre_post_processors  # noqa: E402
from lerobot_policy_vla_rt import VlaRtPolicy  # noqa: E402

from vla_rt.numerics import rel_err  # noqa: E402

TOL = 1e-4


def _plugin(checkpoint, *extra: str):
    cfg = lt.parse_eval_cli(
        ["--env.type=aloha", "--policy.type=vla_rt", f"--policy.checkpoint={checkpoint}", "--policy.device=cpu",
         f"--policy.n_action_steps={lt.N_ACTION_STEPS}", *extra]
    )  # fmt: skip
    policy = make_policy(cfg.policy, env_cfg=cfg.env)
    pre, post = make_pre_post_processors(cfg.policy, pretrained_path=cfg.policy.pretrained_path)
    return policy, pre, post


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_select_action_sequence_matches_lerobot(checkpoints, name):
    lerobot_policy, folder = checkpoints[name]
    pre_lr, post_lr = make_pre_post_processors(lerobot_policy.config, pretrained_path=str(folder))
    plugin, pre, post = _plugin(folder)
    assert isinstance(plugin, VlaRtPolicy) and plugin.engine.backend == "folded"
    assert plugin.engine.config.pi05 == (name == "pi05")

    obs = lt.observations(2 * lt.N_ACTION_STEPS + 1, seed=7)
    expected = lt.rollout(lerobot_policy, pre_lr, post_lr, obs, seed=0)
    got = lt.rollout(plugin, pre, post, obs, seed=0)
    assert got.shape == expected.shape == (len(obs), 1, lt.ACTION_DIM)
    for chunk in range(3):  # every chunk on its own, so a late chunk cannot hide in the total
        span = slice(chunk * lt.N_ACTION_STEPS, (chunk + 1) * lt.N_ACTION_STEPS)
        assert rel_err(got[span], expected[span]) <= TOL, (name, chunk, rel_err(got[span], expected[span]))
    assert rel_err(lt.rollout(plugin, pre, post, obs, seed=1), expected) > 1e-2  # the noise matters


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_predict_action_chunk_takes_the_same_noise_argument(checkpoints, name):
    lerobot_policy, folder = checkpoints[name]
    plugin, pre, _ = _plugin(folder)
    batch = pre(lt.observations(1, seed=3)[0])
    noise = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(4))
    expected = lerobot_policy.predict_action_chunk(batch, noise=noise.clone())
    got = plugin.predict_action_chunk(batch, noise=noise.clone())
    assert got.shape == expected.shape == (1, 10, lt.ACTION_DIM)
    assert rel_err(got, expected) <= TOL


def test_native_file_uses_lerobots_processors_over_its_norm_stats(checkpoints, tmp_path):
    """A native file (vla-rt convert of the LeRobot dir) has no processor files: the plugin builds LeRobot's own π0
    pipeline over the norm stats the file carries, and the actions stay LeRobot's."""
    from vla_rt.checkpoints import load_checkpoint
    from vla_rt.checkpoints.native import save_native

    lerobot_policy, folder = checkpoints["pi0"]
    ckpt = load_checkpoint(str(folder))
    native = save_native(
        tmp_path / "pi0.safetensors", ckpt.weights, ckpt.config, source=str(folder), norm_stats=ckpt.norm_stats,
        use_quantile_norm=ckpt.use_quantile_norm,
    )  # fmt: skip
    pre_lr, post_lr = make_pre_post_processors(lerobot_policy.config, pretrained_path=str(folder))
    plugin, pre, post = _plugin(native)
    obs = lt.observations(lt.N_ACTION_STEPS + 1, seed=8)
    assert rel_err(lt.rollout(plugin, pre, post, obs, 0), lt.rollout(lerobot_policy, pre_lr, post_lr, obs, 0)) <= TOL
