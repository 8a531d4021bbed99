"""The pen-catch training recipe: π0's flow-matching loss (`Pi0Model.compute_loss`) on the demonstrations, AdamW with
warmup + cosine decay and gradient clipping, held-out evaluation of where sampled chunks close.

Frames are decoded, resized (the policy's own `resize_with_pad`) and held in memory once (samples.py), so a step
costs only the model. Writes the native checkpoint + a JSON sidecar with the action schedule the runtime needs and the
recipe, a loss plot, periodic checkpoints and the loss history. `cfg` is the hydra config of
configs/experiment/train_pen_catch.yaml; docs/pen_catch.md has the choices and results.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from vla_rt.checkpoints.native import save_native
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import Pi0Config, preset
from vla_rt.model import Pi0Model, random_weights
from vla_rt.pen_catch.samples import Batcher, PenCatchSamples, fit_norm_stats, load_data


def model_config(cfg: DictConfig, horizon: int) -> Pi0Config:
    """The preset with the configured input size and chunk length (weights do not depend on the chunk)."""
    base = preset(cfg.model.preset)
    size = cfg.model.image_size or base.vision.image_size
    if size % base.vision.patch_size:
        raise ValueError(f"model.image_size {size} is not a multiple of the patch size {base.vision.patch_size}")
    return base.replace(vision=dataclasses.replace(base.vision, image_size=size), chunk=horizon)


def detach_padding(model: Pi0Model, action_dims: int) -> None:
    """Zero the action-input columns of the padding dims. Trained with zero noise there (`flow_noise`), they get no
    gradient and stay zero, so the checkpoint ignores whatever noise a standard sampler puts in the padding."""
    with torch.no_grad():
        model.action_in_proj.weight[:, action_dims:] = 0.0


def flow_noise(
    shape: torch.Size, action_dims: int, on_padding: bool, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Flow-matching noise (B, H, A). Without noise on the padding dims their flow is the constant 0: the 32-wide
    action expert then spends no width carrying 31 channels of noise from t=1 to t=0 (docs/pen_catch.md)."""
    noise = torch.randn(shape, generator=generator)
    if not on_padding:
        noise[..., action_dims:] = 0.0
    return noise


