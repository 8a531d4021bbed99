"""Our attention (the launch table's config, or given ones) against PyTorch's SDPA backends at π0's head-dim-256 shapes.

The peers' ceiling for the batched stages' attention (issue 26): flash (FA2), cuDNN and memory-efficient SDPA,
each forced with `torch.nn.attention.sdpa_kernel`, maskless (the prefix's own attention has no hidden key when the
prompt has no padding) and with the block mask where the backend takes one. Each time is `vla_rt.timing.time_graph`
(a CUDA Graph of back-to-back calls, replays timed by CUDA events); TFLOP/s counts 4·B·Hq·Tq·Tk·D.

    python3 tools/attention_probe.py [--configs "128,64,8,1,8,2,0,1;..."] [--out results/attention_probe.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vla_rt.numerics import rel_err
from vla_rt.timing import time_graph
from vla_rt.triton_kernels import AttentionConfig, attention, attention_config
from vla_rt.triton_kernels.attention import attention_reference

# (name, B, Tq, Tk, Hq, Hkv, D): the server's stages (2 views, prompt 20, chunk 50) and the 1-robot call
SHAPES = [
    ("prefix.v2p20b8", 8, 532, 532, 8, 1, 256),
    ("expert.v2p20h50b32", 32, 51, 583, 8, 1, 256),
    ("prefix.v2p20", 1, 532, 532, 8, 1, 256),
    ("prefix.v3p0", 1, 768, 768, 8, 1, 256),
    ("expert.v2p20h50", 1, 51, 583, 8, 1, 256),
    ("expert.v2p20h50b4", 4, 51, 583, 8, 1, 256),
    ("expert.v2p20h50b8", 8, 51, 583, 8, 1, 256),
    ("expert.v2p20h50b16", 16, 51, 583, 8, 1, 256),
]


@triton.jit
def masked_softmax_kernel(s_ptr, p_ptr, q_block_ptr, k_block_ptr, R, Tq, Tk, HQ, ss_b, ss_r, sp_b, sp_r,
                          scale_log2, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """P = softmax(scale * S) over each row's visible keys, normalised, as bf16 (openpi's order: float32 softmax,
    then the cast before P·V). Rows are (position, head) pairs of one batch element, the head fastest."""
    tiles = tl.cdiv(R, BLOCK_R)
    b = tl.program_id(0) // tiles
    rows = (tl.program_id(0) % tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    j = tl.arange(0, BLOCK_K)
    j_ok = j < Tk
    s = tl.load(s_ptr + b * ss_b + rows[:, None] * ss_r + j[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
    q_blk = tl.load(q_block_ptr + b * Tq + rows // HQ, mask=row_ok, other=-1)
    k_blk = tl.load(k_block_ptr + b * Tk + j, mask=j_ok, other=2**30)
    visible = (k_blk[None, :] <= q_blk[:, None]) & j_ok[None, :]
    s = tl.where(visible, s.to(tl.float32) * scale_log2, float("-inf"))
    m = tl.max(s, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.math.exp2(s - m[:, None])
    total = tl.sum(p, axis=1)
    p = p / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(p_ptr + b * sp_b + rows[:, None] * sp_r + j[None, :], p.to(p_ptr.dtype.element_ty),
             mask=row_ok[:, None] & j_ok[None, :])  # fmt: skip


def gemm_attention(q, k, v, out, q_block, k_block, scale: float, s_dtype=torch.float32, block_r: int = 4):
    """One KV head: S = Q Kᵀ as one strided-batched cuBLAS GEMM over each batch element's (position, head) rows
    (float32 out of bf16 operands), the masked softmax above, then P V as a second batched GEMM: the candidate
    for the server's expert stages, where the flash kernel runs one SM's chain of key tiles per program."""
    b, tq, hq, d = q.shape
    tk = k.shape[1]
    r = tq * hq
    q2, k2, v2 = q.reshape(b, r, d), k.reshape(b, tk, d), v.reshape(b, tk, d)
    pad = -(-tk // 8) * 8  # P's rows 16-byte aligned for cuBLAS
    key = (b, r, tk, s_dtype)
    if gemm_attention.scratch.get("key") != key:
        gemm_attention.scratch = dict(key=key, s=torch.empty(b, r, tk, dtype=s_dtype, device=q.device),
                                      p=torch.zeros(b, r, pad, dtype=q.dtype, device=q.device))  # fmt: skip
    s, p = gemm_attention.scratch["s"], gemm_attention.scratch["p"][:, :, :tk]
    if s_dtype != q.dtype:
        torch.bmm(q2, k2.transpose(1, 2), out_dtype=s_dtype, out=s)
    else:
        torch.bmm(q2, k2.transpose(1, 2), out=s)
    block_k = triton.next_power_of_2(tk)
    masked_softmax_kernel[(b * triton.cdiv(r, block_r),)](
        s, p, q_block, k_block, r, tq, tk, hq, s.stride(0), s.stride(1), p.stride(0), p.stride(1),
        scale * 1.4426950408889634, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    torch.bmm(p, v2, out=out.view(b, r, d))
    return out


gemm_attention.scratch = {}


def _us(fn) -> float:
    return time_graph(lambda i: fn(), copies=1, calls=10, replays=20).median_us


def _blocks(b: int, tq: int, tk: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefix's own attention (tq == tk: one block, all visible), or suffix queries over prefix + suffix keys."""
    if tq == tk:
        return torch.zeros(b, tq, dtype=torch.int32, device=dev), torch.zeros(b, tk, dtype=torch.int32, device=dev)
    k_block = torch.zeros(b, tk, dtype=torch.int32, device=dev)
    k_block[:, tk - tq] = 1  # the state token
    k_block[:, tk - tq + 1 :] = 2
    return k_block[:, tk - tq :].contiguous(), k_block


