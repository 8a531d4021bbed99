"""π0.5's action-expert step as separate kernel launches: the `ExpertStep` contract (expert_step.py) for π0.5.

What changes from π0's per-op step (PI0_SPEC.md, π0.5 section; `FoldedPi0._velocity_pi05` is the same computation
in eager torch): the suffix is the H action tokens alone (S = H rows a batch element, one block: query and key
block 1), the action tokens are `action_in_proj(x_t)` (float32 weights, no time MLP), and every expert norm is
adaptive. The graph passes turned the modulation into per-step tables (`EngineWeights.pi05`, one packed float32
row a step), so a layer at step k is

    x̂ = rmsnorm(x) ⊙ (1 + s_attn[k])              (the Triton `rmsnorm` kernel with the step's scale row)
    qkv = x̂ @ W_qkvᵀ + b_qkv[k]  → RoPE           (b_qkv = W_qkv · shift: the folded shift, RoPE in the epilogue)
    x += g_attn[k] ⊙ (attention @ W_oᵀ)            (the gate as the GEMM's output-column scale, before the residual)
    x̂ = rmsnorm(x) ⊙ (1 + s_ffn[k]);  x += g_ffn[k] ⊙ (GeGLU(x̂ @ W_guᵀ + b_gu[k]) @ W_downᵀ)

and the final norm's scale and shift are folded into the step's `action_out_proj` table, applied in float32 to the
float32 RMSNorm of x (one launch each, as π0's rms_factor + action GEMM), with the Euler update in the epilogue.
Same launch count as π0's step minus the state token and the time MLP's two GEMMs.

The step reads its modulation from one row: `tables[step]`, or the row given as `time_bias` (the streaming engine's
one-step graph copies `weights.step_table[step]` out on the device and passes step 0: one graph for every step).

`time_bias` (B, R), one row per batch element (the stage engine's rows, each at its own Euler step): the same
launches, the GEMMs batched (the weights read once for all rows), with the modulation as (B, ·) rows that the
kernels' epilogues and the norm index by batch element (output row r reads row r // S: `gemm`'s and `rmsnorm`'s
row-group form), so every row computes exactly what a single-row step computes; the per-row `action_out_proj`
(per-step weights) is one GEMM per batch element.
"""

from __future__ import annotations

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Dims, ExpertActivations, PrefixSlot
from vla_rt.engine.weights import EngineWeights, GemmaLayerWeights, Pi05LayerRow


class Pi05ExpertStep:
    """One Euler step of π0.5's action expert on a kernel set with the Triton contracts (`rmsnorm` included)."""

    name = "per-op-pi05"
    per_row_steps = True  # takes (B, R) modulation rows: rows at different steps (the stage engine)

    def __init__(self, kernels, weights: EngineWeights, cfg: Pi0Config, dims: Dims, workspace=None):
        if weights.pi05 is None or dims.state_token:
            raise ValueError("Pi05ExpertStep: expected π0.5 engine weights and dims without a state token")
        self.k, self.w, self.p, self.d, self.eps = kernels, weights, weights.pi05, dims, cfg.rms_eps
        g = cfg.llm  # both experts share the head layout (PI0_SPEC.md)
        self.heads = dict(num_q_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
        self.ws = {} if workspace is None else {"workspace": workspace}

    def run(self, slot: PrefixSlot, xa: ExpertActivations, step: int, num_steps: int,
            time_bias: torch.Tensor | None = None) -> None:  # fmt: skip
        if time_bias is not None and time_bias.dim() == 2:
            self._run_rows(slot, xa, time_bias, num_steps)
            return
        k, p, d, ws = self.k, self.p, self.d, self.ws
        row = p.row(p.tables[step] if time_bias is None else time_bias)
        x_t = xa.x_t.view(d.batch * d.chunk, -1)
        k.gemm(x_t, p.action_in, xa.x, bias=p.action_in_bias, **ws)  # rows b * H + h: the action tokens
        for i, (layer, mod) in enumerate(zip(self.w.expert, row.layers)):
            self._layer(layer, mod, slot, xa, slot.k_cache[i], slot.v_cache[i])
        k.rmsnorm(xa.x, xa.action_emb, self.eps)  # float32 x̂: the final norm's scale lives in the action table
        k.gemm(xa.action_emb, row.action_out, x_t, bias=row.action_out_bias, alpha=-1.0 / num_steps, residual=x_t,
               **ws)  # fmt: skip

    def _layer(self, layer: GemmaLayerWeights, mod: Pi05LayerRow, slot: PrefixSlot, xa: ExpertActivations,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:  # fmt: skip
        k, d, h, ws = self.k, self.d, self.heads, self.ws
        k.rmsnorm(xa.x, xa.normed, self.eps, scale=mod.attn_scale)
        rope = dict(cos=slot.suffix_cos, sin=slot.suffix_sin, k_cache=k_cache, v_cache=v_cache,
                    cache_offset=d.prefix, **h)  # fmt: skip
        k.gemm(xa.normed, layer.qkv, xa.qkv, bias=mod.qkv_bias, rope=rope, **ws)
        keys, hq, hd = d.prefix + d.suffix, h["num_q_heads"], h["head_dim"]
        q = xa.qkv.view(d.batch, d.suffix, -1, hd)[:, :, :hq]
        k.attention(q, k_cache[:, :keys], v_cache[:, :keys], xa.attn.view(d.batch, d.suffix, hq, hd),
                    scale=self.w.gemma_attn_scale, q_block=xa.query_block, k_block=slot.key_block, **ws)  # fmt: skip
        k.gemm(xa.attn, layer.o, xa.x, residual=xa.x, out_scale=mod.attn_gate, **ws)
        k.rmsnorm(xa.x, xa.normed, self.eps, scale=mod.ffn_scale)
        k.gemm(xa.normed, layer.gate_up, xa.mlp, gated=True, bias=mod.gate_up_bias, **ws)
        k.gemm(xa.mlp, layer.down, xa.x, residual=xa.x, out_scale=mod.ffn_gate, **ws)

    # ----- one modulation row per batch element (the stage engine) -------------------------------------------------
    def _run_rows(self, slot: PrefixSlot, xa: ExpertActivations, rows: torch.Tensor, num_steps: int) -> None:
        """The step with (B, R) modulation rows: the same launches as one row, the kernels taking (B, ·) scale, bias
        and gate rows (row r of a GEMM or norm reads its batch element's, r // S); only `action_out_proj`, whose
        weights are per step, runs once per batch element."""
        k, p, d, ws = self.k, self.p, self.d, self.ws
        mod = p.rows(rows)
        x_t = xa.x_t.view(d.batch * d.chunk, -1)
        k.gemm(x_t, p.action_in, xa.x, bias=p.action_in_bias, **ws)
        for i, (layer, m) in enumerate(zip(self.w.expert, mod.layers)):
            self._layer(layer, m, slot, xa, slot.k_cache[i], slot.v_cache[i])
        k.rmsnorm(xa.x, xa.action_emb, self.eps)
        h = d.chunk
        for b in range(d.batch):  # the row's own action_out_proj (the final norm's scale folded in per step)
            out = slice(b * h, (b + 1) * h)
            k.gemm(xa.action_emb[out], mod.action_out[b], x_t[out], bias=mod.action_out_bias[b],
                   alpha=-1.0 / num_steps, residual=x_t[out], **ws)  # fmt: skip
