"""`vla-rt serve --role prefix|expert`: from the serve settings to running servers.

    vla-rt serve CKPT --role prefix --port 8000 --kv-port 8001
        openpi robots on :8000 get whole answers (prefix + relay); robot-side experts subscribe on :8001/kv
    vla-rt serve CKPT_OR_EXPERT_FILE --role expert --prefix-server gpu-box:8001 --port 8000 --max-kv-age-ms 500
        the robot's openpi client on :8000 gets chunks from the newest KV this expert holds

Both take the usual serve flags (profile, views, chunk, prompt length, tokenizer, API key, seed); the two halves must
be started with the same shapes (the KV link's hello refuses a mismatch by name). `CKPT_OR_EXPERT_FILE`: the expert
loads only what it runs; `vla-rt serve CKPT --role export-expert --out FILE` writes that half of a checkpoint once
(`expert_file.py`), so the robot never stores the 3.5B-parameter checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vla_rt.checkpoints import check_destination, load_checkpoint
from vla_rt.engine.split_engines import ExpertEngine, PrefixEngine
from vla_rt.errors import ArgumentError
from vla_rt.inference import Pi0Inference
from vla_rt.inputs import BuiltShapes, ModelInputs
from vla_rt.policy import Pi0Policy
from vla_rt.serve.app import ServeConfig, check_model_settings, device_name, read_model_config, server_options
from vla_rt.serve.engines import ServingModel, WholeCallStages
from vla_rt.serve.profiles import MODEL_VIEWS, RobotProfile, get_profile
from vla_rt.serve.scheduler import StageCosts
from vla_rt.serve.server import PolicyServer, serve_until_signalled
from vla_rt.serve.service import RobotService, ServiceOptions
from vla_rt.serve.worker import StageRunner, measure_costs
from vla_rt.split.expert_file import (
    ExpertWeights,
    fingerprint,
    load_expert_weights,
    read_expert_config,
    save_expert_file,
)
from vla_rt.split.expert_service import ExpertService
from vla_rt.split.expert_worker import ExpertWorker
from vla_rt.split.kv_client import KvLinkClient
from vla_rt.split.kv_codec import DEFAULT_CHUNK_BYTES, KV_FORMATS, KvAssembler
from vla_rt.split.kv_server import KvLinkServer
from vla_rt.split.messages import LinkLayout
from vla_rt.split.prefix_service import PrefixService
from vla_rt.split.shaper import LinkProfile

log = logging.getLogger("vla_rt.split")
ROLES = ("all", "prefix", "expert", "export-expert")
NUM_STEPS = 10


@dataclass(frozen=True)
class SplitConfig:
    role: str = "all"
    kv_port: int = 8001  # prefix: where experts subscribe
    prefix_server: str | None = None  # expert: HOST:PORT of the prefix server's KV link
    max_kv_age_ms: float = 500.0
    kv_format: str = "native"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    link: LinkProfile = LinkProfile()  # test hook: latency / bandwidth applied to what this role sends
    out: str | None = None  # export-expert: the file to write


def add_split_args(p: argparse.ArgumentParser) -> None:
    """The split's flags on `vla-rt serve`. A role's own flags default to None (the role fills in SplitConfig's
    defaults), so `role_flags_used_elsewhere` can tell a flag given to a role that ignores it."""
    g = p.add_argument_group("split π0 (the VLM prefix on a server, the action expert beside the robot; docs/split.md)")
    g.add_argument("--role", choices=ROLES, default="all", help="all: the whole model here (default); prefix: vision "
                   "+ VLM + relay; expert: the action expert on the newest KV; export-expert: write --out")  # fmt: skip
    g.add_argument("--kv-port", type=int, help="prefix: port of the KV link (experts subscribe; default 8001)")
    g.add_argument("--prefix-server", help="expert: HOST:PORT of the prefix server's KV link")
    g.add_argument("--max-kv-age-ms", type=float, help="expert: refuse to act on an older KV (default 500)")
    g.add_argument("--kv-format", choices=KV_FORMATS, help="expert: KV on the wire (native, the default: the "
                   "server's dtype; fp8: e4m3 with a scale per layer, half the bytes)")  # fmt: skip
    g.add_argument("--device", help="where this role runs (default: cuda when available); e.g. cpu for a small expert")
    g.add_argument("--link-latency-ms", type=float, help="test hook: delay every frame this role sends "
                   "(an expert also asks the server to delay what it sends back)")  # fmt: skip
    g.add_argument("--link-mbps", type=float, help="test hook: cap the bandwidth of what this role sends (an expert "
                   "also asks it of the server's downlink)")  # fmt: skip
    g.add_argument("--out", help="export-expert: the expert-only .safetensors file to write")


# the roles each split flag acts in: given to another role it would be silently ignored, so it is refused
ROLE_FLAGS: dict[str, tuple[str, ...]] = {
    "--kv-port": ("prefix",),
    "--prefix-server": ("expert",),
    "--max-kv-age-ms": ("expert",),
    "--kv-format": ("expert",),
    "--link-latency-ms": ("prefix", "expert"),
    "--link-mbps": ("prefix", "expert"),
    "--out": ("export-expert",),
}


def check_role_flags(args: argparse.Namespace) -> None:
    """ArgumentError for the first split flag given to a role that does not use it (e.g. `--prefix-server` without
    `--role expert`: the whole model would run here while the user believes the robot runs the expert alone)."""
    for flag, roles in ROLE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and args.role not in roles:
            needs = " or ".join(f"--role {r}" for r in roles)
            raise ArgumentError(flag, f"{needs} (--role {args.role} does not use it)", value)


def check_prefix_server(address: str) -> None:
    """`HOST:PORT` with a port in [1, 65535]: without one the expert dialled port 80 and waited forever; past 65535
    the connection failed as an internal error after the weights had loaded."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ArgumentError("--prefix-server", "HOST:PORT of the prefix server's KV link, a port in [1, 65535]",
                            address)  # fmt: skip


