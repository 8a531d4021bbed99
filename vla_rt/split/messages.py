"""The KV link's small messages (msgpack through `vla_rt.serve.wire`, never pickle): hello, observation, relay.

    expert -> prefix  hello {protocol, fingerprint, layout, kv_format}      first frame; the server answers its own
                      hello or one text frame saying what does not match, then closes
    expert -> prefix  obs {version, t_capture, images uint8 (V, S, S, 3), image_masks (V,), tokens (P,) int64,
                           token_mask (P,), state (A,) float32 normalised, noise (H, A) float32}
    prefix -> expert  relay {version, actions (H, A) float32 normalised, prefix_ms, relay_ms, server_start}  tiny, first
    prefix -> expert  kv chunks (`kv_codec`)

`version` is the observation's capture time in nanoseconds on the expert's clock (the robot's machine), so versions
grow with capture time, and the age of a KV is measured on one clock. The server never compares it with its own.
Images travel as the uint8 pixels the policy resized to the model's size (150 KB a 224-px view); the server turns
them into floats with the policy's own formula, so the prefix sees what a monolithic engine would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from vla_rt.config import Pi0Config
from vla_rt.inputs import BuiltShapes, ModelInputs
from vla_rt.policy import PreparedObservation
from vla_rt.serve.wire import WireError, pack, unpack_observation
from vla_rt.split.kv_codec import KV_FORMATS, KvLayout

PROTOCOL = 1


@dataclass(frozen=True)
class LinkLayout:
    """Everything both ends must agree on for a KV version to mean the same thing on both."""

    model: str
    depth: int
    kv_heads: int
    head_dim: int
    views: int
    prompt_len: int
    chunk: int
    action_dim: int
    image_size: int
    num_steps: int

    @classmethod
    def of(cls, cfg: Pi0Config, shapes: BuiltShapes, num_steps: int) -> LinkLayout:
        g = cfg.llm
        return cls(cfg.model_name, g.depth, g.num_kv_heads, g.head_dim, shapes.num_views, shapes.prompt_len,
                   shapes.chunk, cfg.action_dim, cfg.vision.image_size, num_steps)  # fmt: skip

    def kv(self, num_patches: int) -> KvLayout:
        return KvLayout(self.depth, self.kv_heads, self.head_dim, self.views * num_patches + self.prompt_len)


class LinkError(ValueError):
    """A message that breaks the KV link's protocol (one line: field, expected, found)."""


def hello(layout: LinkLayout, fingerprint: str, kv_format: str, **extra: Any) -> bytes:
    return pack({"type": "hello", "protocol": PROTOCOL, "fingerprint": fingerprint, "layout": asdict(layout),
                 "kv_format": kv_format, **extra})  # fmt: skip


def check_hello(msg: dict, layout: LinkLayout, fingerprint: str, peer: str) -> str:
    """Checks the peer's hello against ours; returns its kv_format. Raises LinkError naming the first mismatch."""
    if msg.get("type") != "hello" or msg.get("protocol") != PROTOCOL:
        raise LinkError(f"hello: expected a vla-rt split hello, protocol {PROTOCOL}, found type "
                        f"{msg.get('type')!r} protocol {msg.get('protocol')!r}")  # fmt: skip
    if msg.get("fingerprint") != fingerprint:
        raise LinkError(f"fingerprint: expected {fingerprint} (this {peer}'s checkpoint), found "
                        f"{msg.get('fingerprint')!r}: the two halves come from different checkpoints")  # fmt: skip
    theirs = msg.get("layout") if isinstance(msg.get("layout"), dict) else {}
    for name, ours in asdict(layout).items():
        if theirs.get(name) != ours:
            raise LinkError(f"layout.{name}: expected {ours!r} (this {peer}), found {theirs.get(name)!r}: start both "
                            "halves with the same --num-views / --prompt-len / --chunk")  # fmt: skip
    if msg.get("kv_format") not in KV_FORMATS:
        raise LinkError(f"kv_format: expected one of {KV_FORMATS}, found {msg.get('kv_format')!r}")
    return msg["kv_format"]


def decode(frame: bytes | str) -> dict:
    """One frame of the link -> a dict with a `type`. A text frame is the peer's one-line error."""
    if isinstance(frame, str):
        raise LinkError(f"the peer said: {frame}")
    try:
        msg = unpack_observation(frame)
    except WireError as e:
        raise LinkError(str(e).replace("observation", "message", 1)) from None
    if not isinstance(msg.get("type"), str):
        raise LinkError(f"message: expected a map with a 'type', found keys {sorted(msg)[:8]}")
    return msg


