"""Triton kernels for π0: GEMM with fused epilogues (row scale, bias, activation or GeGLU, residual, RoPE into the
KV cache) and split-K, attention with block masks and split-KV, norms, RoPE, patchify.

Every kernel writes into a preallocated `out` and resolves its launch config before launching, so an engine can
capture the whole plan in one CUDA Graph. Launch configs are data (`configs/<gpu-name>.json`, see
`launch_configs`), filled by the tuner (`tuning`). docs/kernels.md explains the designs.

Without CUDA, Triton kernels can only run in Triton's interpreter, and `@triton.jit` picks interpreter or compiler
when a kernel module is imported; so this package turns the interpreter on (unless TRITON_INTERPRET is already set)
before its kernel modules load. Import it as `vla_rt.triton_kernels`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .attention import attention, attention_reference  # noqa: E402
from .attention_configs import AttentionConfig, attention_config  # noqa: E402
from .gemm import gemm  # noqa: E402
from .launch_configs import GemmConfig, gemm_config, gpu_name  # noqa: E402
from .norms import layernorm, rms_factor, rmsnorm  # noqa: E402
from .patchify import patchify  # noqa: E402
from .rope import rope_qk  # noqa: E402
from .workspace import Workspace, default_workspace  # noqa: E402

__all__ = [
    "AttentionConfig",
    "GemmConfig",
    "Workspace",
    "attention",
    "attention_config",
    "attention_reference",
    "default_workspace",
    "gemm",
    "gemm_config",
    "gpu_name",
    "layernorm",
    "patchify",
    "rms_factor",
    "rmsnorm",
    "rope_qk",
]
