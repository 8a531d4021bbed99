"""Benchmark output people read: a Markdown table and a bar plot next to the JSON, and where runs write them."""

from __future__ import annotations

import json
import time
from pathlib import Path

# Every run writes to its own git-ignored folder here; benchmarks/results/ holds only the summaries the README and
# docs cite, and a run goes there when asked (`--out benchmarks/results`).
RAW_DIR = Path("benchmarks/raw")


def run_dir(kind: str) -> Path:
    """A new folder for one run's output: benchmarks/raw/<kind>-<UTC date-time> (relative to the working dir)."""
    return RAW_DIR / f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def _case(row: dict) -> str:
    return f"{row['views']} view{'s' if row['views'] > 1 else ''}, prompt {row['prompt_len']}, chunk {row['chunk']}"


def _memory(row: dict) -> str:
    """Peak GPU memory of the process (the fp32 source weights included), and, where measured, of the backend alone:
    what it holds and needs while it runs, i.e. what a robot's GPU must have."""
    total = f"{row.get('peak_memory_gb', 0):.1f}"
    return f"{total} / {row['backend_memory_gb']:.1f}" if "backend_memory_gb" in row else total


def latency_markdown(result: dict) -> str:
    lines = [
        f"# {result.get('model', 'π0')} latency on {result['device']} ({result['preset']}, {result['dtype']}, {result['num_steps']} steps)",
        "",
        f"torch {result['torch']}; random weights; CUDA events after warm-up (wall clock on CPU); "
        "median and p90 over the calls shown in `n`.",
    ]
    c = result.get("ceilings")
    if c:
        lines += [
            "",
            f"Measured ceilings: copy {c['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"bf16 matmul {c['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (roofline below uses these).",
        ]
    if result.get("notes"):  # provenance, e.g. rows carried over from an earlier run
        lines += ["", f"Runs: {result['notes']}"]
    lines += ["", "| case | backend | median ms | p90 ms | n | × roofline | roofline ms | peak GB (process / backend) | vision / VLM / expert step ms |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["rows"]:
        if "median_ms" not in row:
            lines.append(f"| {_case(row)} | {row['backend']} | – | – | – | – | – | – | {row.get('skipped', '')} |")
            continue
        parts = row.get("parts")
        part = " / ".join(f"{parts[k]['median_ms']:.3f}" for k in ("vision", "vlm", "expert_step")) if parts else ""
        if "compile_s" in row:  # the torch.compile row says what its compile cost and how it was tuned
            part = f"{row.get('mode', '')} compiled in {row['compile_s']:.0f} s" + (
                ", coordinate-descent tuning off" if row.get("coordinate_descent") is False else ""
            )
        roof = row.get("roofline_ms")
        lines.append(
            f"| {_case(row)} | {row['backend']} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} | {row['n']} | "
            f"{row['x_roofline']:.2f} | {roof:.2f} | {_memory(row)} | {part} |"
            if roof
            else f"| {_case(row)} | {row['backend']} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} | {row['n']} "
            f"| – | – | – | {part} |"
        )
    if result.get("peers") and result["device"].startswith("NVIDIA-H200"):
        lines += ["", "Peers on the same H200 (ANCHORS.md, measured by the team on 2026-11-29; not re-run here):", "",
                  "| peer | case | median ms |", "|---|---|---|"]  # fmt: skip
        for name, rows in result["peers"].items():
            for key, ms in rows.items():
                v, p, h = key.split(",")
                lines.append(f"| {name} | {v} views, prompt {p}, chunk {h} | {ms:.2f} |")
    return "\n".join(lines) + "\n"


def latency_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "median_ms" in r]
    cases = sorted({(r["views"], r["prompt_len"], r["chunk"]) for r in rows}, key=lambda c: (c[1], c[0]))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4.5))
    width = 0.8 / max(1, len(backends) + 1)
    for j, backend in enumerate(backends):
        ys = []
        for case in cases:
            match = [r for r in rows if r["backend"] == backend and (r["views"], r["prompt_len"], r["chunk"]) == case]
            ys.append(match[0]["median_ms"] if match else 0)
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=backend)
    roofs = [next((r["roofline_ms"] for r in rows if (r["views"], r["prompt_len"], r["chunk"]) == c), None)
             for c in cases]  # fmt: skip
    if all(roofs):
        ax.bar([i + len(backends) * width for i in range(len(cases))], roofs, width, label="roofline", color="k")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], [f"{v}v p{p} h{h}" for v, p, h in cases])
    ax.set_yscale("log")
    ax.set_ylabel("median latency per inference (ms, log)")
    ax.set_title(f"π0 inference on {result['device']} ({result['dtype']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json_md(out_dir: str | Path, stem: str, result: dict, markdown: str) -> tuple[Path, Path]:
    """`<stem>_<device>.json` and `.md` under out_dir (device from result["device"], spaces as dashes)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{stem}_{result['device'].replace(' ', '-')}"
    paths = out / f"{name}.json", out / f"{name}.md"
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown + "\n")
    return paths
