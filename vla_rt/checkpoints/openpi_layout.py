"""openpi's parameter tree <-> vla-rt's canonical weights: one table of leaves, read and written by the same rules.

openpi (JAX) stacks the layers of each tower on a leading axis (`nn.scan`) and keeps per-head axes in its einsum
kernels; vla-rt's canonical layout is per-layer PyTorch `Linear` matrices (out, in). Each `Leaf` below names one
openpi path ('/'-joined, below the top-level `params` key) and the two functions that move it to and from canonical
tensors. Both directions come from the same table, so the writer used by tests cannot drift from the reader.

Einsum conventions (openpi `gemma.py`, `siglip.py`), with the canonical matrix each becomes:
  q_einsum (N, D, H):        q = x·w  over D           -> q_proj.weight (N*H, D), heads major
  kv_einsum (2, K, D, H):    [0] = K, [1] = V          -> k_proj / v_proj.weight (K*H, D)
  qkv_einsum (3, N, D, H):   variants with N == K      -> q/k/v_proj.weight
  attn_vec_einsum (N, H, D): out = sum_NH o·w          -> o_proj.weight (D, N*H)
  gating_einsum (2, D, F):   [0] = gate, [1] = up      -> gate/up_proj.weight (F, D)
  linear (F, D)                                        -> down_proj.weight (D, F)
  SigLIP DenseGeneral q/k/v kernel (W, heads, hd)      -> (heads*hd, W); bias (heads, hd) -> (heads*hd,)
  SigLIP out kernel (heads, hd, W)                     -> out_proj.weight (W, heads*hd)
  Dense kernel (in, out)                               -> weight (out, in); conv HWIO -> OIHW
RMSNorm scales stay offsets from 1 in both layouts (openpi and canonical agree), so they are copied as they are.

π0.5 (openpi `Pi0Config(pi05=True)`): the action expert's norms are adaptive: openpi's `gemma.RMSNorm` with a
condition creates an unnamed `nn.Dense`, which flax names `Dense_0`, so the leaves are
`layers/pre_attention_norm_1/Dense_0/{kernel (L, W, 3W), bias (L, 3W)}`, `layers/pre_ffw_norm_1/Dense_0/...` and
`final_norm_1/Dense_0/{kernel (W, 3W), bias (3W)}` (no `scale`); the top-level heads are `action_in_proj`,
`time_mlp_in`, `time_mlp_out`, `action_out_proj` (no `state_proj`, no `action_time_mlp_*`). openpi's own
`examples/convert_jax_model_to_pytorch.py` reads exactly these paths.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vla_rt.config import PI05_MAX_TOKEN_LEN, GemmaConfig, Pi0Config, VisionConfig
from vla_rt.model.weights import CheckpointError, param_shapes, suffix_head_names

IMG = "PaliGemma/img/"
ENC = IMG + "Transformer/encoderblock/"
MHA = ENC + "MultiHeadDotProductAttention_0/"
LLM = "PaliGemma/llm/"
# π0.5's marker: its time MLP (π0 has `action_time_mlp_in` and `state_proj` instead)
PI05_MARKER = "time_mlp_in/kernel"

Tensor = torch.Tensor
Weights = dict[str, Tensor]
Transform = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Leaf:
    """One openpi array: `read` turns it into canonical tensors, `write` builds it from canonical tensors."""

    path: str
    read: Callable[[Tensor], Weights]
    write: Callable[[Weights], Tensor]


def _transposed(x: Tensor) -> Tensor:
    return x.T


def _same(x: Tensor) -> Tensor:
    return x


def _single(path: str, name: str, to_openpi: Transform = _same, to_canonical: Transform = _same) -> Leaf:
    return Leaf(path, lambda t: {name: to_canonical(t)}, lambda w: to_openpi(w[name]))


def _stacked(path: str, names: tuple[str, ...], depth: int, to_openpi: Transform, to_canonical: Transform) -> Leaf:
    """A leaf of shape (depth, [len(names),] ...): layer i, group j holds canonical `names[j].format(i)`."""
    grouped = len(names) > 1

    def read(t: Tensor) -> Weights:
        out = {}
        for i in range(depth):
            for j, name in enumerate(names):
                out[name.format(i)] = to_canonical(t[i, j] if grouped else t[i])
        return out

    def write(w: Weights) -> Tensor:
        layers = [[to_openpi(w[name.format(i)]) for name in names] for i in range(depth)]
        return torch.stack([torch.stack(group) if grouped else group[0] for group in layers])

    return Leaf(path, read, write)


def _vision_leaves(v: VisionConfig) -> list[Leaf]:
    w, h, hd, depth = v.width, v.num_heads, v.head_dim, v.depth
    b = "vision.blocks.{}."
    leaves = [
        _single(
            IMG + "embedding/kernel",
            "vision.patch_embed.weight",
            lambda x: x.permute(2, 3, 1, 0),
            lambda x: x.permute(3, 2, 0, 1),
        ),
        _single(IMG + "embedding/bias", "vision.patch_embed.bias"),
        _single(IMG + "pos_embedding", "vision.pos_embed", lambda x: x[None], lambda x: x[0]),
    ]
    for ln, canon in (("LayerNorm_0", "norm1"), ("LayerNorm_1", "norm2")):
        for p, c in (("scale", "weight"), ("bias", "bias")):
            leaves.append(_stacked(f"{ENC}{ln}/{p}", (f"{b}{canon}.{c}",), depth, _same, _same))
    for proj, canon in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        leaves += [
            _stacked(
                f"{MHA}{proj}/kernel",
                (f"{b}attn.{canon}.weight",),
                depth,
                lambda x: x.T.reshape(w, h, hd),
                lambda x: x.reshape(w, h * hd).T,
            ),
            _stacked(
                f"{MHA}{proj}/bias",
                (f"{b}attn.{canon}.bias",),
                depth,
                lambda x: x.reshape(h, hd),
                lambda x: x.reshape(h * hd),
            ),
        ]
    leaves += [
        _stacked(
            MHA + "out/kernel",
            (b + "attn.out_proj.weight",),
            depth,
            lambda x: x.T.reshape(h, hd, w),
            lambda x: x.reshape(h * hd, w).T,
        ),
        _stacked(MHA + "out/bias", (b + "attn.out_proj.bias",), depth, _same, _same),
    ]
    for dense, canon in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
        leaves += [
            _stacked(f"{ENC}MlpBlock_0/{dense}/kernel", (f"{b}mlp.{canon}.weight",), depth, _transposed, _transposed),
            _stacked(f"{ENC}MlpBlock_0/{dense}/bias", (f"{b}mlp.{canon}.bias",), depth, _same, _same),
        ]
    leaves += [
        _single(IMG + "Transformer/encoder_norm/scale", "vision.final_norm.weight"),
        _single(IMG + "Transformer/encoder_norm/bias", "vision.final_norm.bias"),
        _single(IMG + "head/kernel", "projector.weight", _transposed, _transposed),
        _single(IMG + "head/bias", "projector.bias"),
    ]
    return leaves


def _norm_leaves(prefix: str, suffix: str, depth: int, adaptive: bool) -> list[Leaf]:
    """The expert's three norms: RMSNorm `scale` offsets, or π0.5's adaptive-norm `Dense_0` (kernel (in, 3W))."""
    lay = prefix + ".layers.{}."
    pairs = (("pre_attention_norm", "attn_norm"), ("pre_ffw_norm", "ffn_norm"))
    if not adaptive:
        leaves = [
            _stacked(f"{LLM}layers/{o}{suffix}/scale", (f"{lay}{c}.scale",), depth, _same, _same) for o, c in pairs
        ]
        return leaves + [_single(f"{LLM}final_norm{suffix}/scale", f"{prefix}.final_norm.scale")]
    leaves = []
    for o, c in pairs:
        dense = f"{LLM}layers/{o}{suffix}/Dense_0/"
        leaves += [
            _stacked(dense + "kernel", (f"{lay}{c}.dense.weight",), depth, _transposed, _transposed),
            _stacked(dense + "bias", (f"{lay}{c}.dense.bias",), depth, _same, _same),
        ]
    dense = f"{LLM}final_norm{suffix}/Dense_0/"
    return leaves + [
        _single(dense + "kernel", f"{prefix}.final_norm.dense.weight", _transposed, _transposed),
        _single(dense + "bias", f"{prefix}.final_norm.dense.bias"),
    ]


def _gemma_leaves(prefix: str, suffix: str, g: GemmaConfig, adaptive: bool = False) -> list[Leaf]:
    """One Gemma expert; openpi names the second expert's params with the suffix `_1`."""
    n, k, d, h, depth = g.num_heads, g.num_kv_heads, g.width, g.head_dim, g.depth
    lay = prefix + ".layers.{}."

    def heads_in(count: int) -> tuple[Transform, Transform]:  # (count*H, D) <-> (count, D, H)
        return (lambda x: x.reshape(count, h, d).permute(0, 2, 1), lambda x: x.permute(0, 2, 1).reshape(count * h, d))

    attn = f"{LLM}layers/attn/"
    if n == k:  # openpi fuses q, k and v into one einsum when every query head has its own KV head
        leaves = [
            _stacked(
                f"{attn}qkv_einsum{suffix}/w",
                tuple(lay + p for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
                depth,
                *heads_in(n),
            )
        ]
    else:
        leaves = [
            _stacked(f"{attn}q_einsum{suffix}/w", (lay + "q_proj.weight",), depth, *heads_in(n)),
            _stacked(f"{attn}kv_einsum{suffix}/w", (lay + "k_proj.weight", lay + "v_proj.weight"), depth, *heads_in(k)),
        ]
    mlp = f"{LLM}layers/mlp{suffix}/"
    leaves += [
        _stacked(
            f"{attn}attn_vec_einsum{suffix}/w",
            (lay + "o_proj.weight",),
            depth,
            lambda x: x.T.reshape(n, h, d),
            lambda x: x.reshape(n * h, d).T,
        ),
        _stacked(
            mlp + "gating_einsum", (lay + "gate_proj.weight", lay + "up_proj.weight"), depth, _transposed, _transposed
        ),
        _stacked(mlp + "linear", (lay + "down_proj.weight",), depth, _transposed, _transposed),
    ]
    return leaves + _norm_leaves(prefix, suffix, depth, adaptive)


def layout(cfg: Pi0Config) -> list[Leaf]:
    """Every leaf of an openpi π0 or π0.5 params tree for these dims, in a stable order."""
    leaves = _vision_leaves(cfg.vision)
    leaves.append(_single(LLM + "embedder/input_embedding", "llm.embed_tokens.weight"))
    leaves += _gemma_leaves("llm", "", cfg.llm)
    leaves += _gemma_leaves("expert", "_1", cfg.expert, adaptive=cfg.pi05)
    for head in suffix_head_names(cfg):
        leaves += [
            _single(f"{head}/kernel", f"{head}.weight", _transposed, _transposed),
            _single(f"{head}/bias", f"{head}.bias"),
        ]
    return leaves


def openpi_shapes(cfg: Pi0Config) -> dict[str, tuple[int, ...]]:
    """The shape of every openpi leaf for these dims (computed on meta tensors: no memory, same rules as the writer)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in param_shapes(cfg).items()}
    return {leaf.path: tuple(leaf.write(meta).shape) for leaf in layout(cfg)}


def _dims(shapes: dict[str, tuple[int, ...]], path: str, rank: int, meaning: str, source: str) -> tuple[int, ...]:
    if path not in shapes:
        raise CheckpointError(f"{source}: cannot infer model dimensions: tensor {path!r} is missing")
    shape = tuple(shapes[path])
    if len(shape) != rank:
        raise CheckpointError(f"{source}: tensor {path!r} has shape {shape}, expected rank {rank} {meaning}")
    return shape


def _gemma_config(shapes: dict[str, tuple[int, ...]], suffix: str, source: str) -> GemmaConfig:
    attn = f"{LLM}layers/attn/"
    if f"{attn}qkv_einsum{suffix}/w" in shapes:
        depth, _, n, d, h = _dims(
            shapes, f"{attn}qkv_einsum{suffix}/w", 5, "(layers, 3, heads, width, head_dim)", source
        )
        k = n
    else:
        depth, n, d, h = _dims(shapes, f"{attn}q_einsum{suffix}/w", 4, "(layers, heads, width, head_dim)", source)
        k = _dims(shapes, f"{attn}kv_einsum{suffix}/w", 5, "(layers, 2, kv_heads, width, head_dim)", source)[2]
    f = _dims(shapes, f"{LLM}layers/mlp{suffix}/gating_einsum", 4, "(layers, 2, width, mlp_dim)", source)[3]
    return GemmaConfig(width=d, depth=depth, mlp_dim=f, num_heads=n, num_kv_heads=k, head_dim=h)


def _reject_other_models(shapes: dict[str, tuple[int, ...]], source: str) -> None:
    if "action_in_proj/kernel" not in shapes and f"{LLM}embedder/input_embedding" in shapes:
        raise CheckpointError(f"{source}: no action expert (action_in_proj missing): π0-FAST is not supported")


def openpi_config(shapes: dict[str, tuple[int, ...]], source: str, **overrides) -> Pi0Config:
    """All dims from openpi leaf shapes; head counts come from the per-head einsum axes; π0.5 from its time MLP."""
    _reject_other_models(shapes, source)
    pi05 = PI05_MARKER in shapes
    if pi05:
        overrides.setdefault("max_token_len", PI05_MAX_TOKEN_LEN)
    depth, width, heads, _ = _dims(shapes, MHA + "query/kernel", 4, "(layers, width, heads, head_dim)", source)
    mlp = _dims(shapes, ENC + "MlpBlock_0/Dense_0/kernel", 3, "(layers, width, mlp_dim)", source)[2]
    patch = _dims(shapes, IMG + "embedding/kernel", 4, "(patch, patch, 3, width) HWIO", source)[0]
    positions = _dims(shapes, IMG + "pos_embedding", 3, "(1, patches, width)", source)[1]
    grid = math.isqrt(positions)
    if grid * grid != positions:
        raise CheckpointError(f"{source}: {IMG}pos_embedding has {positions} positions, not a square grid")
    try:
        return Pi0Config(
            vision=VisionConfig(
                width=width, depth=depth, mlp_dim=mlp, num_heads=heads, patch_size=patch, image_size=grid * patch
            ),
            llm=_gemma_config(shapes, "", source),
            expert=_gemma_config(shapes, "_1", source),
            vocab_size=_dims(shapes, LLM + "embedder/input_embedding", 2, "(vocab, width)", source)[0],
            action_dim=_dims(shapes, "action_in_proj/kernel", 2, "(action_dim, width)", source)[0],
            pi05=pi05,
            **overrides,
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: inconsistent model dimensions: {e}") from None
