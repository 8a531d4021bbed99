"""The kernel plan of one π0 inference over static buffers, for any kernel set with the Triton contracts.

`vlm(obs, slot, act)`: masks and positions → SigLIP (patches, 27 layers, projector) → text embedding → 17 Gemma
layers and the pruned last one (K/V only) → the slot's KV cache. `expert_step(slot, xa, step, num_steps)`: one
Euler step of the action expert, run by the `ExpertStep` the plan was given or chose (`expert_step.py`: the seam,
with its contract; the per-op Triton sequence unless a faster implementation applies, `expert_why` says why not).
`denoise` runs the steps of one chunk. Nothing here synchronises with the host or allocates after the first call,
so both parts capture into CUDA Graphs.

What runs is what was measured fastest on the H200 (docs/kernels.md keeps what was tried and why it lost): every
RMSNorm as an `rms_factor` launch whose factor the next GEMM applies per row, RoPE in the action expert's QKV GEMM
epilogue but as its own launch on the prefix, and programmatic dependent launch between kernels
(`triton_kernels.pdl`, a launch attribute of the kernels themselves).
"""

from __future__ import annotations

import math

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot
from vla_rt.engine.expert_step import ExpertStep, choose_expert_step
from vla_rt.engine.gemma_layer import GemmaLayerRunner, LayerBuffers
from vla_rt.engine.torch_ops import INVALID_BLOCK
from vla_rt.engine.weights import EngineWeights


class Pi0Plan:
    """The VLM pass and the action-expert steps of one engine on `kernels`.

    workspace: split-K / split-KV scratch of the VLM kernels (None: the device's shared one); expert_step: the
    action-expert implementation (None: `choose_expert_step` with `expert_workspace`, default `workspace`, and
    `sm_count`, the most SMs an expert step may occupy, None: all)."""

    def __init__(self, kernels, weights: EngineWeights, cfg: Pi0Config, dims: Dims, workspace=None, *,
                 expert_step: ExpertStep | None = None, expert_workspace=None, sm_count: int | None = None):  # fmt: skip
        self.k, self.w, self.cfg, self.d = kernels, weights, cfg, dims
        self.ws = {} if workspace is None else {"workspace": workspace}
        self.layer = GemmaLayerRunner(kernels, cfg, dims.batch, weights.gemma_attn_scale, workspace)
        self.expert_why = ""
        if expert_step is None:
            expert_step, self.expert_why = choose_expert_step(
                kernels, weights, cfg, dims, workspace if expert_workspace is None else expert_workspace,
                device=weights.embed_tokens.device, sm_count=sm_count,
            )  # fmt: skip
        self.expert = expert_step
        # openpi multiplies text embeddings by sqrt(width) rounded to the compute dtype (45.25 in bf16)
        self.text_scale = torch.tensor(math.sqrt(cfg.llm.width), dtype=weights.embed_tokens.dtype).item()

    # ----- VLM: observation -> KV cache -----------------------------------------------------------------------------
    def vlm(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        """Vision + VLM prefix for the observation in `obs`; fills `slot` (KV cache, key blocks, suffix RoPE, state)."""
        self.vision(obs, slot, act)
        self.prefix(obs, slot, act)

    def vision(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        """Masks, positions and the image tokens (SigLIP + projector) in the prefix rows."""
        self._masks(obs, slot, act)
        k, w, v, d, ws = self.k, self.w, self.cfg.vision, self.d, self.ws
        eps = self.cfg.layernorm_eps
        n_img = d.batch * d.views
        k.patchify(obs.images.view(n_img, v.image_size, v.image_size, 3), act.patches, v.patch_size)
        k.gemm(act.patches, w.patch, act.vision_x, bias=w.patch_bias, residual=w.pos_embed,
               residual_period=v.num_patches, **ws)  # fmt: skip
        x, h = act.vision_x, act.vision_h
        qkv = act.vision_qkv.view(n_img, v.num_patches, 3, v.num_heads, v.head_dim)
        attn = act.vision_attn.view(n_img, v.num_patches, v.num_heads, v.head_dim)
        for layer in w.vision:
            k.layernorm(x, h, eps)
            k.gemm(h, layer.qkv, act.vision_qkv, bias=layer.qkv_bias, **ws)
            k.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], attn, scale=w.vision_attn_scale, **ws)
            k.gemm(act.vision_attn, layer.out, x, bias=layer.out_bias, residual=x, **ws)
            k.layernorm(x, h, eps)
            k.gemm(h, layer.fc1, act.vision_mlp, bias=layer.fc1_bias, activation="gelu_tanh", **ws)
            k.gemm(act.vision_mlp, layer.fc2, x, bias=layer.fc2_bias, residual=x, **ws)
        k.layernorm(x, h, eps)
        rows = d.image_rows
        for b in range(d.batch):  # image rows of batch b land at the start of its prefix rows
            k.gemm(h[b * rows : (b + 1) * rows], w.projector, act.prefix_x[b * d.prefix : b * d.prefix + rows],
                   bias=w.projector_bias, **ws)  # fmt: skip

    def prefix(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        """Text embedding and the Gemma prefix layers over image + text tokens: the slot's KV cache."""
        d = self.d
        if d.prompt:
            x = act.prefix_x.view(d.batch, d.prefix, -1)[:, d.image_rows :]
            x.copy_(torch.nn.functional.embedding(obs.tokens, self.w.embed_tokens) * self.text_scale)
        io = LayerBuffers(act.prefix_x, act.prefix_qkv, act.prefix_attn, act.prefix_mlp, act.prefix_rms,
                          act.prefix_cos, act.prefix_sin, act.prefix_q_block, act.prefix_k_block, d.prefix, 0)  # fmt: skip
        for i, layer in enumerate(self.w.llm):
            self.layer.run(layer, io, slot.k_cache[i], slot.v_cache[i], rope_epilogue=False)
        slot.version.copy_(obs.version)  # last: a reader that sees the new version sees the whole new cache

    def _masks(self, obs: ObservationInputs, slot: PrefixSlot, act: Activations) -> None:
        """Block ids (valid prefix tokens 0, padding INVALID_BLOCK; state 1, actions 2; π0.5's actions 1), RoPE
        positions that skip missing views and padded tokens, and the state, for this observation."""
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
        slot.key_block[:, d.prefix :].fill_(2 if d.state_token else 1)  # π0.5: the actions are one block
        slot.key_block[:, d.prefix].fill_(1)
        slot.state.copy_(obs.state)

    # ----- action expert ------------------------------------------------------------------------------------------
    def expert_step(self, slot: PrefixSlot, xa: ExpertActivations, step: int, num_steps: int,
                    time_bias: torch.Tensor | None = None) -> None:  # fmt: skip
        """One Euler step; `time_bias` (width,) overrides the table row (a device-selected row for streaming)."""
        self.expert.run(slot, xa, step, num_steps, time_bias)

    def denoise(self, slot: PrefixSlot, xa: ExpertActivations, num_steps: int) -> None:
        """The whole chunk: `num_steps` Euler steps from the noise in `xa.x_t` to the actions there."""
        for step in range(num_steps):
            self.expert.run(slot, xa, step, num_steps)
