"""The tuner's pre-compilation pool: worker processes (spawn) that launch every distinct candidate once on the timing
phase's inputs, so Triton's on-disk cache holds every binary before the timing process asks for it, and a candidate
that fails to compile or hangs there is never launched by the timing process."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import time
from collections.abc import Iterable, Sequence

import torch

from ..workspace import Workspace
from .candidates import TuneItem, compile_key
from .measure import attention_inputs, gemm_inputs, launch_attention, launch_gemm

__all__ = ["STALL_S", "Precompiler", "precompile_one"]

# No pre-compile finished for this long: the rest are abandoned. On the H200 with Triton 3.6 two TMA kernels never
# returned (the tune of the wide GEMMs stalled at 321/323 until its budget ran out); a normal compile takes < 10 s
STALL_S = 60.0

_WORKER: dict = {"dead": False, "cache": {}, "device": "cuda"}


def worker_init(device: str) -> None:
    _WORKER["device"] = device
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))


def precompile_one(item: TuneItem, cfg, dtype_name: str) -> tuple[bool | None, str, float]:
    """Worker: launch `cfg` once on the timing phase's inputs (so Triton compiles and caches it). Returns (ok, error,
    seconds); ok None when this worker's CUDA context is gone and nothing was tried."""
    if _WORKER["dead"]:
        return None, "worker CUDA context lost", 0.0
    start = time.perf_counter()
    dtype = getattr(torch, dtype_name)
    device = torch.device(_WORKER["device"])

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        cache = _WORKER["cache"]
        key = (item.kind, item.shape, dtype_name)
        if key not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            setup = gemm_inputs if item.kind == "gemm" else attention_inputs
            cache[key] = (setup(item.shape, dtype, device), Workspace(device))
        x, ws = cache[key]
        (launch_gemm if item.kind == "gemm" else launch_attention)(x, cfg, 0, ws)
        sync()
        return True, "", time.perf_counter() - start
    except Exception as e:  # a config that fails to compile or run is reported, not fatal
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            sync()
        except Exception:
            _WORKER["dead"] = True
        return False, msg, time.perf_counter() - start


class Precompiler:
    """A spawn pool that pre-compiles (item, config) pairs, once per `compile_key`, in submission order."""

    def __init__(self, workers: int, device: str, dtype_name: str):
        ctx = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=worker_init, initargs=(device,))
        self.dtype_name = dtype_name
        self.futures: dict[tuple, cf.Future] = {}
        self.seconds: list[float] = []
        self.abandoned: set[int] = set()  # ids of futures given up on (a compile or launch that hangs)

    def submit(self, item: TuneItem, configs: Sequence) -> None:
        for cfg in configs:
            key = compile_key(item, cfg)
            if key not in self.futures:
                fut = self.pool.submit(precompile_one, item, cfg, self.dtype_name)
                fut.add_done_callback(self._done)
                self.futures[key] = fut

    def _done(self, f: cf.Future) -> None:
        if not f.cancelled() and f.exception() is None:
            self.seconds.append(f.result()[2])

    def pending(self, item: TuneItem, configs: Sequence) -> list[cf.Future]:
        return [f for c in configs if (f := self.futures.get(compile_key(item, c))) is not None and not f.done()
                and id(f) not in self.abandoned]  # fmt: skip

    def abandon(self, futures: Iterable[cf.Future]) -> None:
        """Stop waiting for `futures`: their candidates count as failed, so the timing process never launches a
        kernel that hung in a worker (it would hang there too)."""
        self.abandoned.update(id(f) for f in futures)

    def status(self, item: TuneItem, cfg) -> tuple[bool | None, str]:
        """(True, "") compiled and ran; (False, error) failed in a worker or was abandoned; (None, why) unknown."""
        f = self.futures.get(compile_key(item, cfg))
        if f is not None and id(f) in self.abandoned and not f.done():
            return False, f"pre-compile abandoned: no progress for {STALL_S:.0f} s (a compile or launch that hangs)"
        if f is None or not f.done() or f.cancelled():
            return None, "not pre-compiled"
        try:
            ok, err, _ = f.result()
        except Exception as e:  # the worker process died
            return None, f"pre-compile worker failed: {type(e).__name__}"
        return ok, err

    def progress(self) -> tuple[int, int]:
        return sum(f.done() for f in self.futures.values()), len(self.futures)

    def shutdown(self) -> None:
        procs = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:  # our own workers: end what still compiles
            if proc.is_alive():
                proc.terminate()
