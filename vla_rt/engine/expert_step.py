"""The seam where an action-expert implementation plugs into the plan: one Euler step of the flow-matching ODE.

The engines call `choose_expert_step(...)` once at build time; it tries the implementations in `CANDIDATES` in
order and falls back to `PerOpExpertStep` (the Triton / torch kernels launched one op at a time), recording in one
line why each candidate it passed over does not apply. The plan then calls `step.run(...)` `num_steps` times per
chunk (the streaming engine: once per graph replay). A new implementation (the persistent CUDA kernel) is one
class with `name` and `run`, plus one builder in `CANDIDATES`; it never reaches into the plan.

π0.5 has its own per-op step (`expert_step_pi05.py`: no state token, S = H, adaptive norms from a per-step table
row, which `time_bias` then carries); what follows is π0's.

Contract of `ExpertStep.run(slot, xa, step, num_steps, time_bias=None)`. Notation: B batch, H chunk, S = H + 1
suffix rows a batch element (the state token, then H action tokens; row b * S + s of the expert's buffers), P
prefix rows (256 a view + prompt), A action dim, W expert width, F expert MLP dim, L expert depth, Hq / Hkv / D the
Gemma heads (shared with the VLM), "cdtype" the engine's compute dtype (bf16 on the GPU; fp32 in CPU tests).
What one call computes, for all B·S rows at once (PI0_SPEC.md; the per-op step is the executable definition):

    x[b*S]       = state[b] @ W_stateᵀ + b_state                        (W_state: weights.suffix.state)
    e            = silu(x_t @ W_atᵀ + time_bias_row)                    (fp32 (B·H, W) in xa.action_emb)
    x[b*S+1+h]   = e[b*H+h] @ W_mlp_outᵀ + b_mlp_out
    for i < L:   x = the Gemma layer `weights.expert[i]` (gemma_layer.py) over the S suffix rows, attending to
                 keys 0..P+S of `slot.k_cache[i]` / `slot.v_cache[i]` with the suffix RoPE rows
    v            = rms_factor(x) ⊙ (x @ W_outᵀ) + b_out                 (final norm folded into W_out)
    x_t         += -(1 / num_steps) * v                                 (rows b*S+1.. of every batch element)

Reads, never writes:
- `slot.k_cache[i][:, :P]`, `slot.v_cache[i][:, :P]`: (B, P + S, Hkv, D) cdtype, the VLM's rotated K and V.
- `slot.key_block` (B, P + S) int32 and `xa.query_block` (B, S) int32: query q sees key j iff
  key_block[b, j] <= query_block[b, q] (prefix keys 0, padding `torch_ops.INVALID_BLOCK`, state 1, actions 2).
- `slot.suffix_cos`, `slot.suffix_sin` (B, S, D/2) float32: RoPE at each batch element's suffix positions.
- `slot.state` (B, A) float32.
- `weights.suffix` (engine/weights.py): state (W, A), state_bias, action_time (W, A) and time_bias (num_steps, W)
  float32 (action_in merged into the action half of the time MLP; the time half per step); mlp_out (W, W),
  mlp_out_bias, action_out (A, W), action_out_bias cdtype; `weights.expert[i]`: qkv ((Hq + 2 Hkv) D, W), o
  (W, Hq D), gate_up (2F, W) = [gate; up], down (W, F), RMSNorm scales folded into qkv, gate_up and action_out.
- `time_bias` (W,) float32 when given: used instead of `weights.suffix.time_bias[step]` (the streaming engine
  selects the row on the device and passes step 0, so one captured graph serves every step). Or (B, W): one row
  per batch element, each at its own Euler step (the stage engine, `stages.py`, batches rows that joined at
  different times). A candidate takes both forms: the stage engine's plans choose their step here like every other.
Writes:
- `xa.x_t` (B, H, A) float32 in place: the only result.
- `slot.k_cache[i][:, P:]`, `slot.v_cache[i][:, P:]`: the suffix rows' K and V, scratch of this step.
- scratch, undefined before and after: `xa.x` (B·S, W), `xa.qkv`, `xa.attn`, `xa.mlp`, `xa.rms`, `xa.action_emb`.
Never touches `slot.version`, the prefix rows, the other slot or the VLM's buffers: in the streaming engine a VLM
pass writes the other slot on another stream at the same time, so a step uses only its own workspace. A call is
launch-only on the current CUDA stream (no host synchronisation, no allocation after the first call), so it
captures into a CUDA Graph, and replays are bit-identical (reductions in a fixed order). `sm_count` (given at build
time) bounds the SMs a step may occupy at once, so a persistent kernel leaves the VLM stream the rest; None: all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from vla_rt.config import Pi0Config
from vla_rt.cuda_kernels.choice import persistent_expert_step
from vla_rt.engine.buffers import Dims, ExpertActivations, PrefixSlot
from vla_rt.engine.expert_step_pi05 import Pi05ExpertStep
from vla_rt.engine.gemma_layer import GemmaLayerRunner, LayerBuffers
from vla_rt.engine.weights import EngineWeights


class ExpertStep(Protocol):
    """One Euler step of the action expert (the contract: this module's docstring)."""

    name: str

    def run(self, slot: PrefixSlot, xa: ExpertActivations, step: int, num_steps: int,
            time_bias: torch.Tensor | None = None) -> None: ...  # fmt: skip


class PerOpExpertStep:
    """The step as separate kernel launches (about seven a layer) of a kernel set with the Triton contracts: the
    suffix embedding, L Gemma layers with the RoPE epilogue in the QKV GEMM, the final norm, and the action
    projection with the Euler update in its epilogue. Every SM count: its kernels are short and the GPU's block
    scheduler shares the SMs with the VLM stream."""

    name = "per-op"
    per_row_steps = True  # takes a (B, W) time_bias: rows at different steps (the stage engine)

    def __init__(self, kernels, weights: EngineWeights, cfg: Pi0Config, dims: Dims, workspace=None):
        self.k, self.w, self.d, self.eps = kernels, weights, dims, cfg.rms_eps
        self.layer = GemmaLayerRunner(kernels, cfg, dims.batch, weights.gemma_attn_scale, workspace)
        self.ws = self.layer.ws
        self._batched_suffix = dims.batch > 1  # the batched forms of the suffix's first and last launches
        if self._batched_suffix:  # their scratch: mlp_out's B·H rows before the copy into x, and v in float32
            out = weights.suffix.mlp_out
            self._actions = torch.empty(dims.batch * dims.chunk, cfg.expert.width, dtype=out.dtype, device=out.device)
            self._v = torch.empty(dims.batch * dims.suffix, cfg.action_dim, dtype=torch.float32, device=out.device)

    def run(self, slot: PrefixSlot, xa: ExpertActivations, step: int, num_steps: int,
            time_bias: torch.Tensor | None = None) -> None:  # fmt: skip
        k, s, d, ws = self.k, self.w.suffix, self.d, self.ws
        x3 = xa.x.view(d.batch, d.suffix, -1)
        k.gemm(slot.state, s.state, x3[:, 0], bias=s.state_bias, **ws)
        per_row_bias = time_bias is not None and time_bias.dim() == 2  # each batch element at its own step
        if not self._batched_suffix:
            self._embed_per_row(xa, step, time_bias, per_row_bias)
        else:
            self._embed_batched(xa, step, time_bias, per_row_bias)
        io = LayerBuffers(xa.x, xa.qkv, xa.attn, xa.mlp, xa.rms, slot.suffix_cos, slot.suffix_sin, xa.query_block,
                          slot.key_block, d.suffix, d.prefix)  # fmt: skip
        for i, layer in enumerate(self.w.expert):
            self.layer.run(layer, io, slot.k_cache[i], slot.v_cache[i], rope_epilogue=True)
        k.rms_factor(xa.x, xa.rms, self.eps)
        if not self._batched_suffix:
            self._update_per_row(xa, num_steps)
        else:
            self._update_batched(xa, num_steps)

    # The suffix's action rows are rows b * S + 1 .. (b + 1) * S of x: no one row stride spans two batch elements, so
    # a GEMM into (or out of) them alone is one launch a batch element. At B = 1 that is one launch with the bias,
    # activation and Euler update fused in its epilogue; at B > 1 the batched forms below take a handful of launches
    # for all rows instead of three a batch element, at the price of a copy (mlp_out) and a small fp32 round trip (v).

    def _embed_per_row(self, xa: ExpertActivations, step: int, time_bias, per_row_bias: bool) -> None:
        k, s, d, ws = self.k, self.w.suffix, self.d, self.ws
        ss, h = d.suffix, d.chunk
        x_t = xa.x_t.view(d.batch * h, -1)
        if per_row_bias:
            for b in range(d.batch):
                rows = slice(b * h, (b + 1) * h)
                k.gemm(x_t[rows], s.action_time, xa.action_emb[rows], bias=time_bias[b], activation="silu", **ws)
        else:
            bias = s.time_bias[step] if time_bias is None else time_bias
            k.gemm(x_t, s.action_time, xa.action_emb, bias=bias, activation="silu", **ws)
        for b in range(d.batch):
            k.gemm(xa.action_emb[b * h : (b + 1) * h], s.mlp_out, xa.x[b * ss + 1 : (b + 1) * ss],
                   bias=s.mlp_out_bias, **ws)  # fmt: skip

    def _embed_batched(self, xa: ExpertActivations, step: int, time_bias, per_row_bias: bool) -> None:
        """e = silu(x_t W_atᵀ + bias) for all B·H rows in one GEMM (per-row biases added after it, then silu, both in
        float32 as the epilogue computes them); mlp_out for all rows into scratch, then one copy into x's action
        rows."""
        k, s, d, ws = self.k, self.w.suffix, self.d, self.ws
        h, width = d.chunk, xa.x.shape[1]
        x_t = xa.x_t.view(d.batch * h, -1)
        if per_row_bias:
            k.gemm(x_t, s.action_time, xa.action_emb, **ws)
            emb = xa.action_emb.view(d.batch, h, -1)
            emb.add_(time_bias[:, None, :])
            torch.nn.functional.silu(emb, inplace=True)
        else:
            bias = s.time_bias[step] if time_bias is None else time_bias
            k.gemm(x_t, s.action_time, xa.action_emb, bias=bias, activation="silu", **ws)
        k.gemm(xa.action_emb, s.mlp_out, self._actions, bias=s.mlp_out_bias, **ws)
        xa.x.view(d.batch, d.suffix, width)[:, 1:].copy_(self._actions.view(d.batch, h, width))

    def _update_per_row(self, xa: ExpertActivations, num_steps: int) -> None:
        """v = action_out(x̂); x_t += -v / num_steps, fused in the GEMM epilogue, a launch a batch element."""
        k, s, d, ws = self.k, self.w.suffix, self.d, self.ws
        for b in range(d.batch):
            rows = slice(b * d.suffix + 1, (b + 1) * d.suffix)
            k.gemm(xa.x[rows], s.action_out, xa.x_t[b], bias=s.action_out_bias, alpha=-1.0 / num_steps,
                   residual=xa.x_t[b], row_scale=xa.rms[rows], **ws)  # fmt: skip

    def _update_batched(self, xa: ExpertActivations, num_steps: int) -> None:
        """v for all B·S rows (the state rows' are computed and dropped) into float32 scratch, then one in-place
        update of x_t from the action rows."""
        k, s, d, ws, v = self.k, self.w.suffix, self.d, self.ws, self._v
        k.gemm(xa.x, s.action_out, v, bias=s.action_out_bias, row_scale=xa.rms, **ws)
        xa.x_t.add_(v.view(d.batch, d.suffix, -1)[:, 1:], alpha=-1.0 / num_steps)


# A candidate builder gets what `choose_expert_step` got and returns an ExpertStep, or a one-line reason (str) why
# it does not apply here (no such GPU, dims it does not serve, a kernel set it does not replace: the torch kernel
# set is the graphed-torch baseline and keeps the per-op step).
CandidateBuilder = Callable[..., "ExpertStep | str"]
# tried in order before PerOpExpertStep: the persistent CUDA kernel where it measured faster on this GPU and shape
CANDIDATES: tuple[CandidateBuilder, ...] = (persistent_expert_step,)


def choose_expert_step(kernels, weights: EngineWeights, cfg: Pi0Config, dims: Dims, workspace=None, *,
                       device: torch.device, sm_count: int | None = None,
                       candidates: tuple[CandidateBuilder, ...] | None = None) -> tuple[ExpertStep, str]:  # fmt: skip
    """(the first candidate that applies, else the per-op step; "name: reason; ..." for those passed over, "" if
    none). `candidates` defaults to `CANDIDATES`; `sm_count`: the most SMs the step may occupy (None: all).
    π0.5's per-op step is its own (`expert_step_pi05.py`); a candidate serves π0, π0.5 or both."""
    reasons = []
    for build in CANDIDATES if candidates is None else candidates:
        made = build(kernels, weights, cfg, dims, workspace, device=device, sm_count=sm_count)
        if not isinstance(made, str):
            return made, "; ".join(reasons)
        reasons.append(f"{getattr(build, '__name__', build)}: {made}")
    per_op = Pi05ExpertStep if cfg.pi05 else PerOpExpertStep
    return per_op(kernels, weights, cfg, dims, workspace), "; ".join(reasons)
