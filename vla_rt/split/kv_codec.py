"""A KV cache version on the wire: encoded into fixed-size chunks, assembled on the other side, never mixed.

One version is the prefix of one observation: every layer's K and V of the valid prefix keys (padding and missing
views are never attended, so they are not sent; the receiver zeroes them), plus the mask that says which keys those
are. Formats: `native` (the engine's compute dtype: bf16 on the GPU) or `fp8` (e4m3, one float32 scale per layer and
K/V: amax / 448; half the bytes, measured accuracy cost in docs/split.md).

Every chunk is one msgpack frame `{type: "kv", version, seq, manifest, data}`. The manifest (a msgpack map in
bytes: capture time, format, shape, prefix mask, scales, sizes, every chunk's CRC-32) rides in every chunk, so chunks
can arrive in any order and the receiver can check that each one belongs to the very cache the others describe. `KvAssembler` keeps one staging buffer:
a chunk of a newer version abandons the staging one, a chunk of an older or already completed version is dropped,
a chunk whose CRC or manifest disagrees poisons its version (dropped whole). A version is handed over only when
all its chunks are in: the expert never sees half of one cache beside half of another.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

KV_FORMATS = ("native", "fp8")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_CHUNK_BYTES = 256 * 1024
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float8_e4m3fn": torch.float8_e4m3fn}  # fmt: skip


class KvFrameError(ValueError):
    """A KV frame that does not fit the link's layout (wrong shape, size, format): a protocol fault, not noise."""


@dataclass(frozen=True)
class KvLayout:
    """The prefix shape both ends agreed on at the handshake."""

    depth: int
    kv_heads: int
    head_dim: int
    prefix_len: int

    def shape(self, rows: int) -> tuple[int, ...]:
        return (self.depth, 2, 1, rows, self.kv_heads, self.head_dim)