def probe(shape, configs: list[AttentionConfig], sdpa: bool = True) -> list[dict]:
    name, b, tq, tk, hq, hkv, d = shape
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, tq, hq, d, device=dev, generator=g).bfloat16()
    k = torch.randn(b, tk, hkv, d, device=dev, generator=g).bfloat16()
    v = torch.randn(b, tk, hkv, d, device=dev, generator=g).bfloat16()
    out = torch.empty_like(q)
    q_block, k_block = _blocks(b, tq, tk, dev)
    ref = attention_reference(q, k, v, scale=d**-0.5, q_block=q_block, k_block=k_block)
    flops = 4 * b * hq * tq * tk * d
    rows = []

    def row(kind: str, cfg: str, us: float, err: float | None = None, note: str = "") -> None:
        rows.append(dict(shape=name, kind=kind, config=cfg, us=round(us, 2), tflops=round(flops / us / 1e6, 1),
                         rel_err=err, note=note))  # fmt: skip
        print(f"{name:<22} {kind:<14} {cfg:<34} {us:8.2f} us {flops / us / 1e6:6.1f} TFLOP/s"
              + (f"  rel {err:.1e}" if err is not None else "") + (f"  {note}" if note else ""), flush=True)  # fmt: skip

    table = attention_config(b, tq, tk, hq, hkv, d, dtype=q.dtype, device=dev)
    for cfg in [table, *configs]:
        label = ",".join(str(x) for x in cfg.to_dict().values())
        try:
            run = lambda cfg=cfg: attention(q, k, v, out, scale=d**-0.5, q_block=q_block, k_block=k_block, config=cfg)  # noqa: E731
            run()
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            row("ours" + (" (table)" if cfg is table else ""), label, _us(run), err)
        except Exception as e:  # a config that does not compile or fit: say so, go on
            rows.append(dict(shape=name, kind="ours", config=label, error=f"{type(e).__name__}: {str(e)[:160]}"))
            print(f"{name:<22} ours           {label:<34} error {type(e).__name__}: {str(e)[:120]}", flush=True)
    if hkv == 1 and tq != tk:  # the two-GEMM candidate (expert stages)
        # the engine's Q: a view of the QKV buffer, (position, head) rows not one stride apart, so a reshape copies
        q_engine = torch.empty(b, tq, hq + 2 * hkv, d, device=dev, dtype=q.dtype)[:, :, :hq]
        q_engine.copy_(q)
        variants = [(q, torch.float32, 4, ""), (q, torch.float32, 8, ""), (q, torch.float32, 2, ""),
                    (q, q.dtype, 4, ""), (q_engine, torch.float32, 4, ", Q as the engine's view (copied)")]  # fmt: skip
        for q_in, s_dtype, block_r, note in variants:
            label = f"S {str(s_dtype).removeprefix('torch.')}, {block_r} rows a softmax program{note}"
            try:
                run = lambda q_in=q_in, s_dtype=s_dtype, block_r=block_r: gemm_attention(  # noqa: E731
                    q_in, k, v, out, q_block, k_block, d**-0.5, s_dtype, block_r
                )
                run()
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                row("two gemms", label, _us(run), err)
            except Exception as e:
                rows.append(
                    dict(shape=name, kind="two gemms", config=label, error=f"{type(e).__name__}: {str(e)[:160]}")
                )
                print(f"{name:<22} two gemms      {label:<34} error {type(e).__name__}: {str(e)[:160]}", flush=True)
    if not sdpa:
        return rows
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask = (k_block[:, None, :] <= q_block[:, :, None])[:, None]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for masked in (False, True):
            if masked and tq == tk:
                continue  # all visible: the maskless call is the same attention
            for gqa in ("enable_gqa", "expanded"):
                kk, vv = (kt, vt) if gqa == "enable_gqa" else (kt.expand(b, hq, tk, d), vt.expand(b, hq, tk, d))
                label = f"{'mask' if masked else 'nomask'} {gqa}"

                def call(kk=kk, vv=vv, masked=masked, gqa=gqa, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(
                            qt, kk, vv, attn_mask=mask if masked else None, enable_gqa=gqa == "enable_gqa"
                        )

                try:
                    o = call()
                    torch.cuda.synchronize()
                    err = None
                    if masked or tq == tk:
                        err = rel_err(o.transpose(1, 2), ref)
                    row(f"sdpa.{backend.name.split('_')[0].lower()}", label, _us(call), err,
                        "" if masked or tq == tk else "no mask: not the same attention")  # fmt: skip
                except Exception as e:
                    first = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
                    rows.append(dict(shape=name, kind=f"sdpa.{backend.name}", config=label,
                                     error=f"{type(e).__name__}: {first}"))  # fmt: skip
                    print(f"{name:<22} sdpa.{backend.name:<9} {label:<34} not available: {first}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="", help="AttentionConfig fields, comma-separated; configs split by ';'")
    p.add_argument("--shapes", default="", help="names from SHAPES to run (default all)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-sdpa", action="store_true", help="ours (table, --configs, two GEMMs) only")
    a = p.parse_args(argv)
    fields = list(AttentionConfig(64, 64).to_dict())
    configs = [AttentionConfig(**dict(zip(fields, map(int, c.split(","))))) for c in a.configs.split(";") if c]
    shapes = [s for s in SHAPES if not a.shapes or s[0] in a.shapes.split(",")]
    rows = [r for s in shapes for r in probe(s, configs, sdpa=not a.no_sdpa)]
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
