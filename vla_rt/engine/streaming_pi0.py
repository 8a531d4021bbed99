"""`StreamingPi0`: π0's plan on the two-stream scheduler (see `streaming.py` for the synchronisation rules).

Two VLM graphs (one per slot) and two expert graphs (one per slot). An expert call is either one denoising step
(`steps_per_call=1`; the step index lives on the GPU, so one graph serves every step) or the whole chunk
(`steps_per_call=num_steps`). On a machine without CUDA the same object runs its plan eagerly and sequentially.

    engine = StreamingPi0(weights, cfg, BuiltShapes(views, chunk, prompt, 1), device=cuda, dtype=torch.bfloat16)
    engine.submit_observation(images, state, tokens, t_capture)        # returns at once
    actions, kv_version, t_capture = engine.next_actions()             # conditioned on frame `kv_version`
"""

from __future__ import annotations

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot
from vla_rt.engine.plan import Pi0Plan
from vla_rt.engine.streaming import ExpertResult, TwoStreamScheduler
from vla_rt.engine.weights import EngineWeights
from vla_rt.graph_capture import graph_capture
from vla_rt.graph_passes import PassContext, apply_passes
from vla_rt.inputs import BuiltShapes, check_model_inputs


class StreamingPi0:
    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        cfg: Pi0Config,
        shapes: BuiltShapes,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_steps: int = 10,
        steps_per_call: int = 1,
        kernels=None,
        expert_sm_count: int | None = None,
    ):
        """`expert_sm_count`: the most SMs an action-expert step may occupy, so a persistent expert kernel leaves
        the VLM stream the rest (None: all; the per-op expert step shares the SMs through the GPU's scheduler)."""
        if steps_per_call not in (1, num_steps):
            raise ValueError(f"steps_per_call: expected 1 or {num_steps} (a whole chunk), found {steps_per_call}")
        self.cfg, self.shapes, self.device, self.num_steps, self.steps_per_call = (
            cfg, shapes, device, num_steps, steps_per_call,
        )  # fmt: skip
        self.dims = d = Dims.of(cfg, shapes)
        ctx = PassContext(cfg, d.views, d.chunk, d.prompt, num_steps, d.batch)
        self.weights = EngineWeights.from_pass_state(apply_passes(weights, ctx), device, dtype)
        cuda = device.type == "cuda"
        if kernels is None:
            from vla_rt.engine.kernels import TorchKernels, triton_kernels

            kernels = triton_kernels() if cuda else TorchKernels()
        ws_vlm = ws_expert = None
        if kernels.name == "triton":
            from vla_rt.triton_kernels import Workspace

            ws_vlm, ws_expert = Workspace(device), Workspace(device)  # one scratch per stream
        self.plan = Pi0Plan(kernels, self.weights, cfg, d, workspace=ws_vlm, expert_workspace=ws_expert,
                            sm_count=expert_sm_count)  # fmt: skip
        self.obs = ObservationInputs.allocate(cfg, d, device)
        self.slots = [PrefixSlot.allocate(cfg, d, device, dtype) for _ in range(2)]
        self.act = Activations.allocate(cfg, d, device, dtype)
        self.xa = ExpertActivations.allocate(cfg, d, device, dtype)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        # the step's row of the per-step table (π0: time bias; π0.5: the packed modulation), selected on the device
        self.time_bias = torch.zeros(self.weights.step_table.shape[1], dtype=torch.float32, device=device)
        self.vlm_graphs: list[torch.cuda.CUDAGraph] | None = None
        self.expert_graphs: list[torch.cuda.CUDAGraph] | None = None
        if cuda:
            self._capture()
        self.scheduler = TwoStreamScheduler(device, self._launch_vlm, self._launch_expert)
        self._version = 0
        self._step = 0  # host mirror of the steps done in the current chunk
        self._chunk_slot = -1

    # ----- what the graphs run ----------------------------------------------------------------------------------
    def _vlm(self, slot: int) -> None:
        self.plan.vlm(self.obs, self.slots[slot], self.act)

    def _expert(self, slot: int) -> None:
        if self.steps_per_call == self.num_steps:
            self.plan.denoise(self.slots[slot], self.xa, self.num_steps)
            return
        torch.index_select(self.weights.step_table, 0, self.step_index, out=self.time_bias[None])
        self.plan.expert_step(self.slots[slot], self.xa, 0, self.num_steps, time_bias=self.time_bias)
        self.step_index.add_(1).remainder_(self.num_steps)

    def _capture(self) -> None:
        self.obs.images.uniform_(-1, 1)
        self.xa.x_t.normal_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles kernels, sizes both workspaces
            for slot in (0, 1):
                self._vlm(slot)
                for _ in range(2):
                    self._expert(slot)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.vlm_graphs, self.expert_graphs = [], []
        for slot in (0, 1):
            for graphs, fn in ((self.vlm_graphs, self._vlm), (self.expert_graphs, self._expert)):
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph):
                    fn(slot)
                graphs.append(graph)
        self.step_index.zero_()
        torch.cuda.synchronize(self.device)

    def _launch_vlm(self, slot: int) -> None:
        if self.vlm_graphs:
            self.vlm_graphs[slot].replay()
        else:
            self._vlm(slot)

    def _launch_expert(self, slot: int) -> None:
        if self.expert_graphs:
            self.expert_graphs[slot].replay()
        else:
            self._expert(slot)

    # ----- API ----------------------------------------------------------------------------------------------------
    def submit_observation(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        tokens: torch.Tensor | None = None,
        t_capture: float = float("nan"),
        *,
        image_masks: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> int:
        """Queues an observation for the VLM and returns its version at once (the newest queued frame wins)."""
        x = check_model_inputs(self.cfg, self.shapes, images, state, tokens, None, image_masks, token_mask)
        self._version += 1
        version = self._version

        def load_inputs() -> None:
            self.obs.load(x, version, non_blocking=True)

        self.scheduler.submit(load_inputs, version, t_capture)
        return version

    def expert_call(self, noise: torch.Tensor | None = None) -> ExpertResult:
        """One expert graph replay (one step, or a whole chunk); returns the actions when a chunk completes."""
        sched = self.scheduler
        starting = self._step == 0
        if starting:
            if not sched.refresh_front():  # chunk boundary: take the newest complete observation
                raise RuntimeError("no observation processed yet: submit_observation() first (wait_ready() at start)")
            self._chunk_slot = sched.front
        if noise is not None:
            noise = noise.to(self.device, torch.float32)

        def before() -> None:
            if starting and noise is not None:
                self.xa.x_t.copy_(noise)
            elif starting:
                self.xa.x_t.normal_()

        slot = sched.expert_call(before)
        assert slot == self._chunk_slot, "the front slot changed inside a chunk"
        self._step += self.steps_per_call
        state = sched.slots[slot]
        actions = None
        if self._step >= self.num_steps:
            self._step = 0
            with sched.sync.on(sched.expert_stream):
                actions = self.xa.x_t.clone()
            if self.device.type == "cuda":  # the caller's stream sees the finished chunk, without a host wait
                torch.cuda.current_stream(self.device).wait_stream(sched.expert_stream)
        return ExpertResult(actions, state.version, state.t_capture, self._step or self.num_steps)

    def next_actions(self, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, int, float]:
        """A whole denoised chunk (B, H, A) and which observation (version, capture time) it is conditioned on."""
        while True:
            result = self.expert_call(noise if self._step == 0 else None)
            if result.actions is not None:
                return result.actions, result.kv_version, result.t_capture

    def wait_ready(self, timeout_s: float = 60.0, version: int | None = None) -> None:
        """Start-up/tests: block until some observation (or `version`) has been through the VLM."""
        self.scheduler.wait_ready(timeout_s, version)
