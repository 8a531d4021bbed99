"""A robot's answer never waits for KV reception: while a KV version is held in the middle of its assembly on the
link, or in the middle of its import into a slot, a request is answered from the version installed before it; once
the held work goes on, the new version is installed and used. The work is held by a gate around the real method
(the assembler's `add`, the engine's `import_prefix`), as a slow link or a big prefix would hold it, only longer:
the test does not depend on this machine's speed, only on which thread waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from split_harness import observation, running_pair
from websockets.sync.client import connect

from vla_rt.serve.wire import pack, unpack_observation

ANSWER_TIMEOUT_S = 10.0  # the old code never answers while the gate is closed: this is how long the test waits


class Robot:
    """An openpi-protocol client whose `infer` gives up after a timeout (openpi's own waits forever)."""

    def __init__(self, port: int):
        self.ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=10)
        self.metadata = unpack_observation(self.ws.recv(timeout=10))

    def infer(self, obs: dict, timeout: float = ANSWER_TIMEOUT_S) -> dict:
        self.ws.send(pack(obs))
        answer = self.ws.recv(timeout=timeout)
        assert not isinstance(answer, str), answer
        return unpack_observation(answer)


class Gate:
    """Wraps a method: every call waits until the gate opens, then runs the method. `calls` keeps the arguments."""

    def __init__(self, fn):
        self.fn, self.entered, self.opened, self.calls = fn, threading.Event(), threading.Event(), []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        self.entered.set()
        assert self.opened.wait(60), "the gate was never opened"
        return self.fn(*args, **kwargs)


@contextmanager
def gated(obj: Any, name: str) -> Iterator[Gate]:
    gate = Gate(getattr(obj, name))
    setattr(obj, name, gate)
    try:
        yield gate
    finally:
        gate.opened.set()


def _wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _first_kv_installed(pair, robot: Robot, rng: np.random.Generator) -> int:
    robot.infer(observation(rng))
    worker = pair.service.worker
    _wait_until(lambda: worker.front >= 0, "the first KV version")
    return worker.front_version


def test_an_answer_does_not_wait_for_a_kv_import_in_progress(checkpoint) -> None:
    rng = np.random.default_rng(21)
    with running_pair(checkpoint) as pair:
        robot, worker = Robot(pair.robot_port), pair.service.worker
        installed = _first_kv_installed(pair, robot, rng)
        with gated(worker.engine, "import_prefix") as gate:
            robot.infer(observation(rng))  # its KV comes next, and its import stops at the gate
            assert gate.entered.wait(10), "no KV version reached the import"
            importing = gate.calls[0][1]["version"]
            t0 = time.monotonic()
            during = robot.infer(observation(rng))  # the old code imported on the answering thread: no answer
            answered_s = time.monotonic() - t0
            assert not gate.opened.is_set() and worker.front_version == installed
        assert during["source"] == "relay" or during["kv_version"] == installed, (during["source"], installed)
        assert answered_s < ANSWER_TIMEOUT_S
        _wait_until(lambda: worker.front_version >= importing, "the held version's install")
        after = robot.infer(observation(rng))
        assert after["kv_version"] >= importing  # installed and used once its import went on


def test_an_answer_does_not_wait_for_kv_chunks_being_assembled(checkpoint) -> None:
    rng = np.random.default_rng(22)
    with running_pair(checkpoint) as pair:
        robot, worker = Robot(pair.robot_port), pair.service.worker
        installed = _first_kv_installed(pair, robot, rng)
        with gated(pair.client.assembler, "add") as gate:
            robot.infer(observation(rng))  # its KV chunks come next, and the first one stops at the gate
            assert gate.entered.wait(10), "no KV chunk reached the assembler"
            arriving = gate.calls[0][0][0]["version"]
            during = robot.infer(observation(rng))  # the old code assembled on the robot's event loop: no answer
            assert not gate.opened.is_set() and worker.front_version == installed
        assert during["source"] == "relay" or during["kv_version"] == installed, (during["source"], installed)
        _wait_until(lambda: worker.front_version >= arriving, "the held version's install")
        after = robot.infer(observation(rng))
        assert after["kv_version"] >= arriving


def test_an_older_observation_offered_late_never_replaces_a_newer_one() -> None:
    """Uplink frames are built on two prepare threads, so a version can reach `offer` after a newer one."""
    from vla_rt.split.kv_client import KvLinkClient

    client = KvLinkClient.__new__(KvLinkClient)  # the uplink's pending slot only: no link, no loop
    client._pending, client._pending_lock, client._loop = None, threading.Lock(), None
    client.offer(5, b"five")
    client.offer(3, b"three")
    assert client._pending == (5, b"five")
    client.offer(7, b"seven")
    assert client._pending == (7, b"seven")
