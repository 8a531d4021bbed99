"""The file layer every checkpoint reader goes through: a bad file becomes one `CheckpointError` naming it.

safetensors' own errors (`SafetensorError: header too large`) name neither the file nor what it really is, and
`safe_open` on a text or pickle file says the same as on a truncated download. Before any reader opens a
`.safetensors` file, `check_safetensors` reads its 8-byte length and JSON header and says what the file is:
empty, too short, a pickle / zip (`torch.save`) / NumPy / HDF5 / Git LFS pointer / text file, a truncated download,
a malformed header, or tensor offsets that do not tile the data (overlapping, leaving a gap or a tail: safetensors'
own rule). `reading(path)` turns whatever else a reader meets (OS errors, JSON errors, safetensors errors, a
path-less CheckpointError from shape inference) into a CheckpointError naming `path`. `check_finite` finds NaN /
inf weights with one reduction per tensor.

Readers (native, LeRobot, openpi, and any new one) open files only through `open_safetensors`, `load_safetensors`,
`read_json`, `reading` and `streaming.read_safetensors` (which checks the file and every tensor it places), so every
format gets the same checks.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from vla_rt.errors import CheckpointError

# Bytes per element of every safetensors dtype (the format's own list).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_MAGIC = (  # first bytes -> what the file is, for files that are not safetensors
    (b"version https://git-lfs", "a Git LFS pointer (the weights were never downloaded: run `git lfs pull`)"),
    (b"PK\x03\x04", "a zip archive (torch.save's format?); vla-rt reads safetensors and never unpickles"),
    (b"\x93NUMPY", "a NumPy .npy file"),
    (b"\x89HDF", "an HDF5 file"),
)


def _sniff(head: bytes) -> str | None:
    """What a non-safetensors file is, from its first bytes (None: unrecognised binary)."""
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a Python pickle (torch.save / pickle.dump); vla-rt reads safetensors and never unpickles"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text and all(c.isprintable() or c in "\t\r\n" for c in text):
        return f"a text file (it starts {text[:40]!r})"
    return None


def check_safetensors(path: str | Path) -> dict[str, Any]:
    """The parsed JSON header of a safetensors file (tensor entries + `__metadata__`), after checking that the file
    is whole: raises CheckpointError(path, what is wrong) otherwise. Reads the header only, never the tensor data."""
    path = Path(path)
    with reading(path):
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(min(size, 64))
            if size == 0:
                raise CheckpointError(path, "an empty file (0 bytes), not a safetensors checkpoint")
            what = _sniff(head)
            if size < 8:
                what = f" ({what})" if what else ""
                raise CheckpointError(path, f"{size} bytes: too short for a safetensors file{what}")
            (header_len,) = struct.unpack("<Q", head[:8])
            looks_like_header = head[8:9] == b"{"
            if not looks_like_header or header_len > MAX_HEADER_BYTES:
                raise CheckpointError(path, f"not a safetensors file: {what or 'unrecognised binary data'}")
            if 8 + header_len > size:
                raise CheckpointError(
                    path,
                    f"truncated: its header says {header_len} header bytes, the file holds {size - 8} after the "
                    "length (an interrupted download or copy?)",
                )
            f.seek(8)
            raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"the safetensors header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, f"the safetensors header is a JSON {type(header).__name__}, expected an object")
    _check_entries(path, header, data_bytes=size - 8 - header_len)
    return header


def _check_entries(path: Path, header: dict[str, Any], data_bytes: int) -> None:
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "the safetensors '__metadata__' must map strings to strings")
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(path, f"header entry {name!r} lacks dtype/shape/data_offsets: {str(entry)[:100]}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(path, f"tensor {name!r} has a malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(path, f"tensor {name!r} has malformed data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CheckpointError(
                path, f"tensor {name!r}: data_offsets {offsets} do not hold {shape} x {dtype} ({DTYPE_SIZES[dtype]} B)"
            )
        spans.append((begin, end, name))
    _check_layout(path, sorted(spans), data_bytes)


def _check_layout(path: Path, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The tensors' byte ranges (sorted by data_offsets) must tile the data exactly, the rule safetensors itself
    enforces: the first starts at 0, each where the one before ends, the last at the file's end. Overlapping tensors
    alias each other's bytes and a gap or a tail is data no tensor describes: a damaged or hand-built file that
    `safe_open` refuses would otherwise load through our own reader (`streaming.read_safetensors`)."""
    end_max = max((end for _, end, _ in spans), default=0)
    if end_max > data_bytes:  # the likeliest damage first: a cut file, named as such
        raise CheckpointError(
            path,
            f"truncated: the header describes {end_max} bytes of tensor data, the file holds {data_bytes} "
            "(an interrupted download or copy?)",
        )
    previous: tuple[int, int, str] | None = None
    for span in spans:
        expected = previous[1] if previous else 0
        if span[0] != expected:
            raise CheckpointError(path, _layout_problem(previous, span, expected))
        previous = span
    covered = previous[1] if previous else 0
    if covered != data_bytes:
        raise CheckpointError(
            path,
            f"the tensors' data_offsets end at byte {covered}, expected {data_bytes} (the end of the file's data): "
            f"{data_bytes - covered} trailing bytes no tensor holds",
        )


