"""CUDA Graph capture with Python's cycle collector held off.

A collection that runs during a capture runs the finalizers of whatever it frees: another engine's CUDA Graphs
(`cudaGraphExecDestroy`), events, pinned blocks. Those are operations a capturing stream does not permit, and the
driver invalidates the capture (`cudaErrorStreamCaptureInvalidated`); which allocation triggers a collection is
chance. It happened on the H200 when a process dropped a server's engine and built another (the split bench,
2026-12-03). So: collect first, while nothing captures, then capture with the collector off.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, **kwargs) -> Iterator[None]:
    """`torch.cuda.graph(graph, **kwargs)` after a collection, with the cycle collector off until the capture ends."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    finally:
        if enabled:
            gc.enable()
