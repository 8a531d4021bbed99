"""From `vla-rt serve`'s settings to a running server: check every setting, load, build the stages, time them.

`ServeConfig` holds every setting (the CLI's flags, one field each) and `ServeConfig.check()` checks all of them in
microseconds, before anything is loaded (a bad port must not wait for a minute of engine builds); `build_service`
does the expensive part once (checkpoint, stage engine and its graphs, cost model) and records how long each phase
took; `build_server` adds the websocket front end. Tests build the same objects with a small model and injected
stage costs.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from vla_rt.arguments import check_device
from vla_rt.checkpoints import check_asset_id, read_runnable_header
from vla_rt.config import Pi0Config
from vla_rt.errors import ArgumentError
from vla_rt.serve.engines import build_serving_model
from vla_rt.serve.profiles import MODEL_VIEWS, PROFILES, get_profile
from vla_rt.serve.scheduler import POLICIES, StageCosts
from vla_rt.serve.server import PolicyServer, ServerOptions
from vla_rt.serve.service import RobotService, ServiceOptions
from vla_rt.serve.worker import StageRunner, measure_costs

log = logging.getLogger("vla_rt.serve")
SERVE_BACKENDS = ("folded", "triton")

# ServeConfig field -> (its flag, type, smallest, largest, smallest excluded): checked before any work
BOUNDS: dict[str, tuple[str, type, float, float, bool]] = {
    "port": ("--port", int, 0, 65535, False),
    "max_batch": ("--max-batch", int, 1, 1024, False),
    "max_prefix": ("--max-prefix", int, 1, 1024, False),
    "num_views": ("--num-views", int, 1, len(MODEL_VIEWS), False),
    "chunk": ("--chunk", int, 1, 1024, False),
    "prompt_len": ("--prompt-len", int, 1, 2048, False),
    "slo_ms": ("--slo-ms", float, 0.0, 1e6, True),
    "window_ms": ("--batch-window-ms", float, 0.0, 1e4, False),
    "robot_hz": ("--robot-hz", float, 0.0, 1000.0, True),
    "max_message_mb": ("--max-message-mb", float, 0.0, 4096.0, True),
    "cost_iters": ("--cost-iters", int, 1, 10000, False),
    "seed": ("--seed", int, 0, 2**63 - 1, False),
    "expert_sms": ("--expert-sms", int, 0, 1024, False),
    "cpu_threads": ("--cpu-threads", int, 1, 1024, False),
    "warm_lead_ms": ("--warm-lead-ms", float, 0.0, 1e3, False),
}


def check_bound(field: str, value: object) -> object:
    """`value` within BOUNDS[field] (None passes: the default), else ArgumentError naming the flag."""
    if value is None:
        return None
    flag, kind, lo, hi, lo_open = BOUNDS[field]
    number = "an integer" if kind is int else "a number"
    expected = f"{number} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok or not math.isfinite(value) or not (lo < value if lo_open else lo <= value) or value > hi:
        raise ArgumentError(flag, expected, value)
    return value


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
    asset_id: str | None = None  # openpi: which assets/<asset_id>/norm_stats.json (required where there are several)
    scheduler: str = "overlap"  # "overlap" (stage-level, the prefix on a second stream), "stage" or "batch"
    max_batch: int = 16  # rows in flight (the stage engine's pool)
    max_prefix: int | None = None  # rows per prefix stage (None: min(8, max_batch); batch: max_batch)
    expert_sms: int = 0  # SMs kept from the prefix stages for the expert steps beside them (0: all shared)
    cpu_threads: int | None = None  # torch's CPU threads in a serving process (None: 1 on CUDA; `use_cpu_threads`)
    slo_ms: float | None = None  # tightens each robot's SLO, its period
    admission: bool = True
    window_ms: float = 2.0
    robot_hz: float = 10.0
    default_prompt: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_message_mb: float = 10.0
    # > 0: rehearse a lone robot's host steps this long before its next frame is due; None: DEFAULT_WARM_LEAD_MS
    warm_lead_ms: float | None = None
    cost_iters: int | None = None  # None: 30 on CUDA, 3 on a CPU
    seed: int | None = None

    def check(self) -> ServeConfig:
        """Every setting against its bounds and the others; ArgumentError (the flag, expected, found) on the first
        bad one. Costs microseconds: `vla-rt serve` runs it before reading the checkpoint."""
        for f in fields(self):
            if f.name in BOUNDS:
                check_bound(f.name, getattr(self, f.name))
        if self.profile not in PROFILES:
            raise ArgumentError("--profile", f"one of {sorted(PROFILES)}", self.profile)
        if self.scheduler not in POLICIES:
            raise ArgumentError("--scheduler", f"one of {POLICIES}", self.scheduler)
        if self.backend is not None and self.backend not in SERVE_BACKENDS:
            raise ArgumentError("--backend", f"one of {SERVE_BACKENDS} (the server runs the engine's stages)",
                                self.backend)  # fmt: skip
        if self.device is not None:
            check_device(self.device)
        if self.expert_sms and self.resolved_device().type != "cuda":
            raise ArgumentError("--expert-sms", "0 on a CPU (an SM partition needs a CUDA device)", self.expert_sms)
        if self.max_prefix is not None and self.max_prefix > self.max_batch:
            raise ArgumentError("--max-prefix", f"at most --max-batch ({self.max_batch}): prefix rows join the pool",
                                self.max_prefix)  # fmt: skip
        views = get_profile(self.profile, self.num_views).views
        if self.num_views is not None and self.num_views < views:
            raise ArgumentError("--num-views", f"at least the {views} model views the {self.profile} profile fills",
                                self.num_views)  # fmt: skip
        if self.tokenizer is not None and not Path(self.tokenizer).is_file():
            raise ArgumentError("--tokenizer", "the path of a SentencePiece .model file", self.tokenizer)
        if self.default_prompt is not None and self.tokenizer is None:
            raise ArgumentError("--default-prompt", "a text prompt with --tokenizer PATH (a SentencePiece .model)",
                                None, found_text="no --tokenizer")  # fmt: skip
        if not self.host:
            raise ArgumentError("--host", "an address to listen on, e.g. 127.0.0.1 or 0.0.0.0", self.host)
        check_asset_id(self.checkpoint, self.asset_id, "--asset-id")  # a random: / file / LeRobot checkpoint: refused
        return self

    def resolved_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolved_max_prefix(self) -> int:
        if self.scheduler == "batch":
            return self.max_batch  # a whole batch joins in one prefix stage
        return self.max_prefix or min(8, self.max_batch)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}".strip()


def use_cpu_threads(cfg: ServeConfig) -> None:
    """Sets torch's intra-op CPU threads for this serving process (its own: `vla-rt serve`, a Ray replica): the
    given count, else one on CUDA; a CPU server keeps torch's own, since there the model itself runs on them.

    Why one on CUDA: the worker's CPU work is copying a stage's rows into its host buffers, and with torch's 16
    OpenMP threads on the H200 machine that copy took 2.6 ms median, 25 ms at p90 and 60 ms at worst (a parallel
    region waits for its slowest thread), against 0.77 / 0.84 / 0.91 ms on one. Those stalls were the prefix stages'
    tails in the start-up cost model (8 rows: p90 81 ms, 41 ms on one thread; the GPU's 38 ms), so admission refused
    robots the GPU had room for (tools/admit_host_probe.py and `device_session.sh variants`, 2026-12-03)."""
    threads = cfg.cpu_threads or (1 if cfg.resolved_device().type == "cuda" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    log.info("torch CPU threads: %d", torch.get_num_threads())


def read_model_config(checkpoint: str, asset_id: str | None = None) -> Pi0Config:
    """The checkpoint's model config (π0 or π0.5, its dims) from a header read: no weights. An openpi checkpoint with
    norm stats for several assets needs `--asset-id` (refused here, before any engine is built: the server would
    feed raw states to the model and send actions in normalised units); a wrong one is named by the reader."""
    return read_runnable_header(checkpoint, asset_id=asset_id, what="vla-rt's server").config


def check_model_settings(cfg: ServeConfig, model_cfg: Pi0Config) -> None:
    """The settings the checkpoint's model needs, checked after its header is read and before any engine is built:
    a π0.5 reads the robot's state from a text prompt (openpi's `discrete_state_input`), so without --tokenizer it
    refuses every request (fixed token ids would freeze the state it sees) and a server for it could answer none."""
    if model_cfg.pi05 and cfg.tokenizer is None:
        raise ArgumentError("--tokenizer", "a SentencePiece .model for a π0.5 checkpoint (its prompt carries the "
                            "robot's state, tokenized per request; PaliGemma's for openpi's checkpoints)", None,
                            found_text=f"no --tokenizer for {cfg.checkpoint}")  # fmt: skip


def build_service(cfg: ServeConfig, costs: StageCosts | None = None) -> RobotService:
    """Checks the settings, loads and builds everything behind the protocol; measures the stage costs unless given."""
    cfg.check()
    t0 = time.perf_counter()
    model_cfg = read_model_config(cfg.checkpoint, cfg.asset_id)
    check_model_settings(cfg, model_cfg)
    profile = get_profile(cfg.profile, cfg.num_views).for_model(model_cfg.pi05)
    views = cfg.num_views or profile.views
    device = cfg.resolved_device()
    backend = cfg.backend or ("triton" if device.type == "cuda" else "folded")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    serving = build_serving_model(cfg.checkpoint, backend=backend, device=device, dtype=dtype, num_views=views,
                                  chunk=cfg.chunk or profile.chunk, prompt_len=cfg.prompt_len,
                                  max_batch=cfg.max_batch, max_prefix=cfg.resolved_max_prefix(),
                                  tokenizer=cfg.tokenizer, expert_sms=cfg.expert_sms,
                                  asset_id=cfg.asset_id)  # fmt: skip
    t1 = time.perf_counter()  # a checkpoint without norm stats: the policy has said so (one warning)
    if costs is None:
        iters = cfg.cost_iters or (30 if device.type == "cuda" else 3)
        costs = measure_costs(StageRunner(serving.stages, prompt_len=serving.policy.prompt_len), iters=iters)
    t2 = time.perf_counter()
    options = ServiceOptions(slo_ms=cfg.slo_ms, admission=cfg.admission, policy=cfg.scheduler,
                             window_ms=cfg.window_ms, default_rate_hz=cfg.robot_hz,
                             default_prompt=cfg.default_prompt, seed=cfg.seed)  # fmt: skip
    service = RobotService(serving, profile, costs, options, device_name=device_name(device))
    service.startup.update(load_and_build=round(t1 - t0, 3), cost_model=round(t2 - t1, 3))
    log.info("start-up: checkpoint + stage engine (graphs) %.1f s, cost model %.1f s", t1 - t0, t2 - t1)
    return service


# A lone robot's p50 on the H200 (2 views, prompt 20, chunk 50, 10 Hz): 15.3-15.8 ms with 2 ms against 15.8-16.0 ms
# without, decode 0.12 -> 0.09 and prepare 0.47 -> 0.30 ms (docs/serving.md, 2026-12-06, session 19)
DEFAULT_WARM_LEAD_MS = 2.0


def warm_lead_ms(cfg: ServeConfig) -> float:
    """`--warm-lead-ms`, else the default: the rehearsal runs only while the server is idle, so it costs no robot."""
    return DEFAULT_WARM_LEAD_MS if cfg.warm_lead_ms is None else cfg.warm_lead_ms


def server_options(cfg: ServeConfig) -> ServerOptions:
    return ServerOptions(host=cfg.host, port=cfg.port, api_key=cfg.api_key,
                         max_message_bytes=int(cfg.max_message_mb * 2**20), warm_lead_ms=warm_lead_ms(cfg))  # fmt: skip


def build_server(cfg: ServeConfig, costs: StageCosts | None = None) -> PolicyServer:
    return PolicyServer(build_service(cfg, costs), server_options(cfg))
