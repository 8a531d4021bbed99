"""Pass (π0.5): fold what is exact of the adaptive norms into the linear layers that read them, per step.

A norm's output feeds one GEMM: `(x̂ ⊙ (1 + s_k) + h_k) Wᵀ = (x̂ ⊙ (1 + s_k)) Wᵀ + W h_k`, with x̂ = r·x. The shift
term is a constant per step: it becomes a (steps, N) bias table of the fused QKV (pre-attention norm; Q rows already
carry the folded softmax scale) and of gate/up (pre-FFW norm, added before the GELU). For the final norm, whose
single reader is `action_out_proj` (W → A, tiny), scale and shift both fold: a (steps, A, W) weight table
`W diag(1 + s_k)` and a (steps, A) bias table `W h_k + b`, so the expert's output GEMM needs no modulation at all.
The layer norms' scale s_k stays a (steps, W) table (an offset from 1) that an RMSNorm applies before the GEMM
(`x̂ ⊙ (1 + s_k)`, the engine's RMSNorm kernel with a per-step scale row): folding it into q/k/v and gate/up would
need a copy of those matrices per step (10x the expert's input weights) and a different weight pointer every step,
which one graph replayed for every step (the streaming engine) cannot follow. The gates stay (steps, W) tables
multiplying the output columns of o_proj / down_proj before their residual add.
"""

from __future__ import annotations

from vla_rt.graph_passes.base import BF16_BYTES, GraphPass, PassContext, PassReport, PassState, layer_ids, require

NAME = "fold_adarms_shift_and_final_norm"
READERS = (("attn", "qkv"), ("ffn", "gate_up"))


def apply(state: PassState, ctx: PassContext) -> PassState:
    if not ctx.cfg.pi05:
        return state
    t = dict(state.tensors)
    require(t, "expert.final_scale_table", "expert.layers.0.qkv.weight", pass_name=NAME)
    for i in layer_ids(t, "expert.layers."):
        p = f"expert.layers.{i}."
        for norm, reader in READERS:
            shift = t.pop(f"{p}{norm}_shift_table").double()
            t[f"{p}{reader}_bias_table"] = (shift @ t[f"{p}{reader}.weight"].double().T).float()
    w, b = t.pop("action_out_proj.weight").double(), t.pop("action_out_proj.bias").double()
    scale, shift = t.pop("expert.final_scale_table").double(), t.pop("expert.final_shift_table").double()
    t["action_out_proj.weight_table"] = (w[None] * (1.0 + scale)[:, None, :]).float()  # (steps, A, W)
    t["action_out_proj.bias_table"] = (shift @ w.T + b).float()  # (steps, A)
    return state.replace(t, adarms_shift_folded=True)


def report(ctx: PassContext) -> PassReport:
    cfg = ctx.cfg
    if not cfg.pi05:
        return PassReport(NAME, 0, 0, 0, note="π0.5 only")
    e, rows = cfg.expert, ctx.batch_size * ctx.suffix_len
    norms = 2 * e.depth + 1
    # per norm and step: the shift add (one elementwise kernel, rows × W); the final norm's scale multiply too
    kernels = ctx.num_steps * (norms + 1)
    flops = ctx.num_steps * rows * e.width * (norms + 1)
    extra = ctx.num_steps * (cfg.action_dim * e.width + cfg.action_dim)
    return PassReport(
        NAME,
        kernels_removed=kernels,
        weight_bytes_saved=-extra * BF16_BYTES,
        flops_saved=flops,
        note="shift → bias tables; final norm → action_out_proj",
    )


PASS = GraphPass(NAME, apply, report)
