"""RoPE-into-KV-cache and patchify kernels vs torch, in Triton's interpreter (fp32 and fp16) on the CPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vla_rt.numerics import rel_err
from vla_rt.triton_kernels import gemm, patchify, rope_qk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 1e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def rotate_halves(x, cos, sin):
    """openpi's split-halves RoPE in float64; x (..., D), cos/sin broadcastable to (..., D/2)."""
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_tables(t, d, positions_offset=0, batch=None):
    """Real RoPE angles (max wavelength 10,000) for positions offset.. (per batch row if batch)."""
    freq = 10_000 ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    pos = torch.arange(t, dtype=torch.float64) + positions_offset
    if batch:
        pos = pos[None] + torch.arange(batch, dtype=torch.float64)[:, None] * 3  # different positions per row
    ang = pos[..., None] * freq
    return ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)


@DTYPES
@pytest.mark.parametrize(
    "heads,per_batch", [((4, 1), False), ((2, 2), True)], ids=["gqa_shared_table", "mha_per_batch"]
)
def test_rope_qk_rotates_q_in_place_and_fills_cache(dtype, heads, per_batch):
    hq, hkv = heads
    b, t, d, t_cache, offset = 2, 5, 24, 11, 4  # D/2 = 12: not a power of two
    qkv = torch.randn(b * t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    before = qkv.clone()
    cos, sin = rope_tables(t, d, positions_offset=7, batch=b if per_batch else None)
    k_cache = torch.full((b, t_cache, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full((b, t_cache, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    rope_qk(qkv, cos, sin, k_cache, v_cache, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, cache_offset=offset,
            q_scale=d**-0.5)  # fmt: skip

    x = before.view(b, t, hq + 2 * hkv, d)
    c = (cos if per_batch else cos.expand(b, t, -1))[:, :, None].double()
    s = (sin if per_batch else sin.expand(b, t, -1))[:, :, None].double()
    got = qkv.view(b, t, hq + 2 * hkv, d)
    assert rel_err(got[:, :, :hq], rotate_halves(x[:, :, :hq], c, s) * d**-0.5) < TOL[dtype]
    assert torch.equal(got[:, :, hq:], x[:, :, hq:])  # K and V columns of the buffer untouched
    assert rel_err(k_cache[:, offset : offset + t], rotate_halves(x[:, :, hq : hq + hkv], c, s)) < TOL[dtype]
    assert torch.equal(v_cache[:, offset : offset + t], x[:, :, hq + hkv :])
    for cache in (k_cache, v_cache):  # rows outside the slice untouched
        assert cache[:, :offset].isnan().all() and cache[:, offset + t :].isnan().all()


@DTYPES
@pytest.mark.parametrize("bias_rows", [0, 1, 2], ids=["no_bias", "bias", "bias_per_batch_row"])
def test_rope_qk_applies_a_gemm_epilogue_first(dtype, bias_rows):
    """With row_scale and bias, every row is `row_scale * row + bias` before the rotation (Q, K and V alike): the
    epilogue of a plain QKV GEMM (cuBLAS) moved here, which must equal the fused GEMM's `rope` contract."""
    hq, hkv, b, t, d, t_cache, offset = 2, 1, 2, 3, 16, 8, 5
    g = torch.Generator().manual_seed(1)
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(b * t, width, generator=g).to(dtype).to(DEVICE)
    scale = (torch.rand(b * t, generator=g) + 0.5).to(DEVICE)
    bias = torch.randn(max(bias_rows, 1), width, generator=g).to(dtype).to(DEVICE)
    bias = None if bias_rows == 0 else bias[0] if bias_rows == 1 else bias
    x = qkv.double() * scale.double()[:, None]
    if bias is not None:
        x = x + (bias.double() if bias.dim() == 1 else bias.double().repeat_interleave(t, dim=0))
    cos, sin = rope_tables(t, d, positions_offset=2, batch=b)
    k_cache = torch.full((b, t_cache, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    rope_qk(qkv, cos, sin, k_cache, v_cache, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, cache_offset=offset,
            row_scale=scale, bias=bias)  # fmt: skip

    x = x.view(b, t, hq + 2 * hkv, d)
    c, s = cos[:, :, None].double(), sin[:, :, None].double()
    assert rel_err(qkv.view(b, t, -1, d)[:, :, :hq], rotate_halves(x[:, :, :hq], c, s)) < TOL[dtype]
    assert rel_err(k_cache[:, offset : offset + t], rotate_halves(x[:, :, hq : hq + hkv], c, s)) < TOL[dtype]
    assert rel_err(v_cache[:, offset : offset + t], x[:, :, hq + hkv :]) < TOL[dtype]


def test_rope_qk_names_a_wrong_row_scale_or_bias():
    qkv = torch.zeros(4, 3 * 16, device=DEVICE)
    cos = sin = torch.zeros(4, 8, device=DEVICE)
    cache = torch.zeros(1, 6, 1, 16, device=DEVICE)
    args = dict(num_q_heads=1, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match=r"row_scale must be contiguous float32 \(4,\), got torch.float16"):
        rope_qk(qkv, cos, sin, cache, cache, row_scale=torch.ones(4, dtype=torch.float16, device=DEVICE), **args)
    with pytest.raises(ValueError, match=r"bias must be \(48,\) or \(G, 48\) with 4 rows a multiple of G"):
        rope_qk(qkv, cos, sin, cache, cache, bias=torch.zeros(3, 48, device=DEVICE), **args)


def test_rope_rejects_out_of_range_cache_rows():
    qkv = torch.zeros(4, 3 * 16, device=DEVICE)
    cos = sin = torch.zeros(4, 8, device=DEVICE)
    cache = torch.zeros(1, 6, 1, 16, device=DEVICE)
    with pytest.raises(ValueError):
        rope_qk(qkv, cos, sin, cache, cache, num_q_heads=1, num_kv_heads=1, head_dim=16, cache_offset=3)


def reference_patches(images, p):
    n, s, _, c = images.shape
    g = s // p
    return images.reshape(n, g, p, g, p, c).permute(0, 1, 3, 2, 4, 5).reshape(n * g * g, p * p * c)


@DTYPES
def test_patchify_order(dtype):
    images = torch.rand(2, 28, 28, 3, device=DEVICE) * 2 - 1
    out = torch.full((8, 588), float("nan"), dtype=dtype, device=DEVICE)
    patchify(images, out, 14)
    assert torch.equal(out, reference_patches(images, 14).to(dtype))


def test_patchify_strided_images_into_padded_rows():
    """Images as a view (every other image, 3 of 4 channels); rows padded to a multiple of 8 for aligned GEMM loads."""
    raw = torch.rand(4, 12, 12, 4, device=DEVICE)
    images = raw[::2, :, :, :3]
    out_buf = torch.full((2 * 9, 56), float("nan"), device=DEVICE)
    out = out_buf[:, :48]
    patchify(images, out, 4)
    assert torch.equal(out, reference_patches(images.contiguous(), 4))
    assert out_buf[:, 48:].isnan().all()


def test_patchify_gemm_equals_conv_with_hwio_kernel():
    """The documented weight mapping: HWIO kernel (p, p, C, W).reshape(p*p*C, W).T is the GEMM weight."""
    p, width = 7, 10
    images = torch.randn(2, 14, 14, 3, device=DEVICE)
    kernel_hwio = torch.randn(p, p, 3, width, device=DEVICE) * 0.1
    bias = torch.randn(width, device=DEVICE)
    # float64 so that a GPU run is not judged against a TF32 convolution
    conv = F.conv2d(
        images.double().permute(0, 3, 1, 2), kernel_hwio.double().permute(3, 2, 0, 1), bias.double(), stride=p
    )
    expected = conv.permute(0, 2, 3, 1).reshape(-1, width)
    patches = torch.empty(8, p * p * 3, device=DEVICE)
    patchify(images, patches, p)
    out = torch.empty(8, width, device=DEVICE)
    gemm(patches, kernel_hwio.reshape(p * p * 3, width).T.contiguous(), out, bias=bias)
    assert rel_err(out, expected) < 1e-5
