"""Kernel sets the engine plan runs on: Triton (`vla_rt.triton_kernels`) or PyTorch ops with the same contracts.

Both write into preallocated outputs, so a plan captured in a CUDA Graph works with either: the torch set is the
"CUDA Graph over folded torch ops" baseline, and it checks the plan's wiring on a CPU in seconds.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vla_rt.engine import torch_ops as ops


class TorchKernels:
    """`vla_rt.triton_kernels`' signatures over eager PyTorch ops."""

    name = "torch"

    @staticmethod
    def gemm(a, w, out, *, bias=None, row_scale=None, activation=None, gated=False, alpha=1.0, residual=None,
             residual_period=None, out_scale=None, rope=None, workspace=None):  # fmt: skip
        """`rope` (the QKV GEMM's RoPE epilogue) as what it replaces: this GEMM, then `rope_qk(out, **rope)`.
        (`workspace`, the Triton kernels' split-K scratch, means nothing here.)"""
        TorchKernels._gemm(a, w, out, bias, row_scale, activation, gated, alpha, residual, residual_period, out_scale)
        if rope is not None:
            TorchKernels.rope_qk(out, **rope)
        return out

    @staticmethod
    def _gemm(a, w, out, bias, row_scale, activation, gated, alpha, residual, residual_period, out_scale):
        if a.dtype in (torch.bfloat16, torch.float16):
            # half precision: cuBLAS's own matmul (fp32 accumulation inside), the epilogue on its result; upcasting
            # the weights first (as the precise mirror `ops.gemm` does) would make this baseline read 2x the bytes
            product = a @ w.T
            y = ops.gemm(product, w, bias=bias, row_scale=row_scale, activation=activation, gated=gated,
                         alpha=alpha, residual=residual, residual_period=residual_period, out_dtype=out.dtype,
                         product=product, out_scale=out_scale)  # fmt: skip
        else:
            y = ops.gemm(a, w, bias=bias, row_scale=row_scale, activation=activation, gated=gated, alpha=alpha,
                         residual=residual, residual_period=residual_period, out_dtype=out.dtype,
                         out_scale=out_scale)  # fmt: skip
        return out.copy_(y)

    @staticmethod
    def attention(q, k, v, out, *, scale, q_block=None, k_block=None, workspace=None):
        if q.dtype in (torch.bfloat16, torch.float16):  # PyTorch's fused attention; rows that see no key -> 0
            mask = None if q_block is None else (k_block[:, None, :] <= q_block[:, :, None])[:, None]
            y = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                scale=scale,
                enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)
            return out.copy_(torch.nan_to_num(y, nan=0.0).reshape(out.shape))
        y = ops.attention(q, k, v, scale=scale, q_block=q_block, k_block=k_block)
        return out.copy_(y.view(out.shape))

    @staticmethod
    def layernorm(x, out, eps, weight=None, bias=None):
        return out.copy_(torch.nn.functional.layer_norm(x.float(), x.shape[-1:], weight, bias, eps))

    @staticmethod
    def rmsnorm(x, out, eps, scale=None):
        return out.copy_(ops.rmsnorm(x.float(), eps, scale))  # fp32 in: one rounding, to out.dtype (the kernel)

    @staticmethod
    def rms_factor(x, out_factor, eps):
        return out_factor.copy_(ops.rms_factor(x, eps))

    @staticmethod
    def rope_qk(qkv, cos, sin, k_cache, v_cache, *, num_q_heads, num_kv_heads, head_dim, cache_offset=0,
                q_scale=1.0):  # fmt: skip
        b = k_cache.shape[0]
        t = qkv.shape[0] // b
        x = qkv.view(b, t, num_q_heads + 2 * num_kv_heads, head_dim)
        q, k, v = x.split([num_q_heads, num_kv_heads, num_kv_heads], dim=2)
        cos = cos.expand(b, t, -1) if cos.dim() == 2 else cos
        sin = sin.expand(b, t, -1) if sin.dim() == 2 else sin

        def rotate(y):
            c, s = cos[:, :, None, :], sin[:, :, None, :]
            y1, y2 = y.float().chunk(2, dim=-1)
            return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1)

        rot_q = rotate(q) * q_scale
        k_cache[:, cache_offset : cache_offset + t].copy_(rotate(k))
        v_cache[:, cache_offset : cache_offset + t].copy_(v)
        q.copy_(rot_q)

    @staticmethod
    def patchify(images, out, patch):
        return out.copy_(ops.patchify(images, patch))


def triton_kernels() -> SimpleNamespace:
    """The Triton kernel set (imported lazily: importing it decides interpreter vs compiler mode)."""
    from vla_rt import triton_kernels as tk

    return SimpleNamespace(
        name="triton",
        gemm=tk.gemm,
        attention=tk.attention,
        layernorm=tk.layernorm,
        rms_factor=tk.rms_factor,
        rmsnorm=tk.rmsnorm,
        rope_qk=tk.rope_qk,
        patchify=tk.patchify,
    )
