"""Static engines for several batch sizes over ONE copy of the engine weights.

A server that batches robots needs an engine (static buffers, a plan, a CUDA Graph) per batch bucket. The graph
passes and the engine weights do not depend on the batch size, so the largest bucket's engine is built as usual and
every smaller one reads its weights: only activations, KV caches and captured graphs are per bucket (π0 in bf16:
one ≈ 6.5 GB copy of the weights instead of one per bucket).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot
from vla_rt.engine.kernels import triton_kernels
from vla_rt.engine.plan import Pi0Plan
from vla_rt.engine.static_engine import StaticPi0Engine
from vla_rt.engine.weights import EngineWeights
from vla_rt.inputs import BuiltShapes


class SharedWeightsEngine(StaticPi0Engine):
    """A `StaticPi0Engine` for `shapes` that runs on existing engine weights instead of building its own."""

    def __init__(self, weights: EngineWeights, cfg: Pi0Config, shapes: BuiltShapes, *, kernels,
                 device: torch.device, dtype: torch.dtype, num_steps: int = 10, cuda_graph: bool = True):  # fmt: skip
        self.cfg, self.shapes, self.device, self.dtype, self.num_steps = cfg, shapes, device, dtype, num_steps
        self.dims = d = Dims.of(cfg, shapes)
        self.weights = weights
        self.obs = ObservationInputs.allocate(cfg, d, device)
        self.slot = PrefixSlot.allocate(cfg, d, device, dtype)
        self.act = Activations.allocate(cfg, d, device, dtype)
        self.xa = ExpertActivations.allocate(cfg, d, device, dtype)
        self.plan = Pi0Plan(kernels, self.weights, cfg, d)
        self.graph = None
        if cuda_graph and device.type == "cuda":
            self._capture()


def build_bucket_engines(
    weights: dict[str, torch.Tensor],
    cfg: Pi0Config,
    shapes: BuiltShapes,
    buckets: Sequence[int],
    *,
    kernels,
    device: torch.device,
    dtype: torch.dtype,
    num_steps: int = 10,
    cuda_graph: bool = True,
) -> dict[int, StaticPi0Engine]:
    """{batch size: engine} for each bucket; `shapes` gives views, chunk and prompt length (its batch is ignored)."""
    if not buckets or min(buckets) < 1:
        raise ValueError(f"buckets: expected positive batch sizes, found {list(buckets)}")
    sizes = sorted(set(buckets), reverse=True)
    largest = StaticPi0Engine(weights, cfg, replace(shapes, batch_size=sizes[0]), kernels=kernels, device=device,
                              dtype=dtype, num_steps=num_steps, cuda_graph=cuda_graph)  # fmt: skip
    engines: dict[int, StaticPi0Engine] = {sizes[0]: largest}
    for b in sizes[1:]:
        engines[b] = SharedWeightsEngine(largest.weights, cfg, replace(shapes, batch_size=b), kernels=kernels,
                                         device=device, dtype=dtype, num_steps=num_steps, cuda_graph=cuda_graph)  # fmt: skip
    return dict(sorted(engines.items()))


def build_triton_buckets(weights, cfg: Pi0Config, shapes: BuiltShapes, buckets: Sequence[int], *, device, dtype,
                         num_steps: int = 10, cuda_graph: bool = True) -> dict[int, StaticPi0Engine]:  # fmt: skip
    """`backend="triton"` engines (the Triton kernels under the plan) for each bucket."""
    return build_bucket_engines(weights, cfg, shapes, buckets, kernels=triton_kernels(), device=device, dtype=dtype,
                                num_steps=num_steps, cuda_graph=cuda_graph)  # fmt: skip
