"""The kernel plan of one π0 inference, over static buffers, for any kernel set with the Triton contracts.

`vlm(obs, slot)`: masks and positions → SigLIP → projector → text embedding → 17 full Gemma layers + the pruned
last one (K/V only) → the slot's KV cache. `expert_step(slot, step)`: suffix embedding from the time-bias table →
18 action-expert layers attending to the slot's cache → action projection fused with the Euler update of x_t.
No host synchronisation and no allocation that changes between calls, so both parts capture into CUDA Graphs.
"""

from __future__ import annotations

import math

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot
from vla_rt.engine.torch_ops import INVALID_BLOCK
from vla_rt.engine.weights import EngineWeights, GemmaLayerWeights


class Pi0Plan:
    def __init__(self, kernels, weights: EngineWeights, cfg: Pi0Config, dims: Dims, workspace=None):
        self.k, self.w, self.cfg, self.d = kernels, weights, cfg, dims
        self.ws = {} if workspace is None else {"workspace": workspace}
        g = cfg.llm
        self.heads = dict(num_q_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
        # openpi multiplies text embeddings by sqrt(width) rounded to the compute dtype (45.25 in bf16)
        self.text_scale = torch.tensor(math.sqrt(g.width), dtype=weights.embed_tokens.dtype).item()

    # ----- VLM: observation -> KV cache -----------------------------------------------------------------------------
    def _masks(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        d = self.d
        valid = torch.cat(
            [obs.image_masks[:, :, None].expand(d.batch, d.views, d.num_patches).reshape(d.batch, -1), obs.token_mask],
            dim=1,
        )
        act.prefix_q_block.copy_(torch.where(valid, 0, -1))
        act.prefix_k_block.copy_(torch.where(valid, 0, INVALID_BLOCK))
        positions = (torch.cumsum(valid.int(), dim=1) - 1).clamp(min=0)
        act.prefix_cos.copy_(self.w.rope_cos[positions])
        act.prefix_sin.copy_(self.w.rope_sin[positions])
        suffix_positions = valid.int().sum(-1, keepdim=True) + torch.arange(d.suffix, device=valid.device)
        slot.suffix_cos.copy_(self.w.rope_cos[suffix_positions])
        slot.suffix_sin.copy_(self.w.rope_sin[suffix_positions])
        slot.key_block[:, : d.prefix].copy_(act.prefix_k_block)
        slot.key_block[:, d.prefix :].fill_(2)
        slot.key_block[:, d.prefix].fill_(1)
        slot.state.copy_(obs.state)

    def _vision(self, obs: ObservationInputs, act: Activations) -> None:
        k, w, v, d = self.k, self.w, self.cfg.vision, self.d
        eps = self.cfg.layernorm_eps
        n_img = d.batch * d.views
        k.patchify(obs.images.view(n_img, v.image_size, v.image_size, 3), act.patches, v.patch_size)
        k.gemm(act.patches, w.patch, act.vision_x, bias=w.patch_bias, residual=w.pos_embed,
               residual_period=v.num_patches, **self.ws)  # fmt: skip
        x, h = act.vision_x, act.vision_h
        qkv = act.vision_qkv.view(n_img, v.num_patches, 3, v.num_heads, v.head_dim)
        attn = act.vision_attn.view(n_img, v.num_patches, v.num_heads, v.head_dim)
        for layer in w.vision:
            k.layernorm(x, h, eps)
            k.gemm(h, layer.qkv, act.vision_qkv, bias=layer.qkv_bias, **self.ws)
            k.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], attn, scale=w.vision_attn_scale, **self.ws)
            k.gemm(act.vision_attn, layer.out, x, bias=layer.out_bias, residual=x, **self.ws)
            k.layernorm(x, h, eps)
            k.gemm(h, layer.fc1, act.vision_mlp, bias=layer.fc1_bias, activation="gelu_tanh", **self.ws)
            k.gemm(act.vision_mlp, layer.fc2, x, bias=layer.fc2_bias, residual=x, **self.ws)
        k.layernorm(x, h, eps)
        rows = d.image_rows
        for b in range(d.batch):  # image rows of batch b land at the start of its prefix rows
            k.gemm(h[b * rows : (b + 1) * rows], w.projector, act.prefix_x[b * d.prefix : b * d.prefix + rows],
                   bias=w.projector_bias, **self.ws)  # fmt: skip

    def _text(self, obs: ObservationInputs, act: Activations) -> None:
        d = self.d
        if d.prompt == 0:
            return
        x = act.prefix_x.view(d.batch, d.prefix, -1)[:, d.image_rows :]
        x.copy_(torch.nn.functional.embedding(obs.tokens, self.w.embed_tokens) * self.text_scale)

    def _gemma_layer(self, layer: GemmaLayerWeights, x, qkv, attn, mlp, rms, cos, sin, k_cache, v_cache, offset,
                     q_block, k_block, rows) -> None:  # fmt: skip
        """One layer of one expert over `rows` tokens per batch whose K/V go to cache rows offset.. ."""
        k, g = self.k, self.cfg.llm
        eps = self.cfg.rms_eps
        k.rms_factor(x, rms, eps)
        if layer.kv_only:  # pruned last VLM layer: only K and V, written next to (stale) Q columns
            k.gemm(x, layer.qkv, qkv[:, g.num_heads * g.head_dim :], row_scale=rms, **self.ws)
        else:
            k.gemm(x, layer.qkv, qkv, row_scale=rms, **self.ws)
        k.rope_qk(qkv, cos, sin, k_cache, v_cache, cache_offset=offset, **self.heads)
        if layer.kv_only:
            return
        keys = offset + rows
        q = qkv.view(self.d.batch, rows, -1, g.head_dim)[:, :, : g.num_heads]
        k.attention(q, k_cache[:, :keys], v_cache[:, :keys], attn.view(self.d.batch, rows, g.num_heads, g.head_dim),
                    scale=self.w.gemma_attn_scale, q_block=q_block, k_block=k_block, **self.ws)  # fmt: skip
        k.gemm(attn, layer.o, x, residual=x, **self.ws)
        k.rms_factor(x, rms, eps)
        k.gemm(x, layer.gate_up, mlp, row_scale=rms, gated=True, **self.ws)
        k.gemm(mlp, layer.down, x, residual=x, **self.ws)

    def vlm(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        """Vision + VLM prefix for the observation in `obs`; fills `slot` (KV cache, key blocks, suffix RoPE, state)."""
        self.vision(obs, slot, act)
        self.prefix(obs, slot, act)

    def vision(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        """Masks, positions and the image tokens (SigLIP + projector) in the prefix rows."""
        self._masks(obs, slot, act)
        self._vision(obs, act)

    def prefix(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        """Text embedding and the Gemma prefix layers over image + text tokens: the slot's KV cache."""
        self._text(obs, act)
        for i, layer in enumerate(self.w.llm):
            self._gemma_layer(
                layer, act.prefix_x, act.prefix_qkv, act.prefix_attn, act.prefix_mlp, act.prefix_rms,
                act.prefix_cos, act.prefix_sin, slot.k_cache[i], slot.v_cache[i], 0,
                act.prefix_q_block, act.prefix_k_block, self.d.prefix,
            )  # fmt: skip
        slot.version.copy_(obs.version)  # last: a reader that sees the new version sees the whole new cache

    # ----- action expert: one Euler step --------------------------------------------------------------------------
    def expert_step(self, slot: PrefixSlot, xa: ExpertActivations, step: int, num_steps: int,
                    time_bias: torch.Tensor | None = None) -> None:  # fmt: skip
        """One Euler step; `time_bias` (width,) overrides the table row (a device-selected row for streaming)."""
        k, s, d = self.k, self.w.suffix, self.d
        ss, h = d.suffix, d.chunk
        x3 = xa.x.view(d.batch, ss, -1)
        k.gemm(slot.state, s.state, x3[:, 0], bias=s.state_bias, **self.ws)
        bias = s.time_bias[step] if time_bias is None else time_bias
        k.gemm(xa.x_t.view(d.batch * h, -1), s.action_time, xa.action_emb, bias=bias,
               activation="silu", **self.ws)  # fmt: skip
        for b in range(d.batch):
            k.gemm(xa.action_emb[b * h : (b + 1) * h], s.mlp_out, xa.x[b * ss + 1 : (b + 1) * ss],
                   bias=s.mlp_out_bias, **self.ws)  # fmt: skip
        for i, layer in enumerate(self.w.expert):
            self._gemma_layer(
                layer, xa.x, xa.qkv, xa.attn, xa.mlp, xa.rms, slot.suffix_cos, slot.suffix_sin,
                slot.k_cache[i], slot.v_cache[i], d.prefix, xa.query_block, slot.key_block, ss,
            )  # fmt: skip
        k.rms_factor(xa.x, xa.rms, self.cfg.rms_eps)
        for b in range(d.batch):  # v = action_out(x̂); x_t += dt * v, fused in the GEMM epilogue
            rows = slice(b * ss + 1, (b + 1) * ss)
            k.gemm(xa.x[rows], s.action_out, xa.x_t[b], bias=s.action_out_bias, row_scale=xa.rms[rows],
                   alpha=-1.0 / num_steps, residual=xa.x_t[b], **self.ws)  # fmt: skip

    def denoise(self, slot: PrefixSlot, xa: ExpertActivations, num_steps: int) -> None:
        for step in range(num_steps):
            self.expert_step(slot, xa, step, num_steps)
