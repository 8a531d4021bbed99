"""Reading a checkpoint one tensor at a time, straight to its target device and dtype.

A full π0 is 3.5B parameters (7 GB in bf16, 14 GB in float32). Loading must not hold the file's contents twice: the
reader allocates one tensor, fills it from the file, moves/casts it to the target (`place`) and only then reads
the next, so host memory peaks at the result plus one tensor (a target on the GPU: one tensor).

safetensors' own `safe_open` memory-maps the file; the pages it touches count as the process's resident memory
until the map closes, so a mapped read of a 7 GB file shows a 14 GB peak (mapping + result) even though the mapped
pages are reclaimable. `read_safetensors` therefore reads with plain `readinto` into the tensor's own storage.
The file format (8-byte little-endian header length, JSON header `{name: {dtype, shape, data_offsets}}`, then the
data) is safetensors' documented layout.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from vla_rt.checkpoints.files import check_finite, check_safetensors
from vla_rt.errors import CheckpointError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def place(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None) -> torch.Tensor:
    """t on `device` in `dtype` (None keeps either); a copy only where one is needed."""
    return t.to(device=device, dtype=dtype or t.dtype) if device is not None or dtype is not None else t


def safetensors_index(path: str | Path) -> tuple[int, dict[str, dict]]:
    """(offset of the data section, {name: {dtype, shape, data_offsets}}) from a safetensors file's header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    return 8 + n, header


def read_safetensors(
    path: str | Path,
    names: Iterable[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for `names`, each read into fresh memory without a memory map, then placed.

    The file is checked first (`files.check_safetensors`: a truncated or foreign file is one CheckpointError naming
    it) and every placed tensor for NaN / inf (`files.check_finite`, one reduction a tensor; a finite stored value
    that overflows the target dtype is named as such)."""
    check_safetensors(path)
    start, index = safetensors_index(path)
    with open(path, "rb", buffering=0) as f:
        for name in names:
            entry = index[name]
            if entry["dtype"] not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, expected a float dtype")
            begin, end = entry["data_offsets"]
            t = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
            buf = t.view(-1).view(torch.uint8).numpy() if t.numel() else None
            if buf is not None:
                if buf.nbytes != end - begin:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} spans {end - begin} bytes, expected {buf.nbytes} for "
                        f"{entry['dtype']} {tuple(entry['shape'])}"
                    )
                f.seek(start + begin)
                view, done = memoryview(buf), 0
                while done < buf.nbytes:  # one read() returns at most ~2 GiB on Linux
                    got = f.readinto(view[done:])
                    if not got:
                        raise CheckpointError(f"{path}: tensor {name!r} is cut short (the file ends inside it)")
                    done += got
            placed = place(t, dtype, device)
            check_finite(placed, name, path, t)
            yield name, placed
            del t, buf, placed
