"""`HostInputRing`: reused host buffers for the rows of a prefix stage, pinned on CUDA.

Why: stacking each stage's rows with `torch.cat` and pinning the result allocated a fresh host tensor per field and
stage, and on the H200 machine every fresh page costs a page fault: a 1-row prefix stage spent 1.4 ms median (11 ms
at p90) on the host before its launch returned, the image `cat` and `fill_` alone 0.25-1.5 ms a call
(tools/admit_host_probe.py, 2026-12-03). Rows copied into buffers that already exist, and pinned, upload as one
asynchronous copy each with no staging copy and no page fault.

A ring of two sets: the caller fills the set `take` returns and passes it to `admit` / `begin_admit`, whose uploads
record an event for it (`uploaded`). A set is handed out again only after that event, so a row is never
overwritten while its upload is queued on the GPU. With at most one stage queued ahead of the GPU (the stage
engine's fence), the wait is for copies that ran long ago.
"""

from __future__ import annotations

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import ObservationInputs, first_rows
from vla_rt.inputs import ModelInputs


def host_inputs(cfg: Pi0Config, *, rows: int, views: int, prompt: int, chunk: int, pin: bool = False) -> ModelInputs:
    """Zeroed host buffers for `rows` rows in the layout `StageEngine.admit` takes: uint8 pixels (rows, V, S, S, 3),
    float32 state (rows, A) and noise (rows, H, A), int64 tokens and bool masks."""
    s, a = cfg.vision.image_size, cfg.action_dim

    def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=pin)

    return ModelInputs(images=zeros(rows, views, s, s, 3, dtype=torch.uint8), state=zeros(rows, a),
                       tokens=zeros(rows, prompt, dtype=torch.long), noise=zeros(rows, chunk, a),
                       image_masks=zeros(rows, views, dtype=torch.bool),
                       token_mask=zeros(rows, prompt, dtype=torch.bool))  # fmt: skip


def loads_direct(x: ModelInputs, device: torch.device) -> bool:
    """True for rows that copy straight into a prefix graph's inputs (`load_pinned`): uint8 pixels and every field
    on the host, pinned when the engine is on CUDA (what `HostInputRing` hands out). Others go through temporaries."""
    fields = (x.images, x.state, x.tokens, x.image_masks, x.token_mask)
    if x.images.dtype != torch.uint8 or any(t is None or t.device.type != "cpu" for t in fields):
        return False
    return device.type != "cuda" or all(t.is_pinned() for t in fields)


def load_pinned(obs: ObservationInputs, pixels: torch.Tensor, x: ModelInputs) -> None:
    """One asynchronous copy per field into the graph's own input buffers `obs` (its first len(x) rows), the uint8
    pixels through `pixels` (a device buffer of at least as many rows) and scaled in place with
    `images_to_model_range`'s ops in its order, so the same floats: no device temporaries, no second copy."""
    pixels = pixels[: len(x.images)]
    pixels.copy_(x.images, non_blocking=True)
    torch.div(pixels, 255.0, out=obs.images).mul_(2.0).sub_(1.0)
    pairs = [(obs.state, x.state), (obs.image_masks, x.image_masks)]
    if obs.tokens.shape[1]:
        pairs += [(obs.tokens, x.tokens), (obs.token_mask, x.token_mask)]
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)


class HostInputRing:
    """Two sets of `host_inputs` of `rows` rows (pinned on CUDA), handed out in turn once their last upload ran."""

    def __init__(self, cfg: Pi0Config, *, rows: int, views: int, prompt: int, chunk: int, device: torch.device):
        self.rows, self.cuda = rows, device.type == "cuda"
        shape = dict(rows=rows, views=views, prompt=prompt, chunk=chunk, pin=self.cuda)
        self._sets = [host_inputs(cfg, **shape) for _ in range(2)]
        self._uploads: list[torch.cuda.Event | None] = [None, None]
        self._taken = 1  # the set handed out last (the next `take` hands out the other)

    def take(self, k: int) -> ModelInputs:
        """The first k rows of the next set, free to write (waits for its last upload, normally long done)."""
        if not 1 <= k <= self.rows:
            raise ValueError(f"input rows: expected 1..{self.rows} (the largest prefix stage), found {k}")
        self._taken = 1 - self._taken
        event = self._uploads[self._taken]
        if event is not None:
            event.synchronize()
        return first_rows(self._sets[self._taken], k, self.rows)

    def uploaded(self) -> None:
        """Marks the set taken last as read by the copies queued so far on the current stream (CUDA only)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self._uploads[self._taken] = event
