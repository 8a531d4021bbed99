"""What the split tests share: a small checkpoint with norm stats, the two roles running on loopback, a robot, and the
monolithic engine's actions for any answer.

The model is the `tiny` preset with 56 px views (16 patches a view) so a prefix and a chunk take milliseconds on
a CPU; the tests check behaviour (versions, ages, exact actions, refusals), with timing bounds far from the
machine's speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from vla_rt import preset
from vla_rt.checkpoints import load_checkpoint
from vla_rt.checkpoints.native import save_native
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import VisionConfig
from vla_rt.engine.static_engine import build_graphed_torch
from vla_rt.inputs import BuiltShapes, ModelInputs
from vla_rt.model import random_weights
from vla_rt.serve.app import ServeConfig
from vla_rt.serve.scheduler import StageCosts
from vla_rt.serve.server import ServerThread
from vla_rt.split.roles import SplitConfig, SplitServers, build_expert_role, build_prefix_role

IMAGE_SIZE, VIEWS, CHUNK, PROMPT, STATE_DIM = 56, 2, 4, 8, 6


def small_config(name: str = "tiny"):
    cfg = preset(name)
    return cfg.replace(vision=VisionConfig(**{**cfg.vision.__dict__, "image_size": IMAGE_SIZE}))


def _stats(rng: np.random.Generator, dim: int) -> NormStats:
    mean, std = rng.normal(size=dim), rng.uniform(0.5, 2.0, dim)
    return NormStats(mean=mean, std=std, q01=mean - 2 * std, q99=mean + 2 * std)


def write_checkpoint(path: Path, name: str = "tiny", seed: int = 3) -> Path:
    rng = np.random.default_rng(seed)
    stats = {"state": _stats(rng, STATE_DIM), "actions": _stats(rng, STATE_DIM)}
    cfg = small_config(name)
    return save_native(path, random_weights(cfg, seed=seed), cfg, source="test", norm_stats=stats)


def serve_config(checkpoint: Path, **kw) -> ServeConfig:
    base = dict(profile="generic", num_views=VIEWS, chunk=CHUNK, prompt_len=PROMPT, port=0, device="cpu", seed=5)
    return ServeConfig(str(checkpoint), **{**base, **kw})


@dataclasses.dataclass
class Pair:
    prefix: SplitServers
    expert: SplitServers
    robot_port: int  # the robot-side expert's openpi port
    direct_port: int  # the prefix server's openpi port
    kv_port: int

    @property
    def service(self):  # the robot-side ExpertService
        return self.expert.servers[0].service

    @property
    def client(self):
        return self.expert.servers[1]


@contextlib.contextmanager
def running_prefix(
    checkpoint: Path, split: SplitConfig | None = None, **serve_kw
) -> Iterator[tuple[SplitServers, int]]:
    prefix = build_prefix_role(serve_config(checkpoint, **serve_kw), split or SplitConfig("prefix", kv_port=0),
                               cost=StageCosts({1: 5.0}, {1: 8.0}, {1: 0.1}, {1: 0.1}, num_steps=1))  # fmt: skip
    with ServerThread(prefix):
        yield prefix, prefix.servers[1].port


@contextlib.contextmanager
def running_expert(checkpoint: Path, kv_port: int, **split_kw) -> Iterator[SplitServers]:
    serve_kw = split_kw.pop("serve", {})
    split = SplitConfig("expert", prefix_server=f"127.0.0.1:{kv_port}", **{"max_kv_age_ms": 2000.0, **split_kw})
    expert = build_expert_role(serve_config(checkpoint, **serve_kw), split)
    with ServerThread(expert):
        yield expert


@contextlib.contextmanager
def running_pair(checkpoint: Path, prefix_split: SplitConfig | None = None, prefix_serve: dict | None = None,
                 **expert_kw) -> Iterator[Pair]:  # fmt: skip
    with running_prefix(checkpoint, prefix_split, **(prefix_serve or {})) as (prefix, kv_port):
        with running_expert(checkpoint, kv_port, **expert_kw) as expert:
            yield Pair(prefix, expert, expert.port, prefix.port, kv_port)


def observation(rng: np.random.Generator, *, prompt=True) -> dict:
    """A generic-profile observation: two camera images, a state of STATE_DIM values, prompt ids."""
    obs = {"images": {v: rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
                      for v in ("base_0_rgb", "left_wrist_0_rgb")},
           "state": rng.uniform(0, 1, STATE_DIM)}  # fmt: skip
    if prompt:
        obs["tokenized_prompt"] = rng.integers(1, 100, 5)
    return obs


def expected_actions(pair, checkpoint, observations: list[dict], answers: list[dict], prompt_len: int = PROMPT):
    """What the monolithic engine gives for each answer: the observation of its KV version (images, prompt; π0.5:
    the state in that prompt), π0's state token from the request (the relay's: from its observation), the noise
    the expert drew for the request the answer's chunk was computed for."""
    ckpt = load_checkpoint(str(checkpoint))
    cfg = ckpt.config.replace(chunk=CHUNK)
    engine = build_graphed_torch(ckpt.weights, cfg, device=torch.device("cpu"), dtype=torch.float32,
                                 shapes=BuiltShapes(VIEWS, CHUNK, prompt_len, 1))  # fmt: skip
    service = pair.service
    policy, profile = service.policy, service.profile
    versions = list(service._states)  # request order (one robot): version i is observation i
    g = torch.Generator().manual_seed(5)
    noises = [torch.randn(1, CHUNK, cfg.action_dim, generator=g) for _ in observations]
    rows = [policy.prepare(profile.parse(o).policy_obs) for o in observations]
    out = []
    for i, answer in enumerate(answers):
        j = versions.index(answer["kv_version"])
        k = j if answer["source"] == "relay" else i  # whose state token and noise the chunk used
        x = ModelInputs(rows[j].images, rows[k].state, rows[j].tokens, None, rows[j].image_masks, rows[j].token_mask)
        actions = engine(x, noises[k], 10)[0].numpy()
        robot_state = profile.parse(observations[j if answer["state_from"] == "observation" else i]).state
        out.append(profile.finish(policy.finish(actions), robot_state, service.action_dim))
    return out
