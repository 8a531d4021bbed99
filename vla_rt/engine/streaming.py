"""Streaming inference: the action expert keeps denoising on the previous KV cache while the VLM refreshes it.

arXiv:2510.26742 §6: the VLM is compute-bound and the action expert memory-bound, so the two overlap on two CUDA
streams. Two `PrefixSlot`s (KV cache + key blocks + suffix RoPE rows + state + version) are double-buffered: the
VLM graph writes the back slot while expert graphs read the front one. Ordering is all on the GPU:

- an expert call on slot X first makes the expert stream wait on `vlm_done[X]` (so it never reads a half-written
  cache) and records `expert_done[X]` after it;
- a VLM pass into slot X first makes the VLM stream wait on `expert_done[X]` (so it never overwrites a cache an
  expert call is still reading).

The host only *polls* events (`Event.query()`, never a wait) to decide when the back slot is complete and becomes
the front one, at a chunk boundary, so all denoising steps of one chunk see one observation. Frames that arrive
while the VLM is busy replace each other (latest frame wins); the newest is launched as soon as the VLM is idle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Higher priority = smaller number in CUDA; the action expert's short calls must not queue behind the VLM.
EXPERT_PRIORITY, VLM_PRIORITY = -1, 0


class CudaSync:
    """CUDA streams and events."""

    def __init__(self, device: torch.device):
        self.device = device

    def stream(self, priority: int):
        return torch.cuda.Stream(self.device, priority=priority)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def record(self, stream, timing: bool = False):
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostSync:
    """No accelerator: launches run eagerly on the host, so every event is complete when it is recorded.

    The scheduler's bookkeeping (slots, versions, latest frame wins) is the same code on the CPU.
    """

    def stream(self, priority: int):
        return None

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream, timing: bool = False):
        return _Done()

    def wait(self, stream, event) -> None:
        pass


@dataclass
class ExpertResult:
    actions: torch.Tensor | None  # (B, H, A) when this call finished a chunk, else None
    kv_version: int  # the observation the actions are conditioned on
    t_capture: float  # that observation's camera capture time
    step: int  # denoising steps done in the current chunk after this call


@dataclass
class _SlotState:
    version: int = -1
    t_capture: float = float("nan")
    vlm_done: object | None = None  # CUDA event (or a completed marker on the CPU)
    expert_done: object | None = None


class TwoStreamScheduler:
    """Double-buffered producer (VLM) / consumer (expert) over two slots, synchronised by CUDA events.

    `vlm_launch(slot)` enqueues a VLM pass writing slot `slot` on the current stream; `expert_launch(slot)` enqueues
    one expert call reading it. Both are usually CUDA Graph replays; the scheduler knows nothing else about them,
    which is what lets a test drive it with a deliberately slow writer and a checking reader.
    """

    def __init__(self, device: torch.device, vlm_launch: Callable[[int], None],
                 expert_launch: Callable[[int], None]):  # fmt: skip
        self.device = device
        self.sync = CudaSync(device) if device.type == "cuda" else HostSync()
        self.vlm_stream = self.sync.stream(VLM_PRIORITY)
        self.expert_stream = self.sync.stream(EXPERT_PRIORITY)
        self._vlm_launch, self._expert_launch = vlm_launch, expert_launch
        self.slots = [_SlotState(), _SlotState()]
        self.front = -1  # no complete slot yet
        self._in_flight: int | None = None  # slot the VLM is writing
        self._pending: tuple[Callable[[], None], int, float] | None = None  # latest frame not yet launched
        self.frames_dropped = 0
        self.trace: list[tuple[str, int, object, object]] | None = None  # (kind, slot, start, end) when tracing

    # ----- VLM side -----------------------------------------------------------------------------------------------
    def submit(self, load_inputs: Callable[[], None], version: int, t_capture: float) -> None:
        """Queue an observation (its `load_inputs` copies it into the VLM's input buffers on the VLM stream)."""
        if self._pending is not None:
            self.frames_dropped += 1
        self._pending = (load_inputs, version, t_capture)
        self.pump()

    def _vlm_busy(self) -> bool:
        if self._in_flight is None:
            return False
        if self.slots[self._in_flight].vlm_done.query():
            self._in_flight = None
            return False
        return True

    def pump(self) -> None:
        """Launches the pending frame if the VLM is idle. Never waits."""
        if self._pending is None or self._vlm_busy():
            return
        load_inputs, version, t_capture = self._pending
        self._pending = None
        back = 1 - self.front if self.front >= 0 else 0
        slot = self.slots[back]
        with self.sync.on(self.vlm_stream):
            if slot.expert_done is not None:
                self.sync.wait(self.vlm_stream, slot.expert_done)  # readers of the old contents are done
            load_inputs()
            start = self.sync.record(self.vlm_stream, timing=True) if self.trace is not None else None
            self._vlm_launch(back)
            done = self.sync.record(self.vlm_stream, timing=self.trace is not None)
            if self.trace is not None:
                self.trace.append(("vlm", back, start, done))
        slot.vlm_done, slot.version, slot.t_capture = done, version, t_capture
        self._in_flight = back

    # ----- expert side --------------------------------------------------------------------------------------------
    def refresh_front(self) -> bool:
        """At a chunk boundary: make the newest complete slot the front one (event poll, no wait)."""
        self.pump()
        candidates = [i for i, s in enumerate(self.slots) if s.vlm_done is not None and s.vlm_done.query()]
        if not candidates:
            return self.front >= 0
        newest = max(candidates, key=lambda i: self.slots[i].version)
        if self.front < 0 or self.slots[newest].version > self.slots[self.front].version:
            self.front = newest
        return True

    def expert_call(self, before: Callable[[], None] | None = None) -> int:
        """Enqueues one expert call on the front slot; returns the slot index. `before` runs on the expert stream."""
        if self.front < 0:
            raise RuntimeError("no observation has been processed yet: submit one and let the VLM finish")
        slot = self.slots[self.front]
        with self.sync.on(self.expert_stream):
            self.sync.wait(self.expert_stream, slot.vlm_done)  # already complete; orders the reads on the GPU
            if before is not None:
                before()
            start = self.sync.record(self.expert_stream, timing=True) if self.trace is not None else None
            self._expert_launch(self.front)
            done = self.sync.record(self.expert_stream, timing=self.trace is not None)
            if self.trace is not None:
                self.trace.append(("expert", self.front, start, done))
        slot.expert_done = done
        self.pump()
        return self.front

    def wait_ready(self, timeout_s: float = 60.0, version: int | None = None) -> None:
        """Blocks until an observation (or observation `version` or newer) is the front one.

        For start-up and tests only: the hot loop never waits on the VLM.
        """
        import time

        t0 = time.perf_counter()
        while not (self.refresh_front() and (version is None or self.slots[self.front].version >= version)):
            if self._in_flight is not None:
                self.slots[self._in_flight].vlm_done.synchronize()
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"no VLM pass completed for version {version} within {timeout_s} s")
