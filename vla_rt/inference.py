"""`load_pi0`: one entry point from a checkpoint (or random weights) to a ready model on any backend.

Backends compute the same function and differ in how:
- `reference`: the eager model in `vla_rt.model` (the spec in code);
- `folded`: eager PyTorch over the graph-pass-transformed weights, in the engine's order (CPU-testable mirror);
- `triton`: the Triton engine under one CUDA Graph (CUDA only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vla_rt.arguments import BACKENDS, LIMITS, check_build_args, check_int
from vla_rt.checkpoints.files import check_finite
from vla_rt.config import Pi0Config
from vla_rt.errors import ArgumentError, CheckpointError
from vla_rt.inputs import BuiltShapes, ModelInputs, check_model_inputs
from vla_rt.model import Pi0Model
from vla_rt.model.weights import validate_weights

__all__ = ["BACKENDS", "Pi0Inference", "build_pi0", "load_pi0", "load_stages"]

# A backend takes checked inputs, noise (B, H, A) float32 and the step count; returns actions (B, H, A) float32.
BackendFn = Callable[[ModelInputs, torch.Tensor, int], torch.Tensor]


class Pi0Inference:
    """A π0 model ready to sample actions, on one backend, for the shapes it was built for."""

    def __init__(
        self,
        run: BackendFn,
        cfg: Pi0Config,
        shapes: BuiltShapes,
        *,
        backend: str,
        device: torch.device,
        dtype: torch.dtype,
        source: str = "",
        norm_stats: Any = None,
        impl: Any = None,
        use_quantile_norm: bool | None = None,
        norm_stats_assets: tuple[str, ...] = (),
        relative_actions: bool = False,
    ):
        self._run = run
        self.config = cfg
        self.shapes = shapes
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.source = source
        self.norm_stats = norm_stats
        self.use_quantile_norm = use_quantile_norm  # the checkpoint's normalisation mode, where it records one
        # openpi: the assets with norm stats; with several and none chosen `Pi0Policy` refuses (raw states in)
        self.norm_stats_assets = tuple(norm_stats_assets)
        # LeRobot's use_relative_actions: the actions are offsets from the state (`Pi0Policy` refuses the model)
        self.relative_actions = relative_actions
        self.impl = impl  # the backend object (Pi0Model, FoldedPi0, TritonPi0): intermediates, benchmarks

    @property
    def stages(self):
        """The batched stages (`vla_rt.engine.stages.StageEngine`) of a model built by `load_stages`."""
        from vla_rt.engine.stages import StageEngine

        if not isinstance(self.impl, StageEngine):
            raise ArgumentError("model", "a model built by vla_rt.inference.load_stages (batched stages)", None,
                                found_text=f"a {self.backend} model built for whole calls")  # fmt: skip
        return self.impl

    @property
    def chunk(self) -> int:
        return self.shapes.chunk or self.config.chunk

    @torch.no_grad()
    def sample_actions(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        tokens: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        num_steps: int = 10,
        *,
        image_masks: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """images (B, V, S, S, 3) in [-1, 1]; state (B, A); tokens (B, P) int64 or None; noise (B, H, A) or None.

        Returns (B, H, A) float32 actions in the model's normalized action space.
        """
        x = check_model_inputs(
            self.config, self.shapes, images, state, tokens, noise, image_masks, token_mask, num_steps
        )
        if noise is None:
            b = images.shape[0]
            gen_device = generator.device if generator is not None else self.device
            noise = torch.randn(b, self.chunk, self.config.action_dim, generator=generator, device=gen_device)
        x.images = x.images.to(self.device)
        x.state = x.state.to(self.device, torch.float32)
        x.image_masks = x.image_masks.to(self.device)
        if x.tokens is not None:
            x.tokens = x.tokens.to(self.device, torch.long)
            x.token_mask = None if x.token_mask is None else x.token_mask.to(self.device).bool()
        return self._run(x, noise.to(self.device, torch.float32), num_steps)


def _reference_backend(model: Pi0Model) -> BackendFn:
    def run(x: ModelInputs, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        return model.sample_actions(
            x.images, x.state, x.tokens, noise, num_steps, image_masks=x.image_masks, token_mask=x.token_mask
        )

    return run


def build_pi0(
    weights: dict[str, torch.Tensor],
    cfg: Pi0Config,
    *,
    backend: str = "reference",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    num_views: int | None = None,
    chunk: int | None = None,
    prompt_len: int | None = None,
    batch_size: int | None = None,
    source: str = "",
    norm_stats: Any = None,
    use_quantile_norm: bool | None = None,
) -> Pi0Inference:
    """Builds a backend from canonical weights (see `vla_rt.model.weights`).

    Arguments are checked first (ArgumentError), then the weights' names, shapes and finiteness (CheckpointError,
    one reduction per tensor), and only then is anything built.
    """
    dev = check_build_args(backend, device, dtype, num_views, chunk, prompt_len, batch_size)
    if not isinstance(cfg, Pi0Config):
        raise ArgumentError("cfg", "a Pi0Config", cfg)
    if not isinstance(weights, Mapping):
        raise ArgumentError("weights", "a dict of canonical tensors (name -> torch.Tensor)", weights)
    name = source or "weights"
    validate_weights(dict(weights), cfg, name)
    for key, t in weights.items():
        check_finite(t, key, name)
    return _build(
        dict(weights), cfg, backend, dev, dtype, num_views, chunk, prompt_len, batch_size, source, norm_stats,
        use_quantile_norm,
    )  # fmt: skip


def _check_range(weights: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> None:
    """float16 tops out at 65504: a weight beyond it would become inf in the cast (bfloat16 has float32's range)."""
    if dtype != torch.float16:
        return
    limit = torch.finfo(torch.float16).max
    for name, t in weights.items():
        if t.dtype in (torch.float32, torch.float64, torch.bfloat16) and t.numel():
            lo, hi = torch.aminmax(t)
            if max(-float(lo), float(hi)) > limit:
                raise CheckpointError(
                    source or "weights",
                    f"tensor {name!r} holds values in [{float(lo):.4g}, {float(hi):.4g}], beyond float16's range "
                    f"(±{limit:.0f}): build in bfloat16 or float32",
                )


def _build(
    weights: dict[str, torch.Tensor],
    cfg: Pi0Config,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    num_views: int | None,
    chunk: int | None,
    prompt_len: int | None,
    batch_size: int | None,
    source: str,
    norm_stats: Any,
    use_quantile_norm: bool | None,
    norm_stats_assets: tuple[str, ...] = (),
    relative_actions: bool = False,
) -> Pi0Inference:
    """Builds a backend from checked arguments and checked weights."""
    _check_range(weights, dtype, source)
    cfg = cfg.replace(chunk=chunk or cfg.chunk)
    shapes = BuiltShapes(num_views=num_views, chunk=chunk, prompt_len=prompt_len, batch_size=batch_size)
    if backend == "reference":
        with torch.device("meta"):  # no throw-away float32 copy of 3.5B parameters on the host
            impl = Pi0Model(cfg)
        # The module takes the given tensors as its parameters (no second copy) where they already are what it
        # needs; otherwise each is cast/moved on its own.
        placed = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        impl.load_state_dict(placed, assign=True)
        del placed
        impl.eval()
        run = _reference_backend(impl)
    elif backend == "folded":
        from vla_rt.engine.folded import build_folded

        run = impl = build_folded(weights, cfg, device=device, dtype=dtype, shapes=shapes)
    else:
        from vla_rt.engine.static_engine import build_triton

        shapes = BuiltShapes(num_views, chunk or cfg.chunk, prompt_len or 0, batch_size or 1)
        run = impl = build_triton(weights, cfg, device=device, dtype=dtype, shapes=shapes)
    return Pi0Inference(
        run,
        cfg,
        shapes,
        backend=backend,
        device=device,
        dtype=dtype,
        source=source,
        norm_stats=norm_stats,
        impl=impl,
        use_quantile_norm=use_quantile_norm,
        norm_stats_assets=norm_stats_assets,
        relative_actions=relative_actions,
    )


def load_pi0(
    path: str,
    backend: str = "reference",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    num_views: int | None = None,
    chunk: int | None = None,
    prompt_len: int | None = None,
    batch_size: int | None = None,
    asset_id: str | None = None,
) -> Pi0Inference:
    """Loads π0 from an openpi checkpoint, a LeRobot π0 dir, a native .safetensors or "random:<preset>[:seed]".

    Dimensions come from the tensor shapes. `num_views`, `chunk`, `prompt_len` fix the shapes the model accepts
    (required by the triton backend, optional elsewhere). `asset_id` picks an openpi checkpoint's
    `assets/<asset_id>/norm_stats.json` (needed where it has several: `Pi0Policy` refuses the model without one).
    The arguments are checked before the checkpoint is read (ArgumentError), the file before its weights
    (CheckpointError), the weights as they are read (NaN / inf).
    """
    from vla_rt.checkpoints import check_asset_id, load_checkpoint

    dev = check_build_args(backend, device, dtype, num_views, chunk, prompt_len, batch_size)
    check_asset_id(path, asset_id)
    # Read straight to the target device, one tensor at a time (each checked for NaN / inf as it is placed). The
    # reference takes the weights in its own dtype; graph passes fold in float32 and round once, so the other
    # backends read float32.
    ckpt = load_checkpoint(path, dtype if backend == "reference" else torch.float32, asset_id=asset_id, device=dev)
    return _build(
        ckpt.weights, ckpt.config, backend, dev, dtype, num_views, chunk, prompt_len, batch_size, ckpt.source,
        ckpt.norm_stats, ckpt.use_quantile_norm, ckpt.norm_stats_assets, ckpt.relative_actions,
    )  # fmt: skip


def load_stages(
    path: str,
    *,
    backend: str = "folded",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    num_views: int,
    chunk: int | None = None,
    prompt_len: int | None = None,
    expert_buckets: Sequence[int] = (1,),
    prefix_buckets: Sequence[int] = (1,),
    num_steps: int = 10,
    expert_sms: int = 0,
    asset_id: str | None = None,
) -> Pi0Inference:
    """π0 / π0.5 as batched stages for a server (`vla_rt.engine.stages`): a prefix stage for newly arrived rows and
    an expert stage that advances every in-flight row one Euler step, over a pool of max(expert_buckets) rows.

    backend "folded": the engine plan on PyTorch ops, eager (a CPU); "triton": the Triton kernels, one CUDA Graph per
    (stage, bucket). `model.stages` is the engine; `model.sample_actions` runs whole requests through it. Arguments
    are checked first, as `load_pi0` checks them (ArgumentError), then the checkpoint is read once. `expert_sms` > 0
    (CUDA): that many SMs kept from the prefix stages for the expert steps beside them (`StageEngine`). `asset_id`:
    the openpi norm stats to use, as in `load_pi0`.
    """
    from vla_rt.checkpoints import check_asset_id, load_checkpoint
    from vla_rt.engine.kernels import TorchKernels, triton_kernels
    from vla_rt.engine.stages import StageEngine

    if backend == "reference":
        raise ArgumentError("backend", "'folded' (PyTorch ops) or 'triton' (the stages run the engine's kernel plan)",
                            backend)  # fmt: skip
    buckets = [*expert_buckets, *prefix_buckets]
    dev = check_build_args(backend, device, dtype, num_views, chunk, prompt_len, max(buckets, default=0))
    check_int("num_steps", num_steps, *LIMITS["num_steps"])
    check_int("expert_sms", expert_sms, 0, 1024)
    if expert_sms and dev.type != "cuda":
        raise ArgumentError("expert_sms", "0 on a CPU (an SM partition needs a CUDA device)", expert_sms)
    if expert_sms and expert_sms >= (sms := torch.cuda.get_device_properties(dev).multi_processor_count):
        raise ArgumentError("expert_sms", f"fewer SMs than this GPU's {sms} (the prefix needs the rest)", expert_sms)
    for name, values in (("expert_buckets", expert_buckets), ("prefix_buckets", prefix_buckets)):
        if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
            raise ArgumentError(name, "positive row counts, e.g. (1, 2, 4, 8)", tuple(values))
    if max(prefix_buckets) > max(expert_buckets):
        raise ArgumentError("prefix_buckets", f"at most the pool's {max(expert_buckets)} rows", tuple(prefix_buckets))
    check_asset_id(path, asset_id)
    ckpt = load_checkpoint(path, torch.float32, asset_id=asset_id, device=dev)
    cfg = ckpt.config.replace(chunk=chunk or ckpt.config.chunk)
    _check_range(ckpt.weights, dtype, ckpt.source)
    shapes = BuiltShapes(num_views, cfg.chunk, cfg.max_token_len if prompt_len is None else prompt_len)
    kernels = triton_kernels() if backend == "triton" else TorchKernels()
    engine = StageEngine(ckpt.weights, cfg, shapes, expert_buckets=expert_buckets, prefix_buckets=prefix_buckets,
                         kernels=kernels, device=dev, dtype=dtype, num_steps=num_steps, expert_sms=expert_sms)  # fmt: skip
    return Pi0Inference(engine, cfg, shapes, backend=backend, device=dev, dtype=dtype, source=ckpt.source,
                        norm_stats=ckpt.norm_stats, impl=engine, use_quantile_norm=ckpt.use_quantile_norm,
                        norm_stats_assets=ckpt.norm_stats_assets, relative_actions=ckpt.relative_actions)  # fmt: skip
