"""Typed engine weights: what the graph passes produce, on the device, in the dtypes the kernels read.

The plan reads fields by name (`layer.qkv`, `suffix.time_bias`) rather than string keys, so a missing or renamed
weight fails at build time, not in the middle of a captured graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vla_rt.graph_passes import PassState

# openpi runs the patch embedding + position embedding and the suffix embedding in float32: keep those weights so.
FLOAT32_WEIGHTS = (
    "vision.patch_embed.weight",
    "vision.patch_embed.bias",
    "vision.pos_embed",
    "state_proj.weight",
    "state_proj.bias",
    "action_time_in.weight",
    "time_bias_table",
    "action_time_mlp_out.weight",
    "action_time_mlp_out.bias",
    "rope.cos",
    "rope.sin",
    "action_in_proj.weight",  # π0.5's action tokens (π0 merges action_in_proj away)
    "action_in_proj.bias",
)


def is_float32_weight(name: str) -> bool:
    """Kept float32 on the device: the names above and every per-step table (`*_table`, applied in float32)."""
    return name in FLOAT32_WEIGHTS or name.endswith("_table")


def padded_rows(w: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """A (N, K) view of a (N, K_pad) allocation with K_pad a multiple of 8: 16-byte aligned rows for the GEMM."""
    n, k = w.shape
    k_pad = -(-k // multiple) * multiple
    if k_pad == k:
        return w.contiguous()
    buf = torch.zeros(n, k_pad, dtype=w.dtype, device=w.device)
    buf[:, :k] = w
    return buf[:, :k]


@dataclass(frozen=True)
class VisionLayerWeights:
    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor
    fc1: torch.Tensor
    fc1_bias: torch.Tensor
    fc2: torch.Tensor
    fc2_bias: torch.Tensor


@dataclass(frozen=True)
class GemmaLayerWeights:
    """One expert's layer. `qkv` holds only K/V rows (and the rest is None) for the pruned last LLM layer."""

    qkv: torch.Tensor
    o: torch.Tensor | None
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    kv_only: bool = False


@dataclass(frozen=True)
class SuffixWeights:
    state: torch.Tensor
    state_bias: torch.Tensor
    action_time: torch.Tensor  # (width, A): action_in_proj merged with the action half of action_time_mlp_in
    time_bias: torch.Tensor  # (steps, width): the time half of action_time_mlp_in per Euler step
    mlp_out: torch.Tensor
    mlp_out_bias: torch.Tensor
    action_out: torch.Tensor  # expert final norm folded in
    action_out_bias: torch.Tensor


@dataclass(frozen=True)
class Pi05LayerRow:
    """One expert layer's modulation at one Euler step (float32 views into a row of `Pi05Weights.tables`)."""

    attn_scale: torch.Tensor  # (W,) pre-attention RMSNorm scale, an offset from 1
    qkv_bias: torch.Tensor  # ((Hq + 2 Hkv) D,) the folded shift through the (Q-scaled) fused QKV
    attn_gate: torch.Tensor  # (W,) the attention residual's gate
    ffn_scale: torch.Tensor
    gate_up_bias: torch.Tensor  # (2F,)
    ffn_gate: torch.Tensor


@dataclass(frozen=True)
class Pi05StepRow:
    layers: list[Pi05LayerRow]
    action_out: torch.Tensor  # (A, W) float32: action_out_proj with the final norm's scale folded in
    action_out_bias: torch.Tensor  # (A,) with the final norm's shift folded in


PI05_LAYER_TABLES = ("attn_scale", "qkv_bias", "attn_gate", "ffn_scale", "gate_up_bias", "ffn_gate")


