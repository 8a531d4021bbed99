"""The two Gemma 'experts' of π0 sharing every attention layer (openpi's `gemma.py`).

Tokens of each expert use that expert's norms, projections and MLP, then all tokens attend jointly. The prefix
pass runs only the LLM expert and returns the per-layer K/V (the KV cache); a denoising step runs only the action
expert, attending to the cached prefix K/V plus its own.

π0.5's action expert uses adaptive RMSNorms (`AdaptiveRMSNorm`): a Dense of the time condition gives each norm
its scale, shift and a gate, and the residual branch after a gated norm is `x + y * gate`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vla_rt.config import GemmaConfig
from vla_rt.model.siglip import gelu_tanh

# gemma/modules.py's mask value: finite, so fully masked rows stay finite (a -inf would give NaN).
MASK_VALUE = -2.3819763e38

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v), each (B, S, num_kv_heads, head_dim)


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x²) + eps) * (1 + scale)` in float32, cast back; scale is stored as an offset from 1."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        # `1 + scale` is evaluated in the parameter's dtype (rounded in bf16, as openpi's bf16 serving does).
        return (normed * (1 + self.scale)).to(x.dtype)


class AdaptiveRMSNorm(nn.Module):
    """π0.5's adaRMSNorm (openpi `gemma.RMSNorm` with a `cond`): `normed * (1 + scale) + shift`, and a gate.

    `dense` (3W, cond_width) maps the condition (B, cond_width) to [scale | shift | gate] (contiguous thirds in that
    order). The Dense runs in the activations' dtype (openpi's `nn.Dense(dtype=x.dtype)`: bf16 when serving), so
    `1 + scale` is rounded in that dtype; normalisation, scale and shift are applied in float32, then cast back.
    Returns (normed (B, T, W) in x's dtype, gate (B, 1, W) in x's dtype).
    """

    def __init__(self, width: int, cond_width: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_width, 3 * width)

    def modulation(self, cond: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(scale, shift, gate), each (B, 1, W) in `dtype`: the Dense of the condition split in thirds."""
        w, b = self.dense.weight.to(dtype), self.dense.bias.to(dtype)
        return torch.nn.functional.linear(cond.to(dtype), w, b)[:, None, :].chunk(3, dim=-1)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, shift, gate = self.modulation(cond, x.dtype)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (normed * (1 + scale) + shift).to(x.dtype), gate


Norm = RMSNorm | AdaptiveRMSNorm


def apply_norm(norm: Norm, x: torch.Tensor, cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed x, gate or None): plain norms ignore the condition; adaptive norms require one."""
    if isinstance(norm, AdaptiveRMSNorm):
        if cond is None:
            raise ValueError("an adaptive RMSNorm (π0.5's action expert) needs the time condition, found None")
        return norm(x, cond)
    return norm(x), None


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """openpi's `_gated_residual`: `x + y`, or `x + y * gate` after an adaptive norm (not `1 + gate`)."""
    return x + y if gate is None else x + y * gate


class GemmaLayer(nn.Module):
    """One expert's weights for one shared layer (adaptive norms for π0.5's action expert)."""

    def __init__(self, cfg: GemmaConfig, eps: float, cond_width: int | None = None):
        super().__init__()
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = _norm(cfg.width, eps, cond_width)
        self.q_proj = nn.Linear(cfg.width, q_width, bias=False)
        self.k_proj = nn.Linear(cfg.width, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.width, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, cfg.width, bias=False)
        self.ffn_norm = _norm(cfg.width, eps, cond_width)
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.width, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


def _norm(width: int, eps: float, cond_width: int | None) -> Norm:
    return RMSNorm(width, eps) if cond_width is None else AdaptiveRMSNorm(width, cond_width, eps)


