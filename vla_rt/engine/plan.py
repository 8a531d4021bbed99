"""The kernel plan of one π0 inference, over static buffers, for any kernel set with the Triton contracts.

`vlm(obs, slot)`: masks and positions → SigLIP → projector → text embedding → 17 full Gemma layers + the pruned
last one (K/V only) → the slot's KV cache. `expert_step(slot, step)`: suffix embedding from the time-bias table →
18 action-expert layers attending to the slot's cache → action projection fused with the Euler update of x_t.
No host synchronisation and no allocation that changes between calls, so both parts capture into CUDA Graphs.

Kernel fusions, per stage ("vlm" prefix layers, "expert"; the Triton engines' defaults are TRITON_FUSIONS):
`fuse_rms` computes each RMSNorm factor inside the GEMM that consumes it (`gemm(..., rms_eps=eps)`) instead of a
separate `rms_factor` launch; `fuse_rope` rotates Q and writes K/V into the KV cache in the QKV GEMM's epilogue
(`gemm(..., rope=...)`) instead of a separate `rope_qk` launch. Both compute what the kernels they replace compute
(the sum of squares in another order; RoPE rotates the fp32 accumulator, so Q and K are rounded once, not twice);
with them the QKV buffer's K/V columns and the fused stage's RMS buffer are never written. A third, `rms_partials`,
has the GEMMs that write the residual stream (O, down) also write its per-16-column sums of squares, from which the
next norm's GEMM (QKV, gate/up, the action projection) takes its RMS factor: no `rms_factor` launch and no second
pass over A, except for each stage's first layer, whose input comes from elsewhere. A fourth, `combine_rms`, has
the same GEMMs write the next norm's factor itself (`gemm(..., rms_out=)`): inside their split-K combine kernel
when their launch config has one, else by an `rms_factor` launch right after, so no config loses a norm. A flag is
a bool (both stages) or a stage name; per stage, rms_partials wins over fuse_rms, which wins over combine_rms.
`l2_prefetch` (a bool, for the action expert) launches one small kernel per layer, on a side stream joined at the
end of the step, that asks L2 for weights the layer will read (see `triton_kernels.prefetch`); a hint that changes
no result. `expert_layer` (a bool, for the action expert) runs each expert layer as one persistent kernel
(`triton_kernels.expert_layer`: the RMS factors, RoPE, attention merges and split-K merges inside it) where the
kernel set has one and the dims fit it, else the separate kernels; it replaces every other expert-stage fusion but
the final norm's source. `skinny_gluon` (a bool, for the action expert) runs each expert layer's QKV (RoPE epilogue)
and gate/up GEMMs on the kernel set's `skinny_gemm` (`triton_kernels.gluon_gemm`: weights streamed before the PDL
wait, the RMSNorm factor summed in-kernel, so neither norm needs an `rms_factor` launch) where the kernel set has
it and `skinny_gemm_applies` accepts the shapes (sm_90, M <= 64 rows, width <= 1024), else the Triton GEMMs;
`Pi0Plan.skinny_why` says why not. `fused_mlp` (a bool, for the action expert) runs each expert layer's whole MLP
(RMS factor, gate/up GeGLU, down, residual) as one `expert_mlp` launch (`triton_kernels.gluon_mlp`: every program
asks for all of its weight tiles before the PDL wait) where the kernel set has it and `expert_mlp_applies` accepts
the shapes, else the separate kernels; `Pi0Plan.mlp_why` says why not.
"""

from __future__ import annotations

import math

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot
from vla_rt.engine.torch_ops import INVALID_BLOCK
from vla_rt.engine.weights import EngineWeights, GemmaLayerWeights

