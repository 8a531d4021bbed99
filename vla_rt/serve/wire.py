"""The wire format of openpi's websocket protocol: msgpack maps with numpy arrays, decoded without trusting the sender.

openpi's `msgpack_numpy` sends an array as the map `{b"__ndarray__": True, b"data": raw bytes, b"dtype": numpy dtype
string, b"shape": list}` and a numpy scalar as `{b"__npgeneric__": True, b"data": item, b"dtype": str}`. Its decoder
builds `np.ndarray(buffer=data, dtype=dtype, shape=shape)` from whatever the sender wrote: an object dtype makes
numpy read the bytes as pointers and the process segfaults. Here an array is built only for bool / integer / float
dtypes, only after checking `len(data) == prod(shape) * itemsize`, and as a read-only view of the received bytes
(no copy). Anything else is a `WireError` naming the key, what was expected and what was found. No pickle anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

ARRAY_KEY, SCALAR_KEY = b"__ndarray__", b"__npgeneric__"
ALLOWED_KINDS = "biuf"  # bool, signed / unsigned integers, floats: the only dtypes an observation holds
MAX_NDIM = 8
MAX_DEPTH = 8  # nesting of maps / lists in an observation (openpi's are 2 deep: images -> camera)


class WireError(ValueError):
    """A frame that is not a valid observation encoding (not msgpack, a bad array map, a refused dtype)."""


def _dtype(value: object, where: str) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        raise WireError(f"{where}: expected a numpy dtype string such as '<f4', found {type(value).__name__}")
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):
        raise WireError(f"{where}: expected a numpy dtype string such as '<f4', found {value!r}") from None
    if dtype.kind not in ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError(f"{where}: expected a bool, integer or float dtype, found {value!r}")
    return dtype


def _array(obj: dict, where: str) -> np.ndarray:
    unknown = set(obj) - {ARRAY_KEY, b"data", b"dtype", b"shape"}
    if unknown or b"data" not in obj or b"dtype" not in obj or b"shape" not in obj:
        raise WireError(
            f"{where}: expected an array map with data, dtype and shape, found keys {sorted(map(str, obj))}"
        )
    dtype = _dtype(obj[b"dtype"], where)
    shape = obj[b"shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise WireError(f"{where}: expected a shape of at most {MAX_NDIM} dims, found {shape!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError(f"{where}: expected a shape of non-negative ints, found {shape!r}")
    data = obj[b"data"]
    if not isinstance(data, bytes):
        raise WireError(f"{where}: expected the array data as bytes, found {type(data).__name__}")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireError(
            f"{where}: expected {expected} bytes of data for shape {tuple(shape)} {dtype}, found {len(data)}"
        )
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def _scalar(obj: dict, where: str) -> np.generic:
    if set(obj) != {SCALAR_KEY, b"data", b"dtype"}:
        raise WireError(f"{where}: expected a scalar map with data and dtype, found keys {sorted(map(str, obj))}")
    dtype = _dtype(obj[b"dtype"], where)
    value = obj[b"data"]
    if not isinstance(value, (bool, int, float)):
        raise WireError(f"{where}: expected a number for a {dtype} scalar, found {type(value).__name__}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not isinstance(value, int) or not info.min <= value <= info.max:
            raise WireError(f"{where}: expected an integer that fits {dtype}, found {value!r}")
    return dtype.type(value)


def _decode_tree(value: Any, where: str, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"{where}: expected at most {MAX_DEPTH} levels of nested maps or lists, found more")
    if isinstance(value, dict):
        if ARRAY_KEY in value:
            return _array(value, where)
        if SCALAR_KEY in value:
            return _scalar(value, where)
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{where}: expected string keys, found the key {key!r}")
            out[key] = _decode_tree(item, key if depth == 0 else f"{where}[{key!r}]", depth + 1)
        return out
    if isinstance(value, list):
        return [_decode_tree(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    return value


def _refuse_ext(code: int, data: bytes) -> None:
    raise WireError(f"observation: expected plain msgpack types, found an extension type {code}")


def unpack_observation(frame: bytes) -> dict[str, Any]:
    """One binary frame -> the observation dict (str keys, numpy arrays for array maps). Raises WireError."""
    try:
        obj = msgpack.unpackb(frame, raw=False, ext_hook=_refuse_ext)
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"observation: expected one msgpack map, found bytes that do not decode ({e})") from None
    if not isinstance(obj, dict):
        raise WireError(f"observation: expected a msgpack map of named fields, found {type(obj).__name__}")
    return _decode_tree(obj, "observation")


def _pack_default(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in ALLOWED_KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        obj = np.ascontiguousarray(obj)
        return {ARRAY_KEY: True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in ALLOWED_KINDS:
            raise TypeError(f"cannot send a scalar of dtype {obj.dtype}")
        return {SCALAR_KEY: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def pack(message: Mapping[str, Any]) -> bytes:
    """A dict (numbers, strings, lists, numpy arrays) -> one msgpack frame that openpi's client decodes."""
    return msgpack.packb(message, default=_pack_default, use_bin_type=True)
