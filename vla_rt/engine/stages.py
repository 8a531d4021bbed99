"""`StageEngine`: π0 / π0.5 as two batched stages over one copy of the weights and a pool of rows (continuous
batching at the granularity of a denoising step, PhysisServe's "stage").

    engine.admit(ids, x)      prefix stage: vision + VLM prefix for k new rows (x: ModelInputs with noise), whose
                              KV caches join the pool; returns when done
    engine.step()             expert stage: one Euler step for every row in the pool, each at its own step index;
                              returns [(id, actions (H, A) float32 on the CPU)] of the rows that just finished
    engine(x, noise, steps)   a BackendFn: the rows of x admitted together and stepped to the end (Pi0Inference)

    engine.begin_admit(ids, x)  the same prefix stage on its own CUDA stream, beside the expert steps (which keep
    engine.prefix_ready()       running on a higher-priority stream); the rows join the pool at `join`, a stage
    engine.join()               boundary, without the host waiting (the expert stream waits for the prefix's event)

Rows join at any stage boundary and leave after their last step. Every row has its own KV cache, key blocks,
suffix RoPE rows, state, noise / x_t and step index; the expert stage reads the per-step table row of each row's
own step (π0: the time bias; π0.5: the packed adaptive-norm modulation) by an index_select on the device, so one
captured graph per bucket serves every mix of steps.

The slot mapping, chosen so that no graph is ever recaptured and no kernel needs an indirection table:
- the in-flight rows stay compact at pool positions 0..n-1, and the expert stage of n rows runs the graph of the
  smallest expert bucket b >= n over positions 0..b-1 (positions n..b-1 are padding: stale but finite rows whose
  results are ignored; rows never mix, every kernel is per batch element);
- a prefix stage of k rows runs the graph of prefix bucket kb >= k over a staging slot of kb rows, then the first
  k staged rows are copied to positions n..n+k-1 (one strided copy per buffer: the per-layer K/V caches are views
  of one (layers, rows, keys, heads, dim) tensor);
- when rows finish, the surviving rows above the new end move down into the holes (index_copy, a few launches).
A copy of a row's prefix K/V (≈ 10 MB for π0 with 2 views) costs microseconds on the GPU; graphs per (stage,
bucket) over shared buffers keep memory at one pool plus one staging slot.

Overlap: a prefix stage is compute-bound while an expert step of a few rows is weight- and latency-bound (its
tensor cores mostly idle), so the two share the GPU well; the prefix gets its own split-K scratch and the lowest
stream priority, so the expert's blocks go first whenever SMs free up. One prefix at a time (one staging slot):
the next `begin_admit` waits, on the GPU, until `join` has copied the staged rows out. Priority alone does not keep
the steps fast: the prefix's blocks fill every SM, and a step's short kernels wait for them (an expert step of 4
rows 1.3 ms alone, 8.4 ms beside an 8-row prefix on the H200). `expert_sms` keeps that many SMs from the prefix
stages (sm_partition.py: their graphs are captured on a green context of the other SMs), so a step beside one always
finds SMs free, at the price of a slower prefix stage.

Every plan goes through `Pi0Plan` and its `ExpertStep` (expert_step.py), so a faster expert step (the persistent
kernel) plugs in here as it does everywhere. On CUDA each (stage, bucket) is a CUDA Graph; on a CPU the same code
runs eagerly (tests use the torch kernels in float32).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Activations, Dims, ExpertActivations, ObservationInputs, PrefixSlot, first_rows
from vla_rt.engine.expert_step import PerOpExpertStep
from vla_rt.engine.host_inputs import HostInputRing, load_pinned, loads_direct
from vla_rt.engine.plan import Pi0Plan
from vla_rt.engine.sm_partition import SmPartition
from vla_rt.engine.static_engine import WARMUP_RUNS
from vla_rt.engine.weights import EngineWeights
from vla_rt.graph_capture import graph_capture
from vla_rt.graph_passes import PassContext, apply_passes
from vla_rt.inputs import BuiltShapes, ModelInputs, images_to_model_range


@dataclass
class _Slots:
    """A PrefixSlot whose per-layer K / V caches are views of one tensor each, so rows copy in one launch."""

    k: torch.Tensor  # (layers, rows, keys, Hkv, D)
    v: torch.Tensor
    slot: PrefixSlot

    @classmethod
    def allocate(cls, cfg: Pi0Config, d: Dims, keys: int, device, dtype) -> _Slots:
        g = cfg.llm
        k = torch.zeros(g.depth, d.batch, keys, g.num_kv_heads, g.head_dim, dtype=dtype, device=device)
        v = torch.zeros_like(k)
        slot = PrefixSlot(
            list(k.unbind(0)), list(v.unbind(0)),
            torch.zeros(d.batch, d.prefix + d.suffix, dtype=torch.int32, device=device),
            torch.zeros(d.batch, d.suffix, g.head_dim // 2, dtype=torch.float32, device=device),
            torch.zeros(d.batch, d.suffix, g.head_dim // 2, dtype=torch.float32, device=device),
            torch.zeros(d.batch, cfg.action_dim, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )  # fmt: skip
        return cls(k, v, slot)

    def per_row(self) -> tuple[torch.Tensor, ...]:
        """The buffers indexed by row along dim 0 (the caches are indexed along dim 1)."""
        s = self.slot
        return s.key_block, s.suffix_cos, s.suffix_sin, s.state


@dataclass
class _Row:
    id: Hashable
    steps: int = 0  # Euler steps done


class StageEngine:
    """The two stages over a pool of `max(expert_buckets)` rows (see the module docstring). Used by one thread."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        cfg: Pi0Config,
        shapes: BuiltShapes,
        *,
        expert_buckets: Sequence[int],
        prefix_buckets: Sequence[int],
        kernels,
        device: torch.device,
        dtype: torch.dtype,
        num_steps: int = 10,
        cuda_graph: bool = True,
        expert_sms: int = 0,
    ):
        self.expert_buckets = tuple(sorted(set(expert_buckets)))
        self.prefix_buckets = tuple(sorted(set(prefix_buckets)))
        if min((*self.expert_buckets, *self.prefix_buckets), default=0) < 1 or not self.prefix_buckets:
            raise ValueError(f"buckets: expected positive row counts, found expert {list(expert_buckets)}, "
                             f"prefix {list(prefix_buckets)}")  # fmt: skip
        self.capacity, self.max_prefix = self.expert_buckets[-1], self.prefix_buckets[-1]
        if self.max_prefix > self.capacity:
            raise ValueError(f"prefix_buckets: expected at most the pool's {self.capacity} rows, "
                             f"found {self.max_prefix}")  # fmt: skip
        self.cfg, self.shapes, self.device, self.dtype, self.num_steps = cfg, shapes, device, dtype, num_steps
        self.dims = d = Dims.of(cfg, replace(shapes, batch_size=self.capacity))
        ctx = PassContext(cfg, d.views, d.chunk, d.prompt, num_steps, d.batch)
        self.weights = EngineWeights.from_pass_state(apply_passes(weights, ctx), device, dtype)
        keys = d.prefix + d.suffix
        # the pool: in-flight rows at positions 0..n-1
        self.pool = _Slots.allocate(cfg, d, keys, device, dtype)
        self.xa = ExpertActivations.allocate(cfg, d, device, dtype)
        self.xa.x_t.zero_()  # padding rows compute on finite values
        self.step_index = torch.zeros(d.batch, dtype=torch.long, device=device)
        table = self.weights.step_table
        self.step_rows = torch.zeros(d.batch, table.shape[1], dtype=torch.float32, device=device)
        # the staging slot a prefix stage writes (its rows are copied into the pool)
        ds = replace(d, batch=self.max_prefix)
        self.staged = _Slots.allocate(cfg, ds, d.prefix, device, dtype)  # prefix keys only: the suffix is the pool's
        self.obs = ObservationInputs.allocate(cfg, ds, device)
        self.act = Activations.allocate(cfg, ds, device, dtype)
        self.staged_noise = torch.zeros_like(self.xa.x_t[: self.max_prefix])
        # uint8 pixels land here from pinned host rows, then are scaled into obs.images (`load_pinned`)
        self.staged_pixels = torch.zeros(self.obs.images.shape, dtype=torch.uint8, device=device)
        # the host side of a prefix stage: reused (pinned on CUDA) buffers its rows are copied into (`input_rows`)
        self._host = HostInputRing(cfg, rows=self.max_prefix, views=d.views, prompt=d.prompt, chunk=d.chunk,
                                   device=device)  # fmt: skip
        # the expert stages' stream (highest priority) and the prefix's own (lowest), each with its split-K scratch
        self.stream = self.prefix_stream = None  # a CPU runs everything eagerly, in order
        # `expert_sms` > 0: the prefix stream lives on a green context of the other SMs (`sm_partition`)
        self.sm_partition = SmPartition(device, expert_sms) if expert_sms else None
        if device.type == "cuda":
            low, high = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(device, priority=high)
            self.prefix_stream = torch.cuda.Stream(device, priority=low)
            if self.sm_partition is not None:
                self.prefix_stream = self.sm_partition.streams["prefix"]
        self._workspaces = (None, None)
        if kernels.name == "triton":
            from vla_rt.triton_kernels import Workspace

            self._workspaces = (Workspace(device), Workspace(device))
        self.plans = {b: self._plan(kernels, replace(d, batch=b)) for b in {*self.expert_buckets, *self.prefix_buckets}}
        self.rows: list[_Row] = []
        self._last_stage: torch.cuda.Event | None = None
        self._pending: tuple[list[Hashable], torch.cuda.Event | None] | None = None  # begin_admit's, until join
        self._staged_free: torch.cuda.Event | None = None  # join's copies out of the staging slot are done
        self.prefix_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.expert_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # `time_stages`: each stage's kernels between two CUDA events (`last_stage_gpu_ms`), so a slow stage can be
        # told apart as GPU time or as the host's stacking, uploads and launches around it (the cost model sets it)
        self.time_stages = False
        self._stage_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if cuda_graph and device.type == "cuda":
            self._capture()

    def _plan(self, kernels, dims: Dims) -> Pi0Plan:
        """The plan of one bucket. Its expert step must take a time-bias row per batch element (`per_row_steps`: the
        per-op steps and the persistent kernel do); one that reads a single row for all still serves one row, else
        the per-op step runs and `plan.expert_why` says why."""
        ws_prefix, ws_expert = self._workspaces
        plan = Pi0Plan(kernels, self.weights, self.cfg, dims, ws_prefix, expert_workspace=ws_expert)
        if dims.batch > 1 and not getattr(plan.expert, "per_row_steps", False):
            why = f"{plan.expert.name}: one time-bias row for all rows, the stage engine's rows are at their own steps"
            per_op = PerOpExpertStep(kernels, self.weights, self.cfg, dims, ws_expert)
            plan = Pi0Plan(kernels, self.weights, self.cfg, dims, ws_prefix, expert_step=per_op)
            plan.expert_why = "; ".join(filter(None, [why, plan.expert_why]))
        return plan

    # ----- what the graphs run ------------------------------------------------------------------------------------
    def _prefix(self, kb: int) -> None:
        obs = first_rows(self.obs, kb, self.max_prefix)
        slot = first_rows(self.staged.slot, kb, self.max_prefix)
        act = first_rows(self.act, kb, self.max_prefix)
        self.plans[kb].vlm(obs, slot, act)

    def _expert(self, b: int) -> None:
        slot = first_rows(self.pool.slot, b, self.capacity)
        xa = first_rows(self.xa, b, self.capacity)
        index, rows = self.step_index[:b], self.step_rows[:b]
        torch.index_select(self.weights.step_table, 0, index, out=rows)  # each row's own step
        self.plans[b].expert_step(slot, xa, 0, self.num_steps, time_bias=rows)
        index.add_(1).remainder_(self.num_steps)

    def _capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                for kb in self.prefix_buckets:
                    self._prefix(kb)
                for b in self.expert_buckets:
                    self._expert(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        for stage, graphs, buckets in (("prefix", self.prefix_graphs, self.prefix_buckets),
                                       ("expert", self.expert_graphs, self.expert_buckets)):  # fmt: skip
            # a prefix graph captured on the partition's stream keeps its kernels on those SMs wherever it replays
            stream = self.prefix_stream if stage == "prefix" and self.sm_partition is not None else None
            for b in buckets:
                graphs[b] = self.capture_stage(stage, b, stream)
        self.step_index.zero_()
        torch.cuda.synchronize(self.device)

    def capture_stage(self, stage: str, rows: int, stream: torch.cuda.Stream | None = None) -> torch.cuda.CUDAGraph:
        """A new CUDA Graph of one stage's kernels ("prefix" or "expert") for the bucket of `rows`, captured on
        `stream` (default: torch's side stream). The engine's own graphs come from here; a probe captures copies on
        other streams, e.g. a green context's, whose kernel nodes keep its SMs wherever they replay. Every copy works
        on the engine's one set of buffers, so replays of copies and of the engine's graphs must not interleave."""
        buckets = {"prefix": self.prefix_buckets, "expert": self.expert_buckets}
        if stage not in buckets:
            raise ValueError(f"stage: expected 'prefix' or 'expert', found {stage!r}")
        if rows not in buckets[stage]:
            raise ValueError(f"rows: expected one of the {stage} buckets {list(buckets[stage])}, found {rows}")
        if self.device.type != "cuda":
            raise RuntimeError(f"capture_stage: CUDA Graphs need an engine on CUDA, this one runs on {self.device}")
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, **({} if stream is None else {"stream": stream})):
            (self._prefix if stage == "prefix" else self._expert)(rows)
        return graph

    # ----- the stages ---------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        """Pool rows neither in flight nor reserved by a prefix stage that has not joined."""
        return self.capacity - len(self.rows) - self.joining

    @property
    def joining(self) -> int:
        """Rows of the prefix stage `begin_admit` launched, until `join`."""
        return 0 if self._pending is None else len(self._pending[0])

    def row_steps(self) -> list[tuple[Hashable, int]]:
        """(id, Euler steps done) of every in-flight row."""
        return [(r.id, r.steps) for r in self.rows]

    def input_rows(self, k: int) -> ModelInputs:
        """Host buffers for the k rows of the next `admit` / `begin_admit`, to fill in place: uint8 pixels, state,
        prompt, masks and noise (`host_inputs`' layout). Pinned on CUDA and reused, so the stage's upload allocates
        nothing on the host; free to write when returned (their last upload has run)."""
        return self._host.take(k)

    def admit(self, ids: Sequence[Hashable], x: ModelInputs) -> None:
        """Prefix stage for k = len(ids) new rows: x holds k checked rows (images float32 in [-1, 1] or uint8
        pixels, scaled here on the device) and their noise (k, H, A). On return the rows are in the pool for the
        next stage; the GPU may still be running this one (see `_fence`)."""
        k = self._check_admit(ids, x)
        with self._on(self.stream):
            self._launch_prefix(k, x)
            self._install(list(ids), self._upload(x.noise))
            self._host.uploaded()
            self._fence()

    def begin_admit(self, ids: Sequence[Hashable], x: ModelInputs) -> None:
        """`admit`'s prefix stage launched on the prefix stream, beside whatever the expert stream runs; the rows
        take their free pool rows now and join at `join`. Returns at once (on a CPU, once the stage ran)."""
        k = self._check_admit(ids, x)
        event = None
        with self._on(self.prefix_stream):
            if self._staged_free is not None:  # the last join's copies out of the staging slot come first
                self.prefix_stream.wait_event(self._staged_free)
            self._launch_prefix(k, x)
            self.staged_noise[:k].copy_(self._upload(x.noise))
            self._host.uploaded()
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(self.prefix_stream)
        self._pending = (list(ids), event)

    def prefix_ready(self) -> bool:
        """True when a prefix stage from `begin_admit` has finished on the GPU (joining it then stalls nothing)."""
        return self._pending is not None and (self._pending[1] is None or self._pending[1].query())

    def join(self) -> list[Hashable]:
        """The rows of `begin_admit`'s prefix stage join the pool for the next expert stage; returns their ids. The
        host does not wait: the expert stream waits for the prefix's event, so joining before `prefix_ready` holds
        the rows in flight until the prefix is done."""
        if self._pending is None:
            raise RuntimeError("join: no prefix stage to join (begin_admit first)")
        (ids, event), self._pending = self._pending, None
        with self._on(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            self._install(ids, self.staged_noise[: len(ids)])
        return ids

    def cancel_admit(self) -> list[Hashable]:
        """Forgets the prefix stage `begin_admit` launched, whose rows will not join (its join failed); returns
        their ids. The rows in flight are untouched."""
        ids = [] if self._pending is None else self._pending[0]
        self._pending = None
        return ids

    def _check_admit(self, ids: Sequence[Hashable], x: ModelInputs) -> int:
        k = len(ids)
        if self._pending is not None:
            raise RuntimeError(f"admit: a prefix stage of {self.joining} rows has not joined yet (join it first)")
        if not 1 <= k <= min(self.max_prefix, self.free):
            most = min(self.max_prefix, self.free)
            raise ValueError(f"admit: expected 1..{most} rows ({self.free} of {self.capacity} free, prefix stages of "
                             f"at most {self.max_prefix}), found {k}")  # fmt: skip
        if x.noise is None or x.noise.shape != (k, self.dims.chunk, self.cfg.action_dim):
            found = None if x.noise is None else tuple(x.noise.shape)
            raise ValueError(f"noise: expected shape {(k, self.dims.chunk, self.cfg.action_dim)}, found {found}")
        return k

    def _launch_prefix(self, k: int, x: ModelInputs) -> None:
        """Uploads k rows into the staging slot's inputs and runs the prefix graph of their bucket (current stream)."""
        kb = _bucket(self.prefix_buckets, k)
        obs = first_rows(self.obs, k, self.max_prefix)
        if loads_direct(x, self.device):
            load_pinned(obs, self.staged_pixels, x)
        else:
            up = self._upload
            images = up(x.images)
            if images.dtype == torch.uint8:
                images = images_to_model_range(images)
            obs.load(ModelInputs(images, up(x.state), up(x.tokens), None, up(x.image_masks), up(x.token_mask)))
        self._run_timed(self.prefix_graphs[kb].replay if kb in self.prefix_graphs else partial(self._prefix, kb))

    def _install(self, ids: list[Hashable], noise: torch.Tensor) -> None:
        """The first len(ids) staged rows become pool rows n.. (current stream), with their noise as x_t."""
        k, n, prefix = len(ids), len(self.rows), self.dims.prefix
        new = slice(n, n + k)
        self.pool.k[:, new, :prefix].copy_(self.staged.k[:, :k])
        self.pool.v[:, new, :prefix].copy_(self.staged.v[:, :k])
        for dst, src in zip(self.pool.per_row(), self.staged.per_row()):
            dst[new].copy_(src[:k])
        self.xa.x_t[new].copy_(noise)
        self.step_index[new].zero_()
        self.rows.extend(_Row(i) for i in ids)
        if self.device.type == "cuda":  # the staging slot is free for the next prefix once these copies ran
            self._staged_free = torch.cuda.Event()
            self._staged_free.record(self.stream)

    def step(self) -> list[tuple[Hashable, torch.Tensor]]:
        """Expert stage: one Euler step for every in-flight row. Returns (id, actions (H, A) float32, CPU) of the
        rows that took their last step; they have left the pool."""
        n = len(self.rows)
        if n == 0:
            raise RuntimeError("step: no row in flight (admit rows first)")
        b = _bucket(self.expert_buckets, n)
        with self._on(self.stream):
            self._run_timed(self.expert_graphs[b].replay if b in self.expert_graphs else partial(self._expert, b))
            for r in self.rows:
                r.steps += 1
            done = [i for i, r in enumerate(self.rows) if r.steps >= self.num_steps]
            if not done:
                self._fence()
                return []
            where = torch.tensor(done, device=self.device)
            actions = self.xa.x_t.index_select(0, where).float().cpu()  # waits for the stage
            finished = [(self.rows[i].id, actions[j]) for j, i in enumerate(done)]
            self._compact(done)
        return finished

    def _compact(self, done: list[int]) -> None:
        """Removes the finished rows; survivors above the new end move down into their positions."""
        gone = set(done)
        end = len(self.rows) - len(done)
        holes = [i for i in done if i < end]
        movers = [i for i in range(end, len(self.rows)) if i not in gone]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for t in (self.pool.k, self.pool.v):
                t.index_copy_(1, dst, t.index_select(1, src))
            for t in (*self.pool.per_row(), self.xa.x_t, self.step_index):
                t.index_copy_(0, dst, t.index_select(0, src))
            for h, m in zip(holes, movers):
                self.rows[h] = self.rows[m]
        del self.rows[end:]

    def drop_all(self) -> list[Hashable]:
        """Forgets every row in flight and any prefix stage not joined (after a failed stage); returns their ids.
        The pool is free again."""
        ids = [r.id for r in self.rows] + self.cancel_admit()
        self.rows.clear()
        return ids

    def _run_timed(self, run: Callable[[], None]) -> None:
        """Runs one stage's kernels on the current stream; with `time_stages` on CUDA, between two events."""
        if not (self.time_stages and self.device.type == "cuda"):
            self._stage_events = None  # never an older stage's time for this one
            run()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        self._stage_events = (start, end)

    def last_stage_gpu_ms(self) -> float | None:
        """The GPU's own time for the last stage run with `time_stages` on (waits for it); None on a CPU or when
        none was timed. Without the host's work around it: the uploads, the launch, the wait for the stage before."""
        if self._stage_events is None:
            return None
        start, end = self._stage_events
        end.synchronize()
        return start.elapsed_time(end)

    def _on(self, stream: torch.cuda.Stream | None):
        """`torch.cuda.stream(stream)` on CUDA; nothing on a CPU (one eager stream)."""
        return nullcontext() if stream is None else torch.cuda.stream(stream)  # streams exist exactly on CUDA

    def _upload(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A host tensor on the device. On CUDA through pinned memory (`input_rows`' buffers are already pinned; others
        are pinned by PyTorch's caching host allocator), so the copy is queued behind the stage in flight instead of
        waiting for it, as a copy from pageable memory would."""
        if t is None or self.device.type != "cuda" or t.device.type == "cuda":
            return None if t is None else t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _fence(self) -> None:
        """Returns once the stage before this one is done: at most one stage queued ahead of the GPU, so the next
        stage is chosen and launched while this one runs (no idle gap between stages) and a decision is never more
        than one stage stale. A stage whose rows finish waits for itself (copying their actions back)."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(self.stream)
        before, self._last_stage = self._last_stage, done
        if before is not None:
            before.synchronize()

    def synchronize(self) -> None:
        """Waits for every stage launched so far (timing, tests)."""
        if self.device.type == "cuda":
            self.stream.synchronize()
            self.prefix_stream.synchronize()

    # ----- whole requests -----------------------------------------------------------------------------------------
    def __call__(self, x: ModelInputs, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        """A BackendFn: the B rows of `x` (B <= the pool) admitted and stepped to the end; (B, H, A) float32."""
        if num_steps != self.num_steps:
            raise ValueError(f"num_steps: expected {self.num_steps} (the engine's step table), found {num_steps}; "
                             "build the engine again with that step count")  # fmt: skip
        b = x.images.shape[0]
        if self.rows or b > self.capacity:
            raise ValueError(f"batch: expected at most {self.capacity} rows on an idle engine, found {b} rows "
                             f"with {len(self.rows)} in flight")  # fmt: skip
        for start in range(0, b, self.max_prefix):
            part = slice(start, min(b, start + self.max_prefix))
            self.admit(range(part.start, part.stop), _row_slice(x, noise, part))
        out: dict[Hashable, torch.Tensor] = {}
        while self.rows:
            out.update(self.step())
        return torch.stack([out[i] for i in range(b)]).to(self.device)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return next(b for b in buckets if b >= n)


def _row_slice(x: ModelInputs, noise: torch.Tensor, rows: slice) -> ModelInputs:
    def cut(t):
        return None if t is None else t[rows]

    return ModelInputs(x.images[rows], x.state[rows], cut(x.tokens), noise[rows], x.image_masks[rows],
                       cut(x.token_mask))  # fmt: skip