@dataclass(frozen=True)
class Pi05Weights:
    """π0.5's action-expert extras: `action_in_proj` (float32) and every per-step modulation vector packed into one
    float32 (steps, R) table, so that one row (`tables[step]`, or a row the streaming engine copies out on the
    device) holds a whole step's modulation; `row(r)` cuts a row into named views. Segments start at multiples of
    8 elements (16-byte aligned GEMM operands)."""

    action_in: torch.Tensor  # (W, A) float32
    action_in_bias: torch.Tensor  # (W,) float32
    tables: torch.Tensor  # (steps, R) float32
    segments: tuple[tuple[int, tuple[int, ...]], ...]  # (offset, shape) of each view, in `row` order

    @classmethod
    def pack(cls, t: dict[str, torch.Tensor], depth: int) -> Pi05Weights:
        parts = [t[f"expert.layers.{i}.{name}_table"] for i in range(depth) for name in PI05_LAYER_TABLES]
        parts += [t["action_out_proj.weight_table"], t["action_out_proj.bias_table"]]
        steps = parts[0].shape[0]
        segments, offset = [], 0
        for p in parts:
            segments.append((offset, tuple(p.shape[1:])))
            offset += -(-p[0].numel() // 8) * 8
        tables = torch.zeros(steps, offset, dtype=torch.float32, device=parts[0].device)
        for (start, _), p in zip(segments, parts):
            tables[:, start : start + p[0].numel()] = p.reshape(steps, -1)
        return cls(t["action_in_proj.weight"], t["action_in_proj.bias"], tables, tuple(segments))

    def row(self, r: torch.Tensor) -> Pi05StepRow:
        """Named views into one step's row `r` ((R,) float32: `tables[step]` or a copy of it)."""
        views = [r[o : o + math.prod(shape)].view(shape) for o, shape in self.segments]
        n = len(PI05_LAYER_TABLES)
        layers = [Pi05LayerRow(*views[i : i + n]) for i in range(0, len(views) - 2, n)]
        return Pi05StepRow(layers, views[-2], views[-1])

    def rows(self, r: torch.Tensor) -> Pi05StepRow:
        """The same named views over (B, R) rows, one step's row per batch element: every view gains a leading B
        (the stage engine's rows at different Euler steps)."""
        b = r.shape[0]
        views = [r[:, o : o + math.prod(shape)].view(b, *shape) for o, shape in self.segments]
        n = len(PI05_LAYER_TABLES)
        layers = [Pi05LayerRow(*views[i : i + n]) for i in range(0, len(views) - 2, n)]
        return Pi05StepRow(layers, views[-2], views[-1])


@dataclass(frozen=True)
class EngineWeights:
    patch: torch.Tensor  # (width, p*p*3) in (kh, kw, c) order, rows padded for alignment
    patch_bias: torch.Tensor
    pos_embed: torch.Tensor
    vision: list[VisionLayerWeights]
    projector: torch.Tensor
    projector_bias: torch.Tensor
    embed_tokens: torch.Tensor
    llm: list[GemmaLayerWeights]
    expert: list[GemmaLayerWeights]
    suffix: SuffixWeights | None  # π0's suffix embedding and output (None for π0.5)
    rope_cos: torch.Tensor  # (max_positions, head_dim/2) float32
    rope_sin: torch.Tensor
    vision_attn_scale: float
    gemma_attn_scale: float
    num_steps: int
    pi05: Pi05Weights | None = None  # π0.5's action tokens and per-step modulation (None for π0)

    @classmethod
    def from_pass_state(cls, state: PassState, device: torch.device, dtype: torch.dtype) -> EngineWeights:
        t = {
            k: v.to(device, torch.float32 if is_float32_weight(k) else dtype).contiguous()
            for k, v in state.tensors.items()
        }
        meta = state.meta

        def gemma(stack: str) -> list[GemmaLayerWeights]:
            ids = sorted({int(k.split(".")[2]) for k in t if k.startswith(f"{stack}.layers.")})
            layers = []
            for i in ids:
                p = f"{stack}.layers.{i}."
                if p + "kv.weight" in t:
                    layers.append(GemmaLayerWeights(t[p + "kv.weight"], None, None, None, kv_only=True))
                else:
                    layers.append(
                        GemmaLayerWeights(
                            t[p + "qkv.weight"],
                            t[p + "o_proj.weight"],
                            t[p + "gate_up.weight"],
                            t[p + "down_proj.weight"],
                        )
                    )
            return layers

        vision = []
        for i in sorted({int(k.split(".")[2]) for k in t if k.startswith("vision.blocks.")}):
            p = f"vision.blocks.{i}."
            vision.append(
                VisionLayerWeights(
                    t[p + "attn.qkv.weight"], t[p + "attn.qkv.bias"], t[p + "attn.out_proj.weight"],
                    t[p + "attn.out_proj.bias"], t[p + "mlp.fc1.weight"], t[p + "mlp.fc1.bias"],
                    t[p + "mlp.fc2.weight"], t[p + "mlp.fc2.bias"],
                )
            )  # fmt: skip
        suffix = pi05 = None
        if "time_bias_table" in t:
            suffix = SuffixWeights(
                t["state_proj.weight"], t["state_proj.bias"], t["action_time_in.weight"], t["time_bias_table"],
                t["action_time_mlp_out.weight"], t["action_time_mlp_out.bias"], t["action_out_proj.weight"],
                t["action_out_proj.bias"],
            )  # fmt: skip
        else:
            pi05 = Pi05Weights.pack(t, len({k.split(".")[2] for k in t if k.startswith("expert.layers.")}))
        return cls(
            patch=padded_rows(t["vision.patch_embed.weight"]),
            patch_bias=t["vision.patch_embed.bias"],
            pos_embed=t["vision.pos_embed"],
            vision=vision,
            projector=t["projector.weight"],
            projector_bias=t["projector.bias"],
            embed_tokens=t["llm.embed_tokens.weight"],
            llm=gemma("llm"),
            expert=gemma("expert"),
            suffix=suffix,
            pi05=pi05,
            rope_cos=t["rope.cos"],
            rope_sin=t["rope.sin"],
            vision_attn_scale=meta["vision_attn_scale"],
            gemma_attn_scale=meta["gemma_attn_scale"],
            num_steps=meta["time_bias_steps"] if suffix is not None else meta["adarms_steps"],
        )

    @property
    def step_table(self) -> torch.Tensor:
        """(steps, R) float32: what differs between Euler steps, one row a step (π0: the time bias; π0.5: the
        packed modulation). The streaming engine copies a row out on the device and passes it as `time_bias`."""
        return self.suffix.time_bias if self.pi05 is None else self.pi05.tables

    def nbytes(self) -> int:
        seen = set()
        total = 0
        for v in _tensors(self):
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.untyped_storage().nbytes()
        return total


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list):
        for x in obj:
            yield from _tensors(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))
