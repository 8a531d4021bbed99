"""Static buffers for one set of shapes (batch B, views V, prompt P, chunk H), allocated once.

`PrefixSlot` holds everything the action expert reads from one observation: the KV cache (prefix rows written by
the VLM pass, suffix rows by the expert itself), the keys' block ids, the suffix RoPE rows and the robot state.
The streaming engine double-buffers slots; the one-shot engine uses one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import torch

from vla_rt.config import Pi0Config
from vla_rt.inputs import BuiltShapes


@dataclass(frozen=True)
class Dims:
    batch: int
    views: int
    prompt: int
    chunk: int
    num_patches: int
    state_token: bool = True  # π0's suffix starts with the state token; π0.5's is the action tokens alone

    @property
    def image_rows(self) -> int:
        return self.views * self.num_patches

    @property
    def prefix(self) -> int:
        return self.image_rows + self.prompt

    @property
    def suffix(self) -> int:
        return self.chunk + (1 if self.state_token else 0)

    @classmethod
    def of(cls, cfg: Pi0Config, shapes: BuiltShapes) -> Dims:
        return cls(shapes.batch_size or 1, shapes.num_views or 1, shapes.prompt_len or 0,
                   shapes.chunk or cfg.chunk, cfg.vision.num_patches, state_token=not cfg.pi05)  # fmt: skip


def first_rows(buffers, b: int, total: int):
    """The same dataclass of buffers over the first `b` of `total` batch elements: every tensor (or list of tensors)
    whose leading dim is a multiple of the batch is cut to its first b/total share, as views, so graphs and copies
    over them share the memory. None fields and the `version` counter stay as they are."""
    values = {}
    for f in dataclasses.fields(buffers):
        v = getattr(buffers, f.name)
        if isinstance(v, list):
            v = [t[: t.shape[0] * b // total] for t in v]
        elif isinstance(v, torch.Tensor) and v.shape[0] % total == 0 and f.name != "version":
            v = v[: v.shape[0] * b // total]
        values[f.name] = v
    return replace(buffers, **values)


def _empty(shape, dtype, device) -> torch.Tensor:
    # NaN-poisoned where possible, so a kernel that forgets to write shows up in tests instead of reading zeros
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if t.is_floating_point() else t.zero_()


@dataclass
class PrefixSlot:
    k_cache: list[torch.Tensor]  # per layer (B, prefix + suffix, Hkv, D)
    v_cache: list[torch.Tensor]
    key_block: torch.Tensor  # (B, prefix + suffix) int32 block ids of all keys the expert sees
    suffix_cos: torch.Tensor  # (B, suffix, D/2) float32 RoPE rows at the suffix positions
    suffix_sin: torch.Tensor
    state: torch.Tensor  # (B, A) float32 normalized state of this observation
    version: torch.Tensor  # (1,) int64 observation counter written by the VLM pass (torn-read checks)

    @classmethod
    def allocate(cls, cfg: Pi0Config, d: Dims, device, dtype) -> PrefixSlot:
        g = cfg.llm
        keys = d.prefix + d.suffix
        return cls(
            [_empty((d.batch, keys, g.num_kv_heads, g.head_dim), dtype, device) for _ in range(g.depth)],
            [_empty((d.batch, keys, g.num_kv_heads, g.head_dim), dtype, device) for _ in range(g.depth)],
            torch.zeros(d.batch, keys, dtype=torch.int32, device=device),
            _empty((d.batch, d.suffix, g.head_dim // 2), torch.float32, device),
            _empty((d.batch, d.suffix, g.head_dim // 2), torch.float32, device),
            torch.zeros(d.batch, cfg.action_dim, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )


@dataclass
class ObservationInputs:
    """Where callers copy an observation before a replay."""

    images: torch.Tensor  # (B, V, S, S, 3) float32 in [-1, 1]
    image_masks: torch.Tensor  # (B, V) bool
    tokens: torch.Tensor  # (B, P) int64
    token_mask: torch.Tensor  # (B, P) bool
    state: torch.Tensor  # (B, A) float32
    version: torch.Tensor  # (1,) int64

    def load(self, x, version: int | None = None, non_blocking: bool = False) -> None:
        """Copies a checked observation (`vla_rt.inputs.ModelInputs`) in; no reallocation, so graphs stay valid.

        A model built with a prompt length but called without tokens gets an all-False token mask.
        """
        self.images.copy_(x.images, non_blocking=non_blocking)
        self.image_masks.copy_(x.image_masks, non_blocking=non_blocking)
        self.state.copy_(x.state, non_blocking=non_blocking)
        if version is not None:
            self.version.fill_(version)
        if self.tokens.shape[1] == 0:
            return
        if x.tokens is None or x.tokens.shape[1] == 0:
            self.token_mask.zero_()
            return
        self.tokens.copy_(x.tokens, non_blocking=non_blocking)
        mask = torch.ones_like(x.tokens, dtype=torch.bool) if x.token_mask is None else x.token_mask
        self.token_mask.copy_(mask, non_blocking=non_blocking)

    @classmethod
    def allocate(cls, cfg: Pi0Config, d: Dims, device) -> ObservationInputs:
        s = cfg.vision.image_size
        return cls(
            torch.zeros(d.batch, d.views, s, s, 3, device=device),
            torch.ones(d.batch, d.views, dtype=torch.bool, device=device),
            torch.zeros(d.batch, d.prompt, dtype=torch.long, device=device),
            torch.zeros(d.batch, d.prompt, dtype=torch.bool, device=device),
            torch.zeros(d.batch, cfg.action_dim, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )


@dataclass
class Activations:
    """Scratch activations of the vision tower, the VLM prefix and the action expert."""

    patches: torch.Tensor
    vision_x: torch.Tensor
    vision_h: torch.Tensor
    vision_qkv: torch.Tensor
    vision_attn: torch.Tensor
    vision_mlp: torch.Tensor
    prefix_x: torch.Tensor
    prefix_qkv: torch.Tensor
    prefix_attn: torch.Tensor
    prefix_mlp: torch.Tensor
    prefix_rms: torch.Tensor
    prefix_cos: torch.Tensor
    prefix_sin: torch.Tensor
    prefix_q_block: torch.Tensor
    prefix_k_block: torch.Tensor

    @classmethod
    def allocate(cls, cfg: Pi0Config, d: Dims, device, dtype) -> Activations:
        v, g = cfg.vision, cfg.llm
        mv = d.batch * d.image_rows
        mp = d.batch * d.prefix
        patch_cols = v.patch_size * v.patch_size * 3
        patch_pad = -(-patch_cols // 8) * 8  # 16-byte aligned rows for the GEMM's fast path
        qkv = (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
        return cls(
            _empty((mv, patch_pad), torch.float32, device)[:, :patch_cols],
            _empty((mv, v.width), dtype, device),
            _empty((mv, v.width), dtype, device),
            _empty((mv, 3 * v.width), dtype, device),
            _empty((mv, v.width), dtype, device),
            _empty((mv, v.mlp_dim), dtype, device),
            _empty((mp, g.width), dtype, device),
            _empty((mp, qkv), dtype, device),
            _empty((mp, g.num_heads * g.head_dim), dtype, device),
            _empty((mp, g.mlp_dim), dtype, device),
            _empty((mp,), torch.float32, device),
            _empty((d.batch, d.prefix, g.head_dim // 2), torch.float32, device),
            _empty((d.batch, d.prefix, g.head_dim // 2), torch.float32, device),
            torch.zeros(d.batch, d.prefix, dtype=torch.int32, device=device),
            torch.zeros(d.batch, d.prefix, dtype=torch.int32, device=device),
        )


@dataclass
class ExpertActivations:
    x_t: torch.Tensor  # (B, H, A) float32: noise in, actions out, updated in place by every Euler step
    x: torch.Tensor  # (B * suffix, width)
    qkv: torch.Tensor
    attn: torch.Tensor
    mlp: torch.Tensor
    rms: torch.Tensor
    action_emb: torch.Tensor  # (B * H, width) float32 (π0.5: the final norm's output)
    query_block: torch.Tensor  # (B, suffix) int32: state token 1, actions 2 (π0.5: actions 1)
    normed: torch.Tensor | None = None  # (B * suffix, width) π0.5: an adaptive RMSNorm's output, the next GEMM's input

    @classmethod
    def allocate(cls, cfg: Pi0Config, d: Dims, device, dtype) -> ExpertActivations:
        e, g = cfg.expert, cfg.llm
        m = d.batch * d.suffix
        qkv = (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
        q_block = torch.full((d.batch, d.suffix), 2 if d.state_token else 1, dtype=torch.int32, device=device)
        q_block[:, 0] = 1
        return cls(
            _empty((d.batch, d.chunk, cfg.action_dim), torch.float32, device),
            _empty((m, e.width), dtype, device),
            _empty((m, qkv), dtype, device),
            _empty((m, g.num_heads * g.head_dim), dtype, device),
            _empty((m, e.mlp_dim), dtype, device),
            _empty((m,), torch.float32, device),
            _empty((d.batch * d.chunk, e.width), torch.float32, device),
            q_block,
            None if d.state_token else _empty((m, e.width), dtype, device),
        )
