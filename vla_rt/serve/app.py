"""From `vla-rt serve`'s settings to a running server: load, build the bucket engines, measure the cost model.

`ServeConfig` holds every setting (the CLI's flags, one field each); `build_service` does the expensive part once
(checkpoint, engines, cost model) and `build_server` adds the websocket front end. Tests build the same objects
with a small model and an injected cost model.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

import torch

from vla_rt.checkpoints import load_checkpoint
from vla_rt.serve.engines import build_serving_model
from vla_rt.serve.profiles import get_profile
from vla_rt.serve.scheduler import CostModel
from vla_rt.serve.server import PolicyServer, ServerOptions
from vla_rt.serve.service import RobotService, ServiceOptions
from vla_rt.serve.worker import BatchRunner, measure_cost_model

log = logging.getLogger("vla_rt.serve")


@dataclass(frozen=True)
class ServeConfig:
    checkpoint: str
    profile: str = "generic"
    backend: str | None = None  # None: triton on CUDA, folded on a CPU
    device: str | None = None  # None: cuda when available
    num_views: int | None = None  # None: the profile's
    chunk: int | None = None  # None: the profile's, else the checkpoint's
    prompt_len: int | None = None  # None: the checkpoint's max_token_len
    tokenizer: str | None = None
    max_batch: int = 16
    slo_ms: float | None = None
    window_ms: float = 2.0
    robot_hz: float = 10.0
    default_prompt: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_message_mb: float = 10.0
    cost_iters: int | None = None  # None: 30 on CUDA, 3 on a CPU
    seed: int | None = None

    def resolved_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}".strip()


def build_service(cfg: ServeConfig, cost: CostModel | None = None) -> RobotService:
    """Loads and builds everything behind the protocol; measures the cost model unless one is given."""
    model_cfg = load_checkpoint(cfg.checkpoint, None, shapes_only=True).config  # π0 or π0.5 (a header read)
    profile = get_profile(cfg.profile, cfg.num_views).for_model(model_cfg.pi05)
    views = cfg.num_views or profile.views
    if views < profile.views:
        raise ValueError(f"num_views: the {profile.name} profile fills {profile.views} model views, "
                         f"expected at least that many, found {views}")  # fmt: skip
    if cfg.default_prompt is not None and cfg.tokenizer is None:
        raise ValueError("default_prompt: a text prompt needs --tokenizer PATH (a SentencePiece .model)")
    if cfg.max_message_mb <= 0:
        raise ValueError(f"max_message_mb: expected a positive size, found {cfg.max_message_mb}")
    device = cfg.resolved_device()
    backend = cfg.backend or ("triton" if device.type == "cuda" else "folded")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    serving = build_serving_model(cfg.checkpoint, backend=backend, device=device, dtype=dtype, num_views=views,
                                  chunk=cfg.chunk or profile.chunk, prompt_len=cfg.prompt_len,
                                  max_batch=cfg.max_batch, tokenizer=cfg.tokenizer)  # fmt: skip
    if serving.policy.norm_stats is None:
        log.warning("%s has no norm stats: states go to the model and actions come back unnormalized",
                    cfg.checkpoint)  # fmt: skip
    if cost is None:
        iters = cfg.cost_iters or (30 if device.type == "cuda" else 3)
        cost = measure_cost_model(BatchRunner(serving), iters=iters)
    options = ServiceOptions(slo_ms=cfg.slo_ms, window_ms=cfg.window_ms, default_rate_hz=cfg.robot_hz,
                             default_prompt=cfg.default_prompt, seed=cfg.seed)  # fmt: skip
    return RobotService(serving, profile, cost, options, device_name=device_name(device))


def server_options(cfg: ServeConfig) -> ServerOptions:
    return ServerOptions(host=cfg.host, port=cfg.port, api_key=cfg.api_key,
                         max_message_bytes=int(cfg.max_message_mb * 2**20))  # fmt: skip


def build_server(cfg: ServeConfig, cost: CostModel | None = None) -> PolicyServer:
    return PolicyServer(build_service(cfg, cost), server_options(cfg))
