"""Pass (π0.5): the time MLP and every adaptive norm's scale, shift and gate become per-step tables.

π0.5's action expert sees the time only through `cond = swish(time_mlp_out(swish(time_mlp_in(posemb(t)))))`, and
each adaptive RMSNorm's Dense turns `cond` into [scale | shift | gate]. The Euler schedule visits fixed times
t_0 = 1, t_1, ... (openpi's float32 loop), so all of it is a function of the step index alone: per layer and norm a
(steps, W) table of `scale` (an offset from 1, as RMSNorm scales are stored: the engine's RMSNorm kernel applies
`1 + scale` in float32, openpi's formula), of `shift` and of `gate`; for the final norm `scale` and `shift` (its
gate is never used). The time MLP and the 2·L + 1 modulation Dense layers leave the plan; a different
number of steps needs new tables (rebuild the plan), as for π0's time-bias table.
"""

from __future__ import annotations

import torch

from vla_rt.graph_passes.base import BF16_BYTES, GraphPass, PassContext, PassReport, PassState, layer_ids, require
from vla_rt.model.pi0 import euler_times, posemb_sincos

NAME = "precompute_adarms_tables"
NORMS = (("attn_norm", "attn"), ("ffn_norm", "ffn"))


def time_condition(t: dict[str, torch.Tensor], times: list[float], width: int) -> torch.Tensor:
    """(steps, W) float64: the time MLP at each Euler time (the sin-cos embedding in float32, as the reference)."""
    device = t["time_mlp_in.weight"].device  # the weights may be on the GPU: the times go where they are
    emb = posemb_sincos(torch.tensor(times, dtype=torch.float32, device=device), width).double()
    h = torch.nn.functional.silu(emb @ t["time_mlp_in.weight"].double().T + t["time_mlp_in.bias"].double())
    return torch.nn.functional.silu(h @ t["time_mlp_out.weight"].double().T + t["time_mlp_out.bias"].double())


def modulation(t: dict[str, torch.Tensor], norm: str, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(scale, shift, gate), each (steps, W) float64: the norm's Dense of the condition, split in thirds."""
    mod = cond @ t[norm + ".dense.weight"].double().T + t[norm + ".dense.bias"].double()
    return mod.chunk(3, dim=-1)


def apply(state: PassState, ctx: PassContext) -> PassState:
    if not ctx.cfg.pi05:
        return state
    t = dict(state.tensors)
    require(t, "time_mlp_in.weight", "expert.final_norm.dense.weight", pass_name=NAME)
    times = euler_times(ctx.num_steps)
    if len(times) != ctx.num_steps:  # openpi's float32 loop visits exactly num_steps times; tables must agree
        raise ValueError(f"num_steps={ctx.num_steps} gives {len(times)} Euler times in float32")
    cond = time_condition(t, times, ctx.cfg.expert.width)
    for i in layer_ids(t, "expert.layers."):
        for norm, short in NORMS:
            p = f"expert.layers.{i}."
            scale, shift, gate = modulation(t, p + norm, cond)
            t[f"{p}{short}_scale_table"] = scale.float()
            t[f"{p}{short}_shift_table"] = shift.float()
            t[f"{p}{short}_gate_table"] = gate.float()
            del t[p + norm + ".dense.weight"], t[p + norm + ".dense.bias"]
    scale, shift, _ = modulation(t, "expert.final_norm", cond)
    t["expert.final_scale_table"], t["expert.final_shift_table"] = scale.float(), shift.float()
    for name in ("time_mlp_in", "time_mlp_out", "expert.final_norm.dense"):
        del t[name + ".weight"], t[name + ".bias"]
    return state.replace(t, adarms_steps=ctx.num_steps, euler_times=times)


def report(ctx: PassContext) -> PassReport:
    cfg = ctx.cfg
    if not cfg.pi05:
        return PassReport(NAME, 0, 0, 0, note="π0.5 only")
    w, b = cfg.expert.width, ctx.batch_size
    norms = 2 * cfg.expert.depth + 1
    # per step: sin/cos embedding (~4 kernels), two Linear + swish (4), per norm a Dense, its split and `1 + scale`
    kernels = ctx.num_steps * (8 + 3 * norms)
    macs = b * (2 * w * w + norms * w * 3 * w)
    weights = 2 * (w * w + w) + norms * (3 * w * w + 3 * w)
    tables = ctx.num_steps * (6 * cfg.expert.depth + 2) * w
    return PassReport(
        NAME,
        kernels_removed=kernels,
        weight_bytes_saved=(weights - tables) * BF16_BYTES,
        flops_saved=2 * macs * ctx.num_steps,
        note=f"{ctx.num_steps}×{w} tables per norm",
    )


PASS = GraphPass(NAME, apply, report)
