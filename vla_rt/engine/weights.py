"""Typed engine weights: what the graph passes produce, on the device, in the dtypes the kernels read.

The plan reads fields by name (`layer.qkv`, `suffix.time_bias`) rather than string keys, so a missing or renamed
weight fails at build time, not in the middle of a captured graph.
"""

from __future__ import annotations

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
    suffix: SuffixWeights
    rope_cos: torch.Tensor  # (max_positions, head_dim/2) float32
    rope_sin: torch.Tensor
    vision_attn_scale: float
    gemma_attn_scale: float
    num_steps: int

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
        suffix = SuffixWeights(
            t["state_proj.weight"], t["state_proj.bias"], t["action_time_in.weight"], t["time_bias_table"],
            t["action_time_mlp_out.weight"], t["action_time_mlp_out.bias"], t["action_out_proj.weight"],
            t["action_out_proj.bias"],
        )  # fmt: skip
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
            rope_cos=t["rope.cos"],
            rope_sin=t["rope.sin"],
            vision_attn_scale=meta["vision_attn_scale"],
            gemma_attn_scale=meta["gemma_attn_scale"],
            num_steps=meta["time_bias_steps"],
        )

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
