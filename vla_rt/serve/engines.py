"""The model a server runs: the stage engine over one copy of the weights, and the policy around it.

`vla_rt.inference.load_stages` builds the engine (checking its own arguments once) with an expert bucket per power of
two up to `max_batch` rows in flight and a prefix bucket per power of two up to `max_prefix` joining rows: `triton` on
CUDA (one CUDA Graph per stage and bucket), `folded` (the same plan on PyTorch ops, eager) on a CPU. The worker
calls the engine's public stage methods; the policy's `prepare` / `finish` turn observations into rows and rows
into actions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from vla_rt.config import Pi0Config
from vla_rt.engine.buffers import Dims
from vla_rt.engine.host_inputs import host_inputs
from vla_rt.engine.stages import StageEngine
from vla_rt.inference import BackendFn, Pi0Inference, load_stages
from vla_rt.inputs import BuiltShapes, ModelInputs, images_to_model_range
from vla_rt.policy import Pi0Policy
from vla_rt.serve.profiles import MODEL_VIEWS
from vla_rt.serve.scheduler import batch_buckets


class WholeCallStages:
    """A whole-request backend (a `BackendFn` of batch 1) behind the stage engine's interface, for a model without
    stages of its own (the split prefix role: prefix, KV export and relay steps in one call). One row at a time: the
    prefix stage takes the row, the one expert stage runs the whole call (so the scheduler counts one step)."""

    prefix_buckets = expert_buckets = (1,)
    capacity = max_prefix = num_steps = 1
    time_stages = False  # the stage engine's switch for CUDA-event timing; a whole call has no stage of its own
    sm_partition = None  # the stage engine's SMs kept for the expert steps; a whole call has none

    def __init__(self, run: BackendFn, cfg: Pi0Config, shapes: BuiltShapes, *, device: torch.device, num_steps: int):
        self.run, self.cfg, self.device, self.call_steps = run, cfg, device, num_steps
        self.dims = Dims.of(cfg, shapes)
        self.rows: list[tuple[Hashable, ModelInputs]] = []

    @property
    def in_flight(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return 1 - len(self.rows)

    def input_rows(self, k: int) -> ModelInputs:
        """Fresh host buffers for the next `admit` (the stage engine's are reused; this row is kept until its step)."""
        d = self.dims
        return host_inputs(self.cfg, rows=k, views=d.views, prompt=d.prompt, chunk=d.chunk)

    def admit(self, ids: Sequence[Hashable], x: ModelInputs) -> None:
        if len(ids) != 1 or self.rows:
            raise ValueError(
                f"admit: expected one row on an idle model, found {len(ids)} with {len(self.rows)} in flight"
            )
        images = images_to_model_range(x.images) if x.images.dtype == torch.uint8 else x.images
        d = self.device
        self.rows.append((ids[0], ModelInputs(images.to(d), x.state.to(d), None if x.tokens is None else x.tokens.to(d),
                                              x.noise, x.image_masks.to(d),
                                              None if x.token_mask is None else x.token_mask.to(d))))  # fmt: skip

    def step(self) -> list[tuple[Hashable, torch.Tensor]]:
        ((row, x),) = self.rows
        self.rows.clear()
        return [(row, self.run(x, x.noise.to(self.device, torch.float32), self.call_steps)[0].float().cpu())]

    def drop_all(self) -> list[Hashable]:
        ids = [i for i, _ in self.rows]
        self.rows.clear()
        return ids

    def synchronize(self) -> None:
        pass

    def last_stage_gpu_ms(self) -> float | None:
        """None: the cost model then reports the wall clock only (the call is one opaque backend function)."""
        return None


@dataclass
class ServingModel:
    stages: StageEngine | WholeCallStages  # what the worker runs
    policy: Pi0Policy  # prepare / finish, and its model: config, shapes, device, norm stats

    @property
    def model(self) -> Pi0Inference:
        return self.policy.model

    @property
    def shapes(self) -> BuiltShapes:
        return self.model.shapes

    @property
    def chunk(self) -> int:
        return self.model.chunk


def build_serving_model(path: str, *, backend: str, device: str | torch.device, dtype: torch.dtype, num_views: int,
                        chunk: int | None, prompt_len: int | None, max_batch: int, max_prefix: int,
                        tokenizer: str | None = None, num_steps: int = 10,
                        expert_sms: int = 0, asset_id: str | None = None) -> ServingModel:  # fmt: skip
    """Loads the checkpoint once and builds the stages. `chunk` / `prompt_len` None: the checkpoint's. expert_sms:
    SMs kept from the prefix stages for the expert steps (`load_stages`). asset_id: the openpi norm stats to use."""
    model = load_stages(path, backend=backend, device=device, dtype=dtype, num_views=num_views, chunk=chunk,
                        prompt_len=prompt_len, expert_buckets=batch_buckets(max_batch),
                        prefix_buckets=batch_buckets(max_prefix), num_steps=num_steps,
                        expert_sms=expert_sms, asset_id=asset_id)  # fmt: skip
    policy = Pi0Policy(model, camera_names=MODEL_VIEWS[:num_views], tokenizer=tokenizer,
                       prompt_len=model.shapes.prompt_len, num_steps=num_steps)  # fmt: skip
    return ServingModel(model.stages, policy)
