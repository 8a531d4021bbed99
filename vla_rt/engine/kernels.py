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
             residual_period=None, rms_eps=None, rope=None, ssq_in=None, ssq_out=None, rms_out=None,
             rms_out_eps=None, **_):  # fmt: skip
        """The fused options as the separate ops they replace: `rms_eps` = `rms_factor` then `row_scale` (from the
        partial sums `ssq_in` when given), `rope` = this GEMM then `rope_qk(out, **rope)`, `ssq_out` = the output's
        per-16-column sums of squares, `rms_out` = this GEMM then `rms_factor(out, rms_out, rms_out_eps)`."""
        if rms_eps is not None:
            if row_scale is not None:
                raise ValueError("give row_scale or rms_eps, not both")
            if ssq_in is not None:
                row_scale = torch.rsqrt(ssq_in.float().sum(0) / a.shape[1] + rms_eps)
            else:
                row_scale = ops.rms_factor(a, rms_eps)
        if ssq_out is not None and rope is not None:
            raise ValueError("ssq_out needs no rope")
        TorchKernels._gemm(a, w, out, bias, row_scale, activation, gated, alpha, residual, residual_period)
        if rope is not None:
            TorchKernels.rope_qk(out, **rope)
        if ssq_out is not None:
            m, n = out.shape
            ssq_out.copy_(out.float().pow(2).view(m, n // 16, 16).sum(-1).T)
        if rms_out is not None:
            rms_out.copy_(ops.rms_factor(out, rms_out_eps))
        return out

    @staticmethod
    def _gemm(a, w, out, bias, row_scale, activation, gated, alpha, residual, residual_period):
        if a.dtype in (torch.bfloat16, torch.float16):
            # half precision: cuBLAS's own matmul (fp32 accumulation inside), the epilogue on its result; upcasting
            # the weights first (as the precise mirror `ops.gemm` does) would make this baseline read 2x the bytes
            product = a @ w.T
            y = ops.gemm(product, w, bias=bias, row_scale=row_scale, activation=activation, gated=gated,
                         alpha=alpha, residual=residual, residual_period=residual_period, out_dtype=out.dtype,
                         product=product)  # fmt: skip
        else:
            y = ops.gemm(a, w, bias=bias, row_scale=row_scale, activation=activation, gated=gated, alpha=alpha,
                         residual=residual, residual_period=residual_period, out_dtype=out.dtype)  # fmt: skip
        return out.copy_(y)

    @staticmethod
    def attention(q, k, v, out, *, scale, q_block=None, k_block=None, **_):
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
    def rms_factor(x, out_factor, eps, **_):
        """(`pdl_early`, a launch-order hint of the Triton kernel, means nothing here.)"""
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
    def expert_layer(x, w_qkv, w_o, w_gate_up, w_down, qkv, attn, mlp, k_cache, v_cache, cos, sin, q_block, k_block,
                     *, cache_offset, eps, scale, num_q_heads, head_dim, q_scale=1.0, **_):  # fmt: skip
        """`triton_kernels.expert_layer` as the separate ops it replaces (one Gemma layer over the expert rows)."""
        k = TorchKernels
        rope = dict(cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, cache_offset=cache_offset,
                    num_q_heads=num_q_heads, num_kv_heads=1, head_dim=head_dim, q_scale=q_scale)  # fmt: skip
        k.gemm(x, w_qkv, qkv, row_scale=ops.rms_factor(x, eps), rope=rope)
        b, s = q_block.shape
        keys = cache_offset + s
        q = qkv.view(b, s, -1, head_dim)[:, :, :num_q_heads]
        k.attention(q, k_cache[:, :keys], v_cache[:, :keys], attn.view(b, s, num_q_heads, head_dim), scale=scale,
                    q_block=q_block, k_block=k_block)  # fmt: skip
        k.gemm(attn, w_o, x, residual=x)
        k.gemm(x, w_gate_up, mlp, gated=True, row_scale=ops.rms_factor(x, eps))
        return k.gemm(mlp, w_down, x, residual=x)

    @staticmethod
    def expert_layer_applies(rows, width, mlp, num_q_heads, num_kv_heads, head_dim):
        """The composed layer serves any dims with one KV head (what the persistent kernel needs first)."""
        return None if num_kv_heads == 1 else f"{num_kv_heads} KV heads"

    @staticmethod
    def skinny_gemm(a, w, out, *, row_scale=None, rms_eps=None, gated=False, rope=None, residual=None, **_):
        """`triton_kernels.skinny_gemm` (the Gluon GEMM of the expert's QKV and gate/up) as `gemm` with the same
        options."""
        return TorchKernels.gemm(a, w, out, row_scale=row_scale, rms_eps=rms_eps, gated=gated, rope=rope,
                                 residual=residual)  # fmt: skip

    @staticmethod
    def skinny_gemm_applies(a, w, **_):
        """The composed ops serve any shapes."""
        return None

    @staticmethod
    def expert_mlp(x, w_gate_up, w_down, h, *, rms_eps=None, row_scale=None, attn=None, w_o=None, **_):
        """`triton_kernels.expert_mlp` (the expert's MLP in one Gluon launch, with `attn` / `w_o` its O projection
        first) as the GEMMs it replaces."""
        if attn is not None:
            TorchKernels.gemm(attn, w_o, x, residual=x)
        TorchKernels.gemm(x, w_gate_up, h, gated=True, rms_eps=rms_eps, row_scale=row_scale)
        return TorchKernels.gemm(h, w_down, x, residual=x)

    @staticmethod
    def expert_mlp_applies(x, w_gate_up, w_down, *_):
        """The composed ops serve any shapes."""
        return None

    @staticmethod
    def prefetch_l2(tensors):
        """A hint to the GPU's L2 (see `triton_kernels.prefetch`); nothing to do for eager ops."""

    @staticmethod
    def prefetch_join(like):
        """(Joins `prefetch_l2`'s side stream; nothing to join here.)"""

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
        rope_qk=tk.rope_qk,
        prefetch_l2=tk.prefetch_l2,
        prefetch_join=tk.prefetch_join,
        expert_layer=tk.expert_layer,
        expert_layer_applies=tk.expert_layer_applies,
        patchify=tk.patchify,
        skinny_gemm=tk.skinny_gemm,
        skinny_gemm_applies=tk.skinny_gemm_applies,
        expert_mlp=tk.expert_mlp,
        expert_mlp_applies=tk.expert_mlp_applies,
    )
