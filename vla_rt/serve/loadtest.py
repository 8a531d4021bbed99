"""`vla-rt loadtest`: N real `openpi-client` robots against a server, each sending observations at a fixed rate.

Every robot is a thread with its own `WebsocketClientPolicy` (openpi's client, unchanged) that sends its profile's
example observation (random uint8 images, a full-length `tokenized_prompt`) every 1/rate seconds, or at once when
the previous answer came late (no bursts to catch up). It records the round trip seen by the robot, the server's
timing, and every error or refusal; `summarize` turns that into requests/s and p50/p90/p99 per robot and overall.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from tqdm import tqdm
from websockets.exceptions import InvalidStatus

from vla_rt.serve.profiles import get_profile

ANSWER_TIMEOUT_S = 60.0  # a robot still waiting this long after the round ended counts as an error
FRAMES_PER_ROBOT = 4
TEXT_PROMPTS = (
    "pick up the fork",
    "fold the towel",
    "put the cup on the plate",
    "open the drawer",
)  # distinct observations a robot cycles through (building one per request would cost more)


@dataclass
class RobotRun:
    robot: int
    latencies_ms: list[float] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)  # time.monotonic() of each answer
    batch_sizes: list[float] = field(default_factory=list)
    server_timing: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    refused: str | None = None
    replica: int | None = None  # the Ray Serve worker replica that admitted it (`vla-rt serve --ray`), else None


def robot_observations(metadata: dict[str, Any], rng: np.random.Generator, size: int = 224) -> list[dict[str, Any]]:
    """Observations for the server's profile: its example with a text prompt when the server has a tokenizer (π0.5
    needs one: its prompt carries the state), else a `tokenized_prompt` of the server's full prompt length."""
    profile = get_profile(metadata["profile"], metadata.get("num_views"))
    frames = []
    for i in range(FRAMES_PER_ROBOT):
        tokens = rng.integers(1, min(metadata["vocab_size"], 1000), metadata["prompt_len"])
        prompt = TEXT_PROMPTS[i % len(TEXT_PROMPTS)] if metadata.get("text_prompts") else tokens
        frames.append(profile.example(rng, size=size, prompt=prompt, state_dim=metadata.get("state_dim") or 8))
    return frames


def refusal(e: InvalidStatus) -> str:
    """A refused handshake as the robot sees it: `HTTP <status>: <the server's reason>`."""
    body = e.response.body.decode(errors="replace").strip() if e.response.body else ""
    return f"HTTP {e.response.status_code}: {body}"


def run_robot(uri: str, robot: int, rate_hz: float, until: float, *, api_key: str | None = None,
              expected_profile: str | None = None, on_answer: Callable[[], None] | None = None,
              image_size: int = 224, run: RobotRun | None = None) -> RobotRun:  # fmt: skip
    """One robot: connect, then infer every 1/rate s until `until` (time.monotonic()); never raises. `run`: the
    record to fill as it goes (a soak reads it while the robot runs)."""
    run = RobotRun(robot) if run is None else run
    try:
        client = WebsocketClientPolicy(host=uri, api_key=api_key)
    except InvalidStatus as e:
        run.refused = refusal(e)
        return run
    except OSError as e:
        run.errors.append(f"connect: {e}")
        return run
    try:
        metadata = client.get_server_metadata()
        run.replica = metadata.get("replica")
        if expected_profile is not None and metadata.get("profile") != expected_profile:
            run.errors.append(f"profile: expected the server to serve {expected_profile!r}, "
                              f"found {metadata.get('profile')!r}")  # fmt: skip
            return run
        frames = robot_observations(metadata, np.random.default_rng(robot), image_size)
        shape = (metadata["action_horizon"], metadata["action_dim"])
        period, due, k = 1.0 / rate_hz, time.monotonic(), 0
        while (now := time.monotonic()) < until:
            if due > now:
                time.sleep(due - now)
            t0 = time.perf_counter()
            try:
                answer = client.infer(frames[k % len(frames)])
            except Exception as e:  # a text error frame (RuntimeError) or a closed connection: both end the robot
                run.errors.append(f"{type(e).__name__}: {e}")
                return run
            run.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            run.answered_at.append(time.monotonic())
            actions = answer.get("actions")
            if not isinstance(actions, np.ndarray) or actions.shape != shape or not np.isfinite(actions).all():
                found = actions.shape if isinstance(actions, np.ndarray) else type(actions).__name__
                run.errors.append(f"actions: expected a finite {shape} array, found {found}")
            timing = answer.get("server_timing", {})
            run.batch_sizes.append(float(timing.get("batch_size", 0)))
            run.server_timing.append({k: float(v) for k, v in timing.items() if isinstance(v, int | float)})
            if on_answer is not None:
                on_answer()
            k += 1
            due = max(due + period, time.monotonic() - period)  # late: send now, but never a burst
    finally:
        client._ws.close()  # openpi-client 0.1.2 has no close(); its connection is this attribute
    return run


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99)}


