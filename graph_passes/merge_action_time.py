"""Pass: `action_in_proj` then the action half of `action_time_mlp_in` is one A→width linear; the time half only
depends on the step index, so it becomes a (steps, width) bias table for the fixed Euler schedule.

`mlp_in([W_a x + b_a, emb(t)]) = (W_ia W_a) x + [W_ia b_a + b_i + W_it emb(t_k)]`. The table is part of the built
plan: a different number of steps needs a new table (rebuild the plan).
"""

from __future__ import annotations

import torch

from vla_rt.graph_passes.base import BF16_BYTES, GraphPass, PassContext, PassReport, PassState, require
from vla_rt.model.pi0 import euler_times, posemb_sincos

NAME = "merge_action_time_embedding"


def apply(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    require(t, "action_in_proj.weight", "action_time_mlp_in.weight", pass_name=NAME)
    width = t["action_in_proj.weight"].shape[0]
    w_a, b_a = t.pop("action_in_proj.weight").double(), t.pop("action_in_proj.bias").double()
    w_in, b_in = t.pop("action_time_mlp_in.weight").double(), t.pop("action_time_mlp_in.bias").double()
    w_ia, w_it = w_in[:, :width], w_in[:, width:]
    times = torch.tensor(euler_times(ctx.num_steps), dtype=torch.float32, device=w_a.device)
    if len(times) != ctx.num_steps:  # openpi's float32 loop visits exactly num_steps times; a table must agree
        raise ValueError(f"num_steps={ctx.num_steps} gives {len(times)} Euler times in float32")
    time_emb = posemb_sincos(times, width).double()  # float32 like the reference, then exact products in f64
    t["action_time_in.weight"] = (w_ia @ w_a).float()
    t["time_bias_table"] = (time_emb @ w_it.T + (w_ia @ b_a + b_in)[None, :]).float()
    return state.replace(t, time_bias_steps=ctx.num_steps, euler_times=euler_times(ctx.num_steps))


def report(ctx: PassContext) -> PassReport:
    we, a = ctx.cfg.expert.width, ctx.cfg.action_dim
    rows = ctx.batch_size * ctx.chunk
    macs_per_step = rows * (a * we + we * we) - rows * a * we  # two GEMMs (A→W, 2W→W) become one A→W
    saved_bytes = (a * we + 2 * we * we + 2 * we) - (a * we + ctx.num_steps * we)
    # per step: sin/cos embedding (~4 kernels), broadcast+concat (2), one GEMM
    return PassReport(
        NAME,
        kernels_removed=7 * ctx.num_steps,
        weight_bytes_saved=saved_bytes * BF16_BYTES,
        flops_saved=2 * macs_per_step * ctx.num_steps,
        note=f"{ctx.num_steps}×{we} bias table",
    )


PASS = GraphPass(NAME, apply, report)
