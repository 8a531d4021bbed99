"""π0 and π0.5 in eager PyTorch: the spec in code (openpi's `pi0.py`), read top to bottom beside PI0_SPEC.md.

Prefix = [view tokens..., prompt tokens] (bidirectional); suffix = [state token, H action tokens] with openpi's
block-causal mask. π0.5 (`cfg.pi05`) has no state token (the state is text in the prompt): its suffix is the H
action tokens `action_in_proj(x_t)`, and the time enters only through the action expert's adaptive RMSNorms,
conditioned on `swish(time_mlp_out(swish(time_mlp_in(posemb(t)))))`. Inference fills a KV cache with one prefix pass, then runs the action expert `num_steps`
times (Euler, t from 1 to 0). Works in float32 and bf16, any batch, any number of views, any prompt length
(including none) and any chunk length. Float32 is IEEE float32 in every pass (no TF32: `vla_rt.model.precision`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vla_rt.config import Pi0Config
from vla_rt.model.gemma import GemmaStack, KVCache, joint_forward
from vla_rt.model.precision import float32_is_float32
from vla_rt.model.siglip import VisionEncoder


def make_attn_mask(input_mask: torch.Tensor, ar_mask: torch.Tensor) -> torch.Tensor:
    """big_vision's rule: token i sees valid token j iff cumsum(ar)[j] <= cumsum(ar)[i]. Returns (B, N, N) bool.

    input_mask: (B, N) bool, False for padding; ar_mask: (N,) or (B, N) bool, True where a new causal block starts.
    """
    ar = torch.broadcast_to(ar_mask, input_mask.shape).int()
    cum = torch.cumsum(ar, dim=1)
    attn = cum[:, None, :] <= cum[:, :, None]
    valid = input_mask[:, None, :] & input_mask[:, :, None]
    return attn & valid


def posemb_sincos(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Sine-cosine embedding of scalar times t (B,) -> (B, dim), float32, openpi's order of operations."""
    if dim % 2:
        raise ValueError(f"time embedding dim {dim} must be even")
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    sinusoid = t.float()[:, None] * (1.0 / period * 2 * math.pi)[None, :]
    return torch.cat([torch.sin(sinusoid), torch.cos(sinusoid)], dim=-1)


def euler_times(num_steps: int) -> list[float]:
    """The t values openpi visits: start at 1.0, add dt = -1/steps in float32, stop once t < -dt/2."""
    dt = torch.tensor(-1.0 / num_steps, dtype=torch.float32)
    t = torch.tensor(1.0, dtype=torch.float32)
    times = []
    while t >= -dt / 2:
        times.append(float(t))
        t = t + dt
    return times


