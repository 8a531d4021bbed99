"""`triton_kernels.cublas_choice`: which GEMMs go to cuBLAS (the table's own measurements) and that each epilogue
it takes computes what `gemm` promises. CPU: the same torch calls run there; the GPU test of the engines checks the
bf16 engines against the float32 reference with it on."""

from __future__ import annotations

import pytest
import torch

from vla_rt.triton_kernels import cublas_choice
from vla_rt.triton_kernels.cublas_choice import _cublas_faster, cublas_faster, cublas_gemm

M, N, K = 24, 40, 32


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) / K**0.5
    bias = torch.randn(N, generator=g, dtype=torch.float64)
    x = torch.randn(M, N, generator=g, dtype=torch.float64)
    return a, w, bias, x


FORMS = ["plain", "bias", "bias+gelu_tanh", "residual"]


def _check_form(form: str, device: str, dtype: torch.dtype, tol: float) -> None:
    """One epilogue form through `cublas_gemm` against float64: out = [residual +] act(a @ w.T [+ bias])."""
    a, w, bias, x = _operands()
    use_bias = "bias" in form
    activation = "gelu_tanh" if "gelu" in form else None
    expect = a @ w.T + (bias if use_bias else 0)
    if activation:
        expect = torch.nn.functional.gelu(expect, approximate="tanh")
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    residual = None
    if form.startswith("residual"):
        out.copy_(x)
        residual = out
        expect = expect + x
    to = dict(dtype=dtype, device=device)
    done = cublas_gemm(a.to(**to), w.to(**to), out, bias=bias.to(**to) if use_bias else None, activation=activation,
                       residual=residual)  # fmt: skip
    assert done
    err = ((out.cpu().double() - expect).norm() / expect.norm()).item()
    assert err <= tol, (form, err)


@pytest.mark.parametrize("form", [f for f in FORMS if "gelu" not in f])
def test_each_epilogue_cublas_takes_matches_the_gemm_contract(form) -> None:
    """float32 on the CPU (the same torch calls as on CUDA) against float64."""
    _check_form(form, "cpu", torch.float32, 1e-6)


def test_gelu_goes_to_cublas_only_on_cuda() -> None:
    """PyTorch's CPU `_addmm_activation` uses the exact GELU, not the tanh approximation `gemm` promises."""
    a, w, bias, _ = (t.float() for t in _operands())
    out = torch.zeros(M, N)
    assert not cublas_gemm(a, w, out, bias=bias, activation="gelu_tanh", residual=None)
    assert not out.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("form", FORMS)
def test_each_epilogue_on_cuda_matches_the_gemm_contract(form, dtype, tol) -> None:
    """On the GPU, cuBLAS / cuBLASLt (the GELU epilogue: the tanh approximation) against float64; float32 with
    TF32 off, as the engines keep it."""
    _check_form(form, "cuda", dtype, tol)


@pytest.mark.parametrize(
    "why, kwargs",
    [
        ("an activation cuBLAS has no epilogue for", dict(activation="silu")),
        ("gelu without a bias", dict(activation="gelu_tanh")),
        ("a residual that is not the output", dict(residual="other")),
        ("an output of another dtype", dict(out_dtype=torch.float64)),
        ("a strided output", dict(strided=True)),
        ("a gated GEMM", dict(extra=dict(gated=True))),
        ("a row-scaled GEMM", dict(extra=dict(row_scale=torch.ones(M)))),
        ("an out_scale", dict(extra=dict(out_scale=torch.ones(N)))),
        ("alpha", dict(extra=dict(alpha=0.5))),
        ("a periodic residual", dict(residual="out", extra=dict(residual_period=M))),
        ("a residual with a bias: two calls round the residual stream twice", dict(residual="out", bias=True)),
    ],
)
def test_what_one_cublas_call_does_not_express_is_left_alone(why, kwargs) -> None:
    """False, and `out` untouched: `gemm` then runs its own kernel."""
    a, w, bias, x = (t.float() for t in _operands())
    wide = torch.full((M, N + 8), 7.0, dtype=kwargs.get("out_dtype", torch.float32))
    out = wide[:, :N] if kwargs.get("strided") else wide[:, :N].contiguous()
    residual = {"out": out, "other": x, None: None}[kwargs.get("residual")]
    before = out.clone()
    done = cublas_gemm(a, w, out, bias=bias if kwargs.get("bias") else None, activation=kwargs.get("activation"),
                       residual=residual, **kwargs.get("extra", {}))  # fmt: skip
    assert not done, why
    assert torch.equal(out, before), why