class GemmaStack(nn.Module):
    """The layers (and, for the LLM, the token embedding) of one expert.

    `cond_width` set: every norm (both per layer and the final one) is adaptive, conditioned on a (B, cond_width)
    vector (π0.5's action expert, conditioned on the time MLP's output).
    """

    def __init__(
        self, cfg: GemmaConfig, vocab_size: int | None = None, eps: float = 1e-6, cond_width: int | None = None
    ):
        super().__init__()
        self.cfg = cfg
        if vocab_size is not None:
            self.embed_tokens = nn.Embedding(vocab_size, cfg.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg, eps, cond_width) for _ in range(cfg.depth))
        self.final_norm = _norm(cfg.width, eps, cond_width)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embedding times sqrt(width) (text only; image tokens are not scaled), in the weights' dtype."""
        x = self.embed_tokens(tokens)
        return x * torch.tensor(math.sqrt(self.cfg.width), dtype=x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, max_wavelength: float = 10_000.0) -> torch.Tensor:
    """RoPE with split halves (not interleaved), computed in float32. x: (B, T, heads, D); positions: (B, T)."""
    d = x.shape[-1]
    freq_exponents = (2.0 / d) * torch.arange(d // 2, dtype=torch.float32, device=x.device)
    timescale = max_wavelength**freq_exponents
    radians = positions.float()[..., None] / timescale  # (B, T, D/2)
    radians = radians[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with openpi's masking.

    q: (B, T, N, H) already scaled; k, v: (B, S, K, H); mask: (B, T, S) bool. Logits and softmax in float32,
    probabilities cast to the value dtype before P·V.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.view(b, t, kv_heads, n // kv_heads, h).permute(0, 2, 3, 1, 4)  # B K G T H
    kk = k.permute(0, 2, 1, 3)[:, :, None]  # B K 1 S H
    vv = v.permute(0, 2, 1, 3)[:, :, None]
    logits = (qg.float() @ kk.float().transpose(-1, -2)) if q.dtype != torch.float32 else qg @ kk.transpose(-1, -2)
    logits = torch.where(mask[:, None, None], logits, torch.tensor(MASK_VALUE, dtype=logits.dtype, device=q.device))
    probs = torch.softmax(logits, dim=-1).to(v.dtype)
    out = probs @ vv  # B K G T H
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, n * h)


def joint_forward(
    stacks: tuple[GemmaStack, GemmaStack],
    xs: tuple[torch.Tensor | None, torch.Tensor | None],
    positions: torch.Tensor,
    mask: torch.Tensor,
    kv_cache: KVCache | None = None,
    dtype: torch.dtype | None = None,
    conds: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[list[torch.Tensor | None], KVCache]:
    """Runs the experts whose input is not None through all shared layers.

    xs: per expert (B, T_e, width_e) or None; positions: (B, sum T_e); mask: (B, sum T_e, S_cache + sum T_e);
    conds: per expert the (B, cond_width) condition of its adaptive norms, or None (plain norms). The final
    adaptive norm's gate is unused, as in openpi. Returns the final-normed outputs per expert and the per-layer K/V of the tokens run here (without the cache,
    which a caller concatenates if it wants the full sequence).
    """
    xs = [None if x is None else x.to(dtype or x.dtype) for x in xs]
    new_cache: KVCache = []
    for i in range(stacks[0].cfg.depth):
        layers = [s.layers[i] for s in stacks]
        qs, ks, vs, gates = [], [], [], []
        for x, layer, cond in zip(xs, layers, conds):
            if x is None:
                gates.append(None)
                continue
            b, t, _ = x.shape
            h, gate = apply_norm(layer.attn_norm, x, cond)
            gates.append(gate)
            qs.append(layer.q_proj(h).view(b, t, -1, stacks[0].cfg.head_dim))
            ks.append(layer.k_proj(h).view(b, t, -1, stacks[0].cfg.head_dim))
            vs.append(layer.v_proj(h).view(b, t, -1, stacks[0].cfg.head_dim))
        q, k, v = torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1)
        head_dim = q.shape[-1]
        q = rope(q, positions)
        q = q * torch.tensor(head_dim**-0.5, dtype=q.dtype)
        k = rope(k, positions)
        new_cache.append((k, v))
        if kv_cache is not None:
            k = torch.cat([kv_cache[i][0], k], 1)
            v = torch.cat([kv_cache[i][1], v], 1)
        encoded = attention(q, k, v, mask)
        start = 0
        out = []
        for x, layer, cond, gate in zip(xs, layers, conds, gates):
            if x is None:
                out.append(None)
                continue
            t = x.shape[1]
            x = gated_residual(x, layer.o_proj(encoded[:, start : start + t]), gate)
            start += t
            h, gate = apply_norm(layer.ffn_norm, x, cond)
            out.append(gated_residual(x, layer.mlp(h), gate))
        xs = out
    return [None if x is None else apply_norm(s.final_norm, x, c)[0] for s, x, c in zip(stacks, xs, conds)], new_cache
