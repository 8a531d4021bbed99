"""Bad input and bad clients: each gets its one-line error and close code, and every other robot keeps being served."""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import websockets.sync.client as ws_client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosed

from vla_rt.serve.worker import StageRunner

GOOD = {"images": {"base_0_rgb": np.zeros((56, 56, 3), np.uint8)}, "state": np.zeros(6), "tokenized_prompt": [1, 2]}


def _raw(port: int, max_size: int | None = None):
    conn = ws_client.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=max_size)
    msgpack_numpy.unpackb(conn.recv())  # metadata
    return conn


def _error_and_close(conn) -> tuple[str, int]:
    text = conn.recv(timeout=30)
    with pytest.raises(ConnectionClosed) as err:
        conn.recv(timeout=30)
    return text, err.value.rcvd.code


def _patch_prefix(monkeypatch, wrapper) -> None:
    """`wrapper(real, self, ...)` in place of both ways a prefix stage starts (`prefix`, and `begin_prefix` under the
    default overlap scheduler)."""
    for name in ("prefix", "begin_prefix"):
        real = getattr(StageRunner, name)
        monkeypatch.setattr(StageRunner, name, lambda self, *a, real=real, **k: wrapper(real, self, *a, **k))


@pytest.fixture(scope="module")
def server(checkpoints, start_server):
    with start_server(checkpoints["generic"], num_views=1, max_batch=4, prompt_len=8, max_message_mb=1) as thread:
        yield thread


BAD = [
    (b"\x93\x01", "observation: expected one msgpack map, found bytes that do not decode"),
    (msgpack_numpy.packb({**GOOD, "velocity": np.zeros(3)}), "found unknown ['velocity']"),
    (msgpack_numpy.packb({"images": GOOD["images"]}), "observation: expected key 'state' (generic profile)"),
    (msgpack_numpy.packb({**GOOD, "state": np.zeros((2, 3))}), "state: expected shape (N,), found shape (2, 3)"),
    (msgpack_numpy.packb({**GOOD, "state": np.zeros(40)}), "state: expected a 1-D vector of at most 6 values"),
    (
        msgpack_numpy.packb({**GOOD, "state": np.array([0, np.inf])}),
        "state: expected finite values, found NaN or inf at index [1]",
    ),
    (
        msgpack_numpy.packb({**GOOD, "images": {"base_0_rgb": np.zeros((56, 56, 3), np.float16) + 9}}),
        "images['base_0_rgb']: expected float values in [0, 1] (or uint8), found range [9, 9]",
    ),
    (
        msgpack.packb(
            {
                **{k: v for k, v in GOOD.items() if k != "state"},
                "state": {b"__ndarray__": True, b"data": b"A" * 16, b"dtype": "|O", b"shape": [2]},
            },
            default=msgpack_numpy.pack_array,
        ),
        "state: expected a bool, integer or float dtype, found '|O'",
    ),  # openpi's own decoder would segfault here
    (msgpack_numpy.packb({**GOOD, "tokenized_prompt": list(range(9))}), "expected at most 8 tokens, found 9"),
    (msgpack_numpy.packb({**GOOD, "tokenized_prompt": [2000]}), "prompt_tokens: expected ids in [0, 1024)"),
    (
        msgpack_numpy.packb({**{k: v for k, v in GOOD.items() if k != "tokenized_prompt"}, "prompt": "pick it up"}),
        "prompt: a text prompt needs the server started with --tokenizer PATH",
    ),
    ("a text frame", "frame: expected a binary msgpack frame (openpi's protocol), found a text frame"),
]


