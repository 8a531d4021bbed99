"""The robot-side expert's one thread: it owns the `ExpertEngine`, installs KV versions, answers chunk requests.

Order of things, all on this thread, so nothing is ever read while it is written:
- A whole KV version (`offer_kv`, from the link) is installed into a slot that is neither the front one nor the one
  a chunk is running on, then that slot becomes the front: between two steps of a chunk in flight (which finishes
  on the version it started with), or at once when idle. A request that starts after the install uses it. With
  three slots (front, the chunk's, the next) a version never waits for more than the step in progress.
- A relay chunk (`offer_relay`) for an observation newer than the front KV is served, once, to the next request:
  the robot gets the new scene's first chunk before its KV has crossed the link.
- Otherwise a request runs a chunk on the front KV with the request's state (π0's state token) and its own noise.
- Staleness: every answer carries its KV's version and age (now minus capture time, one clock: the robot's). Over
  `max_kv_age_ms` the request is refused with one line saying how old, what bound, and what the link is doing;
  before any KV or relay arrived, a request waits for one at most that long.
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
    state: torch.Tensor | None  # (1, A) float32 normalised (π0's state token), None for π0.5
    noise: torch.Tensor  # (1, H, A) float32
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
        self.front = -1
        self.slot_version = [-1] * len(engine.slots)
        self._kv: CompleteKv | None = None  # newest whole version not installed yet
        self._relay: _Relay | None = None
        self._requests: deque[ChunkRequest] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="vla-rt-expert", daemon=True)
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)

    # ----- inputs (any thread) --------------------------------------------------------------------------------------
    def offer_kv(self, kv: CompleteKv) -> None:
        with self._cv:
            if self._kv is None or kv.version > self._kv.version:
                self._kv = kv
            self._cv.notify()

    def offer_relay(self, version: int, actions: np.ndarray) -> None:
        with self._cv:
            if self._relay is None or version > self._relay.version:
                self._relay = _Relay(version, actions)
            self._cv.notify()

    def submit(self, request: ChunkRequest) -> None:
        with self._cv:
            self._requests.append(request)
            self._cv.notify()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(30)

    @property
    def front_version(self) -> int:
        return self.slot_version[self.front] if self.front >= 0 else -1

    # ----- the thread -----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._requests and self._kv is None and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                request = self._requests.popleft() if self._requests else None
            try:
                self._maybe_install()
                if request is not None:
                    self._serve(request)
            except Exception:  # a device fault or a bug: the robot gets one line, the log the traceback
                log.exception("robot-side expert failed")
                if request is not None:
                    request.deliver(ChunkResult(None, "internal error in the robot-side expert (see its log)", -1,
                                                float("nan"), "local", 0.0, 0.0))  # fmt: skip

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def _maybe_install(self) -> None:
        """Installs the newest whole KV version if it is newer than the front one and a free slot exists."""
        with self._cv:
            kv = self._kv
            if kv is None or kv.version <= self.front_version:
                self._kv = None
                return
            free = [i for i in range(len(self.slot_version)) if i not in (self.front, self.engine.chunk_slot)]
            if not free:
                return  # every slot is the front or in use: the chunk in flight ends within num_steps steps
            self._kv = None
        t0 = time.monotonic()
        e = self.engine
        target = free[0]
        e.import_prefix(target, *kv.to_device(e.device, e.dtype), version=kv.version)
        self._sync()
        self.front, self.slot_version[target] = target, kv.version
        t1 = time.monotonic()
        self.events.append({"kind": "install", "version": kv.version, "start": t0, "end": t1, "slot": target,
                            "arrived": kv.completed_at, "mid_chunk": e.chunk_slot >= 0})  # fmt: skip

    def _fresh_relay(self) -> _Relay | None:
        r = self._relay
        return r if r is not None and not r.served and r.version > self.front_version else None

    def _refuse(self, request: ChunkRequest, version: int, age_s: float, why: str) -> None:
        request.deliver(ChunkResult(None, why, version, age_s * 1e3, "local", 0.0,
                                    (time.monotonic() - request.received) * 1e3))  # fmt: skip

    def _serve(self, request: ChunkRequest) -> None:
        bound = self.max_age_s
        while self.front < 0 and self._fresh_relay() is None:  # nothing yet: wait for the first KV or relay
            remaining = request.received + bound - time.monotonic()
            if remaining <= 0:
                return self._refuse(request, -1, float("nan"), f"no KV yet: nothing came from the prefix server "
                                    f"within --max-kv-age-ms {bound * 1e3:.0f} (it {self.link_status()})")  # fmt: skip
            with self._cv:
                self._cv.wait(min(remaining, 0.01))
            self._maybe_install()
        start = time.monotonic()
        relay = self._fresh_relay()
        version = relay.version if relay is not None else self.front_version
        age = start - capture_time(version)
        if age > bound:
            return self._refuse(request, version, age, f"stale KV: the newest prefix (version {version}) is "
                                f"{age * 1e3:.0f} ms old, over --max-kv-age-ms {bound * 1e3:.0f}; the prefix server "
                                f"{self.link_status()}")  # fmt: skip
        if relay is not None:
            relay.served = True
            actions, source = relay.actions, "relay"
        else:
            e, source = self.engine, "local"
            e.start_chunk(self.front, request.state, request.noise)
            while True:
                t0 = time.monotonic()
                done = e.step()
                self.events.append({"kind": "step", "version": version, "start": t0, "end": time.monotonic()})
                if done:
                    break
                self._maybe_install()  # between two steps: a new version lands in another slot
            actions = e.actions()[0].cpu().numpy()
        end = time.monotonic()
        self.events.append({"kind": "answer", "version": version, "start": start, "end": end, "source": source,
                            "age_ms": age * 1e3})  # fmt: skip
        request.deliver(ChunkResult(actions, None, version, age * 1e3, source, (end - start) * 1e3,
                                    (start - request.received) * 1e3))  # fmt: skip
