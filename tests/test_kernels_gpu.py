"""GPU tests of the kernels in bf16 at the real π0 shapes against float32 torch references, plus split-K/split-KV
determinism and a CUDA Graph capture of a chain of kernels. Skipped without CUDA (run on the device machine)."""

import pytest
import torch
import torch.nn.functional as F

from vla_rt.numerics import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from vla_rt.triton_kernels import (
        GemmConfig,
        Workspace,
        attention,
        attention_reference,
        gemm,
        gemm_config,
        layernorm,
        patchify,
        rms_factor,
        rmsnorm,
        rope_qk,
    )
    from vla_rt.triton_kernels.shapes import GemmShape, pi0_attention_shapes, pi0_gemm_shapes

    GEMM_SHAPES = [s for s in pi0_gemm_shapes(chunks=(50, 63)) if not s.rope]
    ROPE_SHAPES = [s for s in pi0_gemm_shapes(chunks=(50, 63)) if s.rope]  # the expert's QKV, RoPE epilogue
    ATTENTION_SHAPES = pi0_attention_shapes()
else:
    GEMM_SHAPES = ROPE_SHAPES = ATTENTION_SHAPES = []

BF16_TOL = 1e-2
DEV = "cuda"


def padded(rows: int, cols: int, dtype=torch.bfloat16, std=1.0) -> torch.Tensor:
    """Random (rows, cols) with the row stride rounded up to a multiple of 8 (the aligned fast path)."""
    stride = -(-cols // 8) * 8
    return (torch.randn(rows, stride, device=DEV) * std).to(dtype)[:, :cols]


def gemm_reference(a, w, bias, row_scale, activation, gated, alpha, residual):
    y = a.float() @ w.float().T
    y = y * row_scale[:, None] if row_scale is not None else y
    y = y + bias.float() if bias is not None else y
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.gelu(gate, approximate="tanh") * up
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif activation == "silu":
        y = F.silu(y)
    y = alpha * y
    return y + residual.float() if residual is not None else y


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"{s.name}-{s.m}x{s.n}x{s.k}")
def test_gemm_bf16_pi0_shapes(shape):
    check_gemm_bf16(shape)


# The wide GEMMs the TMA kernel is for, one of each epilogue (the tuner checks every π0 shape it times): gated with
# a row scale, residual, bias + GELU, SigLIP's K = 588 with the periodic position embedding; 276 and 788 rows
# (prompt 20) leave a partial 128-row tile
TMA_SHAPES = [
    s
    for s in GEMM_SHAPES
    if (s.name, s.m)
    in {("vlm.gate_up", 276), ("vlm.down", 788), ("siglip.fc1", 256), ("siglip.patch", 256), ("vlm.o", 276)}
]


@pytest.mark.parametrize("mode", [1, 2, 3])
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: f"{s.name}-{s.m}x{s.n}x{s.k}")
def test_tma_gemm_bf16_wide_shapes(shape, mode, spy_launches):
    from vla_rt.triton_kernels import gemm_tma as gemm_tma_module

    grids = spy_launches(gemm_tma_module, "gemm_tma_kernel")
    check_gemm_bf16(shape, GemmConfig(128, 128, 64, split_k=1, group_m=8, num_warps=8, num_stages=3, tma=mode))
    assert grids, "the TMA kernel did not run"


# Stream-K (tma = 4) where the last wave is partly empty: SigLIP's fc2 and the expert's down at the server's batches
# (bias + residual, 288 tiles on 132 SMs; residual, 104 tiles: all shared), the VLM's gated gate/up at 788 rows
STREAM_K_CASES = (
    {
        "siglip.fc2 b16 images": (GemmShape("siglip.fc2", 4096, 1152, 4304, bias=True, residual=True),
                                  GemmConfig(128, 128, 64, 1, 8, 8, 4, 0, 4)),
        "expert.down b32": (GemmShape("expert.down", 1632, 1024, 4096, residual=True),
                            GemmConfig(128, 128, 64, 1, 8, 8, 4, 0, 4)),
        "vlm.gate_up 788": (GemmShape("vlm.gate_up", 788, 16384, 2048, gated=True, row_scale=True),
                            GemmConfig(128, 128, 64, 1, 8, 8, 3, 0, 4)),
    }
    if torch.cuda.is_available()
    else {}
)  # fmt: skip