def check_export_out(out: str | None, checkpoint: str) -> None:
    """`--out` of export-expert, before the checkpoint is read: a .safetensors name (the expert role reads no other),
    a path that can be written, and not the checkpoint itself (the expert half would replace the whole model)."""
    if not out:
        raise ArgumentError("--out", "the .safetensors file to write with --role export-expert", None)
    path = Path(out)
    if path.suffix != ".safetensors":
        raise ArgumentError("--out", "a file name ending in .safetensors (the expert role reads no other)", out)
    check_destination(path, "--out")
    if path.exists() and Path(checkpoint).exists() and path.resolve() == Path(checkpoint).resolve():
        raise ArgumentError("--out", "a different file than the checkpoint (it would be replaced by its expert half)",
                            out)  # fmt: skip


def split_config(args: argparse.Namespace) -> SplitConfig:
    """The split flags, checked for every role (before anything loads); SplitConfig's defaults where not given."""
    check_role_flags(args)
    if args.role == "expert" and not args.prefix_server:
        raise ArgumentError("--prefix-server", "HOST:PORT of the prefix server's KV link with --role expert", None)
    if args.role == "export-expert":
        check_export_out(args.out, args.checkpoint)
    if args.prefix_server is not None:
        check_prefix_server(args.prefix_server)
    if args.kv_port is not None and not 0 <= args.kv_port <= 65535:  # else bind() failed after the model loaded
        raise ArgumentError("--kv-port", "a port in [0, 65535]", args.kv_port)
    if args.max_kv_age_ms is not None and not 0 < args.max_kv_age_ms < math.inf:  # NaN: no KV would ever be stale
        raise ArgumentError("--max-kv-age-ms", "a positive bound in milliseconds", args.max_kv_age_ms)
    if args.role == "expert" and getattr(args, "warm_lead_ms", 0.0):
        raise ArgumentError("--warm-lead-ms", "0 with --role expert (it rehearses the server's prepare, which the "
                            "robot-side expert has no stage of)", args.warm_lead_ms)  # fmt: skip
    try:
        link = LinkProfile(args.link_latency_ms or 0.0, args.link_mbps)
    except ValueError:
        raise ArgumentError(
            "--link-latency-ms / --link-mbps",
            "a finite latency >= 0 ms and bandwidth > 0 Mb/s",
            None,
            found_text=f"{args.link_latency_ms} ms, {args.link_mbps} Mb/s",
        ) from None
    given = {k: v for k, v in (("kv_port", args.kv_port), ("max_kv_age_ms", args.max_kv_age_ms),
                               ("kv_format", args.kv_format)) if v is not None}  # fmt: skip
    return SplitConfig(args.role, prefix_server=args.prefix_server, link=link, out=args.out, **given)


