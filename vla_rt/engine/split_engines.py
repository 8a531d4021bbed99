"""The two halves of a split π0 (`vla_rt.split`): a prefix engine and an expert engine with the expert's weights only.

`PrefixEngine` runs vision + the VLM prefix (`Pi0Plan.vlm`, one CUDA Graph on the GPU) into one `PrefixSlot` and
exports what the action expert reads from it: the prefix rows of every layer's K and V, and which prefix keys are
valid (padding and missing views are not). The key blocks and the suffix RoPE rows follow from that mask
(`suffix_layout`), and the state token is the robot's own, so neither travels.

`ExpertEngine` runs the action expert (`choose_expert_step`, the same `ExpertStep` seam as every engine, so the
persistent CUDA kernel plugs in here too) on slots it owns or is given. Built with `from_expert_weights`, it holds
the expert tower, the suffix projections and the per-step tables only: no vision, no VLM (π0 in bf16: ≈ 0.62 GB of
weights, against ≈ 6.5 GB for the whole model). Work is step-granular: `start_chunk`, `step` × num_steps,
`actions`; a caller may `import_prefix` into another slot between two steps, or from another thread (on another
CUDA stream) while they run, so a new KV version lands without touching the chunk in flight. On the GPU each slot
has a one-step CUDA Graph whose Euler step index lives on the device (as in `StreamingPi0`), so one graph serves
every step.

Both engines run batch 1: a split serves one robot per expert, and the prefix server runs robots one at a time.
With a fresh prefix, the expert's actions are bit-identical to `StaticPi0Engine`'s on the same device and dtype:
the same kernels run in the same order on the same values (tests/split/test_split_engines.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot
from vla_rt.engine.expert_step import choose_expert_step
from vla_rt.engine.plan import Pi0Plan
from vla_rt.engine.torch_ops import INVALID_BLOCK
from vla_rt.engine.weights import EngineWeights
from vla_rt.graph_capture import graph_capture
from vla_rt.graph_passes import (
    PassContext,
    apply_passes,
    fold_layernorm,
    passes_for,
    patch_embed_gemm,
    prune_last_layer,
)
from vla_rt.inputs import BuiltShapes, ModelInputs
from vla_rt.model.weights import param_shapes, suffix_head_names

WARMUP_STEPS = 2  # compiles every kernel variant and sizes split-K workspaces before capture
# Passes over the vision tower and the VLM only: the expert's pipeline is the model's minus these.
VLM_PASSES = frozenset(p.PASS.name for p in (patch_embed_gemm, fold_layernorm, prune_last_layer))
# EngineWeights fields the expert never reads, filled with empty tensors so the typed container still builds
_VLM_PLACEHOLDERS = ("vision.patch_embed.weight", "vision.patch_embed.bias", "vision.pos_embed", "projector.weight",
                     "projector.bias", "llm.embed_tokens.weight")  # fmt: skip


def expert_weight_names(names, cfg: Pi0Config) -> list[str]:
    """The canonical tensors the action expert needs: its tower (`expert.*`) and the suffix projections."""
    heads = tuple(f"{h}." for h in suffix_head_names(cfg))
    return [n for n in names if n.startswith("expert.") or n.startswith(heads)]


def expert_subset(weights: Mapping[str, torch.Tensor], cfg: Pi0Config) -> dict[str, torch.Tensor]:
    """The expert's canonical tensors out of a whole model's (the same tensor objects, nothing copied)."""
    return {n: weights[n] for n in expert_weight_names(weights, cfg)}


def default_kernels(device: torch.device):
    """Triton on CUDA, PyTorch ops elsewhere (the folded plan: CPU tests, the tiny model on a robot's CPU)."""
    from vla_rt.engine.kernels import TorchKernels, triton_kernels

    return triton_kernels() if device.type == "cuda" else TorchKernels()


def expert_engine_weights(expert_weights: Mapping[str, torch.Tensor], cfg: Pi0Config, dims: Dims, num_steps: int,
                          device: torch.device, dtype: torch.dtype) -> EngineWeights:  # fmt: skip
    """Engine weights from the expert's canonical tensors alone: the model's passes minus the VLM ones (each pass
    reads only the tensors of its own tower, so the expert's results are bit-identical to a whole-model build)."""
    missing = sorted(set(expert_weight_names(param_shapes(cfg), cfg)) - set(expert_weights))
    if missing:
        shown = missing[:4] + (["..."] if len(missing) > 4 else [])
        raise ValueError(f"expert weights: expected every expert and suffix tensor, found {len(missing)} missing "
                         f"({shown})")  # fmt: skip
    ctx = PassContext(cfg, dims.views, dims.chunk, dims.prompt, num_steps, dims.batch)
    passes = [p for p in passes_for(cfg) if p.name not in VLM_PASSES]
    state = apply_passes(dict(expert_subset(expert_weights, cfg)), ctx, passes)
    placeholders = {n: torch.empty(0, 0) for n in _VLM_PLACEHOLDERS}
    return EngineWeights.from_pass_state(state.replace({**state.tensors, **placeholders}), device, dtype)


def suffix_layout(prefix_mask: torch.Tensor, dims: Dims, rope_cos: torch.Tensor, rope_sin: torch.Tensor):
    """(key_block (B, P + S) int32, suffix_cos, suffix_sin (B, S, D/2) float32) of a prefix with valid keys
    `prefix_mask` (B, P) bool: what `Pi0Plan.vlm` writes into a slot besides the KV cache (valid prefix keys block 0,
    padding INVALID_BLOCK; state token 1, actions 2; π0.5's actions 1; suffix positions after the valid keys)."""
    valid = prefix_mask.bool()
    key_block = torch.empty(valid.shape[0], dims.prefix + dims.suffix, dtype=torch.int32, device=valid.device)
    key_block[:, : dims.prefix] = torch.where(valid, 0, INVALID_BLOCK)
    key_block[:, dims.prefix :] = 2 if dims.state_token else 1
    key_block[:, dims.prefix] = 1
    positions = valid.int().sum(-1, keepdim=True) + torch.arange(dims.suffix, device=valid.device)
    return key_block, rope_cos[positions], rope_sin[positions]


class PrefixEngine:
    """Vision + VLM prefix for batch 1 into `self.slot` (one CUDA Graph on the GPU). Holds the whole model's engine
    weights (built from canonical weights, or another engine's for the same shapes), so a relay
    `ExpertEngine.on_weights(engine.weights, ..., slots=[engine.slot])` shares them."""

    def __init__(self, weights: dict[str, torch.Tensor] | EngineWeights, cfg: Pi0Config, shapes: BuiltShapes, *,
                 device: torch.device, dtype: torch.dtype, num_steps: int = 10, kernels=None,
                 cuda_graph: bool = True):  # fmt: skip
        self.cfg, self.device, self.dtype, self.num_steps = cfg, device, dtype, num_steps
        self.dims = d = Dims.of(cfg, shapes)
        if d.batch != 1:
            raise ValueError(
                f"batch_size: expected 1 (a split prefix engine runs one robot at a time), found {d.batch}"
            )
        self.kernels = kernels or default_kernels(device)
        if isinstance(weights, EngineWeights):  # another engine's (same shapes and steps): no second copy
            self.weights = weights
        else:
            ctx = PassContext(cfg, d.views, d.chunk, d.prompt, num_steps, d.batch)
            self.weights = EngineWeights.from_pass_state(apply_passes(weights, ctx), device, dtype)
        self.obs = ObservationInputs.allocate(cfg, d, device)
        self.slot = PrefixSlot.allocate(cfg, d, device, dtype)
        self.act = Activations.allocate(cfg, d, device, dtype)
        self.plan = Pi0Plan(self.kernels, self.weights, cfg, d)
        g = cfg.llm
        self._export = torch.empty(g.depth, 2, d.batch, d.prefix, g.num_kv_heads, g.head_dim, dtype=dtype,
                                   device=device)  # fmt: skip
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph and device.type == "cuda":
            self._capture()

    def _run_plan(self) -> None:
        self.plan.vlm(self.obs, self.slot, self.act)
        for i, (k, v) in enumerate(zip(self.slot.k_cache, self.slot.v_cache)):
            self._export[i, 0].copy_(k[:, : self.dims.prefix])
            self._export[i, 1].copy_(v[:, : self.dims.prefix])

    def _capture(self) -> None:
        self.obs.images.uniform_(-1, 1)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                self._run_plan()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph):
            self._run_plan()
        torch.cuda.synchronize(self.device)

    def run(self, x: ModelInputs, version: int = 0) -> PrefixSlot:
        """The prefix of one checked observation (batch 1, on this device) into `self.slot`; returns the slot."""
        self.obs.load(x, version)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run_plan()
        return self.slot

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv (L, 2, B, P, Hkv, D) in the compute dtype: every layer's prefix K then V, on the device; prefix_mask
        (B, P) bool: the valid keys). Views of buffers the next `run` overwrites: copy before running again."""
        return self._export, self.slot.key_block[:, : self.dims.prefix] == 0


class ExpertEngine:
    """The action expert over `slots` (its own `num_slots` slots unless given). Build with `from_expert_weights`
    (robot side: expert weights only) or `on_weights` (relay: the prefix engine's weights and slot)."""

    def __init__(self, weights: EngineWeights, cfg: Pi0Config, shapes: BuiltShapes, *, device: torch.device,
                 dtype: torch.dtype, num_steps: int = 10, kernels=None, cuda_graph: bool = True,
                 slots: list[PrefixSlot] | None = None, num_slots: int = 2, sm_count: int | None = None):  # fmt: skip
        self.cfg, self.device, self.dtype, self.num_steps = cfg, device, dtype, num_steps
        self.dims = d = Dims.of(cfg, shapes)
        if d.batch != 1:
            raise ValueError(f"batch_size: expected 1 (one robot per split expert), found {d.batch}")
        if weights.num_steps != num_steps:
            raise ValueError(f"num_steps: expected {weights.num_steps} (the weights' step tables), found {num_steps}")
        self.weights, self.kernels = weights, kernels or default_kernels(device)
        self.slots = slots if slots is not None else [PrefixSlot.allocate(cfg, d, device, dtype)
                                                      for _ in range(num_slots)]  # fmt: skip
        self.xa = ExpertActivations.allocate(cfg, d, device, dtype)
        self.expert, self.expert_why = choose_expert_step(self.kernels, weights, cfg, d, device=device,
                                                          sm_count=sm_count)  # fmt: skip
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.time_bias = torch.zeros(weights.step_table.shape[1], dtype=torch.float32, device=device)
        self._chunk_slot, self._steps_done = -1, 0
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        if cuda_graph and device.type == "cuda":
            self._capture()

    @classmethod
    def from_expert_weights(cls, expert_weights: Mapping[str, torch.Tensor], cfg: Pi0Config, shapes: BuiltShapes, *,
                            device: torch.device, dtype: torch.dtype, num_steps: int = 10, **kw) -> ExpertEngine:  # fmt: skip
        """From canonical expert + suffix tensors (`expert_subset`): nothing of vision or the VLM is on the device."""
        weights = expert_engine_weights(expert_weights, cfg, Dims.of(cfg, shapes), num_steps, device, dtype)
        return cls(weights, cfg, shapes, device=device, dtype=dtype, num_steps=num_steps, **kw)

    @classmethod
    def on_weights(cls, weights: EngineWeights, cfg: Pi0Config, shapes: BuiltShapes, **kw) -> ExpertEngine:
        """Over existing engine weights (the relay beside a `PrefixEngine`: `slots=[prefix.slot]`)."""
        return cls(weights, cfg, shapes, **kw)

    # ----- what a step runs ---------------------------------------------------------------------------------------
    def _step(self, slot: int) -> None:
        """One Euler step on `slot`, its index read from the device counter (one graph serves every step)."""
        torch.index_select(self.weights.step_table, 0, self.step_index, out=self.time_bias[None])
        self.expert.run(self.slots[slot], self.xa, 0, self.num_steps, time_bias=self.time_bias)
        self.step_index.add_(1).remainder_(self.num_steps)

    def _capture(self) -> None:
        for s in self.slots:  # finite inputs for the warm-up (the slots start NaN-poisoned)
            for k, v in zip(s.k_cache, s.v_cache):
                k.zero_(), v.zero_()
            s.suffix_cos.fill_(1.0), s.suffix_sin.zero_()
        self.xa.x_t.normal_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for slot in range(len(self.slots)):
                for _ in range(WARMUP_STEPS):
                    self._step(slot)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.graphs = []
        for slot in range(len(self.slots)):
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph):
                self._step(slot)
            self.graphs.append(graph)
        self.step_index.zero_()
        torch.cuda.synchronize(self.device)

    # ----- KV in ----------------------------------------------------------------------------------------------------
    def import_prefix(self, slot: int, kv: torch.Tensor, prefix_mask: torch.Tensor, rows: torch.Tensor | None = None,
                      version: int = 0) -> None:  # fmt: skip
        """Writes one prefix into slot `slot`: kv (L, 2, 1, R, Hkv, D) in the compute dtype on this device (R = P,
        or the rows `rows` (R,) int64 of the prefix when only those are sent; the others are zeroed: they are
        masked, but must stay finite) and prefix_mask (1, P) bool. Enqueued on the current stream: between two
        steps of a chunk on another slot it is safe, on the chunk's own slot it is not (`chunk_slot`)."""
        if slot == self._chunk_slot:
            raise RuntimeError(f"slot {slot}: a chunk is running on it; import into another slot")
        d, s = self.dims, self.slots[slot]
        g = self.cfg.llm
        expected = (g.depth, 2, d.batch, d.prefix if rows is None else rows.numel(), g.num_kv_heads, g.head_dim)
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise ValueError(f"kv: expected shape {expected} {self.dtype}, found {tuple(kv.shape)} {kv.dtype}")
        if tuple(prefix_mask.shape) != (d.batch, d.prefix):
            raise ValueError(f"prefix_mask: expected shape {(d.batch, d.prefix)}, found {tuple(prefix_mask.shape)}")
        for i, (k, v) in enumerate(zip(s.k_cache, s.v_cache)):
            if rows is None:
                k[:, : d.prefix].copy_(kv[i, 0]), v[:, : d.prefix].copy_(kv[i, 1])
            else:
                k[:, : d.prefix].zero_(), v[:, : d.prefix].zero_()
                k.index_copy_(1, rows, kv[i, 0]), v.index_copy_(1, rows, kv[i, 1])
        key_block, cos, sin = suffix_layout(prefix_mask.to(self.device), d, self.weights.rope_cos,
                                            self.weights.rope_sin)  # fmt: skip
        s.key_block.copy_(key_block), s.suffix_cos.copy_(cos), s.suffix_sin.copy_(sin)
        s.version.fill_(version)

    # ----- a chunk, step by step -------------------------------------------------------------------------------------
    @property
    def chunk_slot(self) -> int:
        """The slot of the chunk in progress (-1: none)."""
        return self._chunk_slot

    def start_chunk(self, slot: int, state: torch.Tensor | None, noise: torch.Tensor) -> None:
        """Begins a chunk on `slot`: noise (1, H, A) float32; state (1, A) float32 the robot's normalised state
        (the state token; π0.5 has none and takes None: its state is in the prefix's prompt)."""
        if self.dims.state_token:
            if state is None:
                raise ValueError("state: expected the robot's (1, A) normalised state for π0's state token, found None")
            self.slots[slot].state.copy_(state)
        self.xa.x_t.copy_(noise)
        self.step_index.zero_()
        self._chunk_slot, self._steps_done = slot, 0

    def step(self) -> bool:
        """One Euler step of the chunk in progress; True when the chunk is complete (`actions()`)."""
        if self._chunk_slot < 0:
            raise RuntimeError("no chunk in progress: start_chunk(...) first")
        if self.graphs is not None:
            self.graphs[self._chunk_slot].replay()
        else:
            self._step(self._chunk_slot)
        self._steps_done += 1
        if self._steps_done == self.num_steps:
            self._chunk_slot = -1
            return True
        return False

    def actions(self) -> torch.Tensor:
        """(1, H, A) float32 actions of the chunk just completed (a copy, on this device)."""
        return self.xa.x_t.clone()

    def run_chunk(self, slot: int, state: torch.Tensor | None, noise: torch.Tensor) -> torch.Tensor:
        """A whole chunk on `slot`: (1, H, A) float32 actions."""
        self.start_chunk(slot, state, noise)
        while not self.step():
            pass
        return self.actions()

    def memory_bytes(self) -> dict[str, int]:
        kv = sum(t.untyped_storage().nbytes() for s in self.slots for t in (*s.k_cache, *s.v_cache))
        return {"weights": self.weights.nbytes(), "kv_slots": kv}
