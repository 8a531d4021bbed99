"""The prefix server's GPU half: the prefix engine and the relay expert beside it, one thread, one lock.

For each observation a robot-side expert sends up (newest wins per expert), the worker runs vision + the VLM prefix
into the engine's slot, then the relay (an `ExpertEngine` on that same slot and the same weights) denoises the
first chunk for it at once, with the state and noise that came with the observation, and hands back the relay frame
(a few KB) before the KV cache's chunks: the robot gets actions for the new scene without waiting for the KV cache
to cross the link. Robots that connect to the prefix server directly (openpi protocol) are answered by `run_full`:
prefix + relay, the monolithic computation. Both paths take `lock`, so one observation owns the engines at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vla_rt.engine.split_engines import ExpertEngine, PrefixEngine
from vla_rt.inputs import BuiltShapes, ModelInputs, check_model_inputs
from vla_rt.split import messages
from vla_rt.split.kv_codec import DEFAULT_CHUNK_BYTES, encode_kv, host_kv

log = logging.getLogger("vla_rt.split")
EVENTS_KEPT = 20_000  # timeline events kept for /split (a benchmark reads them)


@dataclass
class PrefixJob:
    """One uplink observation of one subscriber; `deliver(frames)` is called on the worker thread, never blocks."""

    version: int
    t_capture: float
    inputs: ModelInputs
    noise: torch.Tensor
    kv_format: str
    deliver: Callable[[list[bytes]], None]


class PrefixService:
    def __init__(self, engine: PrefixEngine, relay: ExpertEngine, shapes: BuiltShapes, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):  # fmt: skip
        self.engine, self.relay, self.shapes, self.chunk_bytes = engine, relay, shapes, chunk_bytes
        self.cfg, self.device = engine.cfg, engine.device
        self.lock = threading.Lock()
        self._jobs: OrderedDict[int, PrefixJob] = OrderedDict()  # subscriber -> newest job (oldest first)
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="vla-rt-prefix", daemon=True)
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self.superseded = 0

    # ----- direct robots (openpi protocol): the monolithic computation ---------------------------------------------
    def run_full(self, x: ModelInputs, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        """A `BackendFn` (batch 1): prefix + relay chunk, as `StaticPi0Engine` computes it."""
        if num_steps != self.relay.num_steps:
            raise ValueError(f"num_steps: expected {self.relay.num_steps} (the engines' plan), found {num_steps}")
        with self.lock:
            self.engine.run(x)
            return self.relay.run_chunk(0, x.state, noise)

    # ----- subscribers -----------------------------------------------------------------------------------------------
    def parse(self, msg: dict, layout: messages.LinkLayout) -> tuple[int, float, ModelInputs, torch.Tensor]:
        """An uplink obs message, checked as the model checks its inputs (ids in the vocabulary, ...)."""
        version, t_capture, x, noise = messages.parse_observation(msg, layout)
        try:
            check_model_inputs(self.cfg, self.shapes, x.images, x.state, x.tokens, noise, x.image_masks, x.token_mask)
        except ValueError as e:
            raise messages.LinkError(f"obs: {e}") from None
        return version, t_capture, x, noise

    def submit(self, subscriber: int, job: PrefixJob) -> None:
        """Queues a subscriber's observation; a newer one replaces its queued older one."""
        with self._cv:
            if self._jobs.pop(subscriber, None) is not None:
                self.superseded += 1
            self._jobs[subscriber] = job
            self._cv.notify()

    def forget(self, subscriber: int) -> None:
        with self._cv:
            self._jobs.pop(subscriber, None)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(30)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                _, job = self._jobs.popitem(last=False)
            try:
                self._run(job)
            except Exception:  # a device fault or a bug: logged; the subscriber's KV just does not come
                log.exception("prefix for version %d failed", job.version)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run(self, job: PrefixJob) -> None:
        d = self.device
        x = ModelInputs(job.inputs.images.to(d), job.inputs.state.to(d), None if job.inputs.tokens is None else
                        job.inputs.tokens.to(d), None, job.inputs.image_masks.to(d),
                        None if job.inputs.token_mask is None else job.inputs.token_mask.to(d))  # fmt: skip
        with self.lock:
            t0 = time.monotonic()
            self.engine.run(x, job.version)
            self._sync()
            t1 = time.monotonic()
            actions = self.relay.run_chunk(0, x.state, job.noise.to(d))[0].cpu().numpy()
            t2 = time.monotonic()
            job.deliver([messages.relay(job.version, actions, (t1 - t0) * 1e3, (t2 - t1) * 1e3, t0)])
            host = host_kv(*self.engine.export(), job.kv_format)  # the device work and the copy out, under the lock
        t3 = time.monotonic()
        encoded = encode_kv(host, version=job.version, t_capture=job.t_capture, chunk_bytes=self.chunk_bytes)
        t4 = time.monotonic()
        job.deliver(encoded.frames)
        self.events.append({"kind": "prefix", "version": job.version, "start": t0, "prefix_end": t1, "relay_end": t2,
                            "copied_end": t3, "encoded_end": t4, "kv_bytes": encoded.payload_bytes,
                            "wire_bytes": encoded.wire_bytes, "kv_format": job.kv_format})  # fmt: skip
