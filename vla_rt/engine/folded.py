"""The `folded` backend: eager PyTorch over graph-pass weights, in the Triton engine's order and grouping.

Fused QKV and gate/up GEMMs, the RMSNorm factor applied to GEMM result rows, LayerNorm without affine, the time
bias table instead of the time MLP half, a pruned last VLM layer, RoPE from tables, block-id masks. It isolates
pass bugs from kernel bugs, and with static shapes it can be captured in a CUDA Graph as the "CUDA Graph over
folded torch ops" baseline. No host synchronisation happens inside `sample_actions`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine import torch_ops as ops
from vla_rt.engine.weights import is_float32_weight
from vla_rt.graph_passes import GraphPass, PassContext, PassState, apply_passes, fold_adarms, precompute_adarms
from vla_rt.graph_passes.merge_action_time import PASS as MERGE_ACTION_TIME
from vla_rt.graph_passes.precompute_rope import rope_tables
from vla_rt.inputs import BuiltShapes, ModelInputs

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def prefix_blocks(prefix_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_block, k_block, positions) for the prefix: valid tokens are block 0, padding sees and is seen by none."""
    q_block = torch.where(prefix_mask, 0, -1).int()
    k_block = torch.where(prefix_mask, 0, ops.INVALID_BLOCK).int()
    positions = torch.cumsum(prefix_mask.int(), dim=1) - 1
    return q_block, k_block, positions.clamp(min=0)