@pytest.mark.parametrize("frame, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_gets_one_line_and_1003_while_others_are_served(server, frame, message) -> None:
    other = WebsocketClientPolicy("127.0.0.1", server.port)
    bad = _raw(server.port)
    bad.send(frame)
    text, code = _error_and_close(bad)
    assert message in text and "\n" not in text and "Traceback" not in text
    assert code == 1003
    assert other.infer(GOOD)["actions"].shape == (50, 6)
    other._ws.close()


def test_openpi_client_sees_the_message_as_runtime_error(server) -> None:
    client = WebsocketClientPolicy("127.0.0.1", server.port)
    with pytest.raises(RuntimeError, match=r"Error in inference server:\nstate: expected shape \(N,\)"):
        client.infer({**GOOD, "state": np.zeros((1, 6))})


def test_a_frame_over_the_limit_is_closed_with_1009(server) -> None:
    other = WebsocketClientPolicy("127.0.0.1", server.port)
    big = _raw(server.port)
    big.send(msgpack_numpy.packb({**GOOD, "images": {"base_0_rgb": np.zeros((700, 700, 3), np.uint8)}}))  # 1.4 MB
    with pytest.raises(ConnectionClosed) as err:
        big.recv(timeout=30)
    assert err.value.rcvd.code == 1009 and "exceeds limit" in err.value.rcvd.reason
    assert other.infer(GOOD)["actions"].shape == (50, 6)
    other._ws.close()


def test_stalled_and_vanished_clients_delay_no_one(server) -> None:
    stalled = socket.create_connection(("127.0.0.1", server.port))  # a handshake, then half a frame, then nothing
    stalled.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
    stalled.sendall(b"\x82\xfe\x10\x00\x00\x00\x00\x00" + b"\x00" * 100)  # 4096-byte masked frame, 100 bytes sent
    vanished = _raw(server.port)
    vanished.send(msgpack_numpy.packb(GOOD))
    vanished.close()  # gone before its answer
    client = WebsocketClientPolicy("127.0.0.1", server.port)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert client.infer(GOOD)["actions"].shape == (50, 6)
        times.append(time.perf_counter() - t0)
    assert max(times) < 10.0  # answered while the stalled client holds its connection half-written
    stalled.close()
    client._ws.close()


def test_inference_never_runs_on_the_event_loop(server, monkeypatch) -> None:
    """While the worker is stuck in a stage, the server still answers /healthz and lets robots connect."""
    import urllib.request

    release, started = threading.Event(), threading.Event()

    def stuck(real, self, *args, **kwargs):
        started.set()
        release.wait(30)
        return real(self, *args, **kwargs)

    _patch_prefix(monkeypatch, stuck)
    first = WebsocketClientPolicy("127.0.0.1", server.port)
    answer = {}
    waiter = threading.Thread(target=lambda: answer.setdefault("a", first.infer(GOOD)))
    waiter.start()
    assert started.wait(30)
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as r:
        assert r.status == 200
    second = WebsocketClientPolicy("127.0.0.1", server.port)  # the handshake and metadata do not wait either
    assert time.perf_counter() - t0 < 5.0 and second.get_server_metadata()["profile"] == "generic"
    release.set()
    waiter.join(30)
    assert answer["a"]["actions"].shape == (50, 6)
    first._ws.close()
    second._ws.close()


def test_newer_observation_replaces_the_queued_one(server, monkeypatch) -> None:
    release, started = threading.Event(), threading.Event()

    def stuck_once(real, self, *args, **kwargs):
        if not started.is_set():
            started.set()
            release.wait(30)
        return real(self, *args, **kwargs)

    _patch_prefix(monkeypatch, stuck_once)
    robot = _raw(server.port)
    frames = [msgpack_numpy.packb({**GOOD, "state": np.full(6, float(i))}) for i in range(3)]
    robot.send(frames[0])
    assert started.wait(30)  # frame 0 is in the worker; frames 1 and 2 queue behind it
    robot.send(frames[1])
    robot.send(frames[2])
    time.sleep(0.5)  # (both reach the queue while the worker is stuck)
    release.set()
    answers = [msgpack_numpy.unpackb(robot.recv(timeout=30)) for _ in range(3)]  # one answer per frame, in order
    assert [a["server_timing"].get("superseded", 0) for a in answers] == [0, 1, 1]
    np.testing.assert_array_equal(answers[1]["actions"], answers[2]["actions"])  # both from frame 2, the freshest
    assert not np.array_equal(answers[0]["actions"], answers[1]["actions"])
    robot.close()


@pytest.mark.parametrize("where", ["prefix", "join", "expert", "service"])
def test_a_server_fault_is_one_line_and_1011_and_the_server_goes_on(server, monkeypatch, where, caplog) -> None:
    from vla_rt.serve.service import RobotService

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    if where == "prefix":
        _patch_prefix(monkeypatch, lambda real, *args, **kwargs: broken())
    else:
        monkeypatch.setattr(RobotService if where == "service" else StageRunner,
                            "answer" if where == "service" else where, broken)  # fmt: skip
    robot = _raw(server.port)
    robot.send(msgpack_numpy.packb(GOOD))
    text, code = _error_and_close(robot)
    assert code == 1011 and text.startswith("internal server error") and "injected" not in text
    assert "injected fault" in caplog.text  # the traceback is in the server's log, not on the wire
    monkeypatch.undo()
    client = WebsocketClientPolicy("127.0.0.1", server.port)
    assert client.infer(GOOD)["actions"].shape == (50, 6)
    client._ws.close()
