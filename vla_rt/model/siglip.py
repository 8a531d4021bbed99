"""SigLIP So400m/14 image encoder, as openpi's `siglip.py` computes it (pool_type="none", learned posemb).

Each camera view is encoded on its own: attention never crosses views. The multimodal projector (1152 → 2048)
lives in `pi0.py` because its weights are named `projector.*` at the top level.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vla_rt.config import VisionConfig


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """flax.linen.gelu's default (approximate=True); PI0_SPEC trap: not the erf GELU."""
    return F.gelu(x, approximate="tanh")


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.width, cfg.width)
        self.k_proj = nn.Linear(cfg.width, cfg.width)
        self.v_proj = nn.Linear(cfg.width, cfg.width)
        self.out_proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (
            p(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        # flax scales the query by 1/sqrt(depth) in the compute dtype before the dot product; softmax in that dtype.
        q = q * torch.tensor(self.head_dim**-0.5, dtype=q.dtype)
        probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(n, t, -1)
        return self.out_proj(out)


class VisionMlp(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LN transformer block: x + MHA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, cfg: VisionConfig, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=eps)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width, eps=eps)
        self.mlp = VisionMlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, eps: float = 1e-6):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.num_patches, cfg.width))
        self.blocks = nn.ModuleList(VisionBlock(cfg, eps) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(cfg.width, eps=eps)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images: (N, S, S, 3) in [-1, 1] (NHWC, openpi layout) -> (N, num_patches, width) in the weights' dtype."""
        dtype = self.final_norm.weight.dtype
        # openpi does the patch embedding and the position embedding in float32 ("a bit safer"), then casts.
        x = F.conv2d(
            images.float().permute(0, 3, 1, 2),
            self.patch_embed.weight.float(),
            self.patch_embed.bias.float(),
            stride=self.cfg.patch_size,
        )
        x = x.flatten(2).transpose(1, 2) + self.pos_embed.float()
        x = x.to(dtype)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)