@pytest.mark.parametrize("case", list(STREAM_K_CASES))
def test_stream_k_gemm_bf16_and_bitwise_replays(case, spy_launches):
    """Stream-K on the GPU: within the bf16 bound of the fp32 reference, and two launches (the counters reset by the
    last arrival) bit-identical, since shared tiles merge in program order."""
    from vla_rt.triton_kernels import gemm_stream_k as gemm_stream_k_module

    grids = spy_launches(gemm_stream_k_module, "gemm_stream_k_kernel")
    shape, cfg = STREAM_K_CASES[case]
    check_gemm_bf16(shape, cfg)
    torch.manual_seed(1)
    n_w = shape.n * (2 if shape.gated else 1)
    a, w = padded(shape.m, shape.k), padded(n_w, shape.k, std=shape.k**-0.5)
    outs = []
    for _ in range(2):
        out = torch.full((shape.m, shape.n), float("nan"), device=DEV, dtype=torch.bfloat16)
        gemm(a, w, out, gated=shape.gated, config=cfg)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    assert len(grids) == 3, "the stream-K kernel did not run"


def check_gemm_bf16(shape, config=None):
    torch.manual_seed(0)
    n_w = shape.n * (2 if shape.gated else 1)
    a, w = padded(shape.m, shape.k), padded(n_w, shape.k, std=shape.k**-0.5)
    bias = torch.randn(n_w, device=DEV).bfloat16() if shape.bias else None
    row_scale = torch.rand(shape.m, device=DEV) + 0.5 if shape.row_scale else None
    residual = torch.randn(shape.m, shape.n, device=DEV).bfloat16() if shape.residual else None
    out = torch.full((shape.m, shape.n), float("nan"), device=DEV, dtype=torch.bfloat16)
    kw = dict(bias=bias, row_scale=row_scale, activation=shape.activation, gated=shape.gated, residual=residual)
    gemm(a, w, out, config=config, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, gemm_reference(a, w, alpha=1.0, **kw)) < BF16_TOL


