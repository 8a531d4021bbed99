"""The Gluon skinny GEMM (`triton_kernels.gluon_gemm`) in bf16 at the action expert's shapes against float32 torch:
plain (+ residual aliasing out, row scale), gated GeGLU and the RoPE epilogue into the KV cache, each with the RMS
factor summed in-kernel; in a CUDA Graph with PDL beside Triton kernels (a race on A would read a stale input).
The engine with `skinny_gluon` against the fp32 reference is in tests/test_gpu_engine.py. Skipped without an
sm_90 GPU."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU"
    ),
]

TOL = 1e-2  # bf16 output, fp32 accumulation: ~3e-3 expected
EPS = 1e-6
DEV = "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _rand(*shape, std=1.0, g=None):
    return (torch.randn(*shape, device=DEV, generator=g) * std).to(torch.bfloat16)


def _rms(a: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(a.float().pow(2).mean(-1) + EPS)


def _rotate(y, cos, sin):  # openpi's split-halves RoPE, y (b, t, h, D) fp32, cos/sin (b, t, D/2)
    c, s = cos[:, :, None], sin[:, :, None]
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1)


@pytest.mark.parametrize("m", [64, 51, 17])
@pytest.mark.parametrize("n,k", [(2560, 1024), (1024, 1024), (1024, 512)])
@pytest.mark.parametrize("scale", ["none", "rows", "rms"])
def test_plain(m, n, k, scale):
    from vla_rt.triton_kernels import skinny_gemm

    g = torch.Generator(device=DEV).manual_seed(m * n + k)
    a, w = _rand(m, k, g=g), _rand(n, k, std=k**-0.5, g=g)
    residual = _rand(m, n, g=g)
    ref = a.float() @ w.float().T
    kwargs = {}
    if scale == "rows":
        rs = torch.rand(m, device=DEV, generator=g) + 0.5
        ref, kwargs = ref * rs[:, None], dict(row_scale=rs)
    elif scale == "rms":
        ref, kwargs = ref * _rms(a)[:, None], dict(rms_eps=EPS)
    ref = ref + residual.float()
    out = residual.clone()  # the residual aliases out, as the engine's x += ...
    skinny_gemm(a, w, out, residual=out, **kwargs)
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("m", [64, 51])
@pytest.mark.parametrize("rms", [False, True])
def test_gated(m, rms):
    from vla_rt.triton_kernels import skinny_gemm

    g = torch.Generator(device=DEV).manual_seed(m + rms)
    n, k = 4096, 1024
    a, w = _rand(m, k, g=g), _rand(2 * n, k, std=k**-0.5, g=g)
    rs = _rms(a) if rms else torch.rand(m, device=DEV, generator=g) + 0.5
    y = (a.float() @ w.float().T) * rs[:, None]
    ref = F.gelu(y[:, :n], approximate="tanh") * y[:, n:]
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    skinny_gemm(a, w, out, gated=True, **(dict(rms_eps=EPS) if rms else dict(row_scale=rs)))
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("batch,t,offset", [(1, 64, 320), (1, 51, 788), (2, 32, 100)])
def test_rope_into_cache(batch, t, offset):
    """QKV with the RoPE epilogue: Q rotated in `out` (the K/V columns untouched), rotated K and plain V in the
    cache rows offset.., every other cache row untouched; per-batch-row tables as the engine's slots hold them."""
    from vla_rt.triton_kernels import skinny_gemm

    g = torch.Generator(device=DEV).manual_seed(batch * t + offset)
    hq, hkv, d, k = 8, 1, 256, 1024
    m = batch * t
    a, w = _rand(m, k, g=g), _rand((hq + 2 * hkv) * d, k, std=k**-0.5, g=g)
    pos = torch.arange(t, device=DEV)[None] + offset + torch.arange(batch, device=DEV)[:, None] * 7
    inv = 10000.0 ** (-torch.arange(0, d, 2, device=DEV).float() / d)
    cos, sin = torch.cos(pos[..., None] * inv), torch.sin(pos[..., None] * inv)
    k_cache = _rand(batch, offset + t + 5, hkv, d, g=g)
    v_cache = _rand(batch, offset + t + 5, hkv, d, g=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = _rand(m, (hq + 2 * hkv) * d, g=g)
    out_before = out.clone()
    skinny_gemm(a, w, out, rms_eps=EPS, rope=dict(cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                cache_offset=offset, num_q_heads=hq, num_kv_heads=hkv, head_dim=d))  # fmt: skip
    y = ((a.float() @ w.float().T) * _rms(a)[:, None]).view(batch, t, hq + 2 * hkv, d)
    q, kk, v = y.split([hq, hkv, hkv], dim=2)
    rows = slice(offset, offset + t)
    assert rel_err(out[:, : hq * d].view(batch, t, hq, d), _rotate(q, cos, sin)) <= TOL
    assert torch.equal(out[:, hq * d :], out_before[:, hq * d :])
    assert rel_err(k_cache[:, rows], _rotate(kk, cos, sin)) <= TOL
    assert rel_err(v_cache[:, rows], v) <= TOL
    for cache, before in ((k_cache, k_before), (v_cache, v_before)):
        assert torch.equal(cache[:, :offset], before[:, :offset]) and torch.equal(
            cache[:, offset + t :], before[:, offset + t :]
        )


def test_pdl_chain_in_a_cuda_graph_reads_fresh_inputs():
    """18 layer-like blocks x = x + gemm(GeGLU(skinny_gated(x))) with the RMS factor in-kernel, Triton `gemm` for
    the down projection, captured in one CUDA Graph with PDL: replays on new inputs match torch in fp32 (a Gluon
    kernel reading A before the previous kernel finished would not) and are bit-identical run to run."""
    from vla_rt.triton_kernels import gemm, skinny_gemm

    g = torch.Generator(device=DEV).manual_seed(5)
    m, width, ff, layers = 64, 1024, 4096, 18
    ws_gu = [_rand(2 * ff, width, std=width**-0.5, g=g) for _ in range(layers)]
    ws_d = [_rand(width, ff, std=ff**-0.5 * 0.5, g=g) for _ in range(layers)]
    x, h = _rand(m, width, g=g), torch.empty(m, ff, device=DEV, dtype=torch.bfloat16)

    def chain():
        for wgu, wd in zip(ws_gu, ws_d):
            skinny_gemm(x, wgu, h, gated=True, rms_eps=EPS)
            gemm(h, wd, x, residual=x)

    def reference(x0):
        xf = x0.float()
        for wgu, wd in zip(ws_gu, ws_d):
            y = (xf @ wgu.float().T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
            xf = xf + (F.gelu(y[:, :ff], approximate="tanh") * y[:, ff:]) @ wd.float().T
        return xf

    x0 = x.clone()
    chain()  # eager first: compiles, and gemm's workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        x0 = _rand(m, width, g=g)
        x.copy_(x0)
        graph.replay()
        first = x.clone()
        x.copy_(x0)
        graph.replay()
        assert torch.equal(x, first)
        assert rel_err(x, reference(x0)) <= 3e-2  # 36 bf16 roundings of the residual stream


def test_bad_calls_say_what_is_wrong():
    from vla_rt.triton_kernels import skinny_gemm

    a, w = _rand(64, 1024), _rand(2560, 1024)
    out = torch.empty(64, 2560, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M <= 64"):
        skinny_gemm(_rand(65, 1024), w, torch.empty(65, 2560, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K <= 1024"):
        skinny_gemm(_rand(64, 2048), _rand(2560, 2048), out)
    with pytest.raises(ValueError, match="row_scale or rms_eps"):
        skinny_gemm(a, w, out, row_scale=torch.ones(64, device=DEV), rms_eps=EPS)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        skinny_gemm(a.float(), w.float(), out)
    with pytest.raises(ValueError, match="out must be"):
        skinny_gemm(a, w, out[:, :1024])
