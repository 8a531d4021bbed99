"""One-shot static engine: graph passes → engine weights → static buffers → plan, replayed as one CUDA Graph.

`backend="triton"` is this engine with the Triton kernel set; the benchmark's "CUDA Graph over folded torch ops"
row is the same engine with the torch kernel set. Shapes (batch, views, prompt length, chunk, steps) are fixed at
build time; call `rebuild(...)` (or `load_pi0` again) for others. Prompt tokens and masks are inputs, so they can
change between calls without recapture.
"""

from __future__ import annotations

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot
from vla_rt.engine.plan import Pi0Plan
from vla_rt.engine.weights import EngineWeights
from vla_rt.graph_capture import graph_capture
from vla_rt.graph_passes import PassContext, apply_passes
from vla_rt.inputs import BuiltShapes, ModelInputs

WARMUP_RUNS = 2  # compiles every kernel variant and sizes split-K workspaces before capture


class StaticPi0Engine:
    """π0 for fixed shapes on a kernel set; `__call__` is a BackendFn (see `vla_rt.inference`)."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        cfg: Pi0Config,
        shapes: BuiltShapes,
        *,
        kernels,
        device: torch.device,
        dtype: torch.dtype,
        num_steps: int = 10,
        cuda_graph: bool = True,
    ):
        self.cfg, self.shapes, self.device, self.dtype, self.num_steps = cfg, shapes, device, dtype, num_steps
        self.dims = d = Dims.of(cfg, shapes)
        ctx = PassContext(cfg, d.views, d.chunk, d.prompt, num_steps, d.batch)
        self.weights = EngineWeights.from_pass_state(apply_passes(weights, ctx), device, dtype)
        self.obs = ObservationInputs.allocate(cfg, d, device)
        self.slot = PrefixSlot.allocate(cfg, d, device, dtype)
        self.act = Activations.allocate(cfg, d, device, dtype)
        self.xa = ExpertActivations.allocate(cfg, d, device, dtype)
        self.plan = Pi0Plan(kernels, self.weights, cfg, d)
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph and device.type == "cuda":
            self._capture()

    def run_plan(self) -> None:
        """The whole inference on the current inputs, launched eagerly (what the graph records)."""
        self.plan.vlm(self.obs, self.slot, self.act)
        self.plan.denoise(self.slot, self.xa, self.num_steps)

    def _capture(self) -> None:
        noise = torch.randn_like(self.xa.x_t)
        self.obs.images.uniform_(-1, 1)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.xa.x_t.copy_(noise)
                self.run_plan()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph):
            self.run_plan()
        torch.cuda.synchronize(self.device)

    def load_inputs(self, x: ModelInputs, noise: torch.Tensor) -> None:
        """Copies one call's inputs into the static buffers (no reallocation, so no recapture)."""
        self.obs.load(x)
        self.xa.x_t.copy_(noise)

    def __call__(self, x: ModelInputs, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        if num_steps != self.num_steps:
            raise ValueError(
                f"num_steps: expected {self.num_steps} (the engine's captured plan), found {num_steps}; "
                "build the model again with that step count"
            )
        self.load_inputs(x, noise)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run_plan()
        return self.xa.x_t.clone()

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": self.weights.nbytes()}


def build_triton(weights, cfg: Pi0Config, *, device, dtype, shapes: BuiltShapes, num_steps: int = 10,
                 cuda_graph: bool = True) -> StaticPi0Engine:  # fmt: skip
    """`backend="triton"`: the plan on the Triton kernels under one CUDA Graph."""
    from vla_rt.engine.kernels import triton_kernels

    return StaticPi0Engine(weights, cfg, shapes, kernels=triton_kernels(), device=device, dtype=dtype,
                           num_steps=num_steps, cuda_graph=cuda_graph)  # fmt: skip


def build_graphed_torch(weights, cfg: Pi0Config, *, device, dtype, shapes: BuiltShapes, num_steps: int = 10,
                        cuda_graph: bool = True) -> StaticPi0Engine:  # fmt: skip
    """The same plan on PyTorch ops, captured the same way: the "CUDA Graph over folded torch ops" baseline."""
    from vla_rt.engine.kernels import TorchKernels

    return StaticPi0Engine(weights, cfg, shapes, kernels=TorchKernels(), device=device, dtype=dtype,
                           num_steps=num_steps, cuda_graph=cuda_graph)  # fmt: skip