@pytest.mark.parametrize("bias_rows", [0, 8], ids=["pi0_row_scale", "pi05_bias_per_batch_row"])
def test_cublas_rope_form_bf16_at_the_servers_408_rows(bias_rows):
    """`cublas_choice`'s RoPE form (cuBLAS, then `rope_qk` applying the row scale and π0.5's per-row bias) at the
    server's 8-robot expert QKV, against float32, and against our fused epilogue on the same inputs."""
    from vla_rt.triton_kernels.cublas_choice import cublas_gemm

    torch.manual_seed(0)
    b, t, hq, hkv, d, k, offset = 8, 51, 8, 1, 256, 1024, 532
    m, width = b * t, (hq + 2 * hkv) * d
    a, w = padded(m, k), padded(width, k, std=k**-0.5)
    scale = torch.rand(m, device=DEV) + 0.5
    bias = torch.randn(bias_rows, width, device=DEV).bfloat16() if bias_rows else None
    ang = (torch.arange(t, device=DEV)[:, None] + offset) * 10_000 ** (-torch.arange(d // 2, device=DEV) * 2 / d)
    cos, sin = (f(ang).float()[None].expand(b, t, d // 2).contiguous() for f in (torch.cos, torch.sin))
    got = {}
    for form in ("cublas", "fused"):
        cache = torch.full((2, b, offset + t, hkv, d), float("nan"), device=DEV, dtype=torch.bfloat16)
        out = torch.full((m, width), float("nan"), device=DEV, dtype=torch.bfloat16)
        rope = dict(cos=cos, sin=sin, k_cache=cache[0], v_cache=cache[1], num_q_heads=hq, num_kv_heads=hkv,
                    head_dim=d, cache_offset=offset)  # fmt: skip
        if form == "cublas":
            assert cublas_gemm(a, w, out, row_scale=scale, bias=bias, rope=rope)
        else:
            cfg = gemm_config(m, width, k, gated=False, dtype=a.dtype, device=a.device, rope=True)
            gemm(a, w, out, row_scale=scale, bias=bias, rope=rope, config=cfg)  # a config: never handed to cuBLAS
        torch.cuda.synchronize()
        got[form] = (out[:, : hq * d].view(b, t, hq, d), cache[0, :, offset:], cache[1, :, offset:])
    y = a.float() @ w.float().T * scale[:, None]
    if bias is not None:
        y = y + bias.float().repeat_interleave(t, dim=0)
    y = y.view(b, t, hq + 2 * hkv, d)
    y1, y2 = y[..., : d // 2], y[..., d // 2 :]
    c, s_ = cos[:, :, None], sin[:, :, None]
    rot = torch.cat([y1 * c - y2 * s_, y2 * c + y1 * s_], -1)
    want = (rot[:, :, :hq], rot[:, :, hq : hq + hkv], y[:, :, hq + hkv :])
    for form, parts in got.items():
        for name, g, ref in zip("QKV", parts, want):
            assert rel_err(g, ref) < BF16_TOL, (form, name)
    for name, g_cublas, g_fused in zip("QKV", got["cublas"], got["fused"]):
        assert rel_err(g_cublas, g_fused.float()) < BF16_TOL, name


@pytest.mark.parametrize("mode", [1, 2])
def test_tma_rope_epilogue_and_split_k_bf16(mode, spy_launches):
    """The TMA kernel's two expert paths in bf16: the QKV GEMM's RoPE epilogue into the KV cache (row scale given,
    32 pair columns a tile), and split-K 4 partials through the combine kernel with a residual (bitwise repeatable)."""
    from vla_rt.triton_kernels import gemm_tma as gemm_tma_module

    grids = spy_launches(gemm_tma_module, "gemm_tma_kernel")
    torch.manual_seed(0)
    m, hq, hkv, d, k, offset = 64, 8, 1, 256, 1024, 816
    a, w = padded(m, k), padded((hq + 2 * hkv) * d, k, std=k**-0.5)
    scale = torch.rand(m, device=DEV) + 0.5
    cos, sin, cache = _rope_inputs(m, hq, hkv, d, offset)
    out = torch.full((m, hq * d + 2 * hkv * d), float("nan"), device=DEV, dtype=torch.bfloat16)
    rope = dict(cos=cos, sin=sin, k_cache=cache[0], v_cache=cache[1], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                cache_offset=offset)  # fmt: skip
    gemm(a, w, out, row_scale=scale, rope=rope, config=GemmConfig(64, 32, 128, 1, 1, 4, 5, 0, mode))
    torch.cuda.synchronize()
    y = (a.float() @ w.float().T * scale[:, None]).view(m, hq + 2 * hkv, d)
    y1, y2 = y[..., : d // 2], y[..., d // 2 :]
    rot = torch.cat([y1 * cos[:, None] - y2 * sin[:, None], y2 * cos[:, None] + y1 * sin[:, None]], -1)
    assert rel_err(out[:, : hq * d].view(m, hq, d), rot[:, :hq]) < BF16_TOL
    assert rel_err(cache[0, 0, offset:], rot[:, hq : hq + hkv]) < BF16_TOL
    assert rel_err(cache[1, 0, offset:], y[:, hq + hkv :]) < BF16_TOL

    a, w = padded(m, 4096), padded(1024, 4096, std=4096**-0.5)
    residual = torch.randn(m, 1024, device=DEV).bfloat16()
    outs = []
    for _ in range(2):
        out = torch.full((m, 1024), float("nan"), device=DEV, dtype=torch.bfloat16)
        gemm(a, w, out, residual=residual, config=GemmConfig(64, 64, 128, 4, 1, 4, 4, 1, mode))
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = gemm_reference(a, w, None, None, None, False, 1.0, residual)
    assert rel_err(outs[0], ref) < BF16_TOL
    assert len(grids) == 3, "the TMA kernel did not run"


@pytest.mark.parametrize("combine", [0, 1], ids=["last_program_merges", "combine_kernel"])
@pytest.mark.parametrize("m,n,k", [(64, 1024, 2048), (51, 1024, 4096), (64, 4096, 1024)])
def test_split_k_bitwise_deterministic_and_in_place_euler(m, n, k, combine):
    cfg = gemm_config(m, n, k, gated=False, dtype=torch.bfloat16, device=torch.device(DEV))
    cfg = type(cfg)(**{**cfg.to_dict(), "split_k": max(cfg.split_k, 4), "combine": combine})
    a, w = padded(m, k), padded(n, k, std=k**-0.5)
    outs = [torch.empty(m, n, device=DEV) for _ in range(3)]
    for o in outs:
        gemm(a, w, o, config=cfg)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    x = torch.randn(m, n, device=DEV)  # fp32 x_t, updated in place by x += dt * v
    expected = x + -0.1 * (a.float() @ w.float().T)
    gemm(a, w, x, alpha=-0.1, residual=x, config=cfg)
    assert rel_err(x, expected) < 1e-3


def _blocks(shape):
    """Realistic block ids: a prefix with 5 padded prompt tokens; for the expert, the state/action blocks."""
    if not shape.masked:
        return None, None
    pad = 2**30
    k_block = torch.zeros(shape.b, shape.tk, dtype=torch.int32, device=DEV)
    if shape.tq == shape.tk:  # prefix: bidirectional, padded tail keys (and queries) invisible
        k_block[:, -5:] = pad
        q_block = torch.where(k_block == pad, -1, 0).int()
    else:  # suffix over [prefix; state; actions]
        prefix = shape.tk - shape.tq
        k_block[:, prefix - 5 : prefix] = pad
        k_block[:, prefix] = 1
        k_block[:, prefix + 1 :] = 2
        q_block = k_block[:, prefix:].clone()
    return q_block, k_block


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: s.name)
def test_attention_bf16_pi0_shapes(shape):
    torch.manual_seed(0)
    if shape.hq == shape.hkv:  # SigLIP: q/k/v as views of one fused QKV buffer
        qkv = torch.randn(shape.b * shape.tq, 3 * shape.hq * shape.d, device=DEV).bfloat16()
        q, k, v = (x.view(shape.b, shape.tq, shape.hq, shape.d) for x in qkv.chunk(3, dim=-1))
    else:
        q = torch.randn(shape.b, shape.tq, shape.hq, shape.d, device=DEV).bfloat16()
        k = torch.randn(shape.b, shape.tk, shape.hkv, shape.d, device=DEV).bfloat16()
        v = torch.randn(shape.b, shape.tk, shape.hkv, shape.d, device=DEV).bfloat16()
    q_block, k_block = _blocks(shape)
    out = torch.full((shape.b, shape.tq, shape.hq, shape.d), float("nan"), device=DEV, dtype=torch.bfloat16)
    attention(q, k, v, out, scale=shape.d**-0.5, q_block=q_block, k_block=k_block)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ref = attention_reference(q, k, v, scale=shape.d**-0.5, q_block=q_block, k_block=k_block)
    assert rel_err(out, ref) < BF16_TOL
    again = torch.empty_like(out)
    attention(q, k, v, again, scale=shape.d**-0.5, q_block=q_block, k_block=k_block)
    assert torch.equal(out, again)  # split-KV merge is deterministic


@pytest.mark.parametrize("combine", [0, 1], ids=["last_program_merges", "combine_kernel"])
@pytest.mark.parametrize("block_m,hpp,splits", [(16, 8, 4), (32, 2, 8), (64, 8, 2)])
def test_expert_attention_split_merges_bf16(block_m, hpp, splits, combine):
    from vla_rt.triton_kernels import AttentionConfig

    shape = next(s for s in ATTENTION_SHAPES if s.name == "expert.v3p20h63")
    torch.manual_seed(0)
    q = torch.randn(1, shape.tq, 8, 256, device=DEV).bfloat16()
    k, v = (torch.randn(1, shape.tk, 1, 256, device=DEV).bfloat16() for _ in range(2))
    q_block, k_block = _blocks(shape)
    cfg = AttentionConfig(block_m, 64, hpp, splits, num_warps=8 if block_m >= 64 else 4, combine=combine)
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        attention(q, k, v, out, scale=1 / 16, q_block=q_block, k_block=k_block, config=cfg)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], attention_reference(q, k, v, scale=1 / 16, q_block=q_block, k_block=k_block)) < BF16_TOL


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("prefix.v2p20", (128, 64, 8, 1, 8, 2, 0, 1)),
        ("prefix.v2p20", (64, 64, 8, 1, 4, 2, 0, 1)),
        ("prefix.v3p0", (128, 32, 8, 1, 8, 3, 0, 1)),
        ("expert.v3p20h63", (64, 64, 8, 4, 4, 2, 1, 1)),
        ("expert.v2p20h50", (128, 64, 8, 1, 8, 2, 0, 1)),
    ],
    ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x)),
)
def test_tma_attention_bf16(name, cfg):
    """The TMA kernel (`attention_tma`) at π0's head-dim-256 shapes, with the block masks, batch 2 (each batch
    element's keys stay its own: TMA bounds, no reads into the next), against the float32 reference; repeatable."""
    from vla_rt.triton_kernels import AttentionConfig
    from vla_rt.triton_kernels.attention_tma import tma_attention_applies

    shape = next(s for s in ATTENTION_SHAPES if s.name == name)
    torch.manual_seed(1)
    q = torch.randn(2, shape.tq, 8, 256, device=DEV).bfloat16()
    k, v = (torch.randn(2, shape.tk, 1, 256, device=DEV).bfloat16() for _ in range(2))
    q_block, k_block = (x.expand(2, -1).contiguous() for x in _blocks(shape))
    config = AttentionConfig(*cfg)
    assert tma_attention_applies(q, k, v, config)
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        attention(q, k, v, out, scale=1 / 16, q_block=q_block, k_block=k_block, config=config)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], attention_reference(q, k, v, scale=1 / 16, q_block=q_block, k_block=k_block)) < BF16_TOL


