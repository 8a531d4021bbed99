"""Attention kernel vs an explicit torch reference: GQA packing, openpi's masks as block ids, padding, rows that see
nothing, split-KV, strided views, non-power-of-two head dims. Triton interpreter in fp32 and fp16 on the CPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import math  # noqa: E402

import pytest  # noqa: E402

from vla_rt.numerics import rel_err
from vla_rt.triton_kernels import AttentionConfig, Workspace, attention, attention_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
PAD = 2**30


def reference(q, k, v, scale, visible=None):
    """float64 softmax attention; visible: bool (B, Tq, Tk) or None; rows with no visible key give zeros."""
    group = q.shape[2] // k.shape[2]
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    logits = scale * qd @ kd.transpose(-1, -2)
    if visible is not None:
        logits = logits.masked_fill(~visible[:, None], -math.inf)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return (probs @ vd).transpose(1, 2)


def openpi_attn_mask(input_mask: torch.Tensor, ar_mask: torch.Tensor) -> torch.Tensor:
    """openpi's make_attn_mask: (B, T) bool input/ar masks -> (B, T, T) bool."""
    cumsum = torch.cumsum(ar_mask.int(), dim=1)
    attn = cumsum[:, None, :] <= cumsum[:, :, None]
    valid = input_mask[:, None, :] & input_mask[:, :, None]
    return attn & valid


def block_ids(input_mask: torch.Tensor, ar_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same mask as (q_block, k_block): invalid keys get PAD (seen by nobody), invalid queries -1 (see nothing)."""
    cumsum = torch.cumsum(ar_mask.int(), dim=1).int()
    return torch.where(input_mask, cumsum, -1).int(), torch.where(input_mask, cumsum, PAD).int()


def pi0_masks(b: int, prefix_valid: list[int], prefix_len: int, chunk: int):
    """Prefix (views + prompt, some padding) + suffix (state token, `chunk` action tokens), openpi's ar_mask."""
    t = prefix_len + 1 + chunk
    input_mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(prefix_valid):
        input_mask[i, :n] = True
    input_mask[:, prefix_len:] = True
    ar_mask = torch.zeros(b, t, dtype=torch.bool)
    ar_mask[:, prefix_len] = True  # the state token opens a block
    ar_mask[:, prefix_len + 1] = True  # the first action token opens another
    return input_mask, ar_mask


def rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def run(q, k, v, scale, q_block=None, k_block=None, config=None, workspace=None):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)  # poison
    attention(q, k, v, out, scale=scale, q_block=q_block, k_block=k_block, config=config, workspace=workspace)
    assert torch.isfinite(out).all()
    return out


def test_block_ids_reproduce_openpi_mask():
    input_mask, ar_mask = pi0_masks(2, [9, 6], prefix_len=10, chunk=5)
    q_block, k_block = block_ids(input_mask, ar_mask)
    from_blocks = k_block[:, None, :] <= q_block[:, :, None]
    assert torch.equal(from_blocks, openpi_attn_mask(input_mask, ar_mask))


