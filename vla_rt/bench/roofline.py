"""The roofline of one π0 inference (arXiv:2510.26742 §5.1, ANCHORS.md): the floor no implementation beats.

Per GEMM: max(weight bytes / bandwidth, 2·MACs / FLOP rate), summed over the graph, plus attention FLOPs at the
FLOP rate; bf16 weights, `num_steps` action-expert calls, last VLM layer pruned to its K/V. Activations are not
counted (they live in L2 at these sizes), which is what makes the action expert's floor purely weight-bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from vla_rt.config import Pi0Config
from vla_rt.timing import time_calls

BF16 = 2


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s, device-to-device copy counting read + write
    flops: float  # dense bf16 FLOP/s of a large matmul

    @classmethod
    def h200_anchor(cls) -> Ceilings:
        """ANCHORS.md's measured H200 ceilings (4.23 TB/s, 800 TFLOP/s), for machines where nothing is measured."""
        return cls(4.23e12, 800e12)


@dataclass(frozen=True)
class Roofline:
    vision_ms: float
    vlm_ms: float
    expert_step_ms: float
    num_steps: int

    @property
    def expert_ms(self) -> float:
        return self.expert_step_ms * self.num_steps

    @property
    def total_ms(self) -> float:
        return self.vision_ms + self.vlm_ms + self.expert_ms

    def to_dict(self) -> dict:
        return {**asdict(self), "expert_ms": self.expert_ms, "total_ms": self.total_ms}


def _gemm_s(m: int, k: int, n: int, c: Ceilings) -> float:
    return max(k * n * BF16 / c.bandwidth, 2 * m * k * n / c.flops)


def _attn_s(tq: int, tk: int, heads: int, head_dim: int, c: Ceilings) -> float:
    return 2 * 2 * tq * tk * heads * head_dim / c.flops  # QKᵀ and P·V


def pi0_roofline(
    cfg: Pi0Config, views: int, chunk: int, prompt_len: int, num_steps: int = 10, c: Ceilings | None = None,
    batch: int = 1,
) -> Roofline:  # fmt: skip
    c = c or Ceilings.h200_anchor()
    v, g, e = cfg.vision, cfg.llm, cfg.expert
    n = v.num_patches
    # vision: all views in one batch of rows (weights read once), attention within each view
    mv = batch * views * n
    patch = v.patch_size * v.patch_size * 3
    vision = _gemm_s(mv, patch, v.width, c) + _gemm_s(mv, v.width, g.width, c)
    vision += v.depth * (
        _gemm_s(mv, v.width, 3 * v.width, c) + _gemm_s(mv, v.width, v.width, c)
        + _gemm_s(mv, v.width, v.mlp_dim, c) + _gemm_s(mv, v.mlp_dim, v.width, c)
        + batch * views * _attn_s(n, n, v.num_heads, v.head_dim, c)
    )  # fmt: skip
    # VLM prefix: depth-1 full layers + K/V of the last one
    tp = views * n + prompt_len
    mp = batch * tp
    q, kv = g.num_heads * g.head_dim, 2 * g.num_kv_heads * g.head_dim
    full = (
        _gemm_s(mp, g.width, q + kv, c) + _gemm_s(mp, q, g.width, c)
        + _gemm_s(mp, g.width, 2 * g.mlp_dim, c) + _gemm_s(mp, g.mlp_dim, g.width, c)
        + batch * _attn_s(tp, tp, g.num_heads, g.head_dim, c)
    )  # fmt: skip
    vlm = (g.depth - 1) * full + _gemm_s(mp, g.width, kv, c)
    # action expert, one step: suffix embedding, depth layers over prefix + own keys, output projection
    # (π0.5: no state token and no action-time MLP; its per-step modulation is a few bias/scale rows, not counted)
    ts = chunk + (0 if cfg.pi05 else 1)
    ms = batch * ts
    step = _gemm_s(batch * chunk, cfg.action_dim, e.width, c) + _gemm_s(batch * chunk, e.width, cfg.action_dim, c)
    if not cfg.pi05:
        step += _gemm_s(batch, cfg.action_dim, e.width, c) + _gemm_s(batch * chunk, e.width, e.width, c)
    step += e.depth * (
        _gemm_s(ms, e.width, q + kv, c) + _gemm_s(ms, q, e.width, c)
        + _gemm_s(ms, e.width, 2 * e.mlp_dim, c) + _gemm_s(ms, e.mlp_dim, e.width, c)
        + batch * _attn_s(ts, tp + ts, g.num_heads, g.head_dim, c)
    )  # fmt: skip
    return Roofline(vision * 1e3, vlm * 1e3, step * 1e3, num_steps)


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """The card's copy bandwidth (bytes read + written per second) and bf16 matmul rate, on random data."""
    n = 1 << 30  # 1 GiB of bf16 each way
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = time_calls(lambda: dst.copy_(src), warmup=5, iters=30, device=device)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm = time_calls(lambda: a @ b, warmup=5, iters=30, device=device)
    return {
        "copy_bandwidth_bytes_per_s": 2 * n / (copy.median_ms * 1e-3),
        "bf16_matmul_flops_per_s": 2 * 8192**3 / (mm.median_ms * 1e-3),
    }