def test_norms_rope_patchify_bf16():
    torch.manual_seed(0)
    x = torch.randn(768, 1152, device=DEV).bfloat16() * 3 + 1
    out = torch.empty_like(x)
    w, b = torch.randn(1152, device=DEV), torch.randn(1152, device=DEV)
    layernorm(x, out, 1e-6, w, b)
    assert rel_err(out, F.layer_norm(x.float(), (1152,), w, b, 1e-6)) < BF16_TOL
    xv = torch.randn(816, 2048, device=DEV).bfloat16()
    f = torch.empty(816, device=DEV)
    rms_factor(xv, f, 1e-6)
    assert rel_err(f, torch.rsqrt(xv.float().pow(2).mean(-1) + 1e-6)) < 1e-5
    scale = torch.randn(2048, device=DEV) * 0.1
    normed = torch.empty_like(xv)
    rmsnorm(xv, normed, 1e-6, scale)
    assert rel_err(normed, xv.float() * f[:, None] * (1 + scale)) < BF16_TOL

    t, d = 816, 256
    qkv = torch.randn(t, 10 * d, device=DEV).bfloat16()
    before = qkv.float().view(t, 10, d)
    ang = torch.arange(t, device=DEV)[:, None] * 10_000 ** (-torch.arange(128, device=DEV) / 128)
    cos, sin = ang.cos().float(), ang.sin().float()
    cache = torch.zeros(2, 1, 900, 1, d, device=DEV).bfloat16()
    rope_qk(
        qkv, cos, sin, cache[0], cache[1], num_q_heads=8, num_kv_heads=1, head_dim=d, cache_offset=0, q_scale=d**-0.5
    )

    def rot(y):
        y1, y2 = y[..., :128], y[..., 128:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], -1)

    assert rel_err(qkv.view(t, 10, d)[:, :8], rot(before[:, :8]) * d**-0.5) < BF16_TOL
    assert rel_err(cache[0, 0, :t], rot(before[:, 8:9])) < BF16_TOL
    assert torch.equal(cache[1, 0, :t].float(), before[:, 9:10])

    images = torch.rand(3, 224, 224, 3, device=DEV) * 2 - 1
    patches = torch.empty(768, 592, device=DEV).bfloat16()[:, :588]
    patchify(images, patches, 14)
    ref = images.view(3, 16, 14, 16, 14, 3).permute(0, 1, 3, 2, 4, 5).reshape(768, 588)
    assert torch.equal(patches, ref.bfloat16())