CONFIGS = {
    "default": None,
    "packed_heads_split3": AttentionConfig(block_m=32, block_n=16, heads_per_program=4, num_splits=3),
    "one_head_per_program": AttentionConfig(block_m=16, block_n=16, heads_per_program=1),
    "split3_combine_kernel": AttentionConfig(block_m=32, block_n=16, heads_per_program=4, num_splits=3, combine=1),
    "hpp2_split2_combine_kernel": AttentionConfig(block_m=16, block_n=16, heads_per_program=2, num_splits=2, combine=1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_prefix_lm_mask_with_gqa(dtype, config):
    """π0's joint attention: 8 query heads on 1 KV head, padded prefix, state and action blocks, B=2."""
    input_mask, ar_mask = pi0_masks(2, [11, 7], prefix_len=12, chunk=6)
    q_block, k_block = (x.to(DEVICE) for x in block_ids(input_mask, ar_mask))
    t, d = input_mask.shape[1], 16
    q, k, v = (
        rand(2, t, 8, d, dtype=dtype, seed=1),
        rand(2, t, 1, d, dtype=dtype, seed=2),
        rand(2, t, 1, d, dtype=dtype, seed=3),
    )
    out = run(q, k, v, d**-0.5, q_block, k_block, CONFIGS[config])
    visible = (k_block[:, None, :] <= q_block[:, :, None]).cpu()
    ref = reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5, visible)
    assert rel_err(out.cpu(), ref) < TOL[dtype]
    padded_queries = ~input_mask
    assert (out.cpu()[padded_queries] == 0).all()  # queries that see nothing give zeros, not NaN


@pytest.mark.parametrize("combine", [0, 1], ids=["last_program_merges", "combine_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_suffix_over_cache_split_kv(dtype, combine):
    """The action expert: suffix queries over [prefix cache; own keys], keys split over programs."""
    input_mask, ar_mask = pi0_masks(1, [13], prefix_len=16, chunk=7)
    q_block, k_block = (x.to(DEVICE) for x in block_ids(input_mask, ar_mask))
    suffix = 8
    d = 16
    q = rand(1, suffix, 8, d, dtype=dtype, seed=4)
    k, v = rand(1, 24, 1, d, dtype=dtype, seed=5), rand(1, 24, 1, d, dtype=dtype, seed=6)
    cfg = AttentionConfig(16, 16, heads_per_program=8, num_splits=4, combine=combine)  # 2 splits have no keys
    out = run(q, k, v, d**-0.5, q_block[:, -suffix:].contiguous(), k_block, cfg)
    visible = (k_block[:, None, :] <= q_block[:, -suffix:, None]).cpu()
    assert rel_err(out.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5, visible)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_merges_agree_bitwise_and_combine_slices_cover_everything(dtype):
    """Both merges compute the same sums in the same order (identical bits). D = 40 (padded to 64) with 16-row
    slices: the combine kernel's (row, column) slices must cover every valid output element and no padding."""
    b, tq, tk, d = 2, 11, 37, 40
    q, k, v = (
        rand(b, tq, 4, d, dtype=dtype, seed=20),
        rand(b, tk, 2, d, dtype=dtype, seed=21),
        rand(b, tk, 2, d, dtype=dtype, seed=22),
    )
    q_block = torch.randint(0, 3, (b, tq), dtype=torch.int32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    k_block = torch.randint(0, 3, (b, tk), dtype=torch.int32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    outs = []
    for combine in (0, 1):
        cfg = AttentionConfig(32, 16, heads_per_program=2, num_splits=3, combine=combine)
        ws = Workspace(DEVICE)
        outs.append(run(q, k, v, 0.2, q_block, k_block, cfg, ws))
        assert int(ws.counters(0).abs().sum()) == 0
    assert torch.equal(outs[0], outs[1])
    visible = (k_block[:, None, :] <= q_block[:, :, None]).cpu()
    assert rel_err(outs[1].cpu(), reference(q.cpu(), k.cpu(), v.cpu(), 0.2, visible)) < TOL[dtype]


def test_strides_not_multiple_of_16_from_fused_qkv_with_splits():
    """SigLIP's layout scaled down: head dim 24 (strides multiples of 8, not 16) in a fused (B, T, 3, H, D) buffer,
    the output a strided view too, split over keys with the combine kernel."""
    b, t, h, d = 2, 21, 3, 24
    qkv = rand(b, t, 3, h, d, dtype=torch.float32, seed=23)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    big_out = torch.full((b, t, h, d + 8), float("nan"), device=DEVICE)
    out = big_out[..., :d]
    attention(q, k, v, out, scale=d**-0.5, config=AttentionConfig(16, 16, 1, num_splits=2, combine=1))
    assert torch.isnan(big_out[..., d:]).all()
    assert rel_err(out.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_siglip_like_no_mask_non_pow2_head_dim_from_fused_qkv(dtype):
    """Full bidirectional attention, D=24 (SigLIP's 72 scaled down), q/k/v as strided views of one QKV buffer."""
    b, t, h, d = 2, 19, 3, 24
    qkv = rand(b * t, 3 * h * d, dtype=dtype, seed=7)
    q, k, v = (qkv[:, i * h * d : (i + 1) * h * d].view(b, t, h, d) for i in range(3))
    out = run(q, k, v, d**-0.5)
    assert rel_err(out.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5)) < TOL[dtype]


def test_gqa_two_kv_heads_scale_folded_into_q():
    b, tq, tk, d = 1, 9, 21, 16
    q, k, v = (
        rand(b, tq, 4, d, dtype=torch.float32, seed=8),
        rand(b, tk, 2, d, dtype=torch.float32, seed=9),
        rand(b, tk, 2, d, dtype=torch.float32, seed=10),
    )
    out = run(q * d**-0.5, k, v, 1.0, config=AttentionConfig(16, 16, heads_per_program=2, num_splits=2))
    assert rel_err(out.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5)) < 1e-5


def test_fully_masked_rows_and_split_determinism():
    b, tq, tk, d = 1, 6, 20, 16
    q, k, v = (
        rand(b, tq, 2, d, dtype=torch.float32, seed=11),
        rand(b, tk, 1, d, dtype=torch.float32, seed=12),
        rand(b, tk, 1, d, dtype=torch.float32, seed=13),
    )
    q_block = torch.tensor([[0, 1, -1, 2, -5, 1]], dtype=torch.int32, device=DEVICE)
    k_block = torch.tensor([[1] * 10 + [PAD] * 4 + [2] * 6], dtype=torch.int32, device=DEVICE)
    cfg = AttentionConfig(16, 16, heads_per_program=2, num_splits=2)
    ws = Workspace(DEVICE)
    first = run(q, k, v, 0.3, q_block, k_block, cfg, ws)
    second = run(q, k, v, 0.3, q_block, k_block, cfg, ws)
    assert torch.equal(first, second)
    assert int(ws.counters(0).abs().sum()) == 0
    assert (first[0, [0, 2, 4]] == 0).all()  # blocks 0, -1, -5 see no key
    visible = (k_block[:, None, :] <= q_block[:, :, None]).cpu()
    assert rel_err(first.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), 0.3, visible)) < 1e-5


def test_attention_rejects_bad_inputs():
    q, k = torch.randn(1, 4, 3, 16, device=DEVICE), torch.randn(1, 5, 2, 16, device=DEVICE)
    with pytest.raises(ValueError):  # 3 query heads on 2 KV heads
        attention(q, k, k, torch.empty_like(q), scale=1.0)
    q = torch.randn(1, 4, 4, 16, device=DEVICE)
    with pytest.raises(ValueError):  # one of the two block tensors
        attention(q, k, k, torch.empty_like(q), scale=1.0, q_block=torch.zeros(1, 4, dtype=torch.int32))


def test_heuristic_for_action_expert_fills_gpu_with_small_merges():
    """64 queries x 8 heads over 320..900 keys: small row blocks and a few splits give >= 64 programs while no
    program merges more than 8 x 32 rows of partials (the first H200 run: a merge of 8 splits x 64 rows x 256 on one
    SM cost more than the attention)."""
    from vla_rt.triton_kernels.attention_configs import attention_heuristic, attention_space

    for tk in (320, 576, 900):
        cfg = attention_heuristic(1, 64, tk, 8, 1, 256)
        assert cfg in attention_space(1, 64, tk, 8, 1, 256)
        programs = math.ceil(64 * cfg.heads_per_program / cfg.block_m) * (8 // cfg.heads_per_program) * cfg.num_splits
        assert 64 <= programs <= 300, (tk, cfg)
        assert cfg.num_splits > 1 and cfg.block_m <= 32, (tk, cfg)
        if cfg.combine == 0:
            assert cfg.num_splits * cfg.block_m <= 8 * 32, (tk, cfg)
    assert attention_heuristic(1, 64, 320, 8, 1, 256).num_splits <= 4  # few splits on a short key range
    assert attention_config(1, 64, 900, 8, 1, 256, dtype=torch.float32, device=torch.device("cpu")).num_splits == 1


def test_an_untabled_shape_takes_its_tuned_neighbour(config_dir):
    """π0.5's expert attention is one query and one key short of π0's tuned shapes: the nearest entry of the same
    batch and heads within 16 queries and over as many of its key tiles serves it; farther, the heuristic."""
    from vla_rt.triton_kernels import attention_configs as ac
    from vla_rt.triton_kernels import launch_configs as lc

    tuned = dict(block_m=32, block_n=64, heads_per_program=8, num_splits=5, num_warps=4, num_stages=2, combine=1)
    other = {**tuned, "num_splits": 2}
    table = {"attention": {"bfloat16": {"b1:64x320:h8/1:d256": tuned, "b1:80x320:h8/1:d256": other,
                                        "b8:51x583:h8/1:d256": {**tuned, "block_m": 64}}}}  # fmt: skip
    (config_dir / "Test-GPU.json").write_text(lc.dump_table(table))
    ac._attention_config_cuda.cache_clear()

    def look(b, tq, tk):
        return ac._attention_config_cuda(b, tq, tk, 8, 1, 256, torch.bfloat16, "Test-GPU", 132)

    try:
        assert look(1, 64, 320).num_splits == 5  # exact
        assert look(1, 63, 319).num_splits == 5 and look(1, 66, 257).num_splits == 5  # 5 key tiles of 64 each
        assert look(1, 79, 300).num_splits == 2  # the nearer of the two
        assert look(8, 50, 582).block_m == 64  # the server's π0.5 rows at 8 robots
        heuristic = ac.attention_heuristic
        assert look(1, 63, 256) == heuristic(1, 63, 256, 8, 1, 256, num_sms=132)  # 4 key tiles, not 5
        assert look(1, 40, 320) == heuristic(1, 40, 320, 8, 1, 256, num_sms=132)  # 24 queries away
        assert look(2, 64, 320) == heuristic(2, 64, 320, 8, 1, 256, num_sms=132)  # another batch
    finally:
        ac._attention_config_cuda.cache_clear()


def test_attention_space_covers_gqa_packing_splits_and_merges():
    from vla_rt.triton_kernels.attention_configs import attention_space

    space = attention_space(1, 64, 832, 8, 1, 256)
    assert {c.heads_per_program for c in space} == {1, 2, 4, 8}
    assert {c.num_splits for c in space} >= {1, 2, 4, 8}
    assert {c.block_n for c in space} == {32, 64, 128} and {c.combine for c in space} == {0, 1}
    assert all(c.block_m % c.heads_per_program == 0 for c in space)


def test_meta_tensors_are_a_dry_run():
    q = torch.empty(1, 64, 8, 256, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 320, 1, 256, device="meta", dtype=torch.bfloat16)
    attention(q, k, k, torch.empty_like(q), scale=1.0, config=AttentionConfig(16, 64, 8, num_splits=4, combine=1))


TMA_CONFIGS = {
    "rows64_hpp8": AttentionConfig(64, 16, heads_per_program=8, num_warps=4, tma=1),
    "rows64_hpp4_split3_combine": AttentionConfig(64, 16, heads_per_program=4, num_splits=3, combine=1, tma=1),
    "rows128_hpp8_8warps": AttentionConfig(128, 32, heads_per_program=8, num_warps=8, tma=1),
}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", list(TMA_CONFIGS))
def test_tma_kernel_prefix_lm_mask_from_fused_qkv(config, dtype, d):
    """The TMA kernel on π0's joint attention: 8 query heads on 1 KV head as views into a fused QKV buffer (as the
    engines lay them out), a padded prefix, state and action blocks, B = 2; the last row block is partial (rows past
    Tq arrive as zeros and are not stored), and the key tiles run past Tk."""
    from vla_rt.triton_kernels.attention_tma import tma_attention_applies

    input_mask, ar_mask = pi0_masks(2, [11, 7], prefix_len=12, chunk=6)
    q_block, k_block = (x.to(DEVICE) for x in block_ids(input_mask, ar_mask))
    t = input_mask.shape[1]
    qkv = rand(2, t, 10 * d, dtype=dtype, seed=40 + d)
    q = qkv[..., : 8 * d].view(2, t, 8, d)
    k, v = qkv[..., 8 * d : 9 * d].view(2, t, 1, d), qkv[..., 9 * d :].view(2, t, 1, d)
    cfg = TMA_CONFIGS[config]
    assert tma_attention_applies(q, k, v, cfg) or (DEVICE == "cuda" and dtype == torch.float32)  # GPU: 16-bit only
    out = run(q, k, v, d**-0.5, q_block, k_block, cfg, Workspace(DEVICE))
    visible = (k_block[:, None, :] <= q_block[:, :, None]).cpu()
    ref = reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5, visible)
    assert rel_err(out.cpu(), ref) < TOL[dtype]
    assert (out.cpu()[~input_mask] == 0).all()
    pointer = run(q, k, v, d**-0.5, q_block, k_block, AttentionConfig(16, 16, heads_per_program=8))
    assert rel_err(out.cpu(), pointer.cpu()) < TOL[dtype]


def test_tma_kernel_suffix_over_cache_split_kv_d256():
    """The action expert's shape scaled down: 7 suffix queries x 8 heads over a 40-key cache of head dim 256 (four
    64-wide chunks), keys split 4 ways (one split empty) and merged by the combine kernel, no mask (full attention)."""
    q = rand(1, 7, 8, 256, dtype=torch.float32, seed=50)
    k, v = rand(1, 40, 1, 256, dtype=torch.float32, seed=51), rand(1, 40, 1, 256, dtype=torch.float32, seed=52)
    cfg = AttentionConfig(64, 16, heads_per_program=8, num_splits=4, combine=1, tma=1)
    out = run(q, k, v, 256**-0.5, config=cfg, workspace=Workspace(DEVICE))
    assert rel_err(out.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), 256**-0.5)) < 1e-5


