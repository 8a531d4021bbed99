"""The kernel shapes of real π0 inference, one list shared by the default launch tables, `tune`, the kernel
benchmark and the GPU tests.

GEMM shapes are (M rows, N output columns, K reduction) plus the epilogue the engine uses there (the action expert's
QKV with the RoPE epilogue, the prefix's without); attention shapes are
(B, Tq, Tk, Hq, Hkv, D). Rows: the action expert runs chunk + 1 rows (state token + actions), the VLM prefix
256 * views + prompt rows, SigLIP 256 rows per view; a batch of B robots (the server's buckets) multiplies every
GEMM's rows by B and is the attention's B.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionShape", "GemmShape", "pi0_attention_shapes", "pi0_gemm_shapes"]

VIEWS = (1, 2, 3)
PROMPTS = (0, 20, 48)  # 48 = openpi's max_token_len (prompts padded to it)
CHUNKS = (50, 63)
TOKENS_PER_VIEW = 256
ROPE_HEADS = (8, 1, 256)  # π0's Gemma (VLM and action expert): query heads, KV heads, head dim


@dataclass(frozen=True)
class GemmShape:
    name: str
    m: int
    n: int  # output columns (a gated GEMM reads 2n weight rows)
    k: int
    gated: bool = False
    bias: bool = False
    row_scale: bool = False
    activation: str | None = None
    residual: bool = False
    rope: bool = False  # RoPE epilogue into the KV cache (π0's Gemma heads: ROPE_HEADS)

    @property
    def rope_heads(self) -> tuple[int, int, int]:
        """(num_q_heads, num_kv_heads, head_dim) of a RoPE GEMM: π0's Gemma heads, Q heads from the width (0 for
        the pruned layer's K/V-only GEMM)."""
        hkv, d = ROPE_HEADS[1:]
        return self.n // d - 2 * hkv, hkv, d


@dataclass(frozen=True)
class AttentionShape:
    name: str
    b: int
    tq: int
    tk: int
    hq: int
    hkv: int
    d: int
    masked: bool = False


def _expert_gemms(m: int) -> list[GemmShape]:
    return [
        GemmShape("expert.qkv", m, 2560, 1024, row_scale=True, rope=True),
        GemmShape("expert.o", m, 1024, 2048, residual=True),
        GemmShape("expert.gate_up", m, 4096, 1024, gated=True, row_scale=True),
        GemmShape("expert.down", m, 1024, 4096, residual=True),
        GemmShape("expert.action_out", m, 32, 1024, bias=True, residual=True),  # Euler step in the epilogue
        GemmShape("expert.action_in", m, 1024, 32, bias=True),
        GemmShape("expert.time_mlp_in", m, 1024, 2048, bias=True, activation="silu"),
        GemmShape("expert.time_mlp_out", m, 1024, 1024, bias=True),
    ]


def _vlm_gemms(m: int) -> list[GemmShape]:
    return [
        GemmShape("vlm.qkv", m, 2560, 2048, row_scale=True),
        GemmShape("vlm.o", m, 2048, 2048, residual=True),
        GemmShape("vlm.gate_up", m, 16384, 2048, gated=True, row_scale=True),
        GemmShape("vlm.down", m, 2048, 16384, residual=True),
    ]


def _siglip_gemms(m: int) -> list[GemmShape]:
    return [
        GemmShape("siglip.patch", m, 1152, 588, bias=True, residual=True),  # + position embedding, period 256
        GemmShape("siglip.qkv", m, 3456, 1152, bias=True),
        GemmShape("siglip.o", m, 1152, 1152, bias=True, residual=True),
        GemmShape("siglip.fc1", m, 4304, 1152, bias=True, activation="gelu_tanh"),
        GemmShape("siglip.fc2", m, 1152, 4304, bias=True, residual=True),
        GemmShape("siglip.projector", m, 2048, 1152, bias=True),
    ]


def pi0_gemm_shapes(views=VIEWS, prompts=PROMPTS, chunks=(63,), batches=(1,)) -> list[GemmShape]:
    """Distinct GEMMs of π0 inference for these configurations (the expert's M=51 is served by M=64's config)."""
    shapes: list[GemmShape] = []
    for b in batches:
        for chunk in chunks:
            shapes += _expert_gemms(b * (chunk + 1))
        for v in views:
            shapes += _siglip_gemms(b * TOKENS_PER_VIEW * v)
            for p in prompts:
                shapes += _vlm_gemms(b * (TOKENS_PER_VIEW * v + p))
    seen, unique = set(), []
    for s in shapes:
        if (s.m, s.n, s.k, s.gated, s.rope) not in seen:
            seen.add((s.m, s.n, s.k, s.gated, s.rope))
            unique.append(s)
    return unique


def pi0_attention_shapes(views=VIEWS, prompts=(0, 20), chunks=CHUNKS, batches=(1,)) -> list[AttentionShape]:
    shapes = []
    for b in batches:
        tag = "" if b == 1 else f"b{b}"
        for v in views:
            shapes.append(AttentionShape(f"siglip.v{v}{tag}", b * v, 256, 256, 16, 16, 72))
            for p in prompts:
                prefix = TOKENS_PER_VIEW * v + p
                shapes.append(AttentionShape(f"prefix.v{v}p{p}{tag}", b, prefix, prefix, 8, 1, 256, masked=True))
                for h in chunks:
                    suffix = h + 1
                    name = f"expert.v{v}p{p}h{h}{tag}"
                    shapes.append(AttentionShape(name, b, suffix, prefix + suffix, 8, 1, 256, masked=True))
    return shapes
