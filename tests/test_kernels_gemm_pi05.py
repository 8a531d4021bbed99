"""π0.5's two GEMM epilogue features in Triton's interpreter (fp32 and fp16; the interpreter's bf16 dots are wrong):
the output-column scale (the adaptive-norm gate, `x + y * gate`, before the residual) against `torch_ops.gemm(
out_scale=)`, and a bias in the RoPE epilogue (the folded shift of the pre-attention norm, added before the rotation)
against the GEMM with that bias followed by `rope_qk`. Every kernel the GEMM may run: the pointer kernel, both split-K
reductions and the TMA kernel. A gate applied as `1 + gate` (the plausible bug) must fail the same check.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from vla_rt.engine import torch_ops  # noqa: E402
from vla_rt.numerics import rel_err
from vla_rt.triton_kernels import GemmConfig, gemm, rope_qk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
CONFIGS = {
    "pointer": GemmConfig(16, 32, 16, split_k=1, group_m=2, num_stages=1),
    "split_k_last_program": GemmConfig(16, 32, 16, split_k=3, group_m=2, num_stages=1),
    "split_k_combine": GemmConfig(16, 32, 16, split_k=3, group_m=2, num_stages=1, combine=1),
    "tma_persistent": GemmConfig(16, 16, 16, num_stages=2, tma=2),
}


def _tensors(m, n, k, dtype, seed=0, gated=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n * (2 if gated else 1), k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    gate = (torch.randn(n, generator=g) * 0.7).to(DEVICE)  # signed, around 0 like π0.5's gates
    residual = torch.randn(m, n, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(n * (2 if gated else 1), generator=g).to(DEVICE)
    return a, w, gate, residual, bias


@DTYPES
@pytest.mark.parametrize("config", list(CONFIGS))
def test_out_scale_matches_torch_ops_before_the_residual(config, dtype):
    """o_proj / down_proj of π0.5's expert: `x += gate ⊙ (a @ wᵀ)` in place (residual aliasing out)."""
    a, w, gate, residual, _ = _tensors(20, 48, 40, dtype)
    want = torch_ops.gemm(a, w, residual=residual, out_scale=gate, out_dtype=dtype)
    x = residual.clone()
    gemm(a, w, x, residual=x, out_scale=gate, config=CONFIGS[config])
    assert rel_err(x, want) <= TOL[dtype]
    broken = torch_ops.gemm(a, w, residual=residual, out_scale=1.0 + gate, out_dtype=dtype)  # gate as 1 + gate
    assert rel_err(x, broken) > 100 * TOL[dtype]


def test_out_scale_comes_after_the_activation_and_alpha():
    """The documented order: row scale, bias, GeGLU, alpha, out_scale, residual (fp32, with every term on)."""
    a, w, gate, residual, bias = _tensors(12, 24, 32, torch.float32, seed=3, gated=True)
    row_scale = torch.rand(12, generator=torch.Generator().manual_seed(4)).to(DEVICE) + 0.5
    gate16 = gate.half()  # any float dtype: read as fp32
    kw = dict(bias=bias, row_scale=row_scale, gated=True, alpha=-0.25, residual=residual)
    out = torch.empty(12, 24, device=DEVICE)
    gemm(a, w, out, out_scale=gate16, config=CONFIGS["pointer"], **kw)
    assert rel_err(out, torch_ops.gemm(a, w, out_scale=gate16, **kw)) <= TOL[torch.float32]


def test_out_scale_rejects_a_wrong_shape():
    a, w, gate, _, _ = _tensors(8, 16, 16, torch.float32)
    out = torch.empty(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="out_scale must be contiguous \\(16,\\)"):
        gemm(a, w, out, out_scale=torch.ones(17, device=DEVICE))
    with pytest.raises(ValueError, match="out_scale must be contiguous"):
        gemm(a, w, out, out_scale=torch.ones(32, device=DEVICE)[::2])


ROPE_CONFIGS = {
    "pointer": GemmConfig(16, 16, 16, split_k=1, num_stages=1),
    "split_k_last_program": GemmConfig(16, 16, 16, split_k=3, num_stages=1),
    "split_k_combine": GemmConfig(16, 16, 16, split_k=3, combine=1),
    "tma_persistent": GemmConfig(16, 16, 16, num_stages=2, tma=2),
}


@DTYPES
@pytest.mark.parametrize("config", list(ROPE_CONFIGS))
def test_rope_epilogue_with_bias_equals_gemm_with_bias_then_rope_qk(config, dtype):
    """π0.5's QKV GEMM: RMSNorm-ed rows (no row scale), the step's shift bias, RoPE into the cache rows."""
    b, t, hq, hkv, d, k, offset = 2, 5, 4, 1, 32, 40, 3
    g = torch.Generator().manual_seed(7)
    a = torch.randn(b * t, k, generator=g).to(dtype).to(DEVICE)
    n = (hq + 2 * hkv) * d
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    ang = (torch.arange(t)[None, :, None] + 4 + 3 * torch.arange(b)[:, None, None]) * torch.rand(d // 2, generator=g)
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)

    def caches():
        return [torch.full((b, offset + t + 1, hkv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in (0, 1)]

    qkv = torch.empty(b * t, n, dtype=torch.float32, device=DEVICE)  # unfused: fp32 between GEMM and RoPE
    gemm(a, w, qkv, bias=bias)
    kr, vr = caches()
    k32, v32 = (torch.full(c.shape, float("nan"), device=DEVICE) for c in (kr, vr))
    rope_qk(qkv, cos, sin, k32, v32, cache_offset=offset, **heads)
    out = torch.full((b * t, n), float("nan"), dtype=dtype, device=DEVICE)
    kf, vf = caches()
    rope = dict(cos=cos, sin=sin, k_cache=kf, v_cache=vf, cache_offset=offset, **heads)
    gemm(a, w, out, bias=bias, rope=rope, config=ROPE_CONFIGS[config])
    rows = slice(offset, offset + t)
    assert rel_err(out[:, : hq * d], qkv[:, : hq * d]) <= TOL[dtype]
    assert rel_err(kf[:, rows], k32[:, rows]) <= TOL[dtype] and rel_err(vf[:, rows], v32[:, rows]) <= TOL[dtype]
    assert kf[:, :offset].isnan().all() and kf[:, offset + t :].isnan().all()
    # the bias must be added before the rotation: adding it after (to the rotated values) fails the check
    plain = torch.empty(b * t, n, device=DEVICE)
    gemm(a, w, plain)
    k_after, v_after = (torch.full(c.shape, float("nan"), device=DEVICE) for c in (kr, vr))
    rope_qk(plain, cos, sin, k_after, v_after, cache_offset=offset, **heads)
    k_after[:, rows] += bias[hq * d : (hq + hkv) * d].view(1, 1, hkv, d)
    assert rel_err(kf[:, rows], k_after[:, rows]) > 100 * TOL[dtype]


def test_rope_still_refuses_out_scale():
    a, w = torch.randn(8, 16, device=DEVICE), torch.randn(48, 16, device=DEVICE)
    cache, tab = torch.empty(2, 6, 1, 8, device=DEVICE), torch.zeros(4, 4, device=DEVICE)
    rope = dict(cos=tab, sin=tab, k_cache=cache, v_cache=cache.clone(), num_q_heads=4, num_kv_heads=1, head_dim=8,
                cache_offset=2)  # fmt: skip
    with pytest.raises(ValueError, match="rope takes only row_scale and bias"):
        gemm(a, w, torch.empty(8, 48, device=DEVICE), rope=rope, out_scale=torch.ones(48, device=DEVICE))
