"""π0.5's two GEMM epilogue features in Triton's interpreter (fp32 and fp16; the interpreter's bf16 dots are wrong):
the output-column scale (the adaptive-norm gate, `x + y * gate`, before the residual) against `torch_ops.gemm(
out_scale=)`, and a bias in the RoPE epilogue (the folded shift of the pre-attention norm, added before the rotation)
against the GEMM with that bias followed by `rope_qk`. Every kernel the GEMM may run: the pointer kernel, both split-K
reductions, the TMA kernel and stream-K. A gate applied as `1 + gate` (the plausible bug) must fail the same check.

Then the same features as rows, one per batch element (the stage engine's rows at their own Euler steps): a (G, ·)
bias / out_scale / RMSNorm scale whose row r // (M / G) applies to output row r, given as strided views of one packed
buffer (as `Pi05Weights.rows` hands them out); one row used for every row (the plausible bug) must fail.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from vla_rt.engine import torch_ops  # noqa: E402
from vla_rt.numerics import rel_err
from vla_rt.triton_kernels import GemmConfig, gemm, rmsnorm, rope_qk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
CONFIGS = {
    "pointer": GemmConfig(16, 32, 16, split_k=1, group_m=2, num_stages=1),
    "split_k_last_program": GemmConfig(16, 32, 16, split_k=3, group_m=2, num_stages=1),
    "split_k_combine": GemmConfig(16, 32, 16, split_k=3, group_m=2, num_stages=1, combine=1),
    "tma_persistent": GemmConfig(16, 16, 16, num_stages=2, tma=2),
    "stream_k": GemmConfig(16, 16, 16, num_stages=2, tma=4),
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


G, S = 4, 5  # batch elements, rows each (S not a multiple of any tile: a tile spans several elements)


def _packed(g: torch.Generator, *widths: int) -> list[torch.Tensor]:
    """(G, width) float32 views into one (G, R) buffer, R = sum(widths) + 3: row stride R, unit column stride."""
    buf = torch.randn(G, sum(widths) + 3, generator=g).to(DEVICE)
    views, at = [], 1
    for width in widths:
        views.append(buf[:, at : at + width])
        at += width
    return views


@DTYPES
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gate_rows_before_the_residual(config, dtype):
    """o_proj / down_proj: `x += gate[b] ⊙ (a @ wᵀ)` in place, each row with its batch element's gate."""
    g = torch.Generator().manual_seed(0)
    m, n, k = G * S, 48, 40
    a = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    residual = torch.randn(m, n, generator=g).to(dtype).to(DEVICE)
    (gate,) = _packed(g, n)
    want = torch_ops.gemm(a, w, residual=residual, out_scale=gate, out_dtype=dtype)
    x = residual.clone()
    gemm(a, w, x, residual=x, out_scale=gate, config=CONFIGS[config])
    assert rel_err(x, want) <= TOL[dtype]
    one_row = torch_ops.gemm(a, w, residual=residual, out_scale=gate[0], out_dtype=dtype)
    assert rel_err(x, one_row) > 100 * TOL[dtype]


@DTYPES
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bias_rows_in_the_gated_epilogue(config, dtype):
    """gate_up: GeGLU(a @ wᵀ + bias[b]) with [gate; up] bias rows; the output-scale form in the same call order."""
    g = torch.Generator().manual_seed(1)
    m, n, k = G * S, 24, 32
    a = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    (bias,) = _packed(g, 2 * n)
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    gemm(a, w, out, gated=True, bias=bias, config=CONFIGS[config])
    assert rel_err(out, torch_ops.gemm(a, w, gated=True, bias=bias, out_dtype=dtype)) <= TOL[dtype]
    assert rel_err(out, torch_ops.gemm(a, w, gated=True, bias=bias[1], out_dtype=dtype)) > 100 * TOL[dtype]


