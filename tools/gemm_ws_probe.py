"""Times the warp-specialized CUDA GEMM against Triton's `gemm` and cuBLAS at the server's prefix GEMMs.

`cuda_kernels/gemm_ws.py` against the package's Triton `gemm` (its launch table's config, given explicitly so it
cannot hand the shape to cuBLAS) and cuBLAS.

Shapes: Gemma 2B over the 8-row batch (8 x 532 = 4256 rows) and one request (532 rows): q/k/v (2048 + 2 x 256
columns, plain: the engine's RoPE epilogue is not in gemm_ws), o_proj and down (+= residual), gate/up (gated GeGLU,
2 x 16384 weight rows); SigLIP So400m over 16 and 2 images (4096 / 512 rows): q/k/v and fc1 (+ bias; fc1's gelu
is not in gemm_ws), out and fc2 (+ bias + residual). Each variant (block_n 128 / 256, stages 3-5 where they fit) is
first checked against a float32 torch reference on fresh inputs (its rel error printed), then timed by
`vla_rt.timing.time_graph` (CUDA Graph of back-to-back calls after warm-up, replays timed with CUDA events): median
and p90 µs and TFLOP/s (2 M N_w K). cuBLAS rows: `torch.mm` (the plain GEMM, every shape) and the closest cuBLAS
form of the epilogue (addmm; `out.addmm_` for the residual, + a separate bias add; gated: mm + torch's GeGLU).
Stops starting measurements after --budget-s (the rest listed as skipped).

    python3 tools/gemm_ws_probe.py --out $OUT/ws.json [--budget-s 420] [--shapes gemma.down.4256,...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vla_rt.cuda_kernels.gemm_ws import Variant, gemm_ws, why_not
from vla_rt.numerics import rel_err
from vla_rt.timing import time_graph
from vla_rt.triton_kernels import gemm, gemm_config

EPILOGUES = {"plain": (False, False, False), "residual": (False, True, False), "bias": (True, False, False),
             "bias+residual": (True, True, False), "gated": (False, False, True)}  # (bias, residual, gated)  # fmt: skip
TILINGS = [(128, 3), (128, 4), (128, 5), (256, 3), (256, 4)]


def shapes() -> list[tuple[str, int, int, int, str]]:
    """(name, M, N output columns, K, epilogue)."""
    rows = []
    for m in (4256, 532):
        rows += [(f"gemma.qkv.{m}", m, 2560, 2048, "plain"), (f"gemma.o.{m}", m, 2048, 2048, "residual"),
                 (f"gemma.gate_up.{m}", m, 16384, 2048, "gated"), (f"gemma.down.{m}", m, 2048, 16384, "residual")]  # fmt: skip
    for m in (4096, 512):
        rows += [(f"siglip.qkv.{m}", m, 3456, 1152, "bias"), (f"siglip.out.{m}", m, 1152, 1152, "bias+residual"),
                 (f"siglip.fc1.{m}", m, 4304, 1152, "bias"), (f"siglip.fc2.{m}", m, 1152, 4304, "bias+residual")]  # fmt: skip
    return rows


def _reference(a, w, bias, residual0, gated: bool) -> torch.Tensor:
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y = a.float() @ w.float().T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    if bias is not None:
        y = y + bias.float()
    if gated:
        n = y.shape[1] // 2
        y = F.gelu(y[:, :n], approximate="tanh") * y[:, n:]
    return y + residual0.float() if residual0 is not None else y


def probe_shape(shape, deadline: float, rows: list[dict], skipped: list[str]) -> None:
    name, m, n, k, epi = shape
    has_bias, residual, gated = EPILOGUES[epi]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n_w = 2 * n if gated else n
    a = torch.randn(m, k, generator=g, device=dev).bfloat16()
    w = (torch.randn(n_w, k, generator=g, device=dev) * k**-0.5).bfloat16()
    bias = torch.randn(n_w, generator=g, device=dev).bfloat16() if has_bias else None
    res0 = torch.randn(m, n, generator=g, device=dev).bfloat16() if residual else None
    ref = _reference(a, w, bias, res0, gated)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    flops = 2 * m * n_w * k

    def measure(kind: str, variant: str, run) -> None:
        if time.perf_counter() > deadline:
            skipped.append(f"{name} {kind} {variant}")
            return
        try:
            if residual:
                out.copy_(res0)
            else:
                out.fill_(float("nan"))  # an element the variant does not write shows as NaN in the error
            run()
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            t = time_graph(lambda i: run(), calls=10, replays=20)
        except Exception as e:  # a variant that does not build or launch: say so, go on
            rows.append(dict(shape=name, kind=kind, variant=variant, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(f"{name:<20} {kind:<14} {variant:<16} error {type(e).__name__}: {str(e)[:120]}", flush=True)
            return
        us, p90 = t.median_us, t.p90_ms * 1e3
        rows.append(dict(shape=name, m=m, n=n, k=k, epilogue=epi, kind=kind, variant=variant, median_us=round(us, 2),
                         p90_us=round(p90, 2), tflops=round(flops / us / 1e6, 1), rel_err=err))  # fmt: skip
        print(f"{name:<20} {kind:<14} {variant:<16} {us:9.2f} us  p90 {p90:9.2f}  {flops / us / 1e6:6.1f} TFLOP/s"
              f"  rel {err:.1e}", flush=True)  # fmt: skip

    for bn, stages in TILINGS:
        if Variant(bn, stages).why_unsupported() is None:
            measure("gemm_ws", f"n{bn}.s{stages}", lambda bn=bn, stages=stages: gemm_ws(
                a, w, out, bias=bias, residual=residual, gated=gated, block_n=bn, stages=stages))  # fmt: skip
    cfg = gemm_config(m, n, k, gated=gated, dtype=a.dtype, device=dev)
    measure("triton", "table", lambda: gemm(a, w, out, bias=bias, gated=gated,
                                            residual=out if residual else None, config=cfg))  # fmt: skip
    if gated:
        measure("cublas+torch", "mm+geglu", lambda: out.copy_(_geglu(torch.mm(a, w.T))))
    elif residual:
        measure("cublas", "addmm_" + ("+bias" if has_bias else ""),
                lambda: out.addmm_(a, w.T).add_(bias) if has_bias else out.addmm_(a, w.T))  # fmt: skip
    elif has_bias:
        measure("cublas", "addmm", lambda: torch.addmm(bias, a, w.T, out=out))
    if epi != "plain":  # the plain GEMM's ceiling: not the same result, so its error is against nothing
        mm_out = torch.empty(m, n_w, dtype=torch.bfloat16, device=dev)
        t = time_graph(lambda i: torch.mm(a, w.T, out=mm_out), calls=10, replays=20)
        rows.append(dict(shape=name, kind="cublas", variant="mm (plain)", median_us=round(t.median_us, 2),
                         p90_us=round(t.p90_ms * 1e3, 2), tflops=round(flops / t.median_us / 1e6, 1)))  # fmt: skip
        print(f"{name:<20} {'cublas':<14} {'mm (plain)':<16} {t.median_us:9.2f} us  p90 {t.p90_ms * 1e3:9.2f}  "
              f"{flops / t.median_us / 1e6:6.1f} TFLOP/s", flush=True)  # fmt: skip
    else:
        measure("cublas", "mm", lambda: torch.mm(a, w.T, out=out))


def _geglu(y: torch.Tensor) -> torch.Tensor:
    g, u = y.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no measurement after this many seconds")
    p.add_argument("--shapes", default="", help="comma-separated names (default: all)")
    a = p.parse_args(argv)
    why = why_not(torch.device("cuda"))
    if why:
        raise SystemExit(f"gemm_ws_probe: {why}")
    start = time.perf_counter()
    chosen = [s for s in shapes() if not a.shapes or s[0] in a.shapes.split(",")]
    rows: list[dict] = []
    skipped: list[str] = []
    for s in chosen:
        probe_shape(s, start + a.budget_s, rows, skipped)
    if skipped:
        print(f"budget of {a.budget_s:.0f} s spent: {len(skipped)} measurements skipped", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), budget_s=a.budget_s,
                                               elapsed_s=round(time.perf_counter() - start, 1), rows=rows,
                                               skipped=skipped), indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
