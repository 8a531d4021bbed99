"""A random action-expert problem for the persistent-kernel tests: engine weights (expert layers and suffix only; π0.5:
its action_in_proj and per-step modulation tables instead of the suffix), a filled prefix slot and expert
activations, plus the per-op reference step (`Pi0Plan.expert_step`)."""

from __future__ import annotations

import torch

from vla_rt.config import GemmaConfig, Pi0Config
from vla_rt.engine.buffers import Dims, ExpertActivations, PrefixSlot
from vla_rt.engine.kernels import TorchKernels
from vla_rt.engine.plan import Pi0Plan
from vla_rt.engine.torch_ops import INVALID_BLOCK
from vla_rt.engine.weights import PI05_LAYER_TABLES, EngineWeights, GemmaLayerWeights, Pi05Weights, SuffixWeights
from vla_rt.graph_passes.precompute_rope import rope_tables


def config(depth: int, width: int = 1024, mlp: int = 4096, heads: int = 8, pi05: bool = False) -> Pi0Config:
    """π0's (or π0.5's) expert dims, or narrower ones for quick CPU checks: any width / MLP / heads the kernel takes."""
    return Pi0Config(llm=GemmaConfig(width=2048, depth=depth, mlp_dim=16384, num_heads=heads),
                     expert=GemmaConfig(width=width, depth=depth, mlp_dim=mlp, num_heads=heads), pi05=pi05)  # fmt: skip


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()  # values a bf16 copy holds exactly


def _pi05_weights(cfg: Pi0Config, steps: int, g: torch.Generator) -> Pi05Weights:
    """action_in_proj and random per-step tables, packed as the engine packs them (scales and biases ~0.1 so that
    no term vanishes, gates around 1)."""
    e, a = cfg.expert, cfg.action_dim
    qkv = (cfg.llm.num_heads + 2) * 256
    sizes = dict(attn_scale=e.width, qkv_bias=qkv, attn_gate=e.width, ffn_scale=e.width, gate_up_bias=2 * e.mlp_dim,
                 ffn_gate=e.width)  # fmt: skip
    t = {}
    for i in range(e.depth):
        for name in PI05_LAYER_TABLES:
            base = 1.0 if name.endswith("gate") else 0.0
            t[f"expert.layers.{i}.{name}_table"] = base + 0.1 * torch.randn(steps, sizes[name], generator=g)
    t["action_out_proj.weight_table"] = torch.randn(steps, a, e.width, generator=g) * e.width**-0.5
    t["action_out_proj.bias_table"] = 0.1 * torch.randn(steps, a, generator=g)
    t["action_in_proj.weight"] = torch.randn(e.width, a, generator=g) * a**-0.5
    t["action_in_proj.bias"] = 0.1 * torch.randn(e.width, generator=g)
    return Pi05Weights.pack(t, e.depth)


def problem(depth=2, batch=1, views=1, prompt=0, chunk=63, seed=0, device="cpu", dtype=torch.float32,
            masked_keys: int = 7, width: int = 1024, mlp: int = 4096, heads: int = 8, pi05: bool = False):  # fmt: skip
    """(cfg, dims, weights, slot, xa): weights rounded to bf16 values (so a bf16 pack is exact), `masked_keys`
    prefix keys of each batch marked invalid; `pi05`: π0.5's action expert (no state token, modulation tables)."""
    g = torch.Generator().manual_seed(seed)
    cfg = config(depth, width, mlp, heads, pi05)
    e, a = cfg.expert, cfg.action_dim
    dims = Dims(batch, views, prompt, chunk, 256, state_token=not pi05)

    def rnd(*shape, scale=1.0):
        return _bf16(torch.randn(*shape, generator=g) * scale)

    layers = []
    for _ in range(depth):
        qw = heads * 256
        layers.append(GemmaLayerWeights(rnd(qw + 512, e.width, scale=e.width**-0.5), rnd(e.width, qw, scale=qw**-0.5),
                                        rnd(2 * e.mlp_dim, e.width, scale=e.width**-0.5),
                                        rnd(e.width, e.mlp_dim, scale=e.mlp_dim**-0.5)))  # fmt: skip
    suffix = None if pi05 else SuffixWeights(
        torch.randn(e.width, a, generator=g) * a**-0.5, torch.randn(e.width, generator=g) * 0.1,
        torch.randn(e.width, a, generator=g) * a**-0.5, torch.randn(10, e.width, generator=g) * 0.5,
        rnd(e.width, e.width, scale=e.width**-0.5), torch.randn(e.width, generator=g) * 0.1,
        rnd(a, e.width, scale=e.width**-0.5), torch.randn(a, generator=g) * 0.1,
    )  # fmt: skip
    cos, sin = rope_tables(2048, 256)
    weights = EngineWeights(
        patch=None, patch_bias=None, pos_embed=None, vision=[], projector=None, projector_bias=None,
        embed_tokens=torch.zeros(1, 1), llm=[], expert=layers, suffix=suffix, rope_cos=cos.float(),
        rope_sin=sin.float(), vision_attn_scale=1.0, gemma_attn_scale=256**-0.5, num_steps=10,
        pi05=_pi05_weights(cfg, 10, g) if pi05 else None,
    )  # fmt: skip
    slot = PrefixSlot.allocate(cfg, dims, torch.device("cpu"), dtype)
    for k, v in zip(slot.k_cache, slot.v_cache):
        k[:, : dims.prefix].copy_(_bf16(torch.randn(batch, dims.prefix, 1, 256, generator=g)))
        v[:, : dims.prefix].copy_(_bf16(torch.randn(batch, dims.prefix, 1, 256, generator=g)))
    valid = torch.ones(batch, dims.prefix, dtype=torch.bool)
    for b in range(batch):
        valid[b, torch.randperm(dims.prefix, generator=g)[:masked_keys]] = False
    slot.key_block[:, : dims.prefix] = torch.where(valid, 0, INVALID_BLOCK)
    slot.key_block[:, dims.prefix :] = 1 if pi05 else 2  # π0.5's actions are one block
    slot.key_block[:, dims.prefix] = 1
    pos = valid.int().sum(-1, keepdim=True) + torch.arange(dims.suffix)
    slot.suffix_cos.copy_(cos.float()[pos])
    slot.suffix_sin.copy_(sin.float()[pos])
    slot.state.copy_(torch.randn(batch, a, generator=g))
    xa = ExpertActivations.allocate(cfg, dims, torch.device("cpu"), dtype)
    xa.x_t.copy_(torch.randn(batch, chunk, a, generator=g))
    if device != "cpu" or dtype != torch.float32:
        weights, slot, xa = to_device(weights, slot, xa, device, dtype)
    return cfg, dims, weights, slot, xa


