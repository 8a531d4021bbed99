"""The persistent action-expert layer kernel (`triton_kernels.expert_layer`) against the separate ops it replaces
(TorchKernels: rms_factor, the QKV GEMM + RoPE into the cache, masked attention, the residual GEMMs, GeGLU), in
fp32/fp16 on the CPU interpreter (one program walks every unit) and in bf16 on a GPU (one program per SM, real
grid barriers)."""

from __future__ import annotations

import functools

import pytest
import torch

from vla_rt import triton_kernels as tk
from vla_rt.engine.kernels import TorchKernels
from vla_rt.triton_kernels.expert_layer import ExpertLayerConfig, expert_layer, expert_layer_applies

# the interpreter tests run where there is no GPU (with CUDA, the kernel module compiles instead of interpreting)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; the GPU runs the bf16 tests")
# small dims for the interpreter: every phase has several units and both split merges run
SMALL = dict(width=64, mlp=128, heads=2, head_dim=64)
SMALL_CFG = ExpertLayerConfig(block_m=16, block_k=32, qkv_half=16, att_rows=16, att_keys=16, att_splits=2,
                              o_cols=16, o_split=2, gate_cols=16, down_cols=16, down_split=2)  # fmt: skip
# π0's action expert (Gemma 300M) on a GPU
PI0 = dict(width=1024, mlp=4096, heads=8, head_dim=256)


def make_case(b, s, prefix, width, mlp, heads, head_dim, dtype, device, seed=0, padded_prefix=0):
    """Random layer weights, an x, a KV cache whose prefix rows are filled, openpi-style block masks (prefix 0,
    state token 1, actions 2; `padded_prefix` trailing prefix keys hidden)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

    keys = prefix + s
    case = dict(
        x=rnd(b * s, width),
        w_qkv=rnd((heads + 2) * head_dim, width, std=width**-0.5),
        w_o=rnd(width, heads * head_dim, std=(heads * head_dim) ** -0.5),
        w_gate_up=rnd(2 * mlp, width, std=width**-0.5),
        w_down=rnd(width, mlp, std=mlp**-0.5),
        k_cache=rnd(b, keys + 3, 1, head_dim),
        v_cache=rnd(b, keys + 3, 1, head_dim),
    )
    pos = torch.arange(prefix, prefix + s, dtype=torch.float32)[:, None]
    freq = 10000.0 ** (-torch.arange(head_dim // 2, dtype=torch.float32) / (head_dim // 2))
    case["cos"] = torch.cos(pos * freq).expand(b, s, -1).contiguous().to(device)
    case["sin"] = torch.sin(pos * freq).expand(b, s, -1).contiguous().to(device)
    q_block = torch.full((b, s), 2, dtype=torch.int32)
    q_block[:, 0] = 1
    k_block = torch.zeros((b, keys), dtype=torch.int32)
    k_block[:, prefix:] = q_block
    if padded_prefix:
        k_block[:, prefix - padded_prefix : prefix] = 2**20
    case["q_block"], case["k_block"] = q_block.to(device), k_block.to(device)
    return case


def run_layer(layer, case, *, prefix, heads, head_dim, eps, scale, **options):
    """One layer by `layer` on copies of the case's x and caches: (x, k_cache, v_cache, q)."""
    x = case["x"].clone()
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    m = x.shape[0]
    b, s = case["q_block"].shape
    qkv = torch.empty(m, case["w_qkv"].shape[0], dtype=x.dtype, device=x.device)
    attn = torch.empty(m, heads * head_dim, dtype=x.dtype, device=x.device)
    h = torch.empty(m, case["w_down"].shape[1], dtype=x.dtype, device=x.device)
    layer(
        x, case["w_qkv"], case["w_o"], case["w_gate_up"], case["w_down"], qkv, attn, h, kc, vc, case["cos"],
        case["sin"], case["q_block"], case["k_block"], cache_offset=prefix, eps=eps, scale=scale, num_q_heads=heads,
        head_dim=head_dim, **options,
    )  # fmt: skip
    return x, kc, vc, qkv.view(b, s, -1, head_dim)[:, :, :heads]


