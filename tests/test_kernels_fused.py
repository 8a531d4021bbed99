"""The RoPE epilogue of the GEMM (the action expert's QKV) against the kernels it replaces, in Triton's interpreter
(fp32 and fp16) on the CPU.

`gemm(..., rope=r)` must equal `gemm` + `rope_qk(out, **r)` (Q rotated in place, rotated K and plain V in the cache
rows) — in fp32, where the unfused path rounds nothing in between, elementwise within the worst-case bound of fp32
rounding done in another order (`rounding_bound`: the summation order of the K loop and FMA contraction differ
between the two kernels and between Triton releases) — with every split-K reduction, tiles that straddle heads and
the Q/K/V boundaries, odd shapes, batch rows with their own positions and the pruned K/V-only layer. A set of
deliberately broken RoPE variants, and copies of the kernel with one bug each, must fail the same check.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from vla_rt.numerics import rel_err
from vla_rt.triton_kernels import GemmConfig, Workspace, gemm, rope_qk  # noqa: E402
from vla_rt.triton_kernels import launch_configs as lc  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


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
    # the TMA kernel: 16-column tiles in 16-wide halves
    "tma_one_tile_a_program": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, num_stages=2, tma=1)),
    "tma_persistent": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, num_stages=2, tma=2)),
    "tma_flattened_split_k_combine": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, 3, combine=1, tma=3)),
    "tma_tile_straddles_heads_falls_back": (2, 5, 4, 1, 24, 40, True, 4, GemmConfig(16, 16, 16, tma=2)),
    "tma_stream_k": (2, 5, 4, 1, 32, 40, True, 4, GemmConfig(16, 16, 16, num_stages=2, tma=4)),
}


@DTYPES
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_fused_rope_equals_gemm_then_rope_qk(case, dtype):
    b, t, hq, hkv, d, k, per_batch, offset, config = ROPE_CASES[case]
    a, w, cos, sin, row_scale, caches = rope_case(b, t, hq, hkv, d, k, dtype, per_batch=per_batch, offset=offset,
                                                  t_cache=offset + t + 2)  # fmt: skip
    q_scale = 0.5 if hq else 1.0
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    factor = row_scale
    # the path it replaces: GEMM into the QKV buffer, then rope_qk
    qkv = nan(b * t, (hq + 2 * hkv) * d, dtype=dtype)
    gemm(a, w, qkv, row_scale=factor, config=config)
    rope_qk(qkv, cos, sin, caches["k"], caches["v"], cache_offset=offset, q_scale=q_scale, **heads)
    # fused
    out = nan(b * t, (hq + 2 * hkv) * d, dtype=dtype)
    rope = dict(cos=cos, sin=sin, k_cache=caches["k_fused"], v_cache=caches["v_fused"], cache_offset=offset,
                q_scale=q_scale, **heads)  # fmt: skip
    gemm(a, w, out, rope=rope, config=config, row_scale=row_scale)

    unfused_q = qkv.view(b, t, -1)[:, :, : hq * d].reshape(b, t, hq, d)
    unfused = (unfused_q, caches["k"][:, offset : offset + t], caches["v"][:, offset : offset + t])
    # fp32: nothing is rounded between GEMM and RoPE in the unfused path either, so the two differ only by the
    # order of fp32 roundings (bounded elementwise, tighter than a relative tolerance)
    bounds = None
    if dtype == torch.float32:
        bounds = rounding_bound(a, w, factor, b, hq, hkv, d, q_scale)
    check_rope(out, caches["k_fused"], caches["v_fused"], *unfused, offset, b, hq, hkv, d, tol=TOL[dtype],
               bounds=bounds)  # fmt: skip
    truth = rope_float64(a, w, cos, sin, factor, b, hq, hkv, d, q_scale)
    check_rope(out, caches["k_fused"], caches["v_fused"], *truth, offset, b, hq, hkv, d, tol=TOL[dtype])


@DTYPES
def test_cublas_rope_form_meets_the_fused_contract(dtype):
    """`cublas_choice`'s RoPE form (a plain GEMM by torch, then `rope_qk` applying the row scale before rotating)
    keeps `gemm(..., rope=r)`'s contract: the same Q columns and cache rows, nothing else written. On the CPU
    `torch.mm` stands in for cuBLAS (the same call); `gemm` hands a RoPE GEMM to it where the table's `cublas_us`
    for the `:rope` entry says so."""
    from vla_rt.triton_kernels.cublas_choice import cublas_gemm

    b, t, hq, hkv, d, k, offset = 2, 5, 4, 1, 24, 40, 4
    a, w, cos, sin, row_scale, caches = rope_case(b, t, hq, hkv, d, k, dtype, per_batch=True, offset=offset,
                                                  t_cache=offset + t + 2)  # fmt: skip
    out = nan(b * t, (hq + 2 * hkv) * d, dtype=dtype)
    rope = dict(cos=cos, sin=sin, k_cache=caches["k_fused"], v_cache=caches["v_fused"], cache_offset=offset,
                q_scale=0.5, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)  # fmt: skip
    assert cublas_gemm(a, w, out, row_scale=row_scale, rope=rope)
    truth = rope_float64(a, w, cos, sin, row_scale, b, hq, hkv, d, 0.5)
    # two roundings of Q, K and V (the GEMM's output, then the rotation) where the fused epilogue rounds once; the
    # buffer's K / V columns are scratch that this form fills with the GEMM's output (the fused one leaves them)
    q_only = out.clone()
    q_only[:, hq * d :] = float("nan")
    check_rope(q_only, caches["k_fused"], caches["v_fused"], *truth, offset, b, hq, hkv, d, tol=2 * TOL[dtype])
    # forms it refuses, having written nothing: an epilogue beside RoPE, or an output of another dtype
    before = out.clone()
    assert not cublas_gemm(a, w, out, row_scale=row_scale, rope=rope, alpha=0.5)
    assert not cublas_gemm(a, w, nan(*out.shape, dtype=torch.float64), rope=rope)
    assert torch.equal(out.isnan(), before.isnan()) and torch.equal(out.nan_to_num(), before.nan_to_num())


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
    a, w, cos, sin, row_scale, _ = rope_case(b, t, hq, hkv, d, k, torch.float32, per_batch=True, offset=0,
                                             t_cache=t)  # fmt: skip
    results = []
    for cfg in (GemmConfig(16, 16, 16, split_k=3, num_stages=1),) * 2 + (GemmConfig(16, 16, 16, 3, combine=1),):
        ws = Workspace(DEVICE)
        out, kc, vc = nan(b * t, 144), nan(b, t, 1, d), nan(b, t, 1, d)
        rope = dict(cos=cos, sin=sin, k_cache=kc, v_cache=vc, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        gemm(a, w, out, row_scale=row_scale, rope=rope, config=cfg, workspace=ws)
        assert int(ws.counters(0).abs().sum()) == 0
        results.append((out[:, : hq * d], kc, vc))
    for r in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(r, results[0]))


@pytest.mark.parametrize(
    "bad",
    [
        lambda a, w, o, r, f: gemm(a, w, o, rope=r, out_scale=torch.ones(w.shape[0], device=DEVICE)),
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


def test_rope_keys_and_lookup_fallbacks(config_dir):
    assert lc.gemm_key(64, 2560, 1024, False, rope=True) == "64x2560x1024:rope"
    assert lc.gemm_key(64, 2560, 1024, False) == "64x2560x1024"
    plain = dict(block_m=64, block_n=32, block_k=128, split_k=1, group_m=1, num_warps=4, num_stages=5)
    tuned_rope = {**plain, "block_n": 64, "num_stages": 3}
    table = {"gemm": {"bfloat16": {"64x2560x1024": plain, "64x1024x2048:rope": tuned_rope}}}
    (config_dir / "Test-GPU.json").write_text(lc.dump_table(table))

    def look(m, n, k, gated=False, rope=False):
        return lc._gemm_config_cuda(m, n, k, gated, torch.bfloat16, "Test-GPU", 132, rope)

    transferred = look(64, 2560, 1024, rope=True)  # pairs: half the columns, same weight rows a tile
    assert (transferred.block_n, transferred.block_k, transferred.split_k) == (16, 128, 1)
    assert (64 + 2 * 16) * 128 * 2 * transferred.num_stages <= lc.SMEM_BYTES
    assert look(51, 1024, 2048, rope=True) == lc.GemmConfig.from_dict(tuned_rope)  # the tabled M above
    assert look(64, 1024, 2048) != lc.GemmConfig.from_dict(tuned_rope)  # the flag is part of the key
    assert look(64, 512, 1024, rope=True) == lc.gemm_heuristic(64, 256, 1024, gated=True)  # nothing tabled: pairs
    cpu = lc.gemm_config(64, 2560, 1024, gated=False, dtype=torch.float32, device="cpu", rope=True)
    assert cpu == lc.gemm_config(64, 1280, 1024, gated=False, dtype=torch.float32, device="cpu")


MUTATIONS = {
    # (module, text, replacement)
    # the pair mapping of the K loop: columns (h*D + 2i, h*D + 2i + 1), the interleaved convention, instead of halves
    "adjacent_pairs": (
        "gemm_pointer",
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
    """A copy of the GEMM modules (epilogue, pointer kernel, wrapper) with one deliberate bug must fail the check
    that the real kernel passes."""
    import importlib.util
    import sys
    from pathlib import Path

    real = sys.modules["vla_rt.triton_kernels.gemm"]  # (the package's `gemm` attribute is the function)

    module, old, new = MUTATIONS[mutation]
    chain = ("gemm_epilogue", "gemm_pointer", "gemm")  # each copy imports the copy before it
    sources = {name: Path(real.__file__).with_name(f"{name}.py").read_text() for name in chain}
    assert sources[module].count(old) == 1, f"mutation {mutation!r} no longer applies: update it with the kernel"
    sources[module] = sources[module].replace(old, new)
    for below, above in zip(chain, chain[1:]):
        sources[above] = sources[above].replace(f"from .{below} import", f"from {below}_{mutation} import")
    for name, src in sources.items():  # in chain order: a copy's imports are loaded before it
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