STAGES = ("vlm", "expert")
# What the Triton engines build with unless told otherwise, from the engine A/B on the H200 (tools/bench_fused.py,
# π0 bf16, chunk 63, prompt 0): the RoPE epilogue on the action expert saves 0.56 / 0.55 ms a call at 1 / 3 views;
# on the VLM prefix it gains nothing, and the fused RMS factor is slower (+0.3 ms) with the current configs;
# rms_partials is slower (+0.8 / +1.8 ms), combine_rms within ±0.1 ms, l2_prefetch slower (+0.2-0.4 ms),
# skinny_gluon slower (+0.9 / +0.9 ms), fused_mlp slower (+0.8 / +0.9 ms in its best variant)
# (benchmarks/results/engine_ab_*_NVIDIA-H200.md; docs/kernels.md says why), so those stay off.
TRITON_FUSIONS = dict(
    fuse_rms=False,
    fuse_rope="expert",
    rms_partials=False,
    combine_rms=False,
    l2_prefetch=False,
    expert_layer=False,
    skinny_gluon=False,
    fused_mlp=False,
)
# skinny_gluon: which expert GEMMs run on `skinny_gemm` ("qkv", "gate_up"), and whether it sums their RMS factor itself
# (else an `rms_factor` launch gives it as the row scale); knobs for tools/profile_engine.py's A/B
SKINNY_GEMMS = ("qkv", "gate_up")
SKINNY_RMS_IN_KERNEL = True
# fused_mlp: whether `expert_mlp` sums the RMS factor itself (else an `rms_factor` launch gives it as the row scale,
# and with MLP_NORM_EARLY that launch lets `expert_mlp` launch before it waits, so its weights stream during O)
MLP_RMS_IN_KERNEL = True
MLP_NORM_EARLY = True
# fused_mlp: whether the same launch also does the layer's O projection first (expert_mlp's phase 0; the RMS factor
# then summed in-kernel). Off: measured slower on the H200 (session 9: 1 view 10.35 -> 11.26 ms with fused_mlp on)
MLP_WITH_O = False
# l2_prefetch: as each expert layer starts, one kernel on a side stream asks L2 for the layer's O, gate/up and down
# weights (`triton_kernels.prefetch`), and, with this, for the next layer's QKV (the action projection after the last)
L2_PREFETCH_NEXT_QKV = True


def fusion_stages(name: str, flag) -> frozenset[str]:
    """A fusion flag as the set of stages it applies to: False/None none, True both, "vlm"/"expert" (or a
    collection of them) those."""
    if flag is None or flag is False:
        return frozenset()
    if flag is True:
        return frozenset(STAGES)
    stages = frozenset([flag] if isinstance(flag, str) else flag)
    if not stages <= set(STAGES):
        raise ValueError(f"{name}: expected a bool or stages from {STAGES}, found {flag!r}")
    return stages