@dataclass(frozen=True)
class Built:
    """Shapes and settings both roles derive the same way from the serve flags."""

    profile: RobotProfile
    shapes: BuiltShapes
    device: torch.device
    dtype: torch.dtype


def role_shapes(serve: ServeConfig, cfg) -> Built:
    """The profile, shapes, device and dtype a role runs with (both roles derive them the same way)."""
    profile = get_profile(serve.profile, serve.num_views).for_model(cfg.pi05)
    views = serve.num_views or profile.views
    if views < profile.views:
        raise ArgumentError("--num-views", f"at least {profile.views} (the {profile.name} profile's views)", views)
    if serve.prompt_len is not None and serve.prompt_len < 1:
        raise ArgumentError("--prompt-len", "at least 1 token (π0's prompt is BOS + text + '\\n')", serve.prompt_len)
    chunk = serve.chunk or profile.chunk or cfg.chunk
    prompt = cfg.max_token_len if serve.prompt_len is None else serve.prompt_len
    device = serve.resolved_device()
    return Built(profile, BuiltShapes(views, chunk, prompt, 1), device,
                 torch.bfloat16 if device.type == "cuda" else torch.float32)  # fmt: skip


def _policy(run, cfg, b: Built, serve: ServeConfig, *, backend: str, source: str, norm_stats, quantiles, impl,
            assets: tuple[str, ...] = ()):  # fmt: skip
    model = Pi0Inference(run, cfg, b.shapes, backend=backend, device=b.device, dtype=b.dtype, source=source,
                         norm_stats=norm_stats, impl=impl, use_quantile_norm=quantiles,
                         norm_stats_assets=assets)  # fmt: skip
    return Pi0Policy(model, camera_names=MODEL_VIEWS[: b.shapes.num_views], tokenizer=serve.tokenizer,
                     prompt_len=b.shapes.prompt_len, num_steps=NUM_STEPS)  # fmt: skip


class SplitServers:
    """Several servers of one role on one event loop (`serve(stop, ready)`, as `ServerThread` runs one)."""

    def __init__(self, servers: list, on_start=None, on_stop=None):
        self.servers, self._on_start, self._on_stop = servers, on_start, on_stop

    @property
    def port(self) -> int:
        return self.servers[0].port

    async def serve(self, stop: asyncio.Event, ready: threading.Event | None = None) -> None:
        events = [threading.Event() for _ in self.servers]
        if self._on_start is not None:
            self._on_start()
        try:
            tasks = [asyncio.create_task(s.serve(stop, e)) for s, e in zip(self.servers, events)]
            while not all(e.is_set() for e in events):
                if any(t.done() for t in tasks):
                    await asyncio.gather(*tasks)  # raises what stopped one
                await asyncio.sleep(0.01)
            if ready is not None:
                ready.set()
            await asyncio.gather(*tasks)
        finally:
            if self._on_stop is not None:
                self._on_stop()


def build_prefix_role(serve: ServeConfig, split: SplitConfig, cost: StageCosts | None = None) -> SplitServers:
    """openpi robots on `serve.port` (prefix + relay: whole answers) and the KV link on `split.kv_port`."""
    check_model_settings(serve, read_model_config(serve.checkpoint, serve.asset_id))  # a header read, then weights
    ckpt = load_checkpoint(serve.checkpoint, asset_id=serve.asset_id)
    b = role_shapes(serve, ckpt.config)
    cfg = ckpt.config.replace(chunk=b.shapes.chunk)
    engine = PrefixEngine(ckpt.weights, cfg, b.shapes, device=b.device, dtype=b.dtype, num_steps=NUM_STEPS)
    relay = ExpertEngine.on_weights(engine.weights, cfg, b.shapes, device=b.device, dtype=b.dtype,
                                    num_steps=NUM_STEPS, slots=[engine.slot])  # fmt: skip
    service = PrefixService(engine, relay, b.shapes, chunk_bytes=split.chunk_bytes)
    fp = fingerprint(ckpt.weights)
    policy = _policy(service.run_full, cfg, b, serve, backend="split-prefix", source=ckpt.source,
                     norm_stats=ckpt.norm_stats, quantiles=ckpt.use_quantile_norm, impl=service,
                     assets=ckpt.norm_stats_assets)  # fmt: skip
    del ckpt
    serving = ServingModel(WholeCallStages(service.run_full, cfg, b.shapes, device=b.device, num_steps=NUM_STEPS),
                           policy)  # fmt: skip
    if cost is None:
        runner = StageRunner(serving.stages, prompt_len=policy.prompt_len)
        cost = measure_costs(runner, iters=serve.cost_iters or (30 if b.device.type == "cuda" else 3))
    # policy="stage": the whole call is one opaque backend function with no prefix stage to start beside the steps,
    # so the default `overlap` scheduler (its begin_admit / join) ended every robot request in an internal error
    options = ServiceOptions(policy="stage", slo_ms=serve.slo_ms, admission=serve.admission,
                             window_ms=serve.window_ms, default_rate_hz=serve.robot_hz,
                             default_prompt=serve.default_prompt, seed=serve.seed)  # fmt: skip
    robots = PolicyServer(RobotService(serving, b.profile, cost, options, device_name=device_name(b.device)),
                          server_options(serve))  # fmt: skip
    kv = KvLinkServer(service, LinkLayout.of(cfg, b.shapes, NUM_STEPS), fp, host=serve.host, port=split.kv_port,
                      api_key=serve.api_key, link=split.link)  # fmt: skip
    return SplitServers([robots, kv], on_start=service.start, on_stop=service.stop)