def learning_rate(step: int, cfg: DictConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_fraction` of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: Pi0Model, batch: Batcher, rows: np.ndarray, norm: NormStats, cfg: DictConfig) -> dict:
    """Held-out flow-matching loss (fixed noise and times) and, on the decision frames, how far the close step of a
    chunk sampled as `Pi0Policy` samples it (noise on all 32 dims) lands from the demonstrated one."""
    gen = torch.Generator().manual_seed(cfg.seed)
    images, state, actions = batch(rows)
    noise = flow_noise(actions.shape, batch.samples.actions.shape[-1], cfg.noise_on_padding, gen)
    t = torch.rand(len(rows), generator=gen) * 0.999 + 0.001
    loss = model.compute_loss(images, state, actions, noise=noise, time=t).mean().item()
    decision = rows[batch.samples.decision[rows]]
    if len(decision) == 0:
        return {"val_loss": loss}
    images, state, _ = batch(decision)
    noise = torch.randn(len(decision), model.cfg.chunk, model.cfg.action_dim, generator=gen)
    sampled = norm.unnormalize(model.sample_actions(images, state, noise=noise, num_steps=10)[..., :1].numpy())
    predicted = first_close_step(sampled) * cfg.action.dt_s
    error_ms = (predicted - first_close_step(batch.samples.actions[decision]) * cfg.action.dt_s) * 1000
    window = batch.samples.close_window[decision]
    return {
        "val_loss": loss,
        "close_error_ms_mean": float(np.mean(error_ms)),
        "close_error_ms_abs": float(np.mean(np.abs(error_ms))),
        "close_in_window": float(np.mean((predicted >= window[:, 0]) & (predicted <= window[:, 1]))),
        "close_too_early": float(np.mean(predicted < window[:, 0])),
    }


def first_close_step(chunks: np.ndarray) -> np.ndarray:
    """(B, H, 1) gripper targets -> index of the first step >= 0.5 (H when the chunk never closes)."""
    closed = chunks[..., 0] >= 0.5
    return np.where(closed.any(axis=1), closed.argmax(axis=1), chunks.shape[1])


def save_checkpoint(path: Path, model: Pi0Model, norm: dict[str, NormStats], sidecar: dict[str, Any]) -> None:
    """Native safetensors (weights, dims, norm stats) + `<path>.json`: what the runtime needs beyond the model."""
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_native(
        path, weights, model.cfg, source="experiments/train_pen_catch.py", norm_stats=norm, use_quantile_norm=False
    )
    path.with_suffix(".json").write_text(json.dumps(sidecar, indent=1))


def plot_losses(history: list[dict], path: Path, title: str) -> None:
    steps = np.array([h["step"] for h in history if "loss" in h])
    losses = np.array([h["loss"] for h in history if "loss" in h])
    smooth = np.convolve(losses, np.ones(50) / 50, mode="valid") if len(losses) >= 50 else losses
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(steps[len(steps) - len(smooth) :], smooth, color="tab:blue", label="train (50-step mean)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", label="held-out episodes")
    ax.set(xlabel="step", ylabel="flow-matching loss", yscale="log", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def describe(cfg: DictConfig, mcfg: Pi0Config, train_set: PenCatchSamples, val_set: PenCatchSamples | None) -> dict:
    """The sidecar: what the runtime must reproduce (schedule, views) and how the weights were made."""
    return {
        "task": "pen_catch",
        "dt_action_s": cfg.action.dt_s,
        "horizon": cfg.action.horizon,
        "action_time_origin": "frame_capture",
        "views": [["cam", 0], ["cam", -1]],
        "camera_names": ["cam0", "cam1"],
        "action_dim": int(train_set.actions.shape[-1]),
        "image_size": mcfg.vision.image_size,
        "recipe": OmegaConf.to_container(cfg, resolve=True),
        "data": {
            "dir": str(cfg.data_dir),
            "train_episodes": len(np.unique(train_set.episode)),
            "val_episodes": 0 if val_set is None else len(np.unique(val_set.episode)),
            "train_frames": len(train_set),
            "decision_frames": int(train_set.decision.sum()),
        },
    }


def new_model(cfg: DictConfig, mcfg: Pi0Config, action_dims: int) -> Pi0Model:
    model = Pi0Model(mcfg)
    model.load_state_dict(random_weights(mcfg, seed=cfg.seed))
    if not cfg.noise_on_padding:
        detach_padding(model, action_dims)
    return model.train()


def fit(
    model: Pi0Model,
    cfg: DictConfig,
    batch: Batcher,
    val_batch: Batcher | None,
    checkpoint_fn: Any,
) -> list[dict[str, Any]]:
    """The optimisation loop; returns one record per step (loss, grad norm, lr, and the evaluations)."""
    rng = np.random.default_rng(cfg.seed)
    samples = batch.samples
    weights = 1.0 + (cfg.decision_weight - 1.0) * samples.decision
    weights = weights / weights.sum()
    action_dims = samples.actions.shape[-1]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    history: list[dict[str, Any]] = []
    progress = tqdm(range(1, cfg.max_steps + 1), desc="train π0 pen catch", unit="step")
    for step in progress:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step - 1, cfg)
        images, state, actions = batch(rng.choice(len(samples), size=cfg.batch_size, p=weights))
        noise = flow_noise(actions.shape, action_dims, cfg.noise_on_padding)
        loss = model.compute_loss(images, state, actions, noise=noise).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        record = {"step": step, "loss": loss.item(), "grad_norm": float(grad_norm), "lr": group["lr"]}
        last = step == cfg.max_steps
        if val_batch is not None and (step % cfg.eval_every == 0 or last):
            model.eval()
            rows = np.arange(len(val_batch.samples))
            record |= evaluate(model, val_batch, rows, val_batch.norm["actions"], cfg)
            model.train()
            tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))
        history.append(record)
        progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.1e}")
        if step % cfg.checkpoint_every == 0 and not last:
            checkpoint_fn(f"step_{step:06d}.safetensors")
    return history


def train(cfg: DictConfig, root: Path, run_dir: Path, checkpoint: Path, loss_plot: Path) -> dict[str, Any]:
    """The whole recipe: data from `root`, model, loop (periodic checkpoints, history and a loss plot in `run_dir`),
    the final `checkpoint` + its sidecar, and `loss_plot`. Returns the result summary."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    mcfg = model_config(cfg, cfg.action.horizon)
    started = time.perf_counter()
    train_set, val_set = load_data(
        root, cfg.n_episodes, cfg.val_episodes, mcfg.vision.image_size, cfg.action.horizon, cfg.action.dt_s
    )
    load_s = time.perf_counter() - started
    norm = {"state": fit_norm_stats(train_set.state), "actions": fit_norm_stats(train_set.actions)}
    batch = Batcher(train_set, norm, mcfg.action_dim)
    val_batch = Batcher(val_set, norm, mcfg.action_dim) if val_set is not None else None
    model = new_model(cfg, mcfg, train_set.actions.shape[-1])
    sidecar = describe(cfg, mcfg, train_set, val_set)

    started = time.perf_counter()
    history = fit(model, cfg, batch, val_batch, lambda name: save_checkpoint(run_dir / name, model, norm, sidecar))
    sidecar["result"] = {
        "steps": cfg.max_steps,
        "final_train_loss_mean_last_100": float(np.mean([h["loss"] for h in history[-100:]])),
        **{k: v for k, v in history[-1].items() if k.startswith(("val_", "close_"))},
        "load_s": round(load_s, 1),
        "train_s": round(time.perf_counter() - started, 1),
    }
    save_checkpoint(checkpoint, model, norm, sidecar)
    (run_dir / "history.json").write_text(json.dumps(history))
    title = (
        f"π0 {cfg.model.preset} @ {mcfg.vision.image_size}px, pen catch: {sidecar['data']['train_episodes']} episodes"
    )
    plot_losses(history, loss_plot, title)
    plot_losses(history, run_dir / "loss.png", title)
    return {"checkpoint": str(checkpoint), "loss_plot": str(loss_plot), **sidecar["result"]}
