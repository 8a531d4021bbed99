"""The wire codec against openpi-client's own msgpack_numpy, and every frame it must refuse without crashing."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy

from vla_rt.serve.wire import WireError, pack, unpack_observation


def _array_map(data: bytes, dtype: str, shape: list) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def test_decodes_what_openpi_client_sends() -> None:
    rng = np.random.default_rng(0)
    obs = {
        "images": {"cam_high": rng.integers(0, 256, (3, 8, 8), dtype=np.uint8)},
        "state": rng.normal(size=14),
        "observation/gripper_position": np.float32(0.25),
        "tokenized_prompt": np.arange(5, dtype=np.int32),
        "mask": np.array([True, False]),
        "prompt": "fold the towel",
    }
    out = unpack_observation(msgpack_numpy.packb(obs))
    assert set(out) == set(obs) and out["prompt"] == "fold the towel"
    np.testing.assert_array_equal(out["images"]["cam_high"], obs["images"]["cam_high"])
    np.testing.assert_array_equal(out["state"], obs["state"])
    assert out["state"].dtype == np.float64 and out["tokenized_prompt"].dtype == np.int32
    assert out["observation/gripper_position"] == np.float32(0.25)
    assert isinstance(out["observation/gripper_position"], np.float32)
    np.testing.assert_array_equal(out["mask"], obs["mask"])


def test_answers_decode_with_openpi_client() -> None:
    actions = np.random.default_rng(1).normal(size=(10, 8)).astype(np.float32)
    answer = msgpack_numpy.unpackb(pack({"actions": actions, "server_timing": {"infer_ms": 1.5, "batch_size": 3}}))
    np.testing.assert_array_equal(answer["actions"], actions)
    assert answer["server_timing"] == {"infer_ms": 1.5, "batch_size": 3}


def test_big_endian_arrays_become_native() -> None:
    x = np.arange(4, dtype=">f4")
    out = unpack_observation(msgpack.packb({"state": _array_map(x.tobytes(), ">f4", [4])}))
    assert out["state"].dtype.isnative and out["state"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "value, message",
    [
        (_array_map(b"\0" * 16, "|O", [2]), "expected a bool, integer or float dtype, found '|O'"),  # the segfault
        (_array_map(b"\0" * 8, "<c8", [1]), "expected a bool, integer or float dtype"),
        (_array_map(b"\0" * 8, "<U2", [1]), "expected a bool, integer or float dtype"),
        (_array_map(b"\0" * 8, "[('a', '<f4')]", [1]), "expected a numpy dtype string"),
        (_array_map(b"\0" * 8, "nope", [2]), "expected a numpy dtype string such as '<f4', found 'nope'"),
        (_array_map(b"\0" * 8, 5, [2]), "found int"),
        (_array_map(b"\0" * 12, "<f4", [2]), "expected 8 bytes of data for shape (2,) float32, found 12"),
        (_array_map(b"\0" * 4, "<f4", [2**40, 2**40]), "expected 4835703278458516698824704 bytes"),
        (_array_map(b"\0" * 8, "<f4", [-2]), "expected a shape of non-negative ints"),
        (_array_map(b"\0" * 8, "<f4", "2"), "expected a shape of at most 8 dims"),
        (_array_map(b"\0" * 4, "<f4", [1] * 9), "expected a shape of at most 8 dims"),
        (_array_map("text", "<f4", [1]), "expected the array data as bytes, found str"),
        ({b"__ndarray__": True, b"data": b""}, "expected an array map with data, dtype and shape"),
        ({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}, "expected a number for a float32 scalar"),
        ({b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}, "expected an integer that fits uint8, found 300"),
    ],
)
def test_refuses_bad_array_maps_with_the_key(value, message) -> None:
    with pytest.raises(WireError) as err:
        unpack_observation(msgpack.packb({"images": {"cam_high": value}}))
    assert str(err.value).startswith("images['cam_high']: ") and message in str(err.value)


@pytest.mark.parametrize(
    "frame, message",
    [
        (b"\xc1garbage", "do not decode"),
        (msgpack.packb({"a": 1}) + b"\x01", "do not decode"),
        (msgpack.packb({"a": 1})[:-1], "do not decode"),
        (msgpack.packb([1, 2]), "expected a msgpack map of named fields, found list"),
        (msgpack.packb({1: 2}), "do not decode"),
        (msgpack.packb({"x": msgpack.ExtType(7, b"zz")}), "found an extension type 7"),
        (msgpack.packb({"x": [[[[[[[[[[1]]]]]]]]]]}), "levels of nested maps or lists"),
        (b"", "do not decode"),
    ],
)
def test_refuses_frames_that_are_not_an_observation(frame, message) -> None:
    with pytest.raises(WireError, match="expected") as err:
        unpack_observation(frame)
    assert message in str(err.value)


def test_refuses_to_send_object_arrays() -> None:
    with pytest.raises(TypeError, match="cannot send an array of dtype object"):
        pack({"actions": np.array([None])})
