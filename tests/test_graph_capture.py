"""`graph_capture` holds the cycle collector off for exactly the capture (the capture itself needs CUDA: here
torch.cuda.graph is replaced by a context that records the collector's state; the GPU tests capture for real)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from vla_rt.graph_capture import graph_capture


@pytest.fixture
def fake_capture(monkeypatch) -> list[bool]:
    seen: list[bool] = []

    @contextlib.contextmanager
    def graph(g, **kwargs):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    return seen


def test_the_collector_is_off_during_the_capture_and_back_after(fake_capture) -> None:
    assert gc.isenabled()
    with graph_capture(object()):
        assert not gc.isenabled()
    assert fake_capture == [False] and gc.isenabled()


def test_a_failed_capture_gives_the_collector_back(fake_capture) -> None:
    with pytest.raises(RuntimeError, match="boom"), graph_capture(object()):
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(fake_capture) -> None:
    gc.disable()
    try:
        with graph_capture(object()):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_garbage_from_before_is_collected_before_the_capture(fake_capture) -> None:
    class Cycle:
        freed = False

        def __del__(self) -> None:
            Cycle.freed = True

    a = Cycle()
    a.self = a  # only the cycle collector frees it
    del a
    with graph_capture(object()):
        assert Cycle.freed  # collected before the capture began, not during it