def _linear_f32(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A Linear evaluated in float32 (openpi's suffix embedding sees float32 inputs, so JAX promotes to float32)."""
    return F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())


class Pi0Model(nn.Module):
    """π0's or π0.5's weights (canonical names, see `vla_rt.model.weights`) and its eager forward passes."""

    def __init__(self, cfg: Pi0Config):
        super().__init__()
        self.cfg = cfg
        we, a = cfg.expert.width, cfg.action_dim
        self.vision = VisionEncoder(cfg.vision, cfg.layernorm_eps)
        self.projector = nn.Linear(cfg.vision.width, cfg.llm.width)
        self.llm = GemmaStack(cfg.llm, cfg.vocab_size, cfg.rms_eps)
        self.expert = GemmaStack(cfg.expert, None, cfg.rms_eps, cond_width=we if cfg.pi05 else None)
        self.action_in_proj = nn.Linear(a, we)
        if cfg.pi05:
            self.time_mlp_in = nn.Linear(we, we)
            self.time_mlp_out = nn.Linear(we, we)
        else:
            self.state_proj = nn.Linear(a, we)
            self.action_time_mlp_in = nn.Linear(2 * we, we)
            self.action_time_mlp_out = nn.Linear(we, we)
        self.action_out_proj = nn.Linear(we, a)

    @property
    def dtype(self) -> torch.dtype:
        return self.llm.final_norm.scale.dtype

    # ----- prefix -------------------------------------------------------------------------------------------------
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, V, S, S, 3) in [-1, 1] -> (B, V * num_patches, llm width) image tokens (not scaled)."""
        b, v = images.shape[:2]
        x = self.vision(images.reshape(b * v, *images.shape[2:]))
        x = self.projector(x)
        return x.reshape(b, v * x.shape[1], x.shape[2])

    def embed_prefix(
        self,
        images: torch.Tensor,
        image_masks: torch.Tensor,
        tokens: torch.Tensor | None,
        token_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns prefix tokens (B, S, D), input mask (B, S) and ar mask (S,) (all False: bidirectional)."""
        b, v = images.shape[:2]
        embedded = [self.embed_images(images)]
        n = self.cfg.vision.num_patches
        masks = [image_masks.bool().repeat_interleave(n, dim=1)]
        if tokens is not None and tokens.shape[1] > 0:
            embedded.append(self.llm.embed(tokens))
            masks.append(torch.ones_like(tokens, dtype=torch.bool) if token_mask is None else token_mask.bool())
        x = torch.cat([e.to(self.dtype) for e in embedded], dim=1)
        input_mask = torch.cat(masks, dim=1)
        ar_mask = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
        return x, input_mask, ar_mask

    @float32_is_float32
    def prefix_kv(
        self,
        images: torch.Tensor,
        image_masks: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[KVCache, torch.Tensor]:
        """One prefix pass: the per-layer (k, v) cache and the prefix input mask (B, S)."""
        if image_masks is None:
            image_masks = torch.ones(images.shape[:2], dtype=torch.bool, device=images.device)
        x, input_mask, ar_mask = self.embed_prefix(images, image_masks, tokens, token_mask)
        attn_mask = make_attn_mask(input_mask, ar_mask)
        positions = torch.cumsum(input_mask.int(), dim=1) - 1
        _, kv_cache = joint_forward((self.llm, self.expert), (x, None), positions, attn_mask, dtype=self.dtype)
        return kv_cache, input_mask

    # ----- suffix -------------------------------------------------------------------------------------------------
    def time_condition(self, time: torch.Tensor) -> torch.Tensor:
        """π0.5's adaRMS condition (B, width) float32: swish after both layers of the time MLP (openpi)."""
        time_emb = posemb_sincos(time, self.cfg.expert.width)
        x = F.silu(_linear_f32(self.time_mlp_in, time_emb))
        return F.silu(_linear_f32(self.time_mlp_out, x))

    def embed_suffix(
        self, state: torch.Tensor, noisy_actions: torch.Tensor, time: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Suffix tokens in float32, their input mask, ar mask and the adaRMS condition (None for π0).

        π0: [state token, H action tokens], ar [True, True, False, ...]; π0.5: H action tokens `action_in_proj(x_t)`
        (the state is ignored: it is in the prompt), ar [True, False, ...], condition `time_condition(t)`.
        """
        b, h, _ = noisy_actions.shape
        action_tokens = _linear_f32(self.action_in_proj, noisy_actions)
        if self.cfg.pi05:
            input_mask = torch.ones(b, h, dtype=torch.bool, device=action_tokens.device)
            ar_mask = torch.zeros(h, dtype=torch.bool, device=action_tokens.device)
            ar_mask[0] = True
            return action_tokens, input_mask, ar_mask, self.time_condition(time)
        state_token = _linear_f32(self.state_proj, state)[:, None, :]
        time_emb = posemb_sincos(time, self.cfg.expert.width)  # (B, width)
        time_tokens = time_emb[:, None, :].expand(b, h, -1)
        x = _linear_f32(self.action_time_mlp_in, torch.cat([action_tokens, time_tokens], dim=-1))
        x = _linear_f32(self.action_time_mlp_out, F.silu(x))
        tokens = torch.cat([state_token, x], dim=1)
        input_mask = torch.ones(b, 1 + h, dtype=torch.bool, device=x.device)
        ar_mask = torch.zeros(1 + h, dtype=torch.bool, device=x.device)
        ar_mask[:2] = True
        return tokens, input_mask, ar_mask, None

    @float32_is_float32
    def velocity(
        self,
        kv_cache: KVCache,
        prefix_mask: torch.Tensor,
        state: torch.Tensor,
        x_t: torch.Tensor,
        time: torch.Tensor,
    ) -> torch.Tensor:
        """One action-expert call: v_t (B, H, A) for noisy actions x_t at time t, attending to the prefix cache."""
        tokens, suffix_mask, suffix_ar, cond = self.embed_suffix(state, x_t, time)
        ts = tokens.shape[1]
        suffix_attn = make_attn_mask(suffix_mask, suffix_ar)
        prefix_attn = prefix_mask[:, None, :].expand(-1, ts, -1)
        full_mask = torch.cat([prefix_attn, suffix_attn], dim=-1)
        positions = prefix_mask.int().sum(-1, keepdim=True) + torch.cumsum(suffix_mask.int(), dim=1) - 1
        (_, suffix_out), _ = joint_forward(
            (self.llm, self.expert),
            (None, tokens),
            positions,
            full_mask,
            kv_cache,
            dtype=self.dtype,
            conds=(None, cond),
        )
        return self.action_out_proj(suffix_out[:, -x_t.shape[1] :])

    @float32_is_float32
    @torch.no_grad()
    def sample_actions(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        tokens: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        num_steps: int = 10,
        *,
        image_masks: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        chunk: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Flow-matching sampling: x from noise (t=1) to actions (t=0) in `num_steps` Euler steps.

        images (B, V, S, S, 3) in [-1, 1]; state (B, A) (unused by π0.5: its state is in the tokens); tokens (B, P)
        int64 or None; noise (B, H, A) or None. Returns (B, H, A) float32 in the model's normalized action space.
        """
        b = state.shape[0]
        if noise is None:
            h = chunk or self.cfg.chunk
            noise = torch.randn(b, h, self.cfg.action_dim, generator=generator, device=state.device)
        kv_cache, prefix_mask = self.prefix_kv(images, image_masks, tokens, token_mask)
        dt = -1.0 / num_steps
        x_t = noise.float()
        for t in euler_times(num_steps):
            time = torch.full((b,), t, dtype=torch.float32, device=x_t.device)
            v_t = self.velocity(kv_cache, prefix_mask, state.float(), x_t, time)
            x_t = x_t + dt * v_t.float()
        return x_t

    # ----- training -----------------------------------------------------------------------------------------------
    @float32_is_float32
    def compute_loss(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        actions: torch.Tensor,
        tokens: torch.Tensor | None = None,
        *,
        image_masks: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        time: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Flow-matching loss (B, H): MSE over action dims between v_t and u = noise - actions.

        t ~ Beta(1.5, 1) * 0.999 + 0.001, x_t = t * noise + (1 - t) * actions, one joint prefix+suffix pass.
        """
        b = actions.shape[0]
        if image_masks is None:
            image_masks = torch.ones(images.shape[:2], dtype=torch.bool, device=images.device)
        if noise is None:
            noise = torch.randn(actions.shape, generator=generator, device=actions.device)
        if time is None:
            beta = torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0))
            time = (beta.sample((b,)) * 0.999 + 0.001).to(actions.device)
        t = time[:, None, None]
        x_t = t * noise + (1 - t) * actions
        u_t = noise - actions
        prefix, prefix_mask, prefix_ar = self.embed_prefix(images, image_masks, tokens, token_mask)
        suffix, suffix_mask, suffix_ar, cond = self.embed_suffix(state.float(), x_t.float(), time.float())
        input_mask = torch.cat([prefix_mask, suffix_mask], dim=1)
        ar_mask = torch.cat([prefix_ar, suffix_ar])
        attn_mask = make_attn_mask(input_mask, ar_mask)
        positions = torch.cumsum(input_mask.int(), dim=1) - 1
        (_, suffix_out), _ = joint_forward(
            (self.llm, self.expert), (prefix, suffix), positions, attn_mask, dtype=self.dtype, conds=(None, cond)
        )
        v_t = self.action_out_proj(suffix_out[:, -actions.shape[1] :])
        return (v_t.float() - u_t).square().mean(-1)
