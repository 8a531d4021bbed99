"""Pass: the 14×14 stride-14 patch convolution as one (p·p·3 → width) GEMM over unfolded patches.

A VALID conv with stride = kernel size is exactly a matrix product over non-overlapping patches. The kernel is
reordered to (kh, kw, c) so that a patch row reads the NHWC image contiguously along channels; the learned
position embedding becomes the GEMM's residual input, repeated every `num_patches` rows (one period per view).
"""

from __future__ import annotations

from vla_rt.graph_passes.base import GraphPass, PassContext, PassReport, PassState, require

NAME = "patch_embed_as_gemm"


def apply(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    require(t, "vision.patch_embed.weight", pass_name=NAME)
    w = t.pop("vision.patch_embed.weight")  # (width, 3, p, p) OIHW
    t["vision.patch_embed.weight"] = w.permute(0, 2, 3, 1).reshape(w.shape[0], -1).contiguous()  # (width, p*p*3)
    return state.replace(t, patch_order="hwc")


def report(ctx: PassContext) -> PassReport:
    # The eager graph permutes NHWC->NCHW before the conv and flattens/transposes after it; with the position
    # embedding as the GEMM's residual, the separate add goes too: 3 kernels per vision pass.
    v = ctx.cfg.vision
    rows = ctx.batch_size * ctx.num_views * v.num_patches
    return PassReport(NAME, kernels_removed=3, weight_bytes_saved=0, flops_saved=rows * v.width, note="conv→GEMM")


PASS = GraphPass(NAME, apply, report)
