"""The fused GEMM variants against the kernels they replace, in Triton's interpreter (fp32 and fp16) on the CPU.

`gemm(..., rms_eps=eps)` must equal `rms_factor` + `gemm(..., row_scale=factor)`; `gemm(..., rope=r)` must equal
`gemm` + `rope_qk(out, **r)` (Q rotated in place, rotated K and plain V in the cache rows) — in fp32, where the
unfused path rounds nothing in between, elementwise within the worst-case bound of fp32 rounding done in another
order (`rounding_bound`: the summation order of the K loop and FMA contraction differ between the two kernels and
between Triton releases) — with every
split-K reduction, tiles that straddle heads and
the Q/K/V boundaries, odd shapes, batch rows with their own positions and the pruned K/V-only layer. A set of
deliberately broken RoPE variants must fail the same check.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from vla_rt.triton_kernels import GemmConfig, Workspace, gemm, rms_factor, rope_qk  # noqa: E402
from vla_rt.triton_kernels import launch_configs as lc  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
SPLIT3 = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=3, group_m=2, num_stages=1)
SPLIT3_COMBINE = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=3, group_m=2, num_stages=1, combine=1)
EPS = 1e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def activations(m, k, dtype, seed=0, row_stride=None):
    """Rows with an offset and per-row spread (so the RMS factor matters), as a view with row stride >= k."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(m, row_stride or k, generator=g) * (torch.rand(m, 1, generator=g) * 3 + 0.2) + 0.5
    return base.to(dtype).to(DEVICE)[:, :k]