def _layout_problem(previous: tuple[int, int, str] | None, span: tuple[int, int, str], expected: int) -> str:
    """What is wrong where `span` does not start at `expected`: an overlap with `previous`, or a gap before it."""
    begin, end, name = span
    where = f"{name!r} (data_offsets [{begin}, {end}])"
    if previous is None:
        return f"tensor {where} is the first in the data: expected it to start at byte 0, found {begin}"
    before = f"{previous[2]!r} (data_offsets [{previous[0]}, {previous[1]}])"
    what = "overlap" if begin < expected else f"leave a gap of {begin - expected} bytes no tensor holds"
    return f"tensors {before} and {where} {what}: expected {name!r} to start at byte {expected}, found {begin}"


def tensor_names(header: dict[str, Any]) -> list[str]:
    return [k for k in header if k != "__metadata__"]


@contextlib.contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Any error met while reading `path` leaves as a CheckpointError naming it (a path-less one gets the path)."""
    try:
        yield
    except CheckpointError as e:
        raise e.with_path(path) from None
    except FileNotFoundError:
        raise CheckpointError(path, "no such file or directory") from None
    except IsADirectoryError:
        raise CheckpointError(path, "a directory where a file was expected") from None
    except PermissionError:
        raise CheckpointError(path, "permission denied") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot be read ({e.strerror or e})") from None
    except SafetensorError as e:
        raise CheckpointError(path, f"safetensors cannot read it ({e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"not valid UTF-8 JSON ({e})") from None


@contextlib.contextmanager
def open_safetensors(path: str | Path) -> Iterator[Any]:
    """`safe_open(path)` after `check_safetensors`; errors while it is open name the file."""
    check_safetensors(path)
    with reading(path), safe_open(str(path), framework="pt") as f:
        yield f


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (checked) safetensors file, e.g. a LeRobot normalizer state file."""
    check_safetensors(path)
    with reading(path):
        return load_file(str(path))


def read_json(path: str | Path) -> Any:
    """A JSON file's content; a missing, unreadable or malformed file is a CheckpointError naming it."""
    with reading(path):
        return json.loads(Path(path).read_text(encoding="utf-8"))


def check_finite(tensor: torch.Tensor, name: str, source: str | Path, stored: torch.Tensor | None = None) -> None:
    """Raises CheckpointError when `tensor` holds NaN or inf, naming the tensor, the count and the first index.

    One reduction per tensor (`aminmax`: a NaN anywhere makes both NaN, an inf makes one of them inf; unlike a sum
    it cannot overflow on huge finite weights, and it reads bf16 without converting: ~10x faster than a float32 sum
    on a CPU); only a non-finite result pays for the element-wise check that locates the value.
    `stored` is the tensor before a dtype cast: finite there means the cast overflowed, and the message says so.
    Meta tensors (shapes only), empty and integer tensors are skipped.
    """
    if tensor.device.type == "meta" or not tensor.is_floating_point() or tensor.numel() == 0:
        return
    lo, hi = torch.aminmax(tensor)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    first = tuple(int(i) for i in torch.unravel_index(bad.flatten().nonzero()[0, 0], tensor.shape))
    value = float(tensor[first])
    problem = f"tensor {name!r} holds {count} non-finite value(s) (first: {value} at index {first})"
    if stored is not None and stored.dtype != tensor.dtype and bool(torch.isfinite(stored[first])):
        problem += (
            f": the stored {stored.dtype} value {float(stored[first]):.6g} overflows {tensor.dtype}; "
            "load in a wider dtype"
        )
    else:
        problem += ": the checkpoint is corrupt (a diverged training run or a broken conversion?)"
    raise CheckpointError(source, problem)
