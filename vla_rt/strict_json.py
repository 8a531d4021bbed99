"""Strict JSON out: what vla-rt writes for people and tools to read (trials.json, summary.json) parses anywhere.

Python's `json.dumps` writes `NaN` and `Infinity`, which are not JSON: `jq`, browsers and most parsers reject the
whole file. `to_plain` turns a result tree into plain JSON values (numpy scalars and arrays to Python, tuples to
lists, paths to strings, non-finite floats to null: "no value", which is what a median of no reactions is), and
`write_json` writes it strictly (`allow_nan=False`), atomically (a temp file renamed over the target, so a reader
never sees half a file) and bounded (`max_bytes`: an output that large is a bug upstream, not a result).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

MAX_BYTES = 64 * 2**20  # a pen-catch summary is ~1 kB and trials.json ~2 kB a trial


def to_plain(value: Any) -> Any:
    """A JSON-ready copy: dict keys as strings, non-finite floats as None."""
    if isinstance(value, np.ndarray):
        return [to_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def dumps(value: Any, indent: int | None = 1) -> str:
    return json.dumps(to_plain(value), indent=indent, allow_nan=False)


def write_json(path: str | Path, value: Any, *, indent: int | None = 1, max_bytes: int = MAX_BYTES) -> Path:
    """Writes `value` as strict JSON to `path` (atomically); raises ValueError past `max_bytes`."""
    text = dumps(value, indent)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise ValueError(f"{path}: {size} bytes of JSON, expected at most {max_bytes} (a result this large is a bug)")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