@DTYPES
@pytest.mark.parametrize("config", list(ROPE_CONFIGS))
def test_bias_rows_before_the_rotation(config, dtype):
    """QKV: each batch element's folded shift added before RoPE, Q into `out`, K and V into that element's cache."""
    hq, hkv, d, k, offset = 4, 1, 32, 40, 3
    g = torch.Generator().manual_seed(7)
    n = (hq + 2 * hkv) * d
    a = torch.randn(G * S, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    (bias,) = _packed(g, n)
    ang = (torch.arange(S)[None, :, None] + 4 + 3 * torch.arange(G)[:, None, None]) * torch.rand(d // 2, generator=g)
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)

    def caches(dt):
        return [torch.full((G, offset + S + 1, hkv, d), float("nan"), dtype=dt, device=DEVICE) for _ in (0, 1)]

    def unfused(b):  # fp32 between the GEMM and the rotation
        qkv = torch.empty(G * S, n, device=DEVICE)
        gemm(a, w, qkv, bias=b, config=CONFIGS["pointer"])
        kc, vc = caches(torch.float32)
        rope_qk(qkv, cos, sin, kc, vc, cache_offset=offset, **heads)
        return qkv, kc, vc

    qkv, k32, v32 = unfused(bias)
    out = torch.full((G * S, n), float("nan"), dtype=dtype, device=DEVICE)
    kf, vf = caches(dtype)
    gemm(a, w, out, bias=bias, rope=dict(cos=cos, sin=sin, k_cache=kf, v_cache=vf, cache_offset=offset, **heads),
         config=ROPE_CONFIGS[config])  # fmt: skip
    rows = slice(offset, offset + S)
    assert rel_err(out[:, : hq * d], qkv[:, : hq * d]) <= TOL[dtype]
    assert rel_err(kf[:, rows], k32[:, rows]) <= TOL[dtype] and rel_err(vf[:, rows], v32[:, rows]) <= TOL[dtype]
    _, k_one, _ = unfused(bias[2])
    assert rel_err(kf[:, rows], k_one[:, rows]) > 100 * TOL[dtype]


@DTYPES
def test_rmsnorm_scale_rows(dtype):
    """The pre-attention / pre-FFN norm: rmsnorm(x) ⊙ (1 + scale[b]), one rounding."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(G * S, 64, generator=g).to(dtype).to(DEVICE)
    (scale,) = _packed(g, 64)
    out = torch.empty_like(x)
    rmsnorm(x, out, 1e-6, scale=scale)
    assert rel_err(out, torch_ops.rmsnorm(x.float(), 1e-6, scale).to(dtype)) <= TOL[dtype]
    assert rel_err(out, torch_ops.rmsnorm(x.float(), 1e-6, scale[0]).to(dtype)) > 100 * TOL[dtype]


def test_modulation_rows_are_checked_by_name():
    a, w = torch.randn(G * S, 16, device=DEVICE), torch.randn(16, 16, device=DEVICE)
    out = torch.empty(G * S, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"bias rows: expected \(G, 16\) with unit column stride and G dividing"):
        gemm(a, w, out, bias=torch.zeros(3, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"out_scale rows: expected \(G, 16\)"):
        gemm(a, w, out, out_scale=torch.zeros(16, G, device=DEVICE).T)
    with pytest.raises(ValueError, match="expected both 1-D or both 2-D"):
        gemm(a, w, out, bias=torch.zeros(16, device=DEVICE), out_scale=torch.zeros(G, 16, device=DEVICE))
    with pytest.raises(ValueError, match="the same row count and stride"):
        gemm(a, w, out, bias=torch.zeros(G, 16, device=DEVICE), out_scale=torch.zeros(G, 32, device=DEVICE)[:, :16])
    with pytest.raises(ValueError, match=r"scale rows: expected \(G, 16\)"):
        rmsnorm(a, out, 1e-6, scale=torch.zeros(3, 16, device=DEVICE))