def to_device(weights, slot, xa, device, dtype):
    """The problem on `device`, the engine's weights in `dtype` except those the engine keeps in float32."""

    def mv(t, keep32=False):
        if t is None:
            return None
        return t.to(device, torch.float32 if keep32 or not t.is_floating_point() else dtype)

    layers = [GemmaLayerWeights(mv(li.qkv), mv(li.o), mv(li.gate_up), mv(li.down)) for li in weights.expert]
    s, p = weights.suffix, weights.pi05
    suffix = None if s is None else SuffixWeights(
        mv(s.state, True), mv(s.state_bias, True), mv(s.action_time, True), mv(s.time_bias, True), mv(s.mlp_out, True),
        mv(s.mlp_out_bias, True), mv(s.action_out), mv(s.action_out_bias))  # fmt: skip
    pi05 = None if p is None else Pi05Weights(mv(p.action_in, True), mv(p.action_in_bias, True), mv(p.tables, True),
                                              p.segments)  # fmt: skip
    w = EngineWeights(**{**weights.__dict__, "expert": layers, "suffix": suffix, "pi05": pi05,
                         "embed_tokens": mv(weights.embed_tokens), "rope_cos": mv(weights.rope_cos, True),
                         "rope_sin": mv(weights.rope_sin, True)})  # fmt: skip
    slot2 = PrefixSlot([mv(k) for k in slot.k_cache], [mv(v) for v in slot.v_cache], slot.key_block.to(device),
                       mv(slot.suffix_cos, True), mv(slot.suffix_sin, True), mv(slot.state, True),
                       slot.version.to(device))  # fmt: skip
    xa2 = ExpertActivations(**{k: _activation_to(k, v, device, dtype) for k, v in xa.__dict__.items()})
    return w, slot2, xa2


def _activation_to(name: str, t: torch.Tensor | None, device, dtype) -> torch.Tensor | None:
    """One `ExpertActivations` field on `device`: the engine's float32 fields stay float32, other floats take
    `dtype`, integer fields keep theirs; fields a model does not use (None, e.g. π0.5's `normed` in π0) stay None."""
    if t is None:
        return None
    if name in ("x_t", "action_emb", "rms", "ssq"):
        return t.to(device, torch.float32)
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)


# the cases of tests/test_cuda_expert_gpu.py's accuracy test: (depth, batch, views, prompt, chunk)
GPU_CASES = [(2, 1, 1, 0, 63), (18, 1, 1, 0, 63), (18, 1, 3, 20, 50), (18, 4, 2, 20, 50)]


def gpu_case_kwargs(depth: int, batch: int, views: int, prompt: int, chunk: int) -> dict:
    """`paired_problem`'s keyword arguments for one of GPU_CASES (the seed included)."""
    return dict(batch=batch, views=views, prompt=prompt, chunk=chunk, seed=depth + views)


def paired_problem(depth: int, device, **kw):
    """(cfg, dims, fp32 problem, bf16 problem) on `device`, holding the same values (weights and the KV prefix are
    bf16-representable): the setup of every GPU check of the kernel (tests/test_cuda_expert_gpu.py,
    tools/cuda_expert_check.py). A CPU test builds it too, so a change that breaks this setup fails on the CPU."""
    cfg, dims, w, slot, xa = problem(depth=depth, **kw)
    return cfg, dims, to_device(w, slot, xa, device, torch.float32), to_device(w, slot, xa, device, torch.bfloat16)


def reference_step(cfg, dims, weights, slot, xa, step: int, num_steps: int = 10, kernels=None) -> None:
    """The per-op step (`Pi0Plan.expert_step`) in place on slot / xa."""
    Pi0Plan(kernels or TorchKernels(), weights, cfg, dims).expert_step(slot, xa, step, num_steps)