def weights(n, k, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------------------------ RMS factor

RMS_CASES = {
    # name: (M, N, K, gemm kwargs (True = make the tensor), config)
    "plain": (37, 45, 70, dict(), None),
    "gated_bias": (19, 24, 40, dict(gated=True, bias=True), None),
    "action_out_euler": (21, 32, 48, dict(bias=True, alpha=-0.1, residual=True), None),
    "silu_bias": (20, 33, 48, dict(bias=True, activation="silu"), None),
    "k_below_block": (9, 17, 5, dict(bias=True), None),
    "many_row_tiles_grouped": (70, 80, 24, dict(), GemmConfig(16, 16, 16, split_k=1, group_m=3, num_stages=1)),
    "split_k_gated_residual": (19, 45, 70, dict(gated=True, bias=True, residual=True), SPLIT3),
    "split_k_combine_kernel": (19, 45, 70, dict(gated=True, bias=True, residual=True), SPLIT3_COMBINE),
    "split_k_empty_splits": (21, 40, 20, dict(bias=True), GemmConfig(16, 32, 16, split_k=4, num_stages=1)),
    "combine_empty_splits": (21, 40, 20, dict(bias=True), GemmConfig(16, 32, 16, split_k=4, combine=1)),
}


@DTYPES
@pytest.mark.parametrize("case", list(RMS_CASES))
def test_fused_rms_equals_rms_factor_then_row_scale(case, dtype):
    m, n, k, opts, config = RMS_CASES[case]
    a = activations(m, k, dtype, row_stride=k + 8)  # a strided view: the sum of squares must not read past K
    n_w = 2 * n if opts.get("gated") else n
    w = weights(n_w, k, dtype)
    kw = dict(gated=opts.get("gated", False), activation=opts.get("activation"), alpha=opts.get("alpha", 1.0))
    if opts.get("bias"):
        kw["bias"] = torch.randn(n_w, device=DEVICE).to(dtype)
    residual = torch.randn(m, n, device=DEVICE).to(dtype) if opts.get("residual") else None

    factor = nan(m)
    rms_factor(a, factor, EPS)
    unfused = nan(m, n, dtype=dtype)
    gemm(a, w, unfused, row_scale=factor, residual=residual, config=config, **kw)
    fused = nan(m, n, dtype=dtype)
    gemm(a, w, fused, rms_eps=EPS, residual=residual, config=config, **kw)
    assert torch.isfinite(fused).all()
    assert rel_err(fused, unfused) < TOL[dtype]
    # and against float64 RMSNorm (scale folded into w) then the GEMM: the factor is the norm's, not just consistent
    exact = torch.rsqrt(a.double().square().mean(-1) + EPS)
    y = (a.double() @ w.double().T) * exact[:, None]
    if "bias" in kw:
        y = y + kw["bias"].double()
    if kw["gated"]:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.gelu(gate, approximate="tanh") * up
    elif kw["activation"] == "silu":
        y = torch.nn.functional.silu(y)
    y = kw["alpha"] * y + (residual.double() if residual is not None else 0)
    assert rel_err(fused, y) < TOL[dtype]


def test_fused_rms_euler_step_in_place():
    """The action projection: fp16 rows, fp32 x_t updated in place (`out` aliases `residual`), factor fused."""
    a, w = activations(21, 48, torch.float16), weights(32, 48, torch.float16)
    bias = torch.randn(32, device=DEVICE).half()
    x = torch.randn(21, 32, device=DEVICE)
    expected = x.clone()
    factor = torch.empty(21, device=DEVICE)
    rms_factor(a, factor, EPS)
    gemm(a, w, expected, bias=bias, row_scale=factor, alpha=-0.1, residual=expected)
    for config in (None, SPLIT3, SPLIT3_COMBINE):
        y = x.clone()
        gemm(a, w, y, bias=bias, rms_eps=EPS, alpha=-0.1, residual=y, config=config)
        assert rel_err(y, expected) < 1e-6


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_fused_rms_split_k_deterministic_and_reductions_agree_bitwise(gated):
    a = activations(19, 70, torch.float32)
    w = weights(90 if gated else 45, 70, torch.float32)
    outs = []
    for cfg in (SPLIT3, SPLIT3, SPLIT3_COMBINE):
        ws = Workspace(DEVICE)
        out = nan(19, 45)
        gemm(a, w, out, gated=gated, rms_eps=EPS, config=cfg, workspace=ws)
        assert int(ws.counters(0).abs().sum()) == 0  # ready for the next launch / graph replay
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ------------------------------------------------------------------------------------------------------- RoPE


def rope_case(b, t, hq, hkv, d, k, dtype, *, per_batch, offset, t_cache, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = activations(b * t, k, dtype, seed=seed, row_stride=-(-k // 8) * 8 + 8)
    w = weights((hq + 2 * hkv) * d, k, dtype, seed=seed + 1)
    freq = 10_000 ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    pos = torch.arange(t, dtype=torch.float64) + 5
    if per_batch:
        pos = pos[None] + 3 * torch.arange(b, dtype=torch.float64)[:, None]  # each batch row its own positions
    ang = pos[..., None] * freq
    cos, sin = ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)
    row_scale = (torch.rand(b * t, generator=g) + 0.5).to(DEVICE)
    caches = {n: nan(b, t_cache, hkv, d, dtype=dtype) for n in ("k", "v", "k_fused", "v_fused")}
    return a, w, cos, sin, row_scale, caches


def rope_float64(a, w, cos, sin, factor, b, hq, hkv, d, q_scale):
    """Float64 truth: (Q rotated * q_scale, K rotated, V) per (batch, token, head)."""
    t = a.shape[0] // b
    x = ((a.double() @ w.double().T) * factor.double()[:, None]).view(b, t, hq + 2 * hkv, d)
    c = (cos if cos.dim() == 3 else cos.expand(b, t, -1))[:, :, None].double()
    s = (sin if sin.dim() == 3 else sin.expand(b, t, -1))[:, :, None].double()
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return rot[:, :, :hq] * q_scale, rot[:, :, hq : hq + hkv], x[:, :, hq + hkv :]


def rounding_bound(a, w, factor, b, hq, hkv, d, q_scale):
    """Per-element bound on |fused - unfused| in fp32, for (Q, K, V): both paths compute the same math in fp32.

    What may differ is the order of rounding, not the formulas: the fused epilogue accumulates each head's two
    halves as separate tiles, so its K-loop sums (and Triton's interpreter, numpy's matmul blocking) may add in
    another order. Standard bounds (u = 2^-24, the unit roundoff; gamma_K = K u / (1 - K u)):
    - a length-K fp32 dot product is within gamma_K * sum|a||w| of exact, so two orders differ by 2 gamma_K sum|a||w|;
    - times the row factor: one rounding each, 2u|x|;
    - the rotation y = x1*c - x2*s (|c|, |s| <= 1), two roundings or one FMA: 2u(|x1| + |x2|) each, 4u(...) apart;
    - q_scale is a power of two (exact). V is not rotated: its bound has the first two terms only.
    """
    k = a.shape[1]
    u = 2.0**-24
    gamma = k * u / (1 - k * u)
    t = a.shape[0] // b
    f = factor.double().abs()[:, None]
    x = ((a.double() @ w.double().T) * factor.double()[:, None]).abs().view(b, t, hq + 2 * hkv, d)
    dot = ((a.double().abs() @ w.double().abs().T) * f).view(b, t, hq + 2 * hkv, d)
    plain = 2 * gamma * dot + 2 * u * x  # the GEMM and the factor, per element
    p1, p2 = plain.chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    half = p1 + p2 + 4 * u * (x1 + x2)  # either rotated output mixes both halves' errors
    rotated = torch.cat([half, half], dim=-1) * (1 + 1e-6)  # 1e-6: fp32 vs float64 magnitudes
    return rotated[:, :, :hq] * q_scale, rotated[:, :, hq : hq + hkv], plain[:, :, hq + hkv :] * (1 + 1e-6)


def check_rope(out, k_cache, v_cache, expected_q, expected_k, expected_v, offset, b, hq, hkv, d, *, tol, bounds=None):
    """The fused GEMM's contract: Q in out's first Hq*D columns, K/V in cache rows offset.. only, nothing else.

    `bounds` (per-element absolute bounds for Q, K, V) replaces the relative tolerance where the math gives one.
    """
    t = out.shape[0] // b
    q = out.view(b, t, -1)[:, :, : hq * d].reshape(b, t, hq, d)
    k_rows, v_rows = k_cache[:, offset : offset + t], v_cache[:, offset : offset + t]
    for i, (got, want) in enumerate(((q, expected_q), (k_rows, expected_k), (v_rows, expected_v))):
        assert got.shape == want.shape
        if got.numel() == 0:  # no Q heads (the K/V-only layer)
            continue
        if bounds is not None:
            excess = (got.double() - want.double()).abs() - bounds[i].to(got.device)
            assert excess.max().item() <= 0, f"{'QKV'[i]} beyond the rounding bound by {excess.max().item():.3g}"
        else:
            assert rel_err(got, want) < tol
    assert out[:, hq * d :].isnan().all()  # the K/V columns of the QKV buffer are not written
    for cache in (k_cache, v_cache):  # rows outside the slice untouched
        assert cache[:, :offset].isnan().all() and cache[:, offset + t :].isnan().all()


ROPE_CASES = {
    # name: (b, t, hq, hkv, d, k, per_batch cos/sin, cache offset, config)
    "gqa_batch_per_row_positions": (2, 5, 4, 1, 24, 40, True, 4, None),
    "mha_shared_table": (1, 7, 2, 2, 16, 33, False, 0, None),
    "tiles_straddle_heads": (2, 5, 4, 1, 24, 40, True, 3, GemmConfig(16, 16, 16, split_k=1, num_stages=1)),
    "wide_tile_tables_in_epilogue": (2, 5, 4, 1, 24, 40, True, 4, GemmConfig(64, 128, 16, split_k=1, num_stages=1)),
    "kv_only_pruned_layer": (2, 5, 0, 1, 24, 40, False, 2, GemmConfig(16, 16, 16, split_k=1, num_stages=1)),
    "split_k_last_program": (2, 5, 4, 1, 24, 40, True, 4, GemmConfig(16, 16, 16, split_k=3, num_stages=1)),
    "split_k_combine_kernel": (2, 5, 4, 1, 24, 40, True, 4, GemmConfig(16, 16, 16, split_k=3, combine=1)),
    "pi0_heads_small": (1, 9, 8, 1, 16, 64, False, 6, None),  # the tiny preset's 8 + 1 + 1 heads of 16
    # the TMA kernel (row_scale only; rms_eps falls back to the pointer kernel): 16-column tiles in 16-wide halves
    "tma_one_tile_a_program": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, num_stages=2, tma=1)),
    "tma_persistent": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, num_stages=2, tma=2)),
    "tma_flattened_split_k_combine": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, 3, combine=1, tma=3)),
    "tma_stream_k": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, num_stages=2, tma=4)),
    "tma_tile_straddles_heads_falls_back": (2, 5, 4, 1, 24, 40, True, 4, GemmConfig(16, 16, 16, tma=2)),
}