def observation(version: int, t_capture: float, row: PreparedObservation, noise: torch.Tensor,
                prompt_len: int) -> bytes:  # fmt: skip
    """A prepared observation (batch 1) as the uplink sends it, with the noise the relay should start from."""
    pixels = row.images[0]  # the link carries pixels as the robot sent them: `prepare(..., uint8_images=True)`
    if pixels.dtype != torch.uint8:
        raise TypeError(f"observation: expected uint8 pixels (prepare with uint8_images=True), found {pixels.dtype}")
    tokens = torch.zeros(prompt_len, dtype=torch.int64) if row.tokens is None else row.tokens[0]
    mask = torch.zeros(prompt_len, dtype=torch.bool) if row.token_mask is None else row.token_mask[0]
    return pack({"type": "obs", "version": int(version), "t_capture": float(t_capture),
                 "images": pixels.numpy(), "image_masks": row.image_masks[0].numpy(), "tokens": tokens.numpy(),
                 "token_mask": mask.numpy(), "state": row.state[0].float().numpy(),
                 "noise": noise.reshape(noise.shape[-2:]).float().numpy()})  # fmt: skip


def _array(msg: dict, key: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    a = msg.get(key)
    if (
        not isinstance(a, np.ndarray)
        or a.shape != shape
        or a.dtype.kind != kind[0]
        or a.dtype.itemsize != int(kind[1:])
    ):
        found = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise LinkError(f"obs.{key}: expected an array of shape {shape} ({kind}), found {found}")
    return a


def parse_observation(msg: dict, layout: LinkLayout) -> tuple[int, float, ModelInputs, torch.Tensor]:
    """An uplink obs -> (version, t_capture, model inputs (batch 1, CPU), noise (1, H, A))."""
    version, t_capture = msg.get("version"), msg.get("t_capture")
    if not isinstance(version, int) or isinstance(version, bool) or not isinstance(t_capture, float):
        raise LinkError(f"obs: expected an int version and a float t_capture, found {version!r}, {t_capture!r}")
    s, v, p = layout.image_size, layout.views, layout.prompt_len
    pixels = _array(msg, "images", (v, s, s, 3), "u1")
    image_masks = _array(msg, "image_masks", (v,), "b1")
    tokens = _array(msg, "tokens", (p,), "i8")
    token_mask = _array(msg, "token_mask", (p,), "b1")
    state = _array(msg, "state", (layout.action_dim,), "f4")
    noise = _array(msg, "noise", (layout.chunk, layout.action_dim), "f4")
    if not image_masks.any() or not (np.isfinite(state).all() and np.isfinite(noise).all()):
        raise LinkError("obs: expected at least one view present and finite state and noise, found otherwise")
    images = torch.from_numpy(pixels.copy()[None]).float() / 255.0 * 2.0 - 1.0  # the policy's own formula
    x = ModelInputs(images, torch.from_numpy(state.copy())[None], torch.from_numpy(tokens.copy())[None] if p else None,
                    None, torch.from_numpy(image_masks.copy())[None],
                    torch.from_numpy(token_mask.copy())[None] if p else None)  # fmt: skip
    return version, t_capture, x, torch.from_numpy(noise.copy())[None]


def relay(version: int, actions: np.ndarray, prefix_ms: float, relay_ms: float, server_start: float) -> bytes:
    """`server_start`: when the prefix began, on the server's monotonic clock (a timeline on one machine only)."""
    return pack({"type": "relay", "version": int(version), "actions": np.asarray(actions, np.float32),
                 "prefix_ms": float(prefix_ms), "relay_ms": float(relay_ms), "server_start": float(server_start)})  # fmt: skip


def parse_relay(msg: dict, layout: LinkLayout) -> tuple[int, np.ndarray]:
    version, actions = msg.get("version"), msg.get("actions")
    shape = (layout.chunk, layout.action_dim)
    if not isinstance(version, int) or not isinstance(actions, np.ndarray) or actions.shape != shape:
        raise LinkError(f"relay: expected an int version and actions of shape {shape}, found {version!r}, "
                        f"{getattr(actions, 'shape', type(actions).__name__)}")  # fmt: skip
    return version, actions.astype(np.float32)
