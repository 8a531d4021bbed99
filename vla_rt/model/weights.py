"""The canonical weight layout of π0 in vla-rt: names, shapes, validation, shape inference, random init.

Canonical weights are a flat `dict[str, Tensor]` in PyTorch conventions (a linear layer's `weight` is (out, in);
the patch embedding is an OIHW conv kernel). Every loader (openpi, LeRobot, native) produces exactly this dict,
the reference model's `state_dict()` is exactly this dict, and graph passes start from it.

Gemma RMSNorm scales keep openpi's convention: stored as an offset from 1 (`x̂ * (1 + scale)`). SigLIP LayerNorm
weights are plain multipliers.

π0.5 differs in three places: no `state_proj` and no `action_time_mlp_*`, but `time_mlp_in` / `time_mlp_out`
(W → W each); the action expert's norms have no `scale` but a Dense `*.dense.weight` (3W, W) + `.bias` (3W) whose
output rows are [scale | shift | gate] (openpi's split order); the LLM's norms stay plain.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from vla_rt.config import PI05_MAX_TOKEN_LEN, GemmaConfig, Pi0Config, VisionConfig
from vla_rt.errors import CheckpointError

Shapes = dict[str, tuple[int, ...]]


def vision_shapes(v: VisionConfig, llm_width: int) -> Shapes:
    s: Shapes = {
        "vision.patch_embed.weight": (v.width, 3, v.patch_size, v.patch_size),
        "vision.patch_embed.bias": (v.width,),
        "vision.pos_embed": (v.num_patches, v.width),
    }
    for i in range(v.depth):
        p = f"vision.blocks.{i}."
        s |= {
            p + "norm1.weight": (v.width,),
            p + "norm1.bias": (v.width,),
            p + "attn.q_proj.weight": (v.width, v.width),
            p + "attn.q_proj.bias": (v.width,),
            p + "attn.k_proj.weight": (v.width, v.width),
            p + "attn.k_proj.bias": (v.width,),
            p + "attn.v_proj.weight": (v.width, v.width),
            p + "attn.v_proj.bias": (v.width,),
            p + "attn.out_proj.weight": (v.width, v.width),
            p + "attn.out_proj.bias": (v.width,),
            p + "norm2.weight": (v.width,),
            p + "norm2.bias": (v.width,),
            p + "mlp.fc1.weight": (v.mlp_dim, v.width),
            p + "mlp.fc1.bias": (v.mlp_dim,),
            p + "mlp.fc2.weight": (v.width, v.mlp_dim),
            p + "mlp.fc2.bias": (v.width,),
        }
    s |= {
        "vision.final_norm.weight": (v.width,),
        "vision.final_norm.bias": (v.width,),
        "projector.weight": (llm_width, v.width),
        "projector.bias": (llm_width,),
    }
    return s


def norm_shapes(name: str, width: int, cond_width: int | None) -> Shapes:
    """A plain RMSNorm's `scale` offset, or an adaptive norm's Dense (3W, cond) + bias (3W)."""
    if cond_width is None:
        return {name + ".scale": (width,)}
    return {name + ".dense.weight": (3 * width, cond_width), name + ".dense.bias": (3 * width,)}


def gemma_shapes(prefix: str, g: GemmaConfig, cond_width: int | None = None) -> Shapes:
    q_width, kv_width = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    s: Shapes = {}
    for i in range(g.depth):
        p = f"{prefix}.layers.{i}."
        s |= norm_shapes(p + "attn_norm", g.width, cond_width)
        s |= {
            p + "q_proj.weight": (q_width, g.width),
            p + "k_proj.weight": (kv_width, g.width),
            p + "v_proj.weight": (kv_width, g.width),
            p + "o_proj.weight": (g.width, q_width),
        }
        s |= norm_shapes(p + "ffn_norm", g.width, cond_width)
        s |= {
            p + "gate_proj.weight": (g.mlp_dim, g.width),
            p + "up_proj.weight": (g.mlp_dim, g.width),
            p + "down_proj.weight": (g.width, g.mlp_dim),
        }
    s |= norm_shapes(f"{prefix}.final_norm", g.width, cond_width)
    return s


def suffix_head_names(cfg: Pi0Config) -> tuple[str, ...]:
    """The linear layers outside the towers: π0's state/action-time MLP, or π0.5's time MLP."""
    if cfg.pi05:
        return ("action_in_proj", "time_mlp_in", "time_mlp_out", "action_out_proj")
    return ("state_proj", "action_in_proj", "action_time_mlp_in", "action_time_mlp_out", "action_out_proj")


def param_shapes(cfg: Pi0Config) -> Shapes:
    """Every canonical tensor name with its shape, in a stable order."""
    we, a = cfg.expert.width, cfg.action_dim
    s = vision_shapes(cfg.vision, cfg.llm.width)
    s["llm.embed_tokens.weight"] = (cfg.vocab_size, cfg.llm.width)
    s |= gemma_shapes("llm", cfg.llm)
    s |= gemma_shapes("expert", cfg.expert, cond_width=we if cfg.pi05 else None)
    heads = {
        "state_proj": (we, a),
        "action_in_proj": (we, a),
        "action_time_mlp_in": (we, 2 * we),
        "action_time_mlp_out": (we, we),
        "time_mlp_in": (we, we),
        "time_mlp_out": (we, we),
        "action_out_proj": (a, we),
    }
    for head in suffix_head_names(cfg):
        s |= {f"{head}.weight": heads[head], f"{head}.bias": (heads[head][0],)}
    return s


def is_pi05(names) -> bool:
    """π0.5 has a time MLP and adaptive expert norms where π0 has `state_proj` and the action-time MLP.

    Either sign is enough, so a mixture of the two models is checked (and refused) against π0.5's tensor list.
    """
    return "time_mlp_in.weight" in names or any(n.startswith("expert.") and ".dense." in n for n in names)


def validate_weights(weights: dict[str, torch.Tensor], cfg: Pi0Config, source: str = "checkpoint") -> None:
    """Raises CheckpointError naming every missing, extra or misshaped tensor (expected vs found shape)."""
    expected = param_shapes(cfg)
    problems = []
    for name, shape in expected.items():
        if name not in weights:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
    for name in weights:
        if name not in expected:
            problems.append(f"unexpected tensor {name!r} with shape {tuple(weights[name].shape)}")
    for name, t in weights.items():
        if name in expected and not t.is_floating_point():
            problems.append(f"tensor {name!r} has dtype {t.dtype}, expected a floating-point dtype")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"{source}: {len(problems)} problem(s) with the weights:\n  {shown}{more}")


def _count(weights: dict[str, torch.Tensor] | Shapes, pattern: str) -> int:
    """Number of distinct layer indices i for names like `pattern.{i}.`; a name whose index is not a number (a damaged
    header) is a CheckpointError naming it, not a bare ValueError."""
    idx = set()
    for name in weights:
        if name.startswith(pattern):
            index = name[len(pattern) :].split(".")[0]
            if not index.isdecimal() or not index.isascii():
                raise CheckpointError(f"tensor {name!r}: expected a layer index after {pattern!r}, found {index!r}")
            idx.add(int(index))
    return len(idx)


def _shape(weights: dict[str, torch.Tensor], name: str) -> tuple[int, ...]:
    if name not in weights:
        raise CheckpointError(f"cannot infer model dimensions: tensor {name!r} is missing")
    return tuple(weights[name].shape)


def _infer_gemma(weights: dict[str, torch.Tensor], prefix: str, head_dim: int | None) -> GemmaConfig:
    depth = _count(weights, f"{prefix}.layers.")
    if depth == 0:
        raise CheckpointError(f"cannot infer model dimensions: no tensors named {prefix}.layers.<i>.*")
    q_width, width = _shape(weights, f"{prefix}.layers.0.q_proj.weight")
    kv_width, _ = _shape(weights, f"{prefix}.layers.0.k_proj.weight")
    mlp_dim, _ = _shape(weights, f"{prefix}.layers.0.gate_proj.weight")
    if head_dim is None:
        raise CheckpointError("head_dim must be known to infer Gemma dims")
    return GemmaConfig(
        width=width,
        depth=depth,
        mlp_dim=mlp_dim,
        num_heads=q_width // head_dim,
        num_kv_heads=kv_width // head_dim,
        head_dim=head_dim,
    )


def infer_config(
    weights: dict[str, torch.Tensor],
    head_dim: int | None = None,
    vision_heads: int | None = None,
    **overrides,
) -> Pi0Config:
    """Recovers every dimension from tensor shapes.

    Head counts are not visible in a fused (out, in) matrix, so the canonical layout alone cannot tell 8×256 from
    16×128: loaders that see per-head shapes (openpi's einsum kernels, LeRobot's config) pass `head_dim` and
    `vision_heads`; otherwise π0's conventions apply (Gemma: 1 KV head, so head_dim = K width; SigLIP: 72-dim heads,
    or 16 when the width is not a multiple of 72).
    """
    kv_width = _shape(weights, "llm.layers.0.k_proj.weight")[0]
    head_dim = head_dim or kv_width  # π0 has a single KV head
    vw = _shape(weights, "vision.pos_embed")
    num_patches, v_width = vw
    grid = math.isqrt(num_patches)
    if grid * grid != num_patches:
        raise CheckpointError(f"vision.pos_embed has {num_patches} positions, not a square grid")
    patch = _shape(weights, "vision.patch_embed.weight")[-1]
    if vision_heads is None:
        vision_heads = v_width // 72 if v_width % 72 == 0 else max(1, v_width // 16)
    vision = VisionConfig(
        width=v_width,
        depth=_count(weights, "vision.blocks."),
        mlp_dim=_shape(weights, "vision.blocks.0.mlp.fc1.weight")[0],
        num_heads=vision_heads,
        patch_size=patch,
        image_size=grid * patch,
    )
    vocab, _ = _shape(weights, "llm.embed_tokens.weight")
    action_dim = _shape(weights, "action_in_proj.weight")[1]
    pi05 = is_pi05(weights)
    if pi05:
        overrides.setdefault("max_token_len", PI05_MAX_TOKEN_LEN)
    return Pi0Config(
        vision=vision,
        llm=_infer_gemma(weights, "llm", head_dim),
        expert=_infer_gemma(weights, "expert", head_dim),
        vocab_size=vocab,
        action_dim=action_dim,
        pi05=pi05,
        **overrides,
    )


def random_weights(
    cfg: Pi0Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """`iter_random_weights` as a dict."""
    return dict(iter_random_weights(cfg, seed, dtype, device))


def iter_random_weights(
    cfg: Pi0Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights with the statistics of a trained model's scale (not zeros, not ones).

    Linear weights ~ N(0, 1/fan_in) so activations stay O(1) through 27 + 18 layers; RMSNorm offsets and
    LayerNorm affines are random around their identity so that tests of folding passes can fail. π0.5's modulation
    Dense is random too (openpi initialises it to zeros, which makes t and every residual branch vanish: a test on
    such weights cannot see a wrong norm), its bias centred on scale 0, shift 0, gate 1. The same seed gives
    the same weights on one device type (CUDA draws differ from CPU draws; generating on the GPU takes seconds for
    the full π0 instead of a minute).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.scale") or name.endswith("_norm.scale"):
            t = 0.1 * torch.randn(shape, generator=gen, device=device)
        elif name.endswith("norm.dense.weight"):
            t = 0.5 * torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[1])
        elif name.endswith("norm.dense.bias"):
            t = 0.1 * torch.randn(shape, generator=gen, device=device)
            t[2 * shape[0] // 3 :] += 1.0  # the gate third: residual branches of O(1), like plain residuals
        elif name.startswith("vision.") and ("norm" in name) and name.endswith(".weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen, device=device)
        elif name in ("vision.pos_embed", "llm.embed_tokens.weight"):
            t = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])
        else:
            fan_in = math.prod(shape[1:])
            t = torch.randn(shape, generator=gen, device=device) / math.sqrt(fan_in)
        yield name, t.to(dtype)
