"""Pass: the last VLM layer only feeds its K and V to the action expert: drop its Q, O, MLP and the final norm.

The prefix's outputs are never read by π0 (only the KV cache is), so in the last LLM layer everything after the
K/V projection is dead code: its Q rows of the fused QKV, the output projection, the gated MLP, the FFN norm (folded
already) and `llm.final_norm`.
"""

from __future__ import annotations

from vla_rt.graph_passes.base import BF16_BYTES, GraphPass, PassContext, PassReport, PassState, layer_ids, require

NAME = "prune_last_vlm_layer"


def apply(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    last = layer_ids(t, "llm.layers.")[-1]
    p = f"llm.layers.{last}."
    require(t, p + "qkv.weight", p + "gate_up.weight", pass_name=NAME)
    g = ctx.cfg.llm
    t[p + "kv.weight"] = t.pop(p + "qkv.weight")[g.num_heads * g.head_dim :].contiguous()
    for name in ("o_proj.weight", "gate_up.weight", "down_proj.weight"):
        del t[p + name]
    t.pop("llm.final_norm.scale", None)
    return state.replace(t, pruned_last_layer=last)


def pruned_params(ctx: PassContext) -> int:
    g = ctx.cfg.llm
    q = g.num_heads * g.head_dim
    return g.width * q + q * g.width + 3 * g.width * g.mlp_dim + 2 * g.width  # q, o, gate/up/down, ffn + final norm


def report(ctx: PassContext) -> PassReport:
    g = ctx.cfg.llm
    q = g.num_heads * g.head_dim
    rows = ctx.batch_size * ctx.prefix_len
    macs = rows * (g.width * q + q * g.width + 3 * g.width * g.mlp_dim)
    attn = 2 * rows * ctx.prefix_len * q  # QKᵀ and PV of the last layer
    # Q GEMM, RoPE on Q, attention, O GEMM + residual, RMS, gate/up, GELU·up, down + residual, final norm
    return PassReport(
        NAME,
        kernels_removed=9,
        weight_bytes_saved=pruned_params(ctx) * BF16_BYTES,
        flops_saved=2 * macs + 2 * attn,
        note=f"layer {g.depth - 1} keeps K/V only",
    )


PASS = GraphPass(NAME, apply, report)