@DTYPES
@pytest.mark.parametrize("norm", ["row_scale", "rms_eps"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_fused_rope_equals_gemm_then_rope_qk(case, norm, dtype):
    b, t, hq, hkv, d, k, per_batch, offset, config = ROPE_CASES[case]
    a, w, cos, sin, row_scale, caches = rope_case(b, t, hq, hkv, d, k, dtype, per_batch=per_batch, offset=offset,
                                                  t_cache=offset + t + 2)  # fmt: skip
    q_scale = 0.5 if hq else 1.0
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    factor = row_scale
    if norm == "rms_eps":
        factor = torch.empty(b * t, device=DEVICE)
        rms_factor(a, factor, EPS)
    # the path it replaces: GEMM into the QKV buffer, then rope_qk
    qkv = nan(b * t, (hq + 2 * hkv) * d, dtype=dtype)
    gemm(a, w, qkv, row_scale=factor, config=config)
    rope_qk(qkv, cos, sin, caches["k"], caches["v"], cache_offset=offset, q_scale=q_scale, **heads)
    # fused
    out = nan(b * t, (hq + 2 * hkv) * d, dtype=dtype)
    rope = dict(cos=cos, sin=sin, k_cache=caches["k_fused"], v_cache=caches["v_fused"], cache_offset=offset,
                q_scale=q_scale, **heads)  # fmt: skip
    kw = {"rms_eps": EPS} if norm == "rms_eps" else {"row_scale": row_scale}
    gemm(a, w, out, rope=rope, config=config, **kw)

    unfused_q = qkv.view(b, t, -1)[:, :, : hq * d].reshape(b, t, hq, d)
    unfused = (unfused_q, caches["k"][:, offset : offset + t], caches["v"][:, offset : offset + t])
    # fp32 with the given row scale: nothing is rounded between GEMM and RoPE in the unfused path either, so the
    # two differ only by the order of fp32 roundings (bounded elementwise, tighter than a relative tolerance)
    bounds = None
    if dtype == torch.float32 and norm == "row_scale":
        bounds = rounding_bound(a, w, factor, b, hq, hkv, d, q_scale)
    check_rope(out, caches["k_fused"], caches["v_fused"], *unfused, offset, b, hq, hkv, d, tol=TOL[dtype],
               bounds=bounds)  # fmt: skip
    truth = rope_float64(a, w, cos, sin, factor, b, hq, hkv, d, q_scale)
    check_rope(out, caches["k_fused"], caches["v_fused"], *truth, offset, b, hq, hkv, d, tol=TOL[dtype])


def _broken_variants(x, c, s, hq, hkv, q_scale):
    """RoPE implementations with one plausible bug each, as (name, (q, k, v)) in float64."""
    x1, x2 = x.chunk(2, dim=-1)

    def halves(y1, y2):
        return torch.cat([y1, y2], dim=-1)

    right = halves(x1 * c - x2 * s, x2 * c + x1 * s)
    ev, od = x[..., 0::2], x[..., 1::2]  # rotation on adjacent pairs (2j, 2j+1): the interleaved convention
    inter = torch.stack([ev * c - od * s, od * c + ev * s], dim=-1).flatten(-2)
    backwards = halves(x1 * c + x2 * s, x2 * c - x1 * s)
    swapped_halves = halves(x2 * c + x1 * s, x1 * c - x2 * s)
    q, k, v = slice(0, hq), slice(hq, hq + hkv), slice(hq + hkv, None)
    return {
        "adjacent_pairs": (inter[:, :, q] * q_scale, inter[:, :, k], x[:, :, v]),
        "rotation_backwards": (backwards[:, :, q] * q_scale, backwards[:, :, k], x[:, :, v]),
        "halves_swapped": (swapped_halves[:, :, q] * q_scale, swapped_halves[:, :, k], x[:, :, v]),
        "k_not_rotated": (right[:, :, q] * q_scale, x[:, :, k], x[:, :, v]),
        "v_rotated": (right[:, :, q] * q_scale, right[:, :, k], right[:, :, v]),
        "q_scale_on_k_too": (right[:, :, q] * q_scale, right[:, :, k] * q_scale, x[:, :, v]),
        "q_not_scaled": (right[:, :, q], right[:, :, k], x[:, :, v]),
    }


def test_broken_rope_variants_fail_the_check():
    """The check above must reject a kernel that rotates the wrong pairs, the wrong way, the wrong heads, or writes
    the wrong cache rows: run it on the fused kernel's real output against each broken expectation."""
    b, t, hq, hkv, d, k, offset = 2, 5, 4, 1, 24, 40, 4
    a, w, cos, sin, row_scale, caches = rope_case(b, t, hq, hkv, d, k, torch.float32, per_batch=True,
                                                  offset=offset, t_cache=offset + t + 2)  # fmt: skip
    out = nan(b * t, (hq + 2 * hkv) * d)
    rope = dict(cos=cos, sin=sin, k_cache=caches["k_fused"], v_cache=caches["v_fused"], cache_offset=offset,
                q_scale=0.5, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)  # fmt: skip
    gemm(a, w, out, row_scale=row_scale, rope=rope)
    check_args = (offset, b, hq, hkv, d)
    truth = rope_float64(a, w, cos, sin, row_scale, b, hq, hkv, d, 0.5)
    check_rope(out, caches["k_fused"], caches["v_fused"], *truth, *check_args, tol=1e-5)

    x = ((a.double() @ w.double().T) * row_scale.double()[:, None]).view(b, t, hq + 2 * hkv, d)
    c, s = cos[:, :, None].double(), sin[:, :, None].double()
    for name, expected in _broken_variants(x, c, s, hq, hkv, 0.5).items():
        try:
            check_rope(out, caches["k_fused"], caches["v_fused"], *expected, *check_args, tol=1e-5)
        except AssertionError:
            continue
        pytest.fail(f"the broken variant {name!r} passes the check")
    # K/V written one cache row off, or Q/K columns left unwritten: caught by the same check
    shifted = caches["k_fused"].clone()
    shifted[:, offset + 1 : offset + t + 1] = caches["k_fused"][:, offset : offset + t]
    with pytest.raises(AssertionError):
        check_rope(out, shifted, caches["v_fused"], *truth, *check_args, tol=1e-5)
    leaked = out.clone()
    leaked[:, hq * d :] = 0.0
    with pytest.raises(AssertionError):
        check_rope(leaked, caches["k_fused"], caches["v_fused"], *truth, *check_args, tol=1e-5)


def test_fused_rope_split_k_deterministic_and_reductions_agree_bitwise():
    b, t, hq, hkv, d, k = 2, 5, 4, 1, 24, 40
    a, w, cos, sin, _, _ = rope_case(b, t, hq, hkv, d, k, torch.float32, per_batch=True, offset=0, t_cache=t)
    results = []
    for cfg in (GemmConfig(16, 16, 16, split_k=3, num_stages=1),) * 2 + (GemmConfig(16, 16, 16, 3, combine=1),):
        ws = Workspace(DEVICE)
        out, kc, vc = nan(b * t, 144), nan(b, t, 1, d), nan(b, t, 1, d)
        rope = dict(cos=cos, sin=sin, k_cache=kc, v_cache=vc, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        gemm(a, w, out, rms_eps=EPS, rope=rope, config=cfg, workspace=ws)
        assert int(ws.counters(0).abs().sum()) == 0
        results.append((out[:, : hq * d], kc, vc))
    for r in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(r, results[0]))


@pytest.mark.parametrize(
    "bad",
    [
        lambda a, w, o, r, f: gemm(a, w, o, rms_eps=EPS, row_scale=f),  # both
        lambda a, w, o, r, f: gemm(a, w, o, rope=r, bias=torch.zeros(w.shape[0], device=DEVICE)),
        lambda a, w, o, r, f: gemm(a, w, o, rope=r, alpha=0.5),
        lambda a, w, o, r, f: gemm(a, w, o, rope=r, residual=o),
        lambda a, w, o, r, f: gemm(a, w, o, rope=r, activation="silu"),
        lambda a, w, o, r, f: gemm(a, w, o, rope={**r, "num_q_heads": 3}),  # out width != (Hq + 2 Hkv) D
        lambda a, w, o, r, f: gemm(a, w, o, rope={**r, "cache_offset": 3}),  # cache rows out of range
        lambda a, w, o, r, f: gemm(
            a, w, o, rope={**r, "v_cache": r["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)}
        ),  # other strides  # fmt: skip
        lambda a, w, o, r, f: gemm(a, w, o, rope={**r, "cos": r["cos"][:, :-1]}),
        lambda a, w, o, r, f: gemm(a, w, o, rope={k: v for k, v in r.items() if k != "sin"}),
        lambda a, w, o, r, f: gemm(a, w, o, rope={**r, "sine": r["sin"]}),
    ],
)
def test_fused_gemm_rejects_bad_inputs(bad):
    a, w, o = torch.randn(8, 16, device=DEVICE), torch.randn(48, 16, device=DEVICE), torch.empty(8, 48, device=DEVICE)
    cache = torch.empty(2, 6, 1, 8, device=DEVICE)
    tab = torch.zeros(4, 4, device=DEVICE)
    r = dict(cos=tab, sin=tab, k_cache=cache, v_cache=cache.clone(), num_q_heads=4, num_kv_heads=1, head_dim=8,
             cache_offset=2)  # fmt: skip
    with pytest.raises(ValueError):
        bad(a, w, o, r, torch.ones(8, device=DEVICE))


# ------------------------------------------------------------------------------------------------ launch configs


def test_fused_keys_and_lookup_fallbacks(config_dir):
    assert lc.gemm_key(64, 2560, 1024, False, rms=True, rope=True) == "64x2560x1024:rms:rope"
    assert lc.gemm_key(64, 4096, 1024, True, rms=True) == "64x4096x1024:gated:rms"
    assert lc.gemm_key(64, 2560, 1024, False) == "64x2560x1024"  # the unfused keys are unchanged
    plain = dict(block_m=64, block_n=32, block_k=128, split_k=1, group_m=1, num_warps=4, num_stages=5)
    tuned_rope = {**plain, "block_n": 64, "num_stages": 3}
    table = {"gemm": {"bfloat16": {"64x2560x1024": plain, "64x4096x1024:gated": plain,
                                   "64x1024x2048:rms:rope": tuned_rope}}}  # fmt: skip
    (config_dir / "Test-GPU.json").write_text(lc.dump_table(table))

    def look(m, n, k, gated=False, rms=False, rope=False):
        return lc._gemm_config_cuda(m, n, k, gated, torch.bfloat16, "Test-GPU", 132, rms, rope)

    assert look(64, 2560, 1024, rms=True) == lc.GemmConfig.from_dict(plain)  # same tiles, plus the sum of squares
    assert look(51, 4096, 1024, gated=True, rms=True) == lc.GemmConfig.from_dict(plain)
    transferred = look(64, 2560, 1024, rms=True, rope=True)  # pairs: half the columns, same weight rows a tile
    assert (transferred.block_n, transferred.block_k, transferred.split_k) == (16, 128, 1)
    assert (64 + 2 * 16) * 128 * 2 * transferred.num_stages <= lc.SMEM_BYTES
    assert look(64, 1024, 2048, rms=True, rope=True) == lc.GemmConfig.from_dict(tuned_rope)  # exact entry
    assert look(64, 1024, 2048, rope=True) == lc.GemmConfig.from_dict(tuned_rope)  # rms or not: same tiling
    assert look(64, 512, 1024, rope=True) == lc.gemm_heuristic(64, 256, 1024, gated=True)  # nothing tabled: pairs
    cpu = lc.gemm_config(64, 2560, 1024, gated=False, dtype=torch.float32, device="cpu", rope=True)
    assert cpu == lc.gemm_config(64, 1280, 1024, gated=False, dtype=torch.float32, device="cpu")


MUTATIONS = {
    # (module, text, replacement)
    # the pair mapping of the K loop: columns (h*D + 2i, h*D + 2i + 1), the interleaved convention, instead of halves
    "adjacent_pairs": (
        "gemm",
        "rows_w = (rows_w // ROPE_HALF) * (2 * ROPE_HALF) + rows_w % ROPE_HALF\n        up_offset = ROPE_HALF * stride_wn",
        "rows_w = (rows_w // ROPE_HALF) * (2 * ROPE_HALF) + 2 * (rows_w % ROPE_HALF)\n        up_offset = stride_wn",
    ),
    "rotation_backwards": ("gemm_epilogue", "r1 = x1 * cos - x2 * sin", "r1 = x1 * cos + x2 * sin"),
    "k_cache_row_off_by_one": (
        "gemm_epilogue",
        "(cache_offset + t) * stride_kv_t",
        "(cache_offset + t + 1) * stride_kv_t",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutated_kernel_fails_the_rope_check(mutation, tmp_path, monkeypatch):
    """A copy of gemm.py (with its epilogue module) with one deliberate bug must fail the check that the real
    kernel passes."""
    import importlib.util
    import sys
    from pathlib import Path

    real = sys.modules["vla_rt.triton_kernels.gemm"]  # (the package's `gemm` attribute is the function)

    module, old, new = MUTATIONS[mutation]
    sources = {name: Path(real.__file__).with_name(f"{name}.py").read_text() for name in ("gemm_epilogue", "gemm")}
    assert sources[module].count(old) == 1, f"mutation {mutation!r} no longer applies: update it with the kernel"
    sources[module] = sources[module].replace(old, new)
    epilogue_name = f"gemm_epilogue_{mutation}"
    sources["gemm"] = sources["gemm"].replace("from .gemm_epilogue import", f"from {epilogue_name} import")
    for name, src in sources.items():  # the epilogue first: the gemm copy imports it by its new name
        path = tmp_path / f"{name}_{mutation}.py"
        path.write_text(src.replace("from .", "from vla_rt.triton_kernels."))
        spec = importlib.util.spec_from_file_location(f"{name}_{mutation}", path)
        mutated = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, mutated)
        spec.loader.exec_module(mutated)

    b, t, hq, hkv, d, k, offset = 2, 5, 4, 1, 24, 40, 4
    a, w, cos, sin, row_scale, caches = rope_case(b, t, hq, hkv, d, k, torch.float32, per_batch=True,
                                                  offset=offset, t_cache=offset + t + 2)  # fmt: skip
    truth = rope_float64(a, w, cos, sin, row_scale, b, hq, hkv, d, 0.5)
    for impl, must_pass in ((real.gemm, True), (mutated.gemm, False)):
        out = nan(b * t, (hq + 2 * hkv) * d)
        kc, vc = nan(*caches["k"].shape), nan(*caches["v"].shape)
        rope = dict(cos=cos, sin=sin, k_cache=kc, v_cache=vc, cache_offset=offset, q_scale=0.5, num_q_heads=hq,
                    num_kv_heads=hkv, head_dim=d)  # fmt: skip
        impl(a, w, out, row_scale=row_scale, rope=rope, config=GemmConfig(16, 16, 16, split_k=1, num_stages=1))
        args = (out, kc, vc, *truth, offset, b, hq, hkv, d)
        if must_pass:
            check_rope(*args, tol=1e-5)
        else:
            with pytest.raises(AssertionError):
                check_rope(*args, tol=1e-5)


# --------------------------------------------------------- RMS factor from the producing GEMM's partial sums

SSQ_CONFIGS = {
    "tile16": GemmConfig(block_m=16, block_n=16, block_k=16, split_k=1, group_m=1, num_stages=1),
    "tile64_rows3": GemmConfig(block_m=16, block_n=64, block_k=32, split_k=1, group_m=2, num_stages=1),
    "split3_last_merges": SPLIT3,
    "split3_combine_kernel": SPLIT3_COMBINE,
}


@DTYPES
@pytest.mark.parametrize("cfg_name", list(SSQ_CONFIGS))
def test_ssq_out_then_ssq_in_equals_rms_factor(dtype, cfg_name):
    """A residual GEMM (the expert's O / down) writes per-16-column sums of squares of x; the next GEMM's RMS factor
    from them equals `rms_factor(x)` then `row_scale`. Rows past a tile, 16-column groups split over tiles (block_n
    16) and several groups in one tile (block_n 64), both split-K reductions; the partials' rows have a stride."""
    m, n, k = 37, 96, 80  # x: (37, 96) = 6 groups of 16
    cfg = SSQ_CONFIGS[cfg_name]
    h, w_o = activations(m, k, dtype), weights(n, k, dtype)
    x = activations(m, n, dtype, seed=3).contiguous()
    ssq = nan(n // 16, m + 5)[:, :m]  # row stride m + 5: written where it should be, nothing else read
    gemm(h, w_o, x, residual=x, ssq_out=ssq, config=cfg, workspace=Workspace(DEVICE))
    ref_ssq = x.float().pow(2).view(m, n // 16, 16).sum(-1).T
    assert rel_err(ssq, ref_ssq) < 1e-6  # from the stored (rounded) x, as rms_factor reads it
    w_up = weights(48, n, dtype, seed=4)
    fused, plain = nan(m, 48, dtype=dtype), nan(m, 48, dtype=dtype)
    gemm(x, w_up, fused, rms_eps=EPS, ssq_in=ssq, config=cfg, workspace=Workspace(DEVICE))
    factor = nan(m)
    rms_factor(x, factor, EPS)
    gemm(x, w_up, plain, row_scale=factor, config=cfg, workspace=Workspace(DEVICE))
    assert rel_err(fused, plain) < (1e-6 if dtype == torch.float32 else TOL[dtype])


def test_ssq_in_reads_every_group_in_place():
    """The check above can fail: partial sums of the wrong rows, or one group missing, change the result."""
    m, n = 21, 64
    x = activations(m, n, torch.float32, seed=5).contiguous()
    w = weights(32, n, torch.float32)
    ssq = x.pow(2).view(m, n // 16, 16).sum(-1).T.contiguous()
    factor = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    good, bad = nan(m, 32), nan(m, 32)
    gemm(x, w, good, rms_eps=EPS, ssq_in=ssq)
    assert rel_err(good, (x @ w.T) * factor[:, None]) < 1e-6
    for broken in (ssq.flip(1).contiguous(), torch.cat([ssq[:-1], torch.zeros_like(ssq[:1])])):
        gemm(x, w, bad, rms_eps=EPS, ssq_in=broken)
        assert rel_err(bad, good) > 1e-2


def test_ssq_arguments_are_checked():
    x, w, out = activations(8, 32, torch.float32), weights(16, 32, torch.float32), nan(8, 16)
    with pytest.raises(ValueError, match="ssq_in needs rms_eps"):
        gemm(x, w, out, ssq_in=nan(2, 8))
    with pytest.raises(ValueError, match=r"ssq_in must be float32 \(2, 8\)"):
        gemm(x, w, out, rms_eps=EPS, ssq_in=nan(3, 8))
    with pytest.raises(ValueError, match="ssq_out needs N a multiple of 16"):
        gemm(x, weights(12, 32, torch.float32), nan(8, 12), ssq_out=nan(1, 8))


# ------------------------------------------------------------------------------------------------ rms_out

RMS_OUT_CONFIGS = {
    "combine_kernel": SPLIT3_COMBINE,  # the factor from the combine kernel (one program a row)
    "combine_empty_splits": GemmConfig(16, 32, 16, split_k=4, combine=1),
    "last_merges": SPLIT3,  # no combine kernel: an rms_factor launch after the GEMM
    "no_split": GemmConfig(block_m=16, block_n=32, block_k=16, split_k=1, group_m=2, num_stages=1),
}


@DTYPES
@pytest.mark.parametrize("cfg_name", list(RMS_OUT_CONFIGS))
def test_rms_out_equals_gemm_then_rms_factor(dtype, cfg_name, monkeypatch):
    """A residual GEMM (O / down) with `rms_out` stores the same x as without it, and the factor `rms_factor(x)`
    reads from the stored x; N = 45 is not a power of two (masked columns must not count). With a combine kernel
    no rms_factor launch may happen (the combine computes it)."""
    import importlib

    m, n, k = 37, 45, 80
    cfg = RMS_OUT_CONFIGS[cfg_name]
    if cfg.split_k > 1 and cfg.combine == 1:
        gemm_module = importlib.import_module("vla_rt.triton_kernels.gemm")
        monkeypatch.setattr(gemm_module, "rms_factor", lambda *a: pytest.fail("rms_factor launched"))
    h, w_o = activations(m, k, dtype), weights(n, k, dtype)
    x0 = activations(m, n, dtype, seed=3).contiguous()
    x, x_plain = x0.clone(), x0.clone()
    factor = nan(m)
    gemm(h, w_o, x, residual=x, bias=weights(1, n, dtype, seed=6)[0], rms_out=factor, rms_out_eps=EPS, config=cfg,
         workspace=Workspace(DEVICE))  # fmt: skip
    gemm(h, w_o, x_plain, residual=x_plain, bias=weights(1, n, dtype, seed=6)[0], config=cfg,
         workspace=Workspace(DEVICE))  # fmt: skip
    assert torch.equal(x, x_plain)
    ref = nan(m)
    rms_factor(x, ref, EPS)
    assert rel_err(factor, ref) < 1e-6
    assert rel_err(factor, torch.rsqrt(x.double().pow(2).mean(-1) + EPS)) < 1e-5


def test_rms_out_check_can_fail():
    """The comparison above sees a factor from the wrong rows, or one that missed a column."""
    m, n, k = 19, 40, 48
    h, w = activations(m, k, torch.float32), weights(n, k, torch.float32)
    x, factor = nan(m, n), nan(m)
    gemm(h, w, x, rms_out=factor, rms_out_eps=EPS, config=SPLIT3_COMBINE, workspace=Workspace(DEVICE))
    ref = torch.rsqrt(x.double().pow(2).mean(-1) + EPS)
    assert rel_err(factor, ref) < 1e-6
    assert rel_err(factor.flip(0), ref) > 1e-2
    assert rel_err(factor, torch.rsqrt(x[:, :-1].double().pow(2).mean(-1) + EPS)) > 1e-3


def test_rms_out_arguments_are_checked():
    x, w, out = activations(8, 32, torch.float32), weights(16, 32, torch.float32), nan(8, 16)
    with pytest.raises(ValueError, match="rms_out needs rms_out_eps"):
        gemm(x, w, out, rms_out=nan(8))
    with pytest.raises(ValueError, match="rms_out_eps given without rms_out"):
        gemm(x, w, out, rms_out_eps=EPS)
    with pytest.raises(ValueError, match=r"rms_out must be contiguous float32 \(8,\)"):
        gemm(x, w, out, rms_out=nan(9), rms_out_eps=EPS)