# the spec: the separate ops plan._gemma_layer runs for the expert (TorchKernels.expert_layer composes them; the
# engine tests check it against the reference model); the subject: the persistent kernel
separate_path = functools.partial(run_layer, TorchKernels.expert_layer)
fused_path = functools.partial(run_layer, expert_layer)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_layer(b, s, prefix, dims, dtype, device, config, tol, padded_prefix=0, seed=0, workspace=None):
    case = make_case(b, s, prefix, **dims, dtype=dtype, device=device, seed=seed, padded_prefix=padded_prefix)
    kw = dict(prefix=prefix, heads=dims["heads"], head_dim=dims["head_dim"], eps=1e-6, scale=dims["head_dim"] ** -0.5)
    want = separate_path(case, **kw)
    got = fused_path(case, **kw, config=config, workspace=workspace)
    keys = prefix + s
    errs = {
        "x": rel_err(got[0], want[0]),
        "k_suffix": rel_err(got[1][:, prefix:keys], want[1][:, prefix:keys]),
        "v_suffix": rel_err(got[2][:, prefix:keys], want[2][:, prefix:keys]),
        "q": rel_err(got[3], want[3]),
    }
    assert all(e < tol for e in errs.values()), errs
    # the update is not the identity: x moved by much more than the tolerance
    assert rel_err(want[0], case["x"]) > 20 * tol
    # cache rows outside the suffix are untouched
    assert torch.equal(got[1][:, :prefix], case["k_cache"][:, :prefix])
    assert torch.equal(got[1][:, keys:], case["k_cache"][:, keys:])
    return errs


@cpu_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("b,s,prefix", [(1, 13, 20), (2, 5, 9)])
def test_expert_layer_matches_separate_ops(dtype, tol, b, s, prefix):
    check_layer(b, s, prefix, SMALL, dtype, "cpu", SMALL_CFG, tol)


@cpu_only
def test_expert_layer_masks_padded_prefix_keys_and_splits_without_merge():
    cfg = ExpertLayerConfig(**{**SMALL_CFG.__dict__, "att_splits": 1, "o_split": 1, "down_split": 1})
    check_layer(1, 11, 24, SMALL, torch.float32, "cpu", cfg, 1e-5, padded_prefix=5)


@cpu_only
def test_expert_layer_counters_reset_for_the_next_launch():
    ws = tk.Workspace("cpu")
    check_layer(2, 5, 9, SMALL, torch.float32, "cpu", SMALL_CFG, 1e-5, workspace=ws)
    assert int(ws.counters(0).abs().sum()) == 0
    check_layer(2, 5, 9, SMALL, torch.float32, "cpu", SMALL_CFG, 1e-5, workspace=ws, seed=1)


@cpu_only
def test_expert_layer_check_can_fail():
    """The comparison sees a wrong layer: a changed eps in the kernel shifts x beyond the tolerance."""
    case = make_case(1, 13, 20, **SMALL, dtype=torch.float32, device="cpu")
    kw = dict(prefix=20, heads=2, head_dim=64, scale=0.125)
    want = separate_path(case, **kw, eps=1e-6)
    got = fused_path(case, **kw, eps=0.5, config=SMALL_CFG)
    assert rel_err(got[0], want[0]) > 1e-3


@cpu_only
def test_expert_layer_rejects_what_it_does_not_serve():
    assert expert_layer_applies(64, 1024, 4096, 8, 1, 256) is None
    assert "KV heads" in expert_layer_applies(64, 1024, 4096, 8, 2, 256)
    assert "rows" in expert_layer_applies(65, 1024, 4096, 8, 1, 256)
    case = make_case(1, 13, 20, **SMALL, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="w_o must be"):
        case["w_o"] = case["w_o"][:, :-16]
        fused_path(case, prefix=20, heads=2, head_dim=64, eps=1e-6, scale=0.125, config=SMALL_CFG)
    case = make_case(1, 13, 20, **SMALL, dtype=torch.float32, device="cpu")
    case["k_block"] = case["k_block"].long()
    with pytest.raises(ValueError, match="k_block must be torch.int32"):
        fused_path(case, prefix=20, heads=2, head_dim=64, eps=1e-6, scale=0.125, config=SMALL_CFG)


def gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


GPU_CONFIGS = {
    "default": {},
    "l2_prefetch": dict(prefetch=1),
    # no split merges, the atomic-poll barrier, the first sweep's tiles
    "unsplit_atomic_poll": dict(att_splits=1, o_split=1, down_split=1, o_cols=16, down_cols=16, poll_load=0),
    "first_sweep": dict(att_keys=64, o_cols=16, o_split=2, down_cols=16, down_split=2, num_stages=3),
}


@gpu
@pytest.mark.parametrize("b,s,prefix", [(1, 64, 256), (1, 51, 788), (2, 32, 532)])
@pytest.mark.parametrize("change", list(GPU_CONFIGS))
def test_gpu_expert_layer_bf16(b, s, prefix, change):
    cfg = ExpertLayerConfig(**GPU_CONFIGS[change])
    ws = tk.Workspace("cuda")
    for seed in range(3):  # repeated launches: the barrier and tile counters reset themselves
        check_layer(b, s, prefix, PI0, torch.bfloat16, "cuda", cfg, 1e-2, padded_prefix=7, seed=seed, workspace=ws)
    torch.cuda.synchronize()
    assert int(ws.counters(0).abs().sum()) == 0
