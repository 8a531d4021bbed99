"""Pen-catch training samples: every camera frame of the demonstrations, decoded and labelled once, and the
normalized, padded model inputs for a batch of them (docs/pen_catch.md).

One sample per camera frame i: views (cam0 = frame i, cam1 = frame i-1; the first frame repeats itself, as the
runtime does), state = jaw position, target = the expert's gripper targets at t_capture[i] + k*dt (k < H): the
runtime's `action_time_origin="frame_capture"` schedule, so whatever the camera and inference latency, step k is
executed when it was demonstrated. State and actions are z-scored with statistics of the training episodes and
zero-padded to the model's 32 dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.errors import ConfigError
from vla_rt.policy import resize_with_pad
from vla_rt.robot.pen_dataset import action_chunk, load_episode, load_meta

PEN_VISIBLE_AFTER_S = 0.032  # the tip enters the top image row 32 ms after release (docs/runtime.md)


@dataclass
class PenCatchSamples:
    """Every training sample in memory. N frames over all episodes."""

    frames: np.ndarray  # uint8 (N, S, S, 3), resized to the model's input size
    previous: np.ndarray  # int64 (N,) row of the previous frame (itself for an episode's first frame)
    state: np.ndarray  # float32 (N, 1) jaw position, raw
    actions: np.ndarray  # float32 (N, H, 1) gripper targets, raw
    episode: np.ndarray  # int64 (N,) episode index
    decision: np.ndarray  # bool (N,) pen visible and the close falls inside the chunk: the frames that matter
    close_window: np.ndarray  # float64 (N, 2) s after the frame's capture: close commands in it catch the pen

    def __len__(self) -> int:
        return len(self.frames)


def load_samples(
    root: Path, episodes: list[dict], image_size: int, horizon: int, dt: float, closing_s: float
) -> PenCatchSamples:
    """Decode, resize and label every frame of `episodes` (entries of meta.json) once."""
    frames, previous, state, actions, episode, decision, window = [], [], [], [], [], [], []
    row = 0
    for entry in tqdm(episodes, desc="loading demos", unit="ep"):
        ep = load_episode(root, entry["index"])
        n = len(ep["frames"])
        frames += [resize_with_pad(f, image_size) for f in ep["frames"]]
        previous.append(row + np.maximum(np.arange(n) - 1, 0))
        state.append(ep["state"].astype(np.float32))
        chunks = np.stack([action_chunk(ep, t, horizon, dt) for t in ep["t_capture"]])
        actions.append(chunks)
        episode.append(np.full(n, entry["index"]))
        visible = ep["t_capture"] >= entry["t_release"] + PEN_VISIBLE_AFTER_S
        decision.append(visible & (chunks.min(axis=(1, 2)) < 0.5) & (chunks.max(axis=(1, 2)) >= 0.5))
        window.append(np.array(entry["catch_window"])[None, :] - closing_s - ep["t_capture"][:, None])
        row += n
    return PenCatchSamples(
        np.stack(frames),
        np.concatenate(previous),
        np.concatenate(state),
        np.concatenate(actions),
        np.concatenate(episode),
        np.concatenate(decision),
        np.concatenate(window),
    )


def fit_norm_stats(values: np.ndarray) -> NormStats:
    """Per-dimension stats over all leading axes. A constant dimension gets std 1 (z-scoring it would divide by 0)."""
    flat = values.reshape(-1, values.shape[-1]).astype(np.float64)
    std = flat.std(axis=0)
    std = np.where(std < 1e-3, 1.0, std)
    q01, q99 = np.quantile(flat, 0.01, axis=0), np.quantile(flat, 0.99, axis=0)
    return NormStats(flat.mean(axis=0), std, q01, q99)


class Batcher:
    """Normalized, padded model inputs for rows of a `PenCatchSamples` (images in [-1, 1] as `Pi0Policy` makes)."""

    def __init__(self, samples: PenCatchSamples, norm: dict[str, NormStats], action_dim: int):
        self.samples = samples
        self.norm = norm
        self.state = self._pad(norm["state"].normalize(samples.state), action_dim)
        self.actions = self._pad(norm["actions"].normalize(samples.actions), action_dim)

    @staticmethod
    def _pad(x: np.ndarray, width: int) -> torch.Tensor:
        out = np.zeros((*x.shape[:-1], width), np.float32)
        out[..., : x.shape[-1]] = x
        return torch.from_numpy(out)

    def __call__(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows int (B,) -> images (B, 2, S, S, 3), state (B, A), actions (B, H, A), all float32."""
        s = self.samples
        views = np.stack([s.frames[rows], s.frames[s.previous[rows]]], axis=1)
        images = torch.from_numpy(views).float() / 255.0 * 2.0 - 1.0
        return images, self.state[rows], self.actions[rows]


def split_episodes(meta: dict, n_episodes: int | None, val_episodes: int) -> tuple[list[dict], list[dict]]:
    episodes = meta["episodes"][: n_episodes or None]
    if n_episodes and len(episodes) < n_episodes:
        raise ConfigError("n_episodes", f"null or at most {len(meta['episodes'])} (the episodes the dataset holds)",
                          n_episodes)  # fmt: skip
    n_val = min(val_episodes, len(episodes) // 5)
    return episodes[: len(episodes) - n_val], episodes[len(episodes) - n_val :]


def load_data(
    root: Path, n_episodes: int | None, val_episodes: int, image_size: int, horizon: int, dt: float
) -> tuple[PenCatchSamples, PenCatchSamples | None]:
    """Training and held-out samples at the model's input size."""
    meta = load_meta(root)
    train_eps, val_eps = split_episodes(meta, n_episodes, val_episodes)
    size, closing_s = image_size, meta["episode"]["closing_time_s"]
    train_set = load_samples(root, train_eps, size, horizon, dt, closing_s)
    val_set = load_samples(root, val_eps, size, horizon, dt, closing_s) if val_eps else None
    return train_set, val_set
