"""`vla-rt loadtest`'s flow: start `vla-rt serve` in a child process (or use a running server), run one round of
robots per count, stop it; with `--compare`, the same counts against a stage-level and a whole-batch server, both
admitting every robot, so their latencies are measured under the same load in the same run.

Each server's start-up (process start to /healthz: checkpoint, engine, graphs, cost model) is timed and reported,
and bounded by `--startup-timeout`. Between rounds the flow waits until the server has released the previous
round's robots (`vla_rt_robots_connected` back to 0), so admission sees each round's fleet alone.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import InvalidStatus

from vla_rt.errors import VlaRtError
from vla_rt.serve.admission import Admission
from vla_rt.serve.loadtest import refusal, run_round
from vla_rt.serve.scheduler import StageCosts

IDLE_TIMEOUT_S = 10.0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _get(host: str, port: int, path: str, api_key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Api-Key {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}{path}", headers=headers), timeout=2) as r:
        return r.status, r.read().decode()


def wait_healthy(host: str, port: int, process: subprocess.Popen | None, log_path: Path | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy:\n{tail}")
        try:
            if _get(host, port, "/healthz", None)[0] == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {host}:{port} was not healthy within {timeout:g} s (--startup-timeout)")


def wait_idle(host: str, port: int, api_key: str | None) -> None:
    """Until the server counts no connected robot (the last round's closes reach it asynchronously)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            text = _get(host, port, "/metrics", api_key)[1]
        except OSError:
            return  # no metrics to read (e.g. a key we lack): rounds still run, admission may see stragglers
        found = re.search(r"^vla_rt_robots_connected (\S+)$", text, re.MULTILINE)
        if found is None or float(found.group(1)) == 0:
            return
        time.sleep(0.1)


class ServerProcess:
    """`vla-rt serve ...` as a child process, its log in `log_path`; `startup_s`: spawn to healthy."""

    def __init__(self, argv: Sequence[str], host: str, port: int, log_path: Path, timeout: float):
        self.argv, self.host, self.port, self.log_path, self.timeout = list(argv), host, port, log_path, timeout
        self.process: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> ServerProcess:
        print(f"starting: {shlex.join(self.argv[1:])}  (log: {self.log_path})", flush=True)
        t0 = time.monotonic()
        self.process = subprocess.Popen(self.argv, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.host, self.port, self.process, self.log_path, self.timeout)
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.monotonic() - t0
        print(f"server healthy after {self.startup_s:.1f} s", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def server_argv(checkpoint: str, host: str, port: int, flags: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "vla_rt.cli", "serve", checkpoint, "--host", host, "--port", str(port), *flags]


class ServerRefusedRobot(VlaRtError):
    """The server under test refused a robot at the test's rate before any round: every round would be refused."""


class ServerUnreachable(VlaRtError):
    """No server answered where the test was told to find one."""


def metadata(host: str, port: int, rate: float, api_key: str | None) -> dict[str, Any]:
    """The server's metadata, read by a robot connection at the test's rate (admission sees what the rounds will
    send). A refusal is the server's answer for this rate, not a bug: it ends the test with the server's reason."""
    try:
        probe = WebsocketClientPolicy(f"ws://{host}:{port}/?hz={rate:g}", api_key=api_key)
    except InvalidStatus as e:
        hint = ("; every round would be refused: lower --rate, raise --slo-ms, or load it past capacity with "
                "--no-admission") if e.response.status_code == 503 else ""  # fmt: skip
        raise ServerRefusedRobot(
            f"the server on port {port} refused a robot at {rate:g} Hz ({refusal(e)}){hint}"
        ) from None
    except OSError as e:  # nothing listening there (a --port without CHECKPOINT), or the host unreachable
        raise ServerUnreachable(f"--host {host} --port {port}: expected a vla-rt server, found none answering "
                                f"({e.strerror or e}); start one with `vla-rt serve CHECKPOINT`, or give the "
                                "CHECKPOINT to start one for the test") from None  # fmt: skip
    try:
        return probe.get_server_metadata()
    finally:
        probe._ws.close()  # openpi-client 0.1.2 has no close()


def run_rounds(host: str, port: int, counts: Sequence[int], *, rate: float, seconds: float, api_key: str | None,
               profile: str, label: str = "", on_round=None) -> list[dict[str, Any]]:  # fmt: skip
    """One round per robot count; `on_round(round)` after each (the report is rewritten as rounds come in)."""
    rounds = []
    for n in counts:
        wait_idle(host, port, api_key)
        r = run_round(host, port, n, rate, seconds, api_key=api_key, profile=profile, progress=sys.stderr.isatty())
        rounds.append(r)
        if on_round is not None:
            on_round(r)
        print(f"{label}{n:4d} robots: {r['requests_per_s']:7.1f} requests/s, p50 {r['p50_ms'] or 0:7.1f} ms, "
              f"p90 {r['p90_ms'] or 0:7.1f} ms, p99 {r['p99_ms'] or 0:7.1f} ms, refused {r['refused']}, "
              f"errors {r['errors']}", flush=True)  # fmt: skip
    return rounds


def one_robot(rounds: Sequence[dict[str, Any]], server: dict[str, Any]) -> dict[str, Any] | None:
    """The lone robot's round trip against the engine's own time for one row (P(1) + steps x E(1), the start-up
    cost model): how much the server and the network add, and where (the server's timing fields, medians). The
    kernels' own time where the server measured it (`engine_request_gpu_ms`, CUDA events), else the cost model's
    wall clock, which also holds host work the served path overlaps."""
    alone = next((r for r in rounds if r["robots"] == 1 and r["p50_ms"] is not None), None)
    if alone is None or server.get("engine_request_ms") is None:
        return None
    gpu = server.get("engine_request_gpu_ms")
    engine = server["engine_request_ms"] if gpu is None else gpu
    return {"p50_ms": alone["p50_ms"], "engine_request_ms": server["engine_request_ms"], "engine_request_gpu_ms": gpu,
            "outside_engine_ms": alone["p50_ms"] - engine, "server_timing": alone.get("server_timing", {})}  # fmt: skip


def predicted_p99_ms(server: dict[str, Any], robots: int, rate: float) -> float | None:
    """What the server's admission model predicts for `robots` robots at `rate` Hz (its connect metadata: the
    scheduler, the pool, the SLO, the start-up cost model), to set beside the p99 the admitted robots measured.
    None without a cost model or a robot."""
    if robots < 1 or not server.get("cost_model"):
        return None
    admission = Admission(StageCosts.from_json(server["cost_model"]), policy=server["scheduler"],
                          capacity=server["max_batch"], slo_ms=server.get("slo_ms"))  # fmt: skip
    return admission.predict([rate] * robots).p99_ms


def run_loadtest(checkpoint: str | None, *, host: str, port: int | None, robots: Sequence[int], rate: float,
                 seconds: float, api_key: str | None, profile: str, out: Path, startup_timeout: float,
                 flags: Sequence[str], compare: dict[str, list[str]], compare_robots: Sequence[int],
                 command: str) -> dict[str, Any]:  # fmt: skip
    """The whole flow (module docstring). The report (JSON, Markdown, plot in `out`) is rewritten after every
    round, so a run cut short by a time limit keeps what it measured."""
    from vla_rt.serve.loadtest_report import write_report

    result: dict[str, Any] = {"device": None, "server": None, "rate_hz": rate, "seconds": seconds, "command": command,
                              "startup_s": {}, "rounds": [], "one_robot": None, "compare": {}}  # fmt: skip
    rounds_of = dict(rate=rate, seconds=seconds, api_key=api_key, profile=profile)

    def save(into: list, r: dict, server: dict[str, Any]) -> None:
        r["predicted_p99_ms"] = predicted_p99_ms(server, r["robots"] - r["refused"], rate)  # the admitted robots
        into.append(r)
        result["one_robot"] = one_robot(result["rounds"], result["server"])
        write_report(result, out)

    def start(run_port: int, log: str, server_flags: Sequence[str]) -> ServerProcess:
        argv = server_argv(checkpoint, host, run_port, server_flags)
        return ServerProcess(argv, host, run_port, out / log, startup_timeout)

    def main_rounds(run_port: int) -> None:
        result["server"] = metadata(host, run_port, rate, api_key)
        result["device"] = result["server"]["device"]
        if result["server"]["profile"] != profile and (checkpoint or profile != "generic"):
            raise RuntimeError(f"--profile {profile}: the server serves {result['server']['profile']!r}")
        run_rounds(host, run_port, robots, on_round=lambda r: save(result["rounds"], r, result["server"]), **rounds_of)

    if checkpoint is None:
        main_rounds(port or 8000)
    else:
        main_port = port or free_port(host)
        with start(main_port, "server.log", flags) as server:
            result["startup_s"]["main"] = server.startup_s
            main_rounds(main_port)
    for scheduler, scheduler_flags in compare.items():
        run_port = free_port(host)
        with start(run_port, f"server_{scheduler}.log", scheduler_flags) as server:
            result["startup_s"][scheduler] = server.startup_s
            entry = result["compare"][scheduler] = {"server": metadata(host, run_port, rate, api_key), "rounds": []}
            into = entry["rounds"]
            run_rounds(host, run_port, compare_robots, label=f"[{scheduler}] ",
                       on_round=lambda r, into=into, s=entry["server"]: save(into, r, s), **rounds_of)  # fmt: skip
    for kind, path in write_report(result, out).items():
        print(f"wrote {kind}: {path}")
    return result