def test_the_choice_follows_the_tables_measurements(monkeypatch) -> None:
    """cuBLAS only where its measured time is <= FASTER x ours (timed with the shape's epilogue when the entry has
    that, else the plain GEMM), at this M or the next tabled M above (the entry `gemm` would run), never for a shape
    the tuner did not time against it, never on a CPU, never when switched off."""
    table = {"gemm": {"bfloat16": {
        "512x2048x16384": {"us": 82.0, "torch_us": 54.5},  # cuBLAS 0.66x: taken
        "512x2560x2048": {"us": 10.0, "torch_us": 9.5},  # 0.95x: within noise, ours
        "512x1152x588": {"us": 5.6},  # never timed against cuBLAS
        "512x1152x1152": {"us": 7.6, "torch_us": 5.6, "cublas_us": 8.0},  # plain faster, with its epilogue not: ours
        "512x4304x1152": {"us": 18.0, "torch_us": 10.4, "cublas_us": 11.0},  # with its epilogue still faster
    }}}  # fmt: skip
    monkeypatch.setattr(cublas_choice, "load_table", lambda gpu: table)
    _cublas_faster.cache_clear()
    try:
        assert _cublas_faster(512, 2048, 16384, "bfloat16", "GPU")
        assert _cublas_faster(500, 2048, 16384, "bfloat16", "GPU")  # 500 rows run the 512-row entry
        assert not _cublas_faster(600, 2048, 16384, "bfloat16", "GPU")  # no entry at or above 600
        assert not _cublas_faster(512, 2560, 2048, "bfloat16", "GPU")
        assert not _cublas_faster(512, 1152, 588, "bfloat16", "GPU")
        assert not _cublas_faster(512, 1152, 1152, "bfloat16", "GPU")
        assert _cublas_faster(512, 4304, 1152, "bfloat16", "GPU")
        assert not _cublas_faster(512, 2048, 16384, "float32", "GPU")
    finally:
        _cublas_faster.cache_clear()
    assert not cublas_faster(512, 2048, 16384, torch.bfloat16, torch.device("cpu"))
    rope_table = {"gemm": {"bfloat16": {
        "408x2560x1024:rope": {"us": 11.7, "torch_us": 6.1, "cublas_us": 8.4},  # cuBLAS + rope_qk timed: taken
        "64x2560x1024:rope": {"us": 5.8, "torch_us": 4.0},  # only the plain GEMM timed: never taken
        "64x2560x1024": {"us": 9.0, "torch_us": 4.0},  # the plain entry does not decide a RoPE GEMM
    }}}  # fmt: skip
    monkeypatch.setattr(cublas_choice, "load_table", lambda gpu: rope_table)
    _cublas_faster.cache_clear()
    try:
        assert _cublas_faster(408, 2560, 1024, "bfloat16", "GPU", True)
        assert not _cublas_faster(64, 2560, 1024, "bfloat16", "GPU", True)
        assert _cublas_faster(64, 2560, 1024, "bfloat16", "GPU", False)
    finally:
        _cublas_faster.cache_clear()
    monkeypatch.setenv(cublas_choice.ENV, "off")
    assert not cublas_faster(512, 2048, 16384, torch.bfloat16, torch.device("cuda"))
    monkeypatch.setenv(cublas_choice.ENV, "always")
    with pytest.raises(ValueError, match="VLA_RT_GEMM_CUBLAS: expected 'auto' or 'off', found 'always'"):
        cublas_faster(512, 2048, 16384, torch.bfloat16, torch.device("cuda"))
