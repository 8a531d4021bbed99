"""Where a persistent expert layer's time goes along its chain of stages, from the kernel's per-instruction stamps.

A layer is six dependent stages (QKV, attention, merge, O, gate/up, down). For each stage and layer this splits the
time from the previous stage's last unit done to this stage's last unit done into:

- `handoff`: until the last of this stage's units saw its first input (the previous stage's release reaching it:
  counters, L2, the loader's poll). The handoff probe measures 0.7-0.9 µs for this on the H200.
- `tail`: from then until the stage's last unit is done (its copies, MMAs, epilogue and release).

If the hand-offs sit near the probe's floor and the tails are long, a stage is slow inside its units, not between
them. The first traces (H200, 2026-12-04) measured hand-offs of 0.2-1.2 µs and tails of 3.4-10.7 µs: the units.

    python -m vla_rt.cuda_kernels.expert_trace trace_132_a96_k64_d2.pt   (files from tools/cuda_expert_check.py)
"""

from __future__ import annotations

import statistics
import sys

import torch

from vla_rt.cuda_kernels.expert_schedule import F_LAYER, F_OP, OP_ATTN, OP_DOWN, OP_GATE_UP, OP_MERGE, OP_O, OP_QK, OP_V

STAGES = {"qkv": (OP_QK, OP_V), "attn": (OP_ATTN,), "merge": (OP_MERGE,), "o": (OP_O,), "gate_up": (OP_GATE_UP,),
          "down": (OP_DOWN,)}  # fmt: skip
T_READY, T_DONE = 1, 4  # expert_step.cu's `Stamp` columns


def stage_path(stamps: torch.Tensor, instrs: torch.Tensor) -> dict[str, dict[str, float]]:
    """{stage: {units, handoff, tail, work_mean, work_max, stage}} in the stamps' unit, averaged over the middle
    layers (the first and last quarter left out, and layer 0, which has no down projection before it); plus
    {"layer": {"us": the sum of the stages}}. `stamps`: (instructions, 6) `%globaltimer` values (ns or µs, as
    given); `instrs`: the schedule's instruction table, one row per stamp row. Empty when no layer qualifies."""
    stamps = stamps.double()
    ops, layers = instrs[:, F_OP], instrs[:, F_LAYER]
    depth = int(layers[ops == OP_DOWN].max()) + 1 if (ops == OP_DOWN).any() else 0
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in STAGES}
    for layer in range(max(1, depth // 4), depth - depth // 4):
        prev_done = float(stamps[(ops == OP_DOWN) & (layers == layer - 1), T_DONE].max())
        for name, group in STAGES.items():
            sel = torch.isin(ops, torch.tensor(group)) & (layers == layer)
            if not sel.any():
                continue
            r = stamps[sel]
            ready_last, done_last = float(r[:, T_READY].max()), float(r[:, T_DONE].max())
            work = r[:, T_DONE] - r[:, T_READY]
            rows[name].append({"units": float(sel.sum()), "handoff": ready_last - prev_done,
                               "tail": done_last - ready_last, "work_mean": float(work.mean()),
                               "work_max": float(work.max()), "stage": done_last - prev_done})  # fmt: skip
            prev_done = done_last
    out = {name: {k: statistics.mean(x[k] for x in xs) for k in xs[0]} for name, xs in rows.items() if xs}
    if out:
        out["layer"] = {"us": sum(v["stage"] for v in out.values())}
    return out


def table(path: dict[str, dict[str, float]]) -> str:
    """The path as a Markdown table (µs)."""
    lines = ["| stage | units | hand-off | tail | unit work mean / max | stage |", "|---|---|---|---|---|---|"]
    for name, v in path.items():
        if name != "layer":
            lines.append(f"| {name} | {v['units']:.0f} | {v['handoff']:.2f} | {v['tail']:.2f} | "
                         f"{v['work_mean']:.2f} / {v['work_max']:.2f} | {v['stage']:.2f} |")  # fmt: skip
    if "layer" in path:
        lines.append(f"| layer | | | | | {path['layer']['us']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    for file in argv:
        saved = torch.load(file, weights_only=True)
        print(f"{file}:\n{table(stage_path(saved['trace'].double() / 1e3, saved['instrs']))}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
