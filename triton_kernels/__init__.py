"""Triton kernels for π0: GEMM with fused prologue/epilogue and split-K, attention, norms, RoPE, patchify, and a
warp-specialized Gluon GEMM for the action expert's 64-row QKV and gate/up projections (`gluon_gemm`) and its whole MLP
in one Gluon launch (`gluon_mlp`).

Every kernel writes into a preallocated `out` and resolves its launch config before launching, so an engine can
capture the whole plan in one CUDA Graph. Launch configs are data (`configs/<gpu-name>.json`, see
`launch_configs`), filled by `tune`. docs/kernels.md explains the designs.

Without CUDA, Triton kernels can only run in Triton's interpreter, and `@triton.jit` picks interpreter or compiler
when a kernel module is imported; so this package turns the interpreter on (unless TRITON_INTERPRET is already set)
before its kernel modules load. Import it as `vla_rt.triton_kernels`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .attention import attention, attention_reference  # noqa: E402
from .gemm import gemm  # noqa: E402
from .launch_configs import AttentionConfig, GemmConfig, attention_config, gemm_config, gpu_name  # noqa: E402
from .norms import layernorm, rms_factor, rmsnorm  # noqa: E402
from .patchify import patchify  # noqa: E402
from .prefetch import prefetch_join, prefetch_l2  # noqa: E402
from .rope import rope_qk  # noqa: E402
from .workspace import Workspace, default_workspace  # noqa: E402

try:  # Gluon (triton.experimental.gluon) ships with Triton >= 3.4; the kernels need its 3.6 API and an sm_90 GPU
    from .gluon_gemm import skinny_gemm, skinny_gemm_applies  # noqa: E402
    from .gluon_mlp import expert_mlp, expert_mlp_applies  # noqa: E402
except ImportError as _gluon_error:  # pragma: no cover - depends on the installed Triton
    _GLUON_MISSING = f"this Triton ({_gluon_error}) has no usable Gluon"

    def skinny_gemm_applies(a, w, **_) -> str | None:
        return _GLUON_MISSING

    def skinny_gemm(a, w, out, **_):
        raise ValueError(f"skinny_gemm: {_GLUON_MISSING}")

    def expert_mlp_applies(x, w_gate_up, w_down, *_) -> str | None:
        return _GLUON_MISSING

    def expert_mlp(x, w_gate_up, w_down, h, **_):
        raise ValueError(f"expert_mlp: {_GLUON_MISSING}")


__all__ = [
    "AttentionConfig",
    "GemmConfig",
    "Workspace",
    "attention",
    "attention_config",
    "attention_reference",
    "default_workspace",
    "expert_mlp",
    "expert_mlp_applies",
    "gemm",
    "gemm_config",
    "gpu_name",
    "layernorm",
    "patchify",
    "prefetch_join",
    "prefetch_l2",
    "rms_factor",
    "rmsnorm",
    "rope_qk",
    "skinny_gemm",
    "skinny_gemm_applies",
]
