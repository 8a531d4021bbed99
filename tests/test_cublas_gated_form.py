"""`cublas_choice`'s gated form (a plain GEMM by torch into bf16/fp16 scratch, then the split-K combine kernel as a
one-split combine running the epilogue) against float64 and against our fused gated GEMM, in Triton's interpreter
on the CPU (fp16: the interpreter's bf16 `tl.dot` is wrong, and the form needs 16-bit operands). On the CPU
`torch.mm` stands in for cuBLAS (the same call); `gemm` hands a gated GEMM to it where the table's `cublas_us` for
the `:gated` entry says so."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from vla_rt.numerics import rel_err  # noqa: E402
from vla_rt.triton_kernels import GemmConfig, Workspace, gemm  # noqa: E402
from vla_rt.triton_kernels.cublas_choice import cublas_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, N, K, GROUPS = 12, 24, 32, 3  # GROUPS: π0.5's batch elements, a bias / gate row each
TOL = 2e-3  # fp16: gate and up are rounded once more than in the fused epilogue


def _operands(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.float16).to(DEVICE)

    mod = rand(GROUPS, 3 * N)  # π0.5's modulation rows: bias and gate share one row stride (`gemm` checks it)
    return dict(
        a=rand(M, K), w=rand(2 * N, K, scale=K**-0.5), bias=rand(2 * N), bias_rows=mod[:, : 2 * N],
        out_scale_rows=mod[:, 2 * N :], residual=rand(M, N), row_scale=(torch.rand(M, generator=g) + 0.5).to(DEVICE),
    )  # fmt: skip


def _truth(x: dict, *, bias=None, row_scale=None, out_scale=None, residual=None) -> torch.Tensor:
    """float64: residual + out_scale * gelu_tanh(rs * gate + b_gate) * (rs * up + b_up), rows grouped for 2-D."""
    y = x["a"].double() @ x["w"].double().T
    if row_scale is not None:
        y = y * row_scale.double()[:, None]
    if bias is not None:
        y = y + (bias.double() if bias.dim() == 1 else bias.double().repeat_interleave(M // bias.shape[0], dim=0))
    gate, up = y[:, :N], y[:, N:]
    h = torch.nn.functional.gelu(gate, approximate="tanh") * up
    if out_scale is not None:
        h = h * out_scale.double().repeat_interleave(M // out_scale.shape[0], dim=0)
    return h + (residual.double() if residual is not None else 0)


FORMS = {
    "pi0_gate_up": lambda x: dict(row_scale=x["row_scale"]),
    "bias": lambda x: dict(bias=x["bias"], row_scale=x["row_scale"]),
    "pi05_rows_gate_residual": lambda x: dict(
        bias=x["bias_rows"], out_scale=x["out_scale_rows"], residual=x["residual"]
    ),  # fmt: skip
}


@pytest.mark.parametrize("form", list(FORMS))
def test_gated_form_meets_the_gemm_contract(form) -> None:
    x = _operands()
    kw = FORMS[form](x)
    truth = _truth(x, **kw)
    ws = Workspace(DEVICE)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
    if "residual" in kw:  # the engine's residual is its output (x += ...)
        out.copy_(kw["residual"])
        kw = {**kw, "residual": out}
    assert cublas_gemm(x["a"], x["w"], out, gated=True, workspace=ws, **kw)
    assert rel_err(out, truth) < TOL, rel_err(out, truth)
    fused = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
    if "residual" in kw:
        fused.copy_(x["residual"])
        kw = {**kw, "residual": fused}
    gemm(x["a"], x["w"], fused, gated=True, config=GemmConfig(16, 16, 16, 1, 1, 4, 1, 0, 0), **kw)
    assert rel_err(out, fused.double()) < TOL


def test_gated_form_refuses_what_it_cannot_express_and_writes_nothing() -> None:
    """float32 operands (the scratch holds 16-bit values) go to our kernels."""
    x = _operands()
    a, w = x["a"].float(), x["w"].float()
    out = torch.full((M, N), float("nan"), device=DEVICE)
    assert not cublas_gemm(a, w, out, gated=True, workspace=Workspace(DEVICE))
    assert out.isnan().all()


def test_a_wrong_gated_epilogue_fails_the_check() -> None:
    """The check above can fail: the form's output against the truth without the row scale, or with up and gate
    swapped."""
    x = _operands()
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
    assert cublas_gemm(x["a"], x["w"], out, gated=True, row_scale=x["row_scale"], workspace=Workspace(DEVICE))
    assert rel_err(out, _truth(x)) > 10 * TOL
    swapped = dict(x, w=torch.cat([x["w"][N:], x["w"][:N]]))
    assert rel_err(out, _truth(swapped, row_scale=x["row_scale"])) > 10 * TOL
