"""One Gemma decoder layer as separate kernel launches: what both the VLM prefix and the per-op action expert run.

    rms_factor(x) → QKV GEMM (norm as row scale) → RoPE (Q in place, K/V into the KV cache) → attention over the
    cache → O GEMM (+x) → rms_factor(x) → gate/up GEMM (GeGLU) → down GEMM (+x)

The RMSNorm scales are folded into the QKV and gate/up weights by the graph passes, so a norm costs one
`rms_factor` launch whose result the next GEMM applies per row. RoPE runs either as its own `rope_qk` launch (the
VLM prefix) or in the QKV GEMM's epilogue (the action expert: measured 0.55 ms a call faster on the H200; on the
prefix it gained nothing). The pruned last VLM layer (`layer.kv_only`) only writes K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.weights import GemmaLayerWeights


@dataclass(frozen=True)
class LayerBuffers:
    """What a stage's layers run over: `rows` tokens per batch element, whose K/V go to cache rows offset.. ."""

    x: torch.Tensor  # (B * rows, width) the residual stream, updated in place
    qkv: torch.Tensor  # (B * rows, (Hq + 2 Hkv) D) scratch; Q rotated in place
    attn: torch.Tensor  # (B * rows, Hq D) scratch
    mlp: torch.Tensor  # (B * rows, mlp_dim) scratch
    rms: torch.Tensor  # (B * rows,) float32 scratch: the RMSNorm factor
    cos: torch.Tensor  # (B, rows, D/2) float32 RoPE rows of these tokens
    sin: torch.Tensor
    q_block: torch.Tensor  # (B, rows) int32 block id of every query
    k_block: torch.Tensor  # (B, offset + rows) int32 block id of every key the queries may see
    rows: int
    offset: int


class GemmaLayerRunner:
    """Launches one Gemma layer of the kernel set `kernels` (the Triton contracts) over `LayerBuffers`."""

    def __init__(self, kernels, cfg: Pi0Config, batch: int, attn_scale: float, workspace=None):
        self.k, self.batch, self.attn_scale, self.eps = kernels, batch, attn_scale, cfg.rms_eps
        g = cfg.llm  # both experts share the head layout (PI0_SPEC.md)
        self.heads = dict(num_q_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
        self.ws = {} if workspace is None else {"workspace": workspace}

    def run(self, layer: GemmaLayerWeights, io: LayerBuffers, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            rope_epilogue: bool) -> None:  # fmt: skip
        """x += attention and MLP of `layer`; its K/V land in cache rows offset..offset + rows of every batch."""
        k, h = self.k, self.heads
        k.rms_factor(io.x, io.rms, self.eps)
        q_cols = h["num_q_heads"] * h["head_dim"]
        out = io.qkv[:, q_cols:] if layer.kv_only else io.qkv  # pruned layer: K/V columns only, stale Q beside them
        if rope_epilogue:  # Q rotated in place, K/V straight into the cache rows, in the GEMM's epilogue
            rope = dict(cos=io.cos, sin=io.sin, k_cache=k_cache, v_cache=v_cache, cache_offset=io.offset,
                        **{**h, "num_q_heads": 0 if layer.kv_only else h["num_q_heads"]})  # fmt: skip
            k.gemm(io.x, layer.qkv, out, row_scale=io.rms, rope=rope, **self.ws)
        else:
            k.gemm(io.x, layer.qkv, out, row_scale=io.rms, **self.ws)
            k.rope_qk(io.qkv, io.cos, io.sin, k_cache, v_cache, cache_offset=io.offset, **h)
        if layer.kv_only:
            return
        keys = io.offset + io.rows
        b, d = self.batch, h["head_dim"]
        q = io.qkv.view(b, io.rows, -1, d)[:, :, : h["num_q_heads"]]
        k.attention(q, k_cache[:, :keys], v_cache[:, :keys], io.attn.view(b, io.rows, h["num_q_heads"], d),
                    scale=self.attn_scale, q_block=io.q_block, k_block=io.k_block, **self.ws)  # fmt: skip
        k.gemm(io.attn, layer.o, io.x, residual=io.x, **self.ws)
        k.rms_factor(io.x, io.rms, self.eps)
        k.gemm(io.x, layer.gate_up, io.mlp, gated=True, row_scale=io.rms, **self.ws)
        k.gemm(io.mlp, layer.down, io.x, residual=io.x, **self.ws)