def summarize(runs: list[RobotRun], seconds: float) -> dict[str, Any]:
    """A round's numbers: overall and per robot (answers, requests/s, percentiles, errors), refused robots."""
    everything = [x for r in runs for x in r.latencies_ms]
    batches = [b for r in runs for b in r.batch_sizes if b]
    timings = [t for r in runs for t in r.server_timing]
    keys = sorted({k for t in timings for k in t})
    return {
        "robots": len(runs),
        "answers": len(everything),
        "requests_per_s": len(everything) / seconds,
        **_percentiles(everything),
        "mean_batch": float(np.mean(batches)) if batches else None,
        # medians of the server's own timing fields (where the time between frame and answer went)
        "server_timing": {k: float(np.median([t[k] for t in timings if k in t])) for k in keys},
        "refused": sum(r.refused is not None for r in runs),
        "errors": sum(len(r.errors) for r in runs),
        # admitted robots per worker replica (`--ray`; empty for one server): how the ingress spread them
        "by_replica": dict(sorted(Counter(str(r.replica) for r in runs if r.replica is not None).items())),
        "per_robot": [
            {
                "robot": r.robot,
                "answers": len(r.latencies_ms),
                "requests_per_s": len(r.latencies_ms) / seconds,
                **_percentiles(r.latencies_ms),
                "errors": r.errors,
                "refused": r.refused,
                "replica": r.replica,
            }  # fmt: skip
            for r in runs
        ],
    }


def run_round(host: str, port: int, robots: int, rate_hz: float, seconds: float, *, api_key: str | None = None,
              profile: str | None = None, progress: bool = True, image_size: int = 224) -> dict[str, Any]:  # fmt: skip
    """N robots for `seconds`; returns `summarize`'s dict. The server must be up."""
    uri = f"ws://{host}:{port}/?hz={rate_hz:g}"
    lock, answered = threading.Lock(), [0]

    def count() -> None:
        with lock:
            answered[0] += 1

    until = time.monotonic() + seconds
    results: list[RobotRun | None] = [None] * robots

    def robot(i: int) -> None:
        results[i] = run_robot(uri, i, rate_hz, until, api_key=api_key, expected_profile=profile,
                               on_answer=count, image_size=image_size)  # fmt: skip

    threads = [threading.Thread(target=robot, args=(i,), name=f"robot-{i}", daemon=True) for i in range(robots)]
    start = time.monotonic()
    for t in threads:
        t.start()
    with tqdm(total=round(seconds), desc=f"{robots} robots at {rate_hz:g} Hz", unit="s", disable=not progress,
              leave=False) as bar:  # fmt: skip
        while any(t.is_alive() for t in threads) and time.monotonic() < until + ANSWER_TIMEOUT_S:
            time.sleep(0.25)
            elapsed = min(seconds, time.monotonic() - start)
            bar.n = int(elapsed)
            bar.set_postfix(answers=answered[0], refresh=True)
    for t in threads:
        t.join(max(0.0, until + ANSWER_TIMEOUT_S - time.monotonic()))
    runs = [r if r is not None else RobotRun(i, errors=[f"no answer within {ANSWER_TIMEOUT_S:g} s of the end"])
            for i, r in enumerate(results)]  # fmt: skip
    return summarize(runs, seconds)