def quantize_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv (L, 2, ...) -> (float8_e4m3fn values, (L, 2) float32 scales): x ≈ q * scale, one scale per layer and K/V."""
    amax = kv.abs().amax(dim=tuple(range(2, kv.dim()))).float()
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    view = scales.view(*scales.shape, *([1] * (kv.dim() - 2)))
    return (kv.float() / view).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


# float8_e4m3fn -> float32 for all 256 codes, by torch's own conversion (so a lookup gives the same bits)
_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """q.float(), bit for bit. On a CPU through the 256-entry table: torch's elementwise float8 conversion there
    is ~4x slower than a gather (π0's 2-view KV: 24 ms against 6 ms on one core), and it delays every refresh."""
    if q.device.type != "cpu":
        return q.float()
    codes = q.contiguous().view(torch.uint8).reshape(-1).int()
    return torch.index_select(_FP8_TABLE, 0, codes).view(q.shape)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    view = scales.view(*scales.shape, *([1] * (q.dim() - 2)))
    return (fp8_to_float(q) * view).to(dtype)


@dataclass(frozen=True)
class EncodedKv:
    version: int
    frames: list[bytes]
    payload_bytes: int  # K/V bytes (the frames add headers)

    @property
    def wire_bytes(self) -> int:
        return sum(len(f) for f in self.frames)


@dataclass(frozen=True)
class HostKv:
    """One prefix copied to the host in its wire format (what `encode_kv` chunks)."""

    payload: bytes
    fmt: str
    shape: tuple[int, ...]
    prefix_mask: np.ndarray  # (P,) bool
    scales: bytes  # (L, 2) little-endian float32 for fp8, else empty


def host_kv(kv: torch.Tensor, prefix_mask: torch.Tensor, fmt: str = "native") -> HostKv:
    """kv (L, 2, 1, P, Hkv, D) and prefix_mask (1, P) bool of one prefix (`PrefixEngine.export`) -> the valid rows,
    quantised if fmt is fp8, copied to the host (the device buffers may be reused right after)."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"kv format: expected one of {KV_FORMATS}, found {fmt!r}")
    mask = prefix_mask.reshape(-1).bool()
    rows = kv[:, :, :, mask.to(kv.device)] if not bool(mask.all()) else kv
    scales = b""
    if fmt == "fp8":
        rows, s = quantize_fp8(rows)
        scales = s.cpu().numpy().astype("<f4").tobytes()
    payload = rows.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return HostKv(payload, str(rows.dtype).removeprefix("torch."), tuple(rows.shape), mask.cpu().numpy(), scales)


def encode_kv(kv: torch.Tensor | HostKv, prefix_mask: torch.Tensor | None = None, *, version: int, t_capture: float,
              fmt: str = "native", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> EncodedKv:  # fmt: skip
    """One prefix (device tensors, or a `HostKv` already copied out) -> chunk frames (CPU work only for a HostKv)."""
    host = kv if isinstance(kv, HostKv) else host_kv(kv, prefix_mask, fmt)
    payload = host.payload
    count = max(1, math.ceil(len(payload) / chunk_bytes))
    chunks = [payload[seq * chunk_bytes : (seq + 1) * chunk_bytes] for seq in range(count)]
    manifest = msgpack.packb({
        "t_capture": float(t_capture), "format": host.fmt, "shape": list(host.shape),
        "prefix_len": int(host.prefix_mask.size), "mask": np.packbits(host.prefix_mask).tobytes(),
        "scales": host.scales, "nbytes": len(payload), "chunk_bytes": chunk_bytes, "count": count,
        "crcs": [zlib.crc32(c) for c in chunks],
    })  # fmt: skip
    frames = [msgpack.packb({"type": "kv", "version": int(version), "seq": seq, "manifest": manifest, "data": data})
              for seq, data in enumerate(chunks)]  # fmt: skip
    return EncodedKv(int(version), frames, len(payload))


@dataclass
class CompleteKv:
    """One whole version, on the host: what the expert imports (`to_device`)."""

    version: int
    t_capture: float
    fmt: str
    shape: tuple[int, ...]
    prefix_mask: np.ndarray  # (P,) bool
    scales: np.ndarray | None  # (L, 2) float32 for fp8
    payload: torch.Tensor  # (nbytes,) uint8 on the host, pinned when the expert runs on a GPU
    completed_at: float = 0.0  # time.monotonic() when the last chunk arrived (set by the link)

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    def to_device(self, device: torch.device, dtype: torch.dtype):
        """(kv (L, 2, 1, R, Hkv, D) in `dtype` on `device`, prefix_mask (1, P) bool, rows (R,) int64 or None when
        every prefix key is valid): the arguments of `ExpertEngine.import_prefix`. One host → device copy of the
        payload, asynchronous from pinned memory on the caller's current stream (the caller synchronises it); on
        a CPU no copy but a dtype conversion where the wire's dtype is not the engine's."""
        raw = self.payload.to(device, non_blocking=True)
        kv = raw.view(WIRE_DTYPES[self.fmt]).view(self.shape)
        if self.scales is not None:
            kv = dequantize_fp8(kv, torch.from_numpy(self.scales).to(device), dtype)
        elif kv.dtype != dtype:
            kv = kv.to(dtype)
        mask = torch.from_numpy(self.prefix_mask).to(device)[None]
        rows = None if self.prefix_mask.all() else torch.from_numpy(np.flatnonzero(self.prefix_mask)).to(device)
        return kv, mask, rows


@dataclass
class _Staging:
    version: int
    manifest: bytes
    header: dict
    buffer: torch.Tensor  # (nbytes,) uint8: the version's payload, handed over whole (never reused)
    view: np.ndarray  # the same memory, where chunks are copied in
    seen: set[int] = field(default_factory=set)


class KvAssembler:
    """Chunk frames (decoded msgpack maps) in any order -> whole versions, newest wins. Not thread-safe: one link.

    A chunk's bytes are copied once, straight from the received frame into the version's staging buffer, by numpy
    (which, like zlib's CRC, releases the GIL for a copy this size): the link's thread holds the GIL only for a
    few Python lines a chunk, so a robot-side answer on another thread is not held up by a refresh arriving.
    `pin_memory` (an expert on a GPU): the staging buffer is page-locked, so the whole version goes to the device
    in one asynchronous copy."""

    def __init__(self, layout: KvLayout, *, pin_memory: bool = False):
        self.layout, self.pin_memory = layout, pin_memory
        self.completed_version = -1
        self._staging: _Staging | None = None
        self.poisoned_version = -1  # the newest version dropped for a bad chunk
        self.stats = {"chunks": 0, "completed": 0, "stale": 0, "corrupt": 0, "abandoned": 0}

    def reset_staging(self) -> None:
        """Forgets a partly received version (a new connection will not finish it); completed versions stay."""
        self._staging = None

    def add(self, frame: dict) -> CompleteKv | None:
        """One chunk; returns the version it completes, else None. A protocol fault raises KvFrameError."""
        self.stats["chunks"] += 1
        version, seq, manifest, data = (frame.get(k) for k in ("version", "seq", "manifest", "data"))
        if not (isinstance(version, int) and isinstance(seq, int) and isinstance(manifest, bytes)
                and isinstance(data, bytes)):  # fmt: skip
            raise KvFrameError("kv chunk: expected int version and seq, bytes manifest and data, found "
                               f"{ {k: type(v).__name__ for k, v in frame.items()} }")  # fmt: skip
        if version <= self.completed_version or version == self.poisoned_version:
            self.stats["stale"] += 1
            return None
        staging = self._staging
        if staging is not None and version < staging.version:
            self.stats["stale"] += 1  # a late chunk of a version already superseded
            return None
        if staging is None or version > staging.version:
            if staging is not None:
                self.stats["abandoned"] += 1
            header = self._check_manifest(manifest)
            buffer = torch.empty(header["nbytes"], dtype=torch.uint8, pin_memory=self.pin_memory)
            staging = self._staging = _Staging(version, manifest, header, buffer, buffer.numpy())
        h = staging.header
        start = seq * h["chunk_bytes"]
        expected_len = min(h["chunk_bytes"], h["nbytes"] - start) if 0 <= seq < h["count"] else -1
        if manifest != staging.manifest or len(data) != expected_len or zlib.crc32(data) != h["crcs"][seq]:
            self.stats["corrupt"] += 1  # drop the whole version: never install a cache with a doubtful part
            self.poisoned_version, self._staging = version, None
            return None
        if seq in staging.seen:
            return None
        staging.view[start : start + len(data)] = np.frombuffer(data, np.uint8)
        staging.seen.add(seq)
        if len(staging.seen) < h["count"]:
            return None
        self._staging, self.completed_version = None, version
        self.stats["completed"] += 1
        mask = np.unpackbits(np.frombuffer(h["mask"], np.uint8), count=h["prefix_len"]).astype(bool)
        scales = np.frombuffer(h["scales"], "<f4").reshape(self.layout.depth, 2).copy() if h["scales"] else None
        return CompleteKv(version, h["t_capture"], h["format"], tuple(h["shape"]), mask, scales, staging.buffer)

    def _check_manifest(self, manifest: bytes) -> dict:
        try:
            h = msgpack.unpackb(manifest, raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise KvFrameError(f"kv manifest: expected a msgpack map, found bytes that do not decode ({e})") from None
        need = {"t_capture": float, "format": str, "shape": list, "prefix_len": int, "mask": bytes, "scales": bytes,
                "nbytes": int, "chunk_bytes": int, "count": int, "crcs": list}  # fmt: skip
        if not isinstance(h, dict) or any(not isinstance(h.get(k), t) for k, t in need.items()):
            raise KvFrameError(f"kv manifest: expected fields {sorted(need)}, found {h!r:.200}")
        lay = self.layout
        if h["format"] not in WIRE_DTYPES or h["prefix_len"] != lay.prefix_len:
            raise KvFrameError(f"kv manifest: expected a format in {sorted(WIRE_DTYPES)} and prefix length "
                               f"{lay.prefix_len}, found {h['format']!r} and {h['prefix_len']}")  # fmt: skip
        mask = np.unpackbits(np.frombuffer(h["mask"], np.uint8), count=lay.prefix_len) if h["mask"] else None
        rows = int(mask.sum()) if mask is not None and len(h["mask"]) == -(-lay.prefix_len // 8) else -1
        if rows < 1 or h["shape"] != list(lay.shape(rows)):
            raise KvFrameError(f"kv manifest: expected shape {list(lay.shape(rows))} for {rows} valid prefix keys, "
                               f"found {h['shape']}")  # fmt: skip
        itemsize = torch.empty(0, dtype=WIRE_DTYPES[h["format"]]).element_size()
        fp8 = h["format"] == "float8_e4m3fn"
        if h["nbytes"] != math.prod(h["shape"]) * itemsize or len(h["scales"]) != (8 * lay.depth if fp8 else 0):
            raise KvFrameError(f"kv manifest: expected {math.prod(h['shape']) * itemsize} bytes of {h['format']} and "
                               f"{2 * lay.depth if fp8 else 0} scales, found {h['nbytes']} and "
                               f"{len(h['scales']) // 4}")  # fmt: skip
        if (h["chunk_bytes"] < 1 or h["count"] != max(1, math.ceil(h["nbytes"] / h["chunk_bytes"]))
                or len(h["crcs"]) != h["count"] or not all(isinstance(c, int) for c in h["crcs"])):  # fmt: skip
            raise KvFrameError(f"kv manifest: {h['count']} chunks of {h['chunk_bytes']} bytes cannot hold "
                               f"{h['nbytes']} bytes")  # fmt: skip
        if fp8 and not np.all(np.isfinite(np.frombuffer(h["scales"], "<f4"))):
            raise KvFrameError("kv manifest: expected finite fp8 scales, found NaN or inf")
        return h
