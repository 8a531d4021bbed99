"""The robot-side expert's two threads: one answers chunk requests on the `ExpertEngine`, one installs KV versions.

An answer never waits for a KV version being received or installed: the link decodes and assembles chunks on its
own thread (`kv_client.py`), and the installer thread copies a whole version (host → device, the slot's rows, the
suffix layout) into a slot no chunk reads, on a CUDA stream of its own, while chunks run. What the two threads
share is a pointer, under one short lock:
- `front`, the slot of the newest installed version. A chunk takes it when it starts (and holds that slot until
  its actions are on the host); the installer writes only a slot that is neither the front nor held, and makes it
  the front once its copy is complete. So a chunk in flight finishes on the version it started with, every chunk
  that starts after an install uses the new one, and an answer is conditioned on one version, which it names.
  With three slots (front, the chunk's, the next) the installer never waits for a slot.
- A relay chunk (`offer_relay`) for an observation newer than the front KV is served, once, to the next request:
  the robot gets the new scene's first chunk before its KV has crossed the link.
- Otherwise a request runs a chunk on the front KV with the request's state (π0's state token) and its own noise.
- Staleness: every answer carries its KV's version and age (now minus capture time, one clock: the robot's). Over
  `max_kv_age_ms` the request is refused with one line saying how old, what bound, and what the link is doing;
  before any KV or relay arrived, a request waits for one at most that long, and so does the first request after
  the robot sent none for longer than the bound (its KV is stale only because nothing went up: its own
  observation's relay or KV is on the way). Requests that keep coming on a stale KV are refused at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vla_rt.engine.split_engines import ExpertEngine
from vla_rt.split.kv_codec import CompleteKv

log = logging.getLogger("vla_rt.split")
EVENTS_KEPT = 20_000
NS = 1e-9


def capture_time(version: int) -> float:
    """A version is its observation's capture time in ns on the robot's monotonic clock."""
    return version * NS


@dataclass
class ChunkRequest:
    state: torch.Tensor | None  # (1, A) float32 normalised (π0's state token), None for π0.5; host or device
    noise: torch.Tensor  # (1, H, A) float32, host or device (`start_chunk` copies both into the engine)
    received: float  # time.monotonic()
    deliver: Callable[[ChunkResult], None]  # called on this thread; must not block


@dataclass(frozen=True)
class ChunkResult:
    actions: np.ndarray | None  # (H, A) float32 normalised, None with an error
    error: str | None
    kv_version: int
    kv_age_ms: float
    source: str  # "local" (this expert on its KV) or "relay" (the prefix server's first chunk)
    compute_ms: float
    queue_ms: float


@dataclass
class _Relay:
    version: int
    actions: np.ndarray
    served: bool = False


class ExpertWorker:
    def __init__(self, engine: ExpertEngine, *, max_kv_age_ms: float, link_status: Callable[[], str] = lambda: ""):
        self.engine, self.max_age_s, self.link_status = engine, max_kv_age_ms / 1e3, link_status
        self.front = -1  # the slot of the newest installed version (-1: none yet)
        self.slot_version = [-1] * len(engine.slots)
        self._held = -1  # the slot the chunk in progress reads, until its actions are on the host
        self._kv: CompleteKv | None = None  # newest whole version not installed yet
        self._relay: _Relay | None = None
        self._requests: deque[ChunkRequest] = deque()
        self._last_received = float("-inf")  # the previous request's arrival (answering thread only)
        self._cv = threading.Condition()  # guards all of the above; never held across device work
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="vla-rt-expert", daemon=True)
        self._installer = threading.Thread(target=self._install_loop, name="vla-rt-kv-install", daemon=True)
        self._stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)

    # ----- inputs (any thread) --------------------------------------------------------------------------------------
    def offer_kv(self, kv: CompleteKv) -> None:
        with self._cv:
            if self._kv is None or kv.version > self._kv.version:
                self._kv = kv
            self._cv.notify_all()

    def offer_relay(self, version: int, actions: np.ndarray) -> None:
        with self._cv:
            if self._relay is None or version > self._relay.version:
                self._relay = _Relay(version, actions)
            self._cv.notify_all()

    def submit(self, request: ChunkRequest) -> None:
        with self._cv:
            self._requests.append(request)
            self._cv.notify_all()

    def start(self) -> None:
        self._installer.start()
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(30)
        self._installer.join(30)

    @property
    def front_version(self) -> int:
        return self.slot_version[self.front] if self.front >= 0 else -1

    # ----- the answering thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._requests and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                request = self._requests.popleft()
            try:
                self._serve(request)
            except Exception:  # a device fault or a bug: the robot gets one line, the log the traceback
                log.exception("robot-side expert failed")
                self._release()
                request.deliver(ChunkResult(None, "internal error in the robot-side expert (see its log)", -1,
                                            float("nan"), "local", 0.0, 0.0))  # fmt: skip

    def _fresh_relay(self) -> _Relay | None:
        r = self._relay
        return r if r is not None and not r.served and r.version > self.front_version else None

    def _refuse(self, request: ChunkRequest, version: int, age_s: float, why: str) -> None:
        request.deliver(ChunkResult(None, why, version, age_s * 1e3, "local", 0.0,
                                    (time.monotonic() - request.received) * 1e3))  # fmt: skip

    def _take(self, request: ChunkRequest) -> tuple[float, _Relay | None, int, int] | None:
        """(start, a fresh relay or None, the front slot now held or -1, its version), under the lock: the atomic
        switch between two versions is here. Waits for the first KV or relay at most the staleness bound (None if
        none came). After an idle spell longer than the bound, the front KV is stale because no observation went up,
        not because the link is slow, so the request waits as long for its own observation's relay or KV; without
        that, a robot that paused (between episodes) had its first request refused as stale and its connection
        closed. A request that follows another within the bound keeps the immediate refusal."""
        bound = self.max_age_s
        after_idle = request.received - self._last_received > bound
        self._last_received = request.received
        with self._cv:
            while self._fresh_relay() is None and (
                self.front < 0 or (after_idle and time.monotonic() - capture_time(self.front_version) > bound)
            ):
                remaining = request.received + bound - time.monotonic()
                if remaining <= 0 or self._stopped:
                    if self.front < 0:
                        return None
                    break  # still stale: `_serve` refuses it, naming its age
                self._cv.wait(remaining)
            start, relay = time.monotonic(), self._fresh_relay()
            if relay is not None:  # marked served by `_serve` (only this thread serves), unless refused
                return start, relay, -1, relay.version
            self._held = self.front
            return start, None, self.front, self.front_version

    def _release(self) -> None:
        with self._cv:
            self._held = -1
            self._cv.notify_all()

    def _serve(self, request: ChunkRequest) -> None:
        bound = self.max_age_s
        taken = self._take(request)
        if taken is None:
            return self._refuse(request, -1, float("nan"), f"no KV yet: nothing came from the prefix server "
                                f"within --max-kv-age-ms {bound * 1e3:.0f} (it {self.link_status()})")  # fmt: skip
        start, relay, slot, version = taken
        age = start - capture_time(version)
        if age > bound:
            self._release()
            return self._refuse(request, version, age, f"stale KV: the newest prefix (version {version}) is "
                                f"{age * 1e3:.0f} ms old, over --max-kv-age-ms {bound * 1e3:.0f}; the prefix server "
                                f"{self.link_status()}")  # fmt: skip
        if relay is not None:
            relay.served = True
            actions, source = relay.actions, "relay"
        else:
            actions, source = self._chunk(slot, version, request), "local"
        end = time.monotonic()
        self.events.append({"kind": "answer", "version": version, "start": start, "end": end, "source": source,
                            "age_ms": age * 1e3})  # fmt: skip
        request.deliver(ChunkResult(actions, None, version, age * 1e3, source, (end - start) * 1e3,
                                    (start - request.received) * 1e3))  # fmt: skip

    def _chunk(self, slot: int, version: int, request: ChunkRequest) -> np.ndarray:
        """One chunk on the held slot; the slot is released once the actions are on the host (the copy waits for
        every step), so the installer never overwrites a KV a step may still read."""
        e = self.engine
        try:
            e.start_chunk(slot, request.state, request.noise)
            while True:
                t0 = time.monotonic()
                done = e.step()
                self.events.append({"kind": "step", "version": version, "start": t0, "end": time.monotonic()})
                if done:
                    return e.actions()[0].cpu().numpy()
        finally:
            self._release()

    # ----- the installing thread ------------------------------------------------------------------------------------
    def _free_slot(self) -> int:
        """A slot neither the front nor held (-1: none; with three slots there always is one). Under the lock."""
        return next((i for i in range(len(self.slot_version)) if i not in (self.front, self._held)), -1)

    def _install_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._kv is None or self._free_slot() < 0):
                    self._cv.wait()
                if self._stopped:
                    return
                kv, self._kv, target = self._kv, None, self._free_slot()
                if kv.version <= self.front_version:
                    continue
            try:
                self._install(kv, target)
            except Exception:  # a device fault or a bug: this version is lost, the next one is tried
                log.exception("installing KV version %d failed", kv.version)

    def _install(self, kv: CompleteKv, target: int) -> None:
        """Copies a whole version into `target` (no chunk reads it), waits for the copy, then makes it the front."""
        t0 = time.monotonic()
        e = self.engine
        if self._stream is None:
            e.import_prefix(target, *kv.to_device(e.device, e.dtype), version=kv.version)
        else:
            with torch.cuda.stream(self._stream):
                e.import_prefix(target, *kv.to_device(e.device, e.dtype), version=kv.version)
            self._stream.synchronize()
        with self._cv:
            self.front, self.slot_version[target] = target, kv.version
            mid_chunk = self._held >= 0
            self._cv.notify_all()
        self.events.append({"kind": "install", "version": kv.version, "start": t0, "end": time.monotonic(),
                            "slot": target, "arrived": kv.completed_at, "mid_chunk": mid_chunk})  # fmt: skip