def test_tma_kernel_siglip_like_head_dim_72_from_fused_qkv():
    """SigLIP's attention scaled down: head dim 72 in two 64-wide chunks (the second's columns past 72 arrive as
    zeros and are not stored), 3 heads each its own KV head, q / k / v as views of one fused buffer, no mask."""
    from vla_rt.triton_kernels.attention_tma import tma_attention_applies

    b, t, h, d = 2, 19, 3, 72
    qkv = rand(b, t, 3 * h * d, dtype=torch.float32, seed=57)
    q, k, v = (x.view(b, t, h, d) for x in qkv.chunk(3, dim=-1))
    cfg = AttentionConfig(64, 16, heads_per_program=1, tma=1)
    assert tma_attention_applies(q, k, v, cfg)
    big_out = torch.full((b, t, h, d + 8), float("nan"), device=DEVICE)
    out = big_out[..., :d]
    attention(q, k, v, out, scale=d**-0.5, config=cfg)
    assert torch.isnan(big_out[..., d:]).all()  # nothing stored past D
    assert rel_err(out.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5)) < 1e-5
    split = AttentionConfig(64, 16, heads_per_program=1, num_splits=2, combine=1, tma=1)
    out2 = run(q, k, v, d**-0.5, config=split, workspace=Workspace(DEVICE))
    assert rel_err(out2.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), d**-0.5)) < 1e-5