@pytest.mark.parametrize("reductions", ["table", "last_program", "combine_kernel"])
def test_cuda_graph_capture_of_an_expert_layer_slice(reductions):
    """rms_factor -> QKV GEMM (split-K, row scale) -> RoPE into cache -> split-KV attention -> O GEMM with residual
    in place, captured once and replayed on new inputs: matches eager, counters reset, nothing allocated. With the
    table's configs, and with split reductions forced to either kind."""
    from vla_rt.triton_kernels import AttentionConfig, GemmConfig

    cfgs = {"qkv": None, "attn": None, "o": None}
    if reductions != "table":
        c = int(reductions == "combine_kernel")
        cfgs = {"qkv": GemmConfig(64, 64, 128, 4, 1, 4, 4, c), "attn": AttentionConfig(32, 64, 8, 8, 4, 2, c),
                "o": GemmConfig(64, 32, 128, 8, 1, 4, 4, c)}  # fmt: skip
    torch.manual_seed(0)
    m, width, d, prefix = 64, 1024, 256, 768
    x = torch.randn(m, width, device=DEV).bfloat16()
    w_qkv, w_o = padded(2560, width, std=width**-0.5), padded(width, 2048, std=2048**-0.5)
    factor = torch.empty(m, device=DEV)
    qkv = torch.empty(m, 2560, device=DEV).bfloat16()
    cache = torch.randn(2, 1, prefix + m, 1, d, device=DEV).bfloat16()
    ang = torch.randn(m, d // 2, device=DEV)
    cos, sin = ang.cos(), ang.sin()
    attn = torch.empty(1, m, 8, d, device=DEV).bfloat16()
    k_block = torch.zeros(1, prefix + m, dtype=torch.int32, device=DEV)
    k_block[:, prefix] = 1
    k_block[:, prefix + 1 :] = 2
    q_block = k_block[:, prefix:].clone()
    ws = Workspace(DEV)

    def layer():
        rms_factor(x, factor, 1e-6)
        gemm(x, w_qkv, qkv, row_scale=factor, workspace=ws, config=cfgs["qkv"])
        rope_qk(qkv, cos, sin, cache[0], cache[1], num_q_heads=8, num_kv_heads=1, head_dim=d, cache_offset=prefix,
                q_scale=d**-0.5)  # fmt: skip
        q = qkv[:, : 8 * d].view(1, m, 8, d)
        attention(q, cache[0], cache[1], attn, scale=1.0, q_block=q_block, k_block=k_block, workspace=ws,
                  config=cfgs["attn"])  # fmt: skip
        gemm(attn.view(m, 8 * d), w_o, x, residual=x, workspace=ws, config=cfgs["o"])

    x0 = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # warm-up: compiles, sizes the workspace
    torch.cuda.current_stream().wait_stream(stream)
    eager = x.clone()
    reserved = ws.nbytes
    graph = torch.cuda.CUDAGraph()
    x.copy_(x0)
    with torch.cuda.graph(graph):
        layer()
    for _ in range(2):
        x.copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(x, eager) < 1e-2
    assert ws.nbytes == reserved and int(ws.counters(0).abs().sum()) == 0
    x1 = torch.randn_like(x0)
    x.copy_(x1)
    graph.replay()
    replayed = x.clone()
    x.copy_(x1)
    layer()
    assert rel_err(replayed, x) < 1e-2


# --------------------------------------------------------------------------------------------- RoPE epilogue


def _rope_inputs(m, hq, hkv, d, offset):
    """Expert-like RoPE inputs: real angles at positions offset.., a cache with `offset` prefix rows before."""
    pos = torch.arange(m, device=DEV)[:, None] + offset
    ang = pos * 10_000 ** (-torch.arange(d // 2, device=DEV) * 2 / d)
    cache = torch.full((2, 1, offset + m, hkv, d), float("nan"), device=DEV).bfloat16()
    return ang.cos().float(), ang.sin().float(), cache


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: f"{s.name}-{s.m}x{s.n}x{s.k}")
def test_rope_gemm_bf16_pi0_shapes(shape):
    """The expert's QKV GEMM with the RoPE epilogue at its π0 shapes and table configs against fp32 torch: Q (in
    `out`), K and V (in the cache rows), bitwise deterministic."""
    torch.manual_seed(0)
    n_w = shape.n * (2 if shape.gated else 1)
    a = padded(shape.m, shape.k) * (torch.rand(shape.m, 1, device=DEV) * 3 + 0.2).bfloat16()
    w = padded(n_w, shape.k, std=shape.k**-0.5)
    factor = torch.rsqrt(a.float().pow(2).mean(-1) + 1e-6)
    hq, hkv, d = shape.rope_heads
    offset = 816
    cos, sin, cache = _rope_inputs(shape.m, hq, hkv, d, offset)
    rope = dict(cos=cos, sin=sin, k_cache=cache[0], v_cache=cache[1], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                cache_offset=offset)  # fmt: skip
    results = []
    for _ in range(2):
        out = torch.full((shape.m, shape.n), float("nan"), device=DEV, dtype=torch.bfloat16)
        cache.fill_(float("nan"))
        gemm(a, w, out, row_scale=factor, rope=rope)
        torch.cuda.synchronize()
        results.append((out[:, : hq * d].clone(), cache[:, :, offset:].clone()))
    assert all(torch.equal(x, y) for x, y in zip(*results))
    y = (a.float() @ w.float().T * factor[:, None]).view(shape.m, hq + 2 * hkv, d)
    y1, y2 = y[..., : d // 2], y[..., d // 2 :]
    c, s = cos[:, None], sin[:, None]
    rot = torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], -1)
    out, kv = results[0]
    assert rel_err(out.view(shape.m, hq, d), rot[:, :hq]) < BF16_TOL
    assert rel_err(kv[0, 0], rot[:, hq : hq + hkv]) < BF16_TOL
    assert rel_err(kv[1, 0], y[:, hq + hkv :]) < BF16_TOL
    assert cache[:, :, :offset].isnan().all()


@pytest.mark.parametrize("combine", [0, 1], ids=["last_program_merges", "combine_kernel"])
def test_rope_split_k_bitwise_deterministic_bf16(combine):
    """The RoPE epilogue after either split-K reduction: bit-identical runs, and equal (to bf16 rounding) to the
    unsplit launch."""
    from vla_rt.triton_kernels import GemmConfig

    torch.manual_seed(0)
    m, k, hq, hkv, d, offset = 64, 1024, 8, 1, 256, 768
    a, w = padded(m, k), padded(2560, k, std=k**-0.5)
    factor = torch.rand(m, device=DEV) + 0.5
    cos, sin, cache = _rope_inputs(m, hq, hkv, d, offset)
    rope = dict(cos=cos, sin=sin, k_cache=cache[0], v_cache=cache[1], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                cache_offset=offset)  # fmt: skip
    results = []
    for cfg in (GemmConfig(64, 32, 128, 4, 1, 4, 4, combine),) * 2 + (GemmConfig(64, 16, 128, 1, 1, 4, 4),):
        out = torch.full((m, 2560), float("nan"), device=DEV).bfloat16()
        gemm(a, w, out, row_scale=factor, rope=rope, config=cfg)
        torch.cuda.synchronize()
        results.append(
            torch.cat([out[:, : hq * d], cache[0, 0, offset:].view(m, -1), cache[1, 0, offset:].view(m, -1)], 1)
        )
    assert torch.equal(results[0], results[1])
    assert rel_err(results[0], results[2]) < 1e-2


def test_cuda_graph_capture_of_an_expert_layer_with_the_rope_epilogue():
    """rms_factor -> QKV GEMM with the RoPE epilogue -> split-KV attention -> O GEMM with residual -> rms_factor ->
    gate/up -> down with residual (the action expert's layer as the engine runs it), captured and replayed: equal
    (bf16 rounding) to the same slice with a separate rope_qk, deterministic, nothing allocated."""
    torch.manual_seed(0)
    m, width, d, prefix, eps = 64, 1024, 256, 768, 1e-6
    x0 = torch.randn(m, width, device=DEV).bfloat16()
    w_qkv, w_o = padded(2560, width, std=width**-0.5), padded(width, 2048, std=2048**-0.5)
    w_gu, w_down = padded(8192, width, std=width**-0.5), padded(width, 4096, std=4096**-0.5)
    cos, sin, _ = _rope_inputs(m, 8, 1, d, prefix)
    prefix_kv = torch.randn(2, 1, prefix, 1, d, device=DEV).bfloat16()
    k_block = torch.zeros(1, prefix + m, dtype=torch.int32, device=DEV)
    k_block[:, prefix] = 1
    k_block[:, prefix + 1 :] = 2
    q_block = k_block[:, prefix:].clone()

    def make(fused: bool):
        x = x0.clone()
        cache = torch.cat([prefix_kv, torch.full((2, 1, m, 1, d), float("nan"), device=DEV).bfloat16()], dim=2)
        qkv = torch.full((m, 2560), float("nan"), device=DEV).bfloat16()
        attn, mlp = torch.empty(1, m, 8, d, device=DEV).bfloat16(), torch.empty(m, 4096, device=DEV).bfloat16()
        factor = torch.empty(m, device=DEV)
        ws = Workspace(DEV)
        rope = dict(cos=cos, sin=sin, k_cache=cache[0], v_cache=cache[1], num_q_heads=8, num_kv_heads=1, head_dim=d,
                    cache_offset=prefix)  # fmt: skip

        def layer():
            rms_factor(x, factor, eps)
            if fused:
                gemm(x, w_qkv, qkv, row_scale=factor, rope=rope, workspace=ws)
            else:
                gemm(x, w_qkv, qkv, row_scale=factor, workspace=ws)
                rope_qk(qkv, cos, sin, cache[0], cache[1], num_q_heads=8, num_kv_heads=1, head_dim=d,
                        cache_offset=prefix)  # fmt: skip
            q = qkv[:, : 8 * d].view(1, m, 8, d)
            attention(q, cache[0], cache[1], attn, scale=d**-0.5, q_block=q_block, k_block=k_block, workspace=ws)
            gemm(attn.view(m, 8 * d), w_o, x, residual=x, workspace=ws)
            rms_factor(x, factor, eps)
            gemm(x, w_gu, mlp, gated=True, row_scale=factor, workspace=ws)
            gemm(mlp, w_down, x, residual=x, workspace=ws)

        return x, layer, ws

    results = {}
    for fused in (False, True):
        x, layer, ws = make(fused)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer()  # warm-up: compiles, sizes the workspace
        torch.cuda.current_stream().wait_stream(stream)
        reserved = ws.nbytes
        graph = torch.cuda.CUDAGraph()
        x.copy_(x0)
        with torch.cuda.graph(graph):
            layer()
        replays = []
        for _ in range(2):
            x.copy_(x0)
            graph.replay()
            torch.cuda.synchronize()
            replays.append(x.clone())
        assert torch.equal(replays[0], replays[1]) and torch.isfinite(replays[0]).all()
        assert ws.nbytes == reserved and int(ws.counters(0).abs().sum()) == 0
        results[fused] = replays[0]
    assert rel_err(results[True], results[False]) < 1e-2


# The float32 GEMMs of the bf16 engines (openpi's float32 patch and suffix embeddings): (M, N, K) at 1 and 32 rows.
FLOAT32_SHAPES = [(256, 1152, 588), (4096, 1152, 588), (50, 1024, 32), (1600, 1024, 32), (1600, 1024, 1024)]


def _float32_gemm_error(m: int, n: int, k: int) -> float:
    torch.manual_seed(m + n + k)
    a, w = padded(m, k, torch.float32), padded(n, k, torch.float32, std=k**-0.5)
    bias = torch.randn(n, device=DEV)
    out = torch.empty(m, n, device=DEV)
    gemm(a, w, out, bias=bias, activation="silu")
    expected = F.silu(a.double() @ w.double().T + bias.double())
    return rel_err(out, expected)


@pytest.mark.parametrize("m,n,k", FLOAT32_SHAPES)
def test_float32_gemm_has_float32_accuracy(m, n, k):
    """float32 operands go through three TF32 tensor-core products (`float32_dot`): float32 accuracy against
    float64, where one TF32 product is ~1e-3 off (the next test shows the bound tells them apart)."""
    assert _float32_gemm_error(m, n, k) < 1e-5


def test_float32_gemm_bound_rejects_one_tf32_product(monkeypatch):
    from vla_rt.triton_kernels import float32_dot

    monkeypatch.setattr(float32_dot, "FLOAT32_DOT_PRECISION", "tf32")
    assert _float32_gemm_error(1600, 1024, 1024) > 1e-5