def suffix_blocks(
    prefix_mask: torch.Tensor, suffix_len: int, state_token: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Suffix [state, actions...]: state is block 1, actions block 2 (openpi's ar_mask [True, True, False, ...]);
    π0.5 (no state token): the actions are block 1 (ar_mask [True, False, ...])."""
    b = prefix_mask.shape[0]
    own = torch.full((b, suffix_len), 2 if state_token else 1, dtype=torch.int32, device=prefix_mask.device)
    own[:, 0] = 1
    k_block = torch.cat([torch.where(prefix_mask, 0, ops.INVALID_BLOCK).int(), own], dim=1)
    positions = prefix_mask.int().sum(-1, keepdim=True) + torch.arange(suffix_len, device=prefix_mask.device)
    return own, k_block, positions


class FoldedPi0:
    """π0 over engine weights. Shapes are free here; the engine fixes them."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        cfg: Pi0Config,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_steps: int = 10,
        max_positions: int | None = None,
        passes: Sequence[GraphPass] | None = None,
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        positions = max_positions or (8 * cfg.vision.num_patches + cfg.max_token_len + 1 + 4 * cfg.chunk)
        # views/chunk/prompt only size the RoPE table here: one generous context, grown by a call that needs more.
        ctx = PassContext(cfg, num_views=1, chunk=positions - cfg.vision.num_patches - 1, num_steps=num_steps)
        # What a new step count rebuilds its per-step tables from (π0: the time-bias table; π0.5: the modulation).
        raw = ("time_mlp_", "action_out_proj") if cfg.pi05 else ("action_in_proj", "action_time_mlp_in")
        self._raw_suffix = {k: v for k, v in weights.items() if k.startswith(raw) or (cfg.pi05 and ".dense." in k)}
        self._ctx = ctx
        self.state = self._place(apply_passes(weights, ctx, passes))
        # π0.5's tables as built here, from the float32 weights: a later rebuild can only fold the placed (maybe
        # bf16) matrices, so returning to this step count takes these back rather than a slightly different copy.
        self._built_tables = (num_steps, {k: v for k, v in self.w.items() if k.endswith("_table")}, self.state.meta)

    def _place(self, state: PassState) -> PassState:
        t = {
            k: v.to(self.device, torch.float32 if is_float32_weight(k) else self.dtype)
            for k, v in state.tensors.items()
        }
        return state.replace(t)

    def set_num_steps(self, num_steps: int) -> None:
        """Rebuilds the per-step tables (the only weights that depend on the step count)."""
        if num_steps == self.state.meta.get("time_bias_steps", self.state.meta.get("adarms_steps")):
            return
        ctx = PassContext(self.cfg, self._ctx.num_views, self._ctx.chunk, num_steps=num_steps)
        if self.cfg.pi05:
            self._set_pi05_tables(ctx)
            return
        merged = MERGE_ACTION_TIME.apply(PassState(dict(self._raw_suffix)), ctx)
        t = dict(self.state.tensors)
        t["action_time_in.weight"] = merged.tensors["action_time_in.weight"].to(self.device)
        t["time_bias_table"] = merged.tensors["time_bias_table"].to(self.device)
        self.state = PassState(t, {**self.state.meta, **merged.meta})

    def _set_pi05_tables(self, ctx: PassContext) -> None:
        """π0.5: the modulation tables for a new schedule, folded into the placed (fused, Q-scaled) QKV / gate-up."""
        built_steps, built, built_meta = self._built_tables
        if ctx.num_steps == built_steps:
            self.state = PassState({**self.w, **built}, {**self.state.meta, **built_meta})
            return
        fused = {
            k: v.float()
            for k, v in self.w.items()
            if k.startswith("expert.") and k.endswith((".qkv.weight", ".gate_up.weight"))
        }
        state = PassState({**self._raw_suffix, **fused})
        state = fold_adarms.PASS.apply(precompute_adarms.PASS.apply(state, ctx), ctx)
        t = dict(self.state.tensors)
        t.update({k: v.to(self.device) for k, v in state.tensors.items() if k.endswith("_table")})
        self.state = PassState(t, {**self.state.meta, **state.meta})

    def cover_positions(self, num_positions: int) -> None:
        """Grows the RoPE tables to `num_positions` rows where a call sees more positions than they hold: a model
        built without `num_views` / `chunk` takes any view count and chunk length (as the reference does). The rows
        already there keep their values (each row depends on its position alone)."""
        if num_positions <= self.w["rope.cos"].shape[0]:
            return
        cos, sin = rope_tables(num_positions, self.cfg.llm.head_dim)
        t = {**self.w, "rope.cos": cos.to(self.device), "rope.sin": sin.to(self.device)}
        self.state = self.state.replace(t, rope_positions=num_positions)

    @property
    def w(self) -> dict[str, torch.Tensor]:
        return self.state.tensors

    # ----- vision -------------------------------------------------------------------------------------------------
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, V, S, S, 3) -> image tokens (B, V * N, llm width) in the compute dtype."""
        v, w, eps = self.cfg.vision, self.w, self.cfg.layernorm_eps
        b, nv = images.shape[:2]
        patches = ops.patchify(images.reshape(b * nv, *images.shape[2:]).float(), v.patch_size)
        x = ops.gemm(
            patches,
            w["vision.patch_embed.weight"],
            bias=w["vision.patch_embed.bias"],
            residual=w["vision.pos_embed"],
            residual_period=v.num_patches,
            out_dtype=self.dtype,
        )
        n_img, n = b * nv, v.num_patches
        for i in range(v.depth):
            p = f"vision.blocks.{i}."
            qkv = ops.gemm(ops.layernorm(x, eps), w[p + "attn.qkv.weight"], bias=w[p + "attn.qkv.bias"])
            q, k, vv = qkv.view(n_img, n, 3, v.num_heads, v.head_dim).unbind(2)
            a = ops.attention(q, k, vv, scale=self.state.meta["vision_attn_scale"])
            x = ops.gemm(
                a.reshape(-1, v.width), w[p + "attn.out_proj.weight"], bias=w[p + "attn.out_proj.bias"], residual=x
            )
            h = ops.gemm(
                ops.layernorm(x, eps), w[p + "mlp.fc1.weight"], bias=w[p + "mlp.fc1.bias"], activation="gelu_tanh"
            )
            x = ops.gemm(h, w[p + "mlp.fc2.weight"], bias=w[p + "mlp.fc2.bias"], residual=x)
        tokens = ops.gemm(ops.layernorm(x, eps), w["projector.weight"], bias=w["projector.bias"])
        return tokens.view(b, nv * n, -1)

    # ----- shared Gemma layer -------------------------------------------------------------------------------------
    def _modulation(self, p: str, norm: str, reader: str, step: int | None) -> dict[str, torch.Tensor] | None:
        """π0.5's expert at Euler step `step`: this norm's scale row, the reader's folded-shift bias row and the gate
        row of the residual after it; None for π0 and for the PaliGemma expert."""
        if step is None or not self.cfg.pi05 or not p.startswith("expert."):
            return None
        w = self.w
        return {
            "scale": w[f"{p}{norm}_scale_table"][step],
            "bias": w[f"{p}{reader}_bias_table"][step],
            "gate": w[f"{p}{norm}_gate_table"][step],
        }

    def _normed_gemm(self, x: torch.Tensor, weight: torch.Tensor, mod: dict | None, **kw) -> torch.Tensor:
        """The GEMM that reads a norm: π0's RMS factor as the row scale (its scale folded into the weight), or
        π0.5's RMSNorm with the step's scale row, then the GEMM with the step's folded shift as its bias."""
        if mod is None:
            return ops.gemm(x, weight, row_scale=ops.rms_factor(x, self.cfg.rms_eps), **kw)
        return ops.gemm(ops.rmsnorm(x, self.cfg.rms_eps, mod["scale"]), weight, bias=mod["bias"], **kw)

    def _attention_block(self, x, p, positions, q_block, k_block, kv_prefix=None, step=None):
        """RMS factor → fused QKV → RoPE → attention → O + residual. Returns (x, k, v) with k, v of these tokens.

        π0.5's expert (`step` given): the step's adaptive RMSNorm, the QKV GEMM with the folded shift as its bias,
        and the O GEMM multiplying by the gate before the residual."""
        g, w = self.cfg.llm, self.w
        b, t, width = x.shape
        mod = self._modulation(p, "attn", "qkv", step)
        qkv = self._normed_gemm(x.view(-1, width), w[p + "qkv.weight"], mod).view(b, t, -1, g.head_dim)
        q, k, v = qkv.split([g.num_heads, g.num_kv_heads, g.num_kv_heads], dim=2)
        q = ops.rope(q, w["rope.cos"], w["rope.sin"], positions)
        k = ops.rope(k, w["rope.cos"], w["rope.sin"], positions)
        keys, values = (
            (k, v) if kv_prefix is None else (torch.cat([kv_prefix[0], k], 1), torch.cat([kv_prefix[1], v], 1))
        )
        a = ops.attention(q, keys, values, scale=self.state.meta["gemma_attn_scale"], q_block=q_block, k_block=k_block)
        gate = None if mod is None else mod["gate"]
        x = ops.gemm(a.view(b * t, -1), w[p + "o_proj.weight"], residual=x.view(b * t, width), out_scale=gate)
        return x.view(b, t, width), k, v

    def _mlp_block(self, x: torch.Tensor, p: str, step: int | None = None) -> torch.Tensor:
        b, t, width = x.shape
        flat = x.view(-1, width)
        mod = self._modulation(p, "ffn", "gate_up", step)
        h = self._normed_gemm(flat, self.w[p + "gate_up.weight"], mod, gated=True)
        gate = None if mod is None else mod["gate"]
        return ops.gemm(h, self.w[p + "down_proj.weight"], residual=flat, out_scale=gate).view(b, t, width)

    # ----- prefix -------------------------------------------------------------------------------------------------
    def prefix_kv(
        self,
        images: torch.Tensor,
        image_masks: torch.Tensor,
        tokens: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[KVCache, torch.Tensor]:
        g, w = self.cfg.llm, self.w
        x = self.encode_images(images)
        masks = [image_masks.bool().repeat_interleave(self.cfg.vision.num_patches, dim=1)]
        if tokens is not None and tokens.shape[1] > 0:
            text = w["llm.embed_tokens.weight"][tokens]
            x = torch.cat([x, text * torch.tensor(math.sqrt(g.width), dtype=text.dtype)], dim=1)
            masks.append(torch.ones_like(tokens, dtype=torch.bool) if token_mask is None else token_mask.bool())
        prefix_mask = torch.cat(masks, dim=1)
        q_block, k_block, positions = prefix_blocks(prefix_mask)
        cache: KVCache = []
        last = self.state.meta["pruned_last_layer"]
        for i in range(last):
            x, k, v = self._attention_block(x, f"llm.layers.{i}.", positions, q_block, k_block)
            cache.append((k, v))
            x = self._mlp_block(x, f"llm.layers.{i}.")
        b, t, width = x.shape
        r = ops.rms_factor(x.view(-1, width), self.cfg.rms_eps)
        kv = ops.gemm(x.view(-1, width), w[f"llm.layers.{last}.kv.weight"], row_scale=r).view(b, t, -1, g.head_dim)
        k, v = kv.split(g.num_kv_heads, dim=2)
        cache.append((ops.rope(k, w["rope.cos"], w["rope.sin"], positions), v))
        return cache, prefix_mask

    # ----- action expert ------------------------------------------------------------------------------------------
    def state_token(self, state: torch.Tensor) -> torch.Tensor:
        """(B, A) -> (B, 1, width) float32: the same for every denoising step of one inference."""
        return ops.gemm(state.float(), self.w["state_proj.weight"], bias=self.w["state_proj.bias"])[:, None]

    def velocity(
        self, cache: KVCache, prefix_mask: torch.Tensor, state_token: torch.Tensor | None, x_t: torch.Tensor, step: int
    ) -> torch.Tensor:
        """One action-expert call at Euler step index `step` (time = the plan's step time). Returns (B, H, A) fp32."""
        if self.cfg.pi05:
            return self._velocity_pi05(cache, prefix_mask, x_t, step)
        w = self.w
        b, h, a = x_t.shape
        emb = ops.gemm(
            x_t.reshape(-1, a).float(), w["action_time_in.weight"], bias=w["time_bias_table"][step], activation="silu"
        )
        emb = ops.gemm(emb, w["action_time_mlp_out.weight"], bias=w["action_time_mlp_out.bias"])
        x = torch.cat([state_token, emb.view(b, h, -1)], dim=1).to(self.dtype)
        q_block, k_block, positions = suffix_blocks(prefix_mask, 1 + h)
        for i in range(self.cfg.expert.depth):
            p = f"expert.layers.{i}."
            x, _, _ = self._attention_block(x, p, positions, q_block, k_block, kv_prefix=cache[i])
            x = self._mlp_block(x, p)
        actions = x[:, 1:].reshape(b * h, -1)
        r = ops.rms_factor(actions, self.cfg.rms_eps)
        v = ops.gemm(
            actions, w["action_out_proj.weight"], bias=w["action_out_proj.bias"], row_scale=r, out_dtype=torch.float32
        )
        return v.view(b, h, a)

    def _velocity_pi05(self, cache: KVCache, prefix_mask: torch.Tensor, x_t: torch.Tensor, step: int) -> torch.Tensor:
        """π0.5: action tokens `action_in_proj(x_t)` alone; every expert norm modulated by the step's tables; the
        final norm folded into the step's `action_out_proj` weight table."""
        w = self.w
        b, h, a = x_t.shape
        x = ops.gemm(x_t.reshape(-1, a).float(), w["action_in_proj.weight"], bias=w["action_in_proj.bias"])
        x = x.view(b, h, -1).to(self.dtype)
        q_block, k_block, positions = suffix_blocks(prefix_mask, h, state_token=False)
        for i in range(self.cfg.expert.depth):
            p = f"expert.layers.{i}."
            x, _, _ = self._attention_block(x, p, positions, q_block, k_block, kv_prefix=cache[i], step=step)
            x = self._mlp_block(x, p, step=step)
        actions = x.reshape(b * h, -1)
        r = ops.rms_factor(actions, self.cfg.rms_eps)
        out = w["action_out_proj.weight_table"][step]
        v = ops.gemm(actions, out, bias=w["action_out_proj.bias_table"][step], row_scale=r, out_dtype=torch.float32)
        return v.view(b, h, a)

    def __call__(self, x: ModelInputs, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        """The backend entry point: actions (B, H, A) float32 from checked inputs and noise."""
        self.set_num_steps(num_steps)
        prompt_len = 0 if x.tokens is None else x.tokens.shape[1]
        suffix_len = noise.shape[1] + (0 if self.cfg.pi05 else 1)
        self.cover_positions(x.images.shape[1] * self.cfg.vision.num_patches + prompt_len + suffix_len)
        cache, prefix_mask = self.prefix_kv(x.images, x.image_masks, x.tokens, x.token_mask)
        state_token = None if self.cfg.pi05 else self.state_token(x.state)
        dt = -1.0 / num_steps
        x_t = noise.float()
        for step in range(num_steps):
            x_t = x_t + dt * self.velocity(cache, prefix_mask, state_token, x_t, step)
        return x_t


def build_folded(
    weights: dict[str, torch.Tensor],
    cfg: Pi0Config,
    *,
    device: torch.device,
    dtype: torch.dtype,
    shapes: BuiltShapes,
) -> FoldedPi0:
    """The backend `load_pi0(..., backend="folded")` runs (callable as a BackendFn)."""
    max_positions = None
    if shapes.num_views is not None:
        max_positions = (
            shapes.num_views * cfg.vision.num_patches
            + (shapes.prompt_len or cfg.max_token_len)
            + 1
            + (shapes.chunk or cfg.chunk)
        )
    return FoldedPi0(weights, cfg, device=device, dtype=dtype, max_positions=max_positions)
