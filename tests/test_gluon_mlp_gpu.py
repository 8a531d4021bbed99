"""The expert MLP in one Gluon launch (`triton_kernels.gluon_mlp.expert_mlp`) in bf16 at π0's expert dims against
float32 torch: the h it leaves, the residual update, counters that reset (repeated launches bit-identical), and a
CUDA Graph of 18 layers with PDL beside Triton kernels replayed many times (a program reading h before its producers
published, or x before the previous kernel finished, would show as a mismatch or a replay that differs).
The engine with `fused_mlp` against the fp32 reference is in tests/test_gpu_engine.py. Skipped without an sm_90 GPU."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU"
    ),
]

TOL = 1e-2  # bf16 h and x, fp32 accumulation: ~3e-3 expected
EPS = 1e-6
DEV = "cuda"
WIDTH, FF = 1024, 4096


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _rand(*shape, std=1.0, g=None, dtype=torch.bfloat16):
    return (torch.randn(*shape, device=DEV, generator=g) * std).to(dtype)


def _weights(g, dtype=torch.bfloat16):
    return _rand(2 * FF, WIDTH, std=WIDTH**-0.5, g=g, dtype=dtype), _rand(WIDTH, FF, std=FF**-0.5, g=g, dtype=dtype)


def _reference(x: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, x + h @ w_dᵀ) in fp32, h = gelu_tanh(rs x @ gateᵀ) (rs x @ upᵀ) with the RMS factor rs of x's rows."""
    xf = x.float()
    y = (xf @ w_gu.float().T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    h = F.gelu(y[:, :FF], approximate="tanh") * y[:, FF:]
    return h, xf + h @ w_d.float().T


@pytest.mark.parametrize("m", [64, 51, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stages", [(12, 12, True), (12, 12, False), (9, 16, True), (20, 4, True)])
@pytest.mark.parametrize("rows_given", [False, True])
def test_expert_mlp_matches_fp32(m, dtype, stages, rows_given):
    from vla_rt.triton_kernels import expert_mlp
    from vla_rt.triton_kernels.gluon_mlp import MlpConfig

    g = torch.Generator(device=DEV).manual_seed(m)
    w_gu, w_d = _weights(g, dtype)
    x0 = _rand(m, WIDTH, g=g, dtype=dtype)
    ref_h, ref_x = _reference(x0, w_gu, w_d)
    x, h = x0.clone(), torch.full((m, FF), float("nan"), device=DEV, dtype=dtype)
    w_stages, a_stages, stagger = stages
    norm = dict(row_scale=torch.rsqrt(x0.float().pow(2).mean(-1) + EPS)) if rows_given else dict(rms_eps=EPS)
    expert_mlp(x, w_gu, w_d, h, config=MlpConfig(w_stages, a_stages, stagger=stagger), **norm)
    assert rel_err(h, ref_h) <= TOL
    # the update itself, not only x + update (the residual would hide a wrong MLP)
    assert rel_err(x.float() - x0.float(), ref_x - x0.float()) <= 2 * TOL
    assert rel_err(x, ref_x) <= TOL


@pytest.mark.parametrize("m", [64, 51, 1])
def test_expert_mlp_with_the_o_projection_matches_fp32(m):
    """attn / w_o: x += attn @ w_oᵀ (phase 0, its split-K meeting publishing x's columns), then the MLP of that x."""
    from vla_rt.triton_kernels import expert_mlp

    g = torch.Generator(device=DEV).manual_seed(100 + m)
    w_gu, w_d = _weights(g)
    w_o = _rand(WIDTH, 2 * WIDTH, std=(2 * WIDTH) ** -0.5, g=g)
    x0, attn = _rand(m, WIDTH, g=g), _rand(m, 2 * WIDTH, g=g)
    x1 = x0.float() + attn.float() @ w_o.float().T
    ref_h, ref_x = _reference(x1, w_gu, w_d)
    x, h = x0.clone(), torch.full((m, FF), float("nan"), device=DEV, dtype=torch.bfloat16)
    expert_mlp(x, w_gu, w_d, h, rms_eps=EPS, attn=attn, w_o=w_o)
    assert rel_err(h, ref_h) <= TOL
    assert rel_err(x.float() - x0.float(), ref_x - x0.float()) <= 2 * TOL
    for _ in range(5):  # counters reset (phase 0's too): the same result again
        again = x0.clone()
        expert_mlp(again, w_gu, w_d, h, rms_eps=EPS, attn=attn, w_o=w_o)
        assert torch.equal(again, x)


@pytest.mark.parametrize("with_o", [True, False])
@pytest.mark.parametrize("stages", [(12, 12), (4, 8)])
def test_several_layers_in_one_launch_match_fp32(with_o, stages):
    """layers=5: the stacked weights' layers one after the other in one launch (phase 0 with the same attn each
    layer), weights streaming across layer boundaries; against fp32 torch layer by layer, and 10 launches
    bit-identical with the counters back at zero."""
    from vla_rt.triton_kernels import default_workspace, expert_mlp
    from vla_rt.triton_kernels.gluon_mlp import MlpConfig

    g = torch.Generator(device=DEV).manual_seed(7)
    layers, m = 5, 64
    ws = [_weights(g) for _ in range(layers)]
    ws_o = [_rand(WIDTH, 2 * WIDTH, std=(2 * WIDTH) ** -0.5, g=g) for _ in range(layers)]
    w_gu, w_d, w_o = (torch.cat(t) for t in ([w[0] for w in ws], [w[1] for w in ws], ws_o))
    x0, attn = _rand(m, WIDTH, g=g), _rand(m, 2 * WIDTH, g=g)
    ref = x0.float()
    for i in range(layers):
        if with_o:
            ref = ref + attn.float() @ ws_o[i].float().T
        ref = _reference(ref, *ws[i])[1]
    o_args = dict(attn=attn, w_o=w_o) if with_o else {}
    h = torch.empty(m, FF, device=DEV, dtype=torch.bfloat16)
    first = None
    for _ in range(10):
        x = x0.clone()
        expert_mlp(x, w_gu, w_d, h, rms_eps=EPS, layers=layers, config=MlpConfig(*stages), **o_args)
        if first is None:
            first = x.clone()
            assert rel_err(x.float() - x0.float(), ref - x0.float()) <= 2 * TOL
        assert torch.equal(x, first)
    torch.cuda.synchronize()
    assert int(default_workspace(x.device).counters(0).abs().sum()) == 0


def test_repeated_launches_are_bit_identical_and_leave_the_counters_at_zero():
    from vla_rt.triton_kernels import default_workspace, expert_mlp

    g = torch.Generator(device=DEV).manual_seed(3)
    w_gu, w_d = _weights(g)
    x0 = _rand(64, WIDTH, g=g)
    h = torch.empty(64, FF, device=DEV, dtype=torch.bfloat16)
    first = None
    for _ in range(20):
        x = x0.clone()
        expert_mlp(x, w_gu, w_d, h, rms_eps=EPS)
        first = x.clone() if first is None else first
        assert torch.equal(x, first)
    torch.cuda.synchronize()
    assert int(default_workspace(x.device).counters(0).abs().sum()) == 0


@pytest.mark.parametrize("with_o", [False, True])
def test_pdl_chain_in_a_cuda_graph_replays_match_fp32_and_each_other(with_o):
    """18 blocks x += O(x) (Triton `gemm`, or with_o: `expert_mlp`'s phase 0 over x), x += MLP(x) (`expert_mlp`) in
    one CUDA Graph with PDL: replays on new inputs match torch in fp32, and 50 replays of one input are
    bit-identical."""
    from vla_rt.triton_kernels import expert_mlp, gemm

    g = torch.Generator(device=DEV).manual_seed(5)
    m, layers = 64, 18
    ws_o = [_rand(WIDTH, WIDTH, std=WIDTH**-0.5 * 0.5, g=g) for _ in range(layers)]
    ws = [_weights(g) for _ in range(layers)]
    x, h = _rand(m, WIDTH, g=g), torch.empty(m, FF, device=DEV, dtype=torch.bfloat16)
    xc = torch.empty_like(x)  # with_o: phase 0 reads a copy of x (attn may not alias the x it updates)

    def chain():
        for w_o, (w_gu, w_d) in zip(ws_o, ws):
            if with_o:
                xc.copy_(x)
                expert_mlp(x, w_gu, w_d, h, rms_eps=EPS, attn=xc, w_o=w_o)
            else:
                gemm(x, w_o, x, residual=x)
                expert_mlp(x, w_gu, w_d, h, rms_eps=EPS)

    def reference(x0):
        xf = x0.float()
        for w_o, (w_gu, w_d) in zip(ws_o, ws):
            xf = xf + xf @ w_o.float().T
            xf = _reference(xf, w_gu, w_d)[1]
        return xf

    chain()  # eager first: compiles, and sizes the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for i in range(3):
        x0 = _rand(m, WIDTH, g=g)
        x.copy_(x0)
        graph.replay()
        first = x.clone()
        assert torch.isfinite(first).all()
        assert rel_err(first, reference(x0)) <= 3e-2  # 36 bf16 roundings of the residual stream
        for _ in range(50 if i == 0 else 3):
            x.copy_(x0)
            graph.replay()
            assert torch.equal(x, first)


def test_bad_calls_say_what_is_wrong():
    from vla_rt.triton_kernels import expert_mlp, expert_mlp_applies
    from vla_rt.triton_kernels.gluon_mlp import MlpConfig

    w_gu, w_d = _weights(None)
    x, h = _rand(64, WIDTH), torch.empty(64, FF, device=DEV, dtype=torch.bfloat16)
    assert expert_mlp_applies(x, w_gu, w_d) is None
    with pytest.raises(ValueError, match="M <= 64"):
        expert_mlp(_rand(65, WIDTH), w_gu, w_d, torch.empty(65, FF, device=DEV, dtype=torch.bfloat16), rms_eps=EPS)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        expert_mlp(x.float(), w_gu.float(), w_d.float(), h.float(), rms_eps=EPS)
    with pytest.raises(ValueError, match="gate/up"):
        expert_mlp(x, w_gu[:FF], w_d, h, rms_eps=EPS)
    with pytest.raises(ValueError, match="h must be"):
        expert_mlp(x, w_gu, w_d, h[:, :1024], rms_eps=EPS)
    with pytest.raises(ValueError, match="4 <= a_stages"):  # phase 2 would wait for a slot it holds itself
        expert_mlp(x, w_gu, w_d, h, rms_eps=EPS, config=MlpConfig(12, 2))
    with pytest.raises(ValueError, match="summed in-kernel"):
        expert_mlp(x, w_gu, w_d, h, row_scale=torch.ones(64, device=DEV), attn=_rand(64, 2048), w_o=_rand(WIDTH, 2048))
    with pytest.raises(ValueError, match="O projection needs"):
        expert_mlp(x, w_gu, w_d, h, rms_eps=EPS, attn=_rand(64, 1000), w_o=_rand(WIDTH, 1000))
    with pytest.raises(ValueError, match=r"gate/up \(3 x 2 MLP"):  # layers=3 needs three layers' rows
        expert_mlp(x, w_gu, w_d, h, rms_eps=EPS, layers=3)
    with pytest.raises(ValueError, match="exactly one"):
        expert_mlp(x, w_gu, w_d, h)
    with pytest.raises(ValueError, match="row_scale must be"):
        expert_mlp(x, w_gu, w_d, h, row_scale=torch.ones(64, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sm_90"):
        expert_mlp(x.cpu(), w_gu.cpu(), w_d.cpu(), h.cpu(), rms_eps=EPS)