class Pi0Plan:
    def __init__(self, kernels, weights: EngineWeights, cfg: Pi0Config, dims: Dims, workspace=None, *,
                 fuse_rms: bool | str = False, fuse_rope: bool | str = False,
                 rms_partials: bool | str = False, combine_rms: bool | str = False,
                 l2_prefetch: bool = False, expert_layer: bool = False, skinny_gluon: bool = False,
                 fused_mlp: bool = False):  # fmt: skip
        self.k, self.w, self.cfg, self.d = kernels, weights, cfg, dims
        self.ws = {} if workspace is None else {"workspace": workspace}
        self.fuse_rms = fusion_stages("fuse_rms", fuse_rms)
        self.fuse_rope = fusion_stages("fuse_rope", fuse_rope)
        self.rms_partials = fusion_stages("rms_partials", rms_partials)
        # the GEMMs that write the residual stream also write its RMS factor, where no other fusion supplies it
        self.combine_rms = fusion_stages("combine_rms", combine_rms) - self.rms_partials - self.fuse_rms
        if not isinstance(l2_prefetch, bool):
            raise ValueError(f"l2_prefetch is a bool (it applies to the action expert), found {l2_prefetch!r}")
        self.l2_prefetch = l2_prefetch
        self.expert_layer = self._expert_layer_applies(expert_layer, cfg, dims)
        self.skinny_why = self._skinny_why(skinny_gluon, weights, cfg, dims)
        self.skinny = self.skinny_why is None
        self.mlp_why = self._fused_mlp_why(fused_mlp, weights, cfg, dims)
        self.fused_mlp = self.mlp_why is None
        self.mlp_with_o = self.fused_mlp and MLP_WITH_O  # (read once, as _fused_mlp_why checked the shapes for it)
        widths = {"vlm": cfg.llm.width, "expert": cfg.expert.width}
        odd = [s for s in self.rms_partials if widths[s] % 16]
        if odd:
            raise ValueError(f"rms_partials needs widths that are multiples of 16; {odd}: {[widths[s] for s in odd]}")
        g = cfg.llm
        self.heads = dict(num_q_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
        # openpi multiplies text embeddings by sqrt(width) rounded to the compute dtype (45.25 in bf16)
        self.text_scale = torch.tensor(math.sqrt(g.width), dtype=weights.embed_tokens.dtype).item()

    def _expert_layer_applies(self, wanted: bool, cfg: Pi0Config, dims: Dims) -> bool:
        """Whether expert layers run as one persistent kernel: asked for, offered by the kernel set, dims it serves."""
        if not isinstance(wanted, bool):
            raise ValueError(f"expert_layer is a bool (it applies to the action expert), found {wanted!r}")
        if not wanted:
            return False
        if self.l2_prefetch:
            raise ValueError("expert_layer prefetches its own weights: drop l2_prefetch")
        if "expert" in self.rms_partials or "expert" in self.combine_rms:
            raise ValueError("expert_layer computes its own RMS factors: drop rms_partials / combine_rms for 'expert'")
        applies = getattr(self.k, "expert_layer_applies", None)
        if applies is None:
            return False
        e, g = cfg.expert, cfg.llm
        why = applies(dims.batch * dims.suffix, e.width, e.mlp_dim, g.num_heads, g.num_kv_heads, g.head_dim)
        return why is None

    def _skinny_why(self, wanted: bool, weights: EngineWeights, cfg: Pi0Config, dims: Dims) -> str | None:
        """None if the expert's QKV and gate/up GEMMs run on `skinny_gemm`, else why not."""
        if not isinstance(wanted, bool):
            raise ValueError(f"skinny_gluon is a bool (it applies to the action expert), found {wanted!r}")
        if not wanted:
            return "not asked for"
        if self.expert_layer:
            raise ValueError("skinny_gluon and expert_layer both replace the expert's GEMMs: pick one")
        applies = getattr(self.k, "skinny_gemm_applies", None)
        if applies is None:
            return f"the {getattr(self.k, 'name', '?')} kernel set has no skinny_gemm"
        layer = weights.expert[0]
        x = torch.empty(dims.batch * dims.suffix, cfg.expert.width, device=layer.qkv.device, dtype=layer.qkv.dtype)
        g = cfg.llm
        rope = dict(num_q_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
        return applies(x, layer.qkv, rope=rope) or applies(x, layer.gate_up, gated=True)

    def _fused_mlp_why(self, wanted: bool, weights: EngineWeights, cfg: Pi0Config, dims: Dims) -> str | None:
        """None if each expert layer's MLP runs as one `expert_mlp` launch, else why not."""
        if not isinstance(wanted, bool):
            raise ValueError(f"fused_mlp is a bool (it applies to the action expert), found {wanted!r}")
        if not wanted:
            return "not asked for"
        if self.expert_layer:
            raise ValueError("fused_mlp and expert_layer both replace the expert's MLP: pick one")
        if "expert" in self.rms_partials or "expert" in self.combine_rms:
            raise ValueError("fused_mlp neither reads nor leaves norm statistics: drop rms_partials / combine_rms "
                             "for 'expert'")  # fmt: skip
        applies = getattr(self.k, "expert_mlp_applies", None)
        if applies is None:
            return f"the {getattr(self.k, 'name', '?')} kernel set has no expert_mlp"
        layer = weights.expert[0]
        x = torch.empty(dims.batch * dims.suffix, cfg.expert.width, device=layer.qkv.device, dtype=layer.qkv.dtype)
        if not MLP_WITH_O:
            return applies(x, layer.gate_up, layer.down)
        g = cfg.llm
        attn = torch.empty(x.shape[0], g.num_heads * g.head_dim, device=x.device, dtype=x.dtype)
        return applies(x, layer.gate_up, layer.down, None, attn, layer.o)

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

    def _norm(self, x, rms, stage: str, ssq=None, rms_ready: bool = False) -> dict:
        """The RMSNorm factor of x's rows as GEMM keyword arguments: from the partial sums of squares `ssq` that the
        GEMM which wrote x left (rms_partials), computed inside the GEMM (fused), already in `rms` (`rms_ready`: the
        GEMM which wrote x wrote it, combine_rms), or by `rms_factor` into `rms` now; the last two as the row scale."""
        if ssq is not None:
            return {"rms_eps": self.cfg.rms_eps, "ssq_in": ssq}
        if stage in self.fuse_rms:
            return {"rms_eps": self.cfg.rms_eps}
        if not rms_ready:
            self.k.rms_factor(x, rms, self.cfg.rms_eps)
        return {"row_scale": rms}

    def _keep_norm(self, rms, stage: str, ssq) -> dict:
        """Keyword arguments for a GEMM that writes the residual stream x: leave what the next norm needs."""
        if ssq is not None:
            return {"ssq_out": ssq}
        if stage in self.combine_rms:
            return {"rms_out": rms, "rms_out_eps": self.cfg.rms_eps}
        return {}

    def _gemma_layer(self, layer: GemmaLayerWeights, x, qkv, attn, mlp, rms, cos, sin, k_cache, v_cache, offset,
                     q_block, k_block, rows, stage: str, ssq=None, ssq_ready: bool = False,
                     prefetch: list | None = None) -> None:  # fmt: skip
        """One layer of one expert over `rows` tokens per batch whose K/V go to cache rows offset.. . With `ssq`
        (rms_partials), the O and down GEMMs leave x's partial sums of squares there for the next norm (with
        combine_rms, its factor in `rms`); `ssq_ready`: the layer's input x already has them (every layer but the
        first). `prefetch`: weights to ask L2 for as the layer starts (l2_prefetch)."""
        k, g = self.k, self.cfg.llm
        if prefetch:  # from a side stream, while this layer's QKV, attention and O run
            k.prefetch_l2(prefetch)
        # the RoPE epilogue's arguments (fuse_rope, skinny_gluon) and what the residual-stream GEMMs leave behind
        rope = dict(cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, cache_offset=offset, **self.heads)
        keep = self._keep_norm(rms, stage, ssq)
        if stage == "expert" and self.skinny:  # the Gluon GEMMs: both RMS factors in-kernel, RoPE epilogue
            self._skinny_or_gemm("qkv", x, layer.qkv, qkv, rms, rope=rope)
            with_o = self.mlp_with_o
            self._attention_o(layer, x, qkv, attn, k_cache, v_cache, offset, q_block, k_block, rows, {}, not with_o)
            if self.fused_mlp:
                self._expert_mlp(layer, x, mlp, rms, attn if with_o else None)
                return
            self._skinny_or_gemm("gate_up", x, layer.gate_up, mlp, rms, gated=True)
            k.gemm(mlp, layer.down, x, residual=x, **keep, **self.ws)
            return
        # the layer's input has its norm statistics when the previous layer's down GEMM left them (ssq_ready)
        norm_in = self._norm(x, rms, stage, ssq if ssq_ready else None, ssq_ready and stage in self.combine_rms)
        q_cols = g.num_heads * g.head_dim
        # pruned last VLM layer: only K and V, written next to (stale) Q columns
        out = qkv[:, q_cols:] if layer.kv_only else qkv
        if stage in self.fuse_rope:  # Q rotated in place, K/V straight into the cache rows, in the GEMM epilogue
            if layer.kv_only:
                rope["num_q_heads"] = 0
            k.gemm(x, layer.qkv, out, rope=rope, **norm_in, **self.ws)
        else:
            k.gemm(x, layer.qkv, out, **norm_in, **self.ws)
            k.rope_qk(qkv, cos, sin, k_cache, v_cache, cache_offset=offset, **self.heads)
        if layer.kv_only:
            return
        with_o = stage == "expert" and self.mlp_with_o
        self._attention_o(layer, x, qkv, attn, k_cache, v_cache, offset, q_block, k_block, rows, keep, not with_o)
        if stage == "expert" and self.fused_mlp:  # RMS factor, gate/up, down and residual (and O) in one launch
            self._expert_mlp(layer, x, mlp, rms, attn if with_o else None)
            return
        k.gemm(x, layer.gate_up, mlp, gated=True, **self._norm(x, rms, stage, ssq, stage in self.combine_rms),
               **self.ws)  # fmt: skip
        k.gemm(mlp, layer.down, x, residual=x, **keep, **self.ws)

    def _expert_mlp(self, layer: GemmaLayerWeights, x, mlp, rms, attn=None) -> None:
        """x += MLP(RMSNorm(x)) as one `expert_mlp` launch (with MLP_RMS_IN_KERNEL off, after an `rms_factor`);
        with `attn` (MLP_WITH_O), x += O(attn) first in the same launch."""
        eps = self.cfg.rms_eps
        if attn is not None:
            self.k.expert_mlp(x, layer.gate_up, layer.down, mlp, rms_eps=eps, attn=attn, w_o=layer.o, **self.ws)
            return
        if MLP_RMS_IN_KERNEL:
            self.k.expert_mlp(x, layer.gate_up, layer.down, mlp, rms_eps=eps, **self.ws)
            return
        self.k.rms_factor(x, rms, eps, pdl_early=MLP_NORM_EARLY)
        self.k.expert_mlp(x, layer.gate_up, layer.down, mlp, row_scale=rms, **self.ws)

    def _skinny_or_gemm(self, which: str, x, w, out, rms, **options) -> None:
        """An RMS-normed expert GEMM on `skinny_gemm` (which in SKINNY_GEMMS) or on `gemm`."""
        eps = self.cfg.rms_eps
        if which in SKINNY_GEMMS and SKINNY_RMS_IN_KERNEL:
            self.k.skinny_gemm(x, w, out, rms_eps=eps, **options)
            return
        self.k.rms_factor(x, rms, eps)
        if which in SKINNY_GEMMS:
            self.k.skinny_gemm(x, w, out, row_scale=rms, **options)
        else:
            self.k.gemm(x, w, out, row_scale=rms, **options, **self.ws)

    def _attention_o(self, layer: GemmaLayerWeights, x, qkv, attn, k_cache, v_cache, offset, q_block, k_block, rows,
                     keep: dict, o: bool = True) -> None:  # fmt: skip
        """Attention of the layer's rotated Q over cache rows ..offset + rows, then (`o`) x += O(attention)."""
        k, g = self.k, self.cfg.llm
        keys = offset + rows
        q = qkv.view(self.d.batch, rows, -1, g.head_dim)[:, :, : g.num_heads]
        k.attention(q, k_cache[:, :keys], v_cache[:, :keys], attn.view(self.d.batch, rows, g.num_heads, g.head_dim),
                    scale=self.w.gemma_attn_scale, q_block=q_block, k_block=k_block, **self.ws)  # fmt: skip
        if o:
            k.gemm(attn, layer.o, x, residual=x, **keep, **self.ws)

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
                act.prefix_q_block, act.prefix_k_block, self.d.prefix, "vlm",
                act.prefix_ssq if "vlm" in self.rms_partials else None, i > 0,
            )  # fmt: skip
        slot.version.copy_(obs.version)  # last: a reader that sees the new version sees the whole new cache

    # ----- action expert: one Euler step --------------------------------------------------------------------------
    def expert_step(self, slot: PrefixSlot, xa: ExpertActivations, step: int, num_steps: int,
                    time_bias: torch.Tensor | None = None) -> None:  # fmt: skip
        """One Euler step; `time_bias` (width,) overrides the table row (a device-selected row for streaming)."""
        k, s, d = self.k, self.w.suffix, self.d
        ss, h = d.suffix, d.chunk
        partials = "expert" in self.rms_partials
        x3 = xa.x.view(d.batch, ss, -1)
        k.gemm(slot.state, s.state, x3[:, 0], bias=s.state_bias, **self.ws)
        bias = s.time_bias[step] if time_bias is None else time_bias
        k.gemm(xa.x_t.view(d.batch * h, -1), s.action_time, xa.action_emb, bias=bias,
               activation="silu", **self.ws)  # fmt: skip
        for b in range(d.batch):
            k.gemm(xa.action_emb[b * h : (b + 1) * h], s.mlp_out, xa.x[b * ss + 1 : (b + 1) * ss],
                   bias=s.mlp_out_bias, **self.ws)  # fmt: skip
        layers = self.w.expert
        for i, layer in enumerate(layers):
            if self.expert_layer:  # the whole layer in one persistent kernel
                k.expert_layer(
                    xa.x, layer.qkv, layer.o, layer.gate_up, layer.down, xa.qkv, xa.attn, xa.mlp, slot.k_cache[i],
                    slot.v_cache[i], slot.suffix_cos, slot.suffix_sin, xa.query_block, slot.key_block,
                    cache_offset=d.prefix, eps=self.cfg.rms_eps, scale=self.w.gemma_attn_scale,
                    num_q_heads=self.heads["num_q_heads"], head_dim=self.heads["head_dim"], **self.ws,
                )  # fmt: skip
                continue
            self._gemma_layer(
                layer, xa.x, xa.qkv, xa.attn, xa.mlp, xa.rms, slot.suffix_cos, slot.suffix_sin,
                slot.k_cache[i], slot.v_cache[i], d.prefix, xa.query_block, slot.key_block, ss, "expert",
                xa.ssq if partials else None, i > 0, self._prefetch_set(layers, i),
            )  # fmt: skip
        fused = "expert" in self.fuse_rms
        if not fused and not partials and "expert" not in self.combine_rms:  # (else the last down GEMM wrote it)
            k.rms_factor(xa.x, xa.rms, self.cfg.rms_eps)
        for b in range(d.batch):  # v = action_out(x̂); x_t += dt * v, fused in the GEMM epilogue
            rows = slice(b * ss + 1, (b + 1) * ss)
            norm = {"rms_eps": self.cfg.rms_eps} if fused else {"row_scale": xa.rms[rows]}
            if partials:  # the last down GEMM left x's partial sums
                norm = {"rms_eps": self.cfg.rms_eps, "ssq_in": xa.ssq[:, rows]}
            k.gemm(xa.x[rows], s.action_out, xa.x_t[b], bias=s.action_out_bias, alpha=-1.0 / num_steps,
                   residual=xa.x_t[b], **norm, **self.ws)  # fmt: skip
        if self.l2_prefetch:
            k.prefetch_join(xa.x_t)

    def _prefetch_set(self, layers, i: int) -> list | None:
        """What expert layer i asks L2 for as it starts (l2_prefetch): its O and MLP weights, then (with
        L2_PREFETCH_NEXT_QKV) the next layer's QKV, or the action projection after the last layer."""
        if not self.l2_prefetch:
            return None
        layer = layers[i]
        out = [layer.o, layer.gate_up, layer.down]
        if L2_PREFETCH_NEXT_QKV:
            out.append(layers[i + 1].qkv if i + 1 < len(layers) else self.w.suffix.action_out)
        return out

    def denoise(self, slot: PrefixSlot, xa: ExpertActivations, num_steps: int) -> None:
        for step in range(num_steps):
            self.expert_step(slot, xa, step, num_steps)