def _no_local_model(x: ModelInputs, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
    raise RuntimeError("the robot-side expert has no VLM: its answers come from ExpertService")


def build_expert_role(serve: ServeConfig, split: SplitConfig) -> SplitServers:
    """The robot's openpi client on `serve.port`; the KV link to `split.prefix_server`."""
    check_model_settings(serve, read_expert_config(serve.checkpoint, serve.asset_id))  # a header read, then weights
    ew = load_expert_weights(serve.checkpoint, serve.asset_id)
    b = role_shapes(serve, ew.config)
    cfg = ew.config.replace(chunk=b.shapes.chunk)
    engine = ExpertEngine.from_expert_weights(ew.weights, cfg, b.shapes, device=b.device, dtype=b.dtype,
                                              num_steps=NUM_STEPS, num_slots=3)  # fmt: skip
    return expert_servers(engine, ew, b, serve, split)


def expert_servers(engine: ExpertEngine, ew: ExpertWeights, b: Built, serve: ServeConfig,
                   split: SplitConfig) -> SplitServers:  # fmt: skip
    """The expert role around a built engine (the benchmark runs several rounds on one)."""
    cfg = engine.cfg
    policy = _policy(_no_local_model, cfg, b, serve, backend="split-expert", source=ew.source,
                     norm_stats=ew.norm_stats, quantiles=ew.use_quantile_norm, impl=engine,
                     assets=ew.norm_stats_assets)  # fmt: skip
    layout = LinkLayout.of(cfg, b.shapes, NUM_STEPS)
    client: KvLinkClient | None = None
    worker = ExpertWorker(engine, max_kv_age_ms=split.max_kv_age_ms, link_status=lambda: client.status())
    client = KvLinkClient(split.prefix_server, layout, ew.fingerprint, split.kv_format,
                          KvAssembler(layout.kv(cfg.vision.num_patches), pin_memory=b.device.type == "cuda"),
                          on_relay=worker.offer_relay, on_kv=worker.offer_kv, api_key=serve.api_key, link=split.link,
                          downlink=split.link if split.link.shaped else None)  # fmt: skip
    service = ExpertService(policy, b.profile, worker, client, default_prompt=serve.default_prompt, seed=serve.seed,
                            device_name=device_name(b.device))  # fmt: skip
    # no rehearsal: the robot-side expert prepares nothing on its loop (split_config refuses --warm-lead-ms > 0)
    return SplitServers([PolicyServer(service, server_options(replace(serve, warm_lead_ms=0.0))), client])


def run_role(serve: ServeConfig, split: SplitConfig) -> int:
    """`vla-rt serve --role ...` (not `all`, which `cmd_serve` runs itself)."""
    if split.role == "export-expert":  # a file without the robot's norm stats would run the expert in model units
        path = save_expert_file(split.out, serve.checkpoint, serve.asset_id, field="--asset-id")  # refuses no asset
        print(f"wrote the expert half of {serve.checkpoint} to {path} ({path.stat().st_size / 1e9:.2f} GB)")
        return 0
    server = build_prefix_role(serve, split) if split.role == "prefix" else build_expert_role(serve, split)

    return serve_until_signalled(server)
