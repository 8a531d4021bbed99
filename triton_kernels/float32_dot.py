"""The `tl.dot` input precision the GEMM kernels use for each operand dtype.

openpi computes the patch embedding and the suffix embedding (state, action-time MLP, its output projection) in
float32, so the bf16 engines keep those GEMMs in float32. Triton's "ieee" float32 dot runs on the FMA pipes, not the
tensor cores: on the H200 it took 248 µs for the expert's 1600 x 1024 x 1024 mlp_out at 32 rows and 604 µs for the
patch embedding of 16 images (`tools/profile_engine.py`), more than the bf16 GEMMs around them. "tf32x3" splits each
float32 operand into a TF32 high part and a TF32 remainder and sums three tensor-core products in float32: float32
accuracy (measured against float64 by `tools/fp32_gemm_precision.py` and `tests/test_kernels_gpu.py`) at tensor-core
speed. bf16 and fp16 operands go to the tensor cores whatever this says ("tf32" is then ignored by Triton).
Triton's CPU interpreter computes every precision as IEEE float32.
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT32_DOT_PRECISION", "dot_precision"]

FLOAT32_DOT_PRECISION = "tf32x3"


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` for a `tl.dot` of two `dtype` tiles."""
    return FLOAT32_DOT_PRECISION if dtype == torch.float32 else "tf32"