def test_tma_config_falls_back_where_tma_cannot_describe_the_views():
    """A `tma` config on views TMA cannot describe (rows 328 bytes apart), on a head dim whose chunks miss
    the merge's padded width (192), or with an in-kernel merge runs the pointer kernel with the same tiles, still
    exact."""
    from vla_rt.triton_kernels.attention_tma import tma_attention_applies, tma_attention_config_applies

    rows = rand(1, 9, 82, dtype=torch.float32, seed=53)  # positions 328 bytes apart: not whole 16 bytes
    q = k = rows[..., :80].unflatten(-1, (2, 40))
    cfg = AttentionConfig(64, 16, heads_per_program=1, tma=1)
    assert tma_attention_config_applies(cfg, 40) and not tma_attention_applies(q, k, k, cfg)
    assert rel_err(run(q, k, k, 0.1, config=cfg).cpu(), reference(q.cpu(), k.cpu(), k.cpu(), 0.1)) < 1e-5
    assert not tma_attention_config_applies(cfg, 192) and tma_attention_config_applies(cfg, 256)
    q64, k64 = rand(1, 9, 2, 64, dtype=torch.float32, seed=55), rand(1, 30, 2, 64, dtype=torch.float32, seed=56)
    merged_in_kernel = AttentionConfig(64, 16, heads_per_program=1, num_splits=2, combine=0, tma=1)
    assert not tma_attention_applies(q64, k64, k64, merged_in_kernel)
    out = run(q64, k64, k64, 0.1, config=merged_in_kernel, workspace=Workspace(DEVICE))
    assert rel_err(out.cpu(), reference(q64.cpu(), k64.cpu(), k64.cpu(), 0.1)) < 1e-5
