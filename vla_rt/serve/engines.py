"""The model a server runs: the stage engine over one copy of the weights, and the policy around it.

`vla_rt.inference.load_stages` builds the engine (checking its own arguments once) with an expert bucket per power of
two up to `max_batch` rows in flight and a prefix bucket per power of two up to `max_prefix` joining rows: `triton` on
CUDA (one CUDA Graph per stage and bucket), `folded` (the same plan on PyTorch ops, eager) on a CPU. The worker
calls the engine's public stage methods; the policy's `prepare` / `finish` turn observations into rows and rows
into actions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_rt.engine.stages import StageEngine
from vla_rt.inference import Pi0Inference, load_stages
from vla_rt.inputs import BuiltShapes
from vla_rt.policy import Pi0Policy
from vla_rt.serve.profiles import MODEL_VIEWS
from vla_rt.serve.scheduler import batch_buckets


@dataclass
class ServingModel:
    model: Pi0Inference  # built by load_stages: config, shapes, device, norm stats, and `stages`
    policy: Pi0Policy

    @property
    def stages(self) -> StageEngine:
        return self.model.stages

    @property
    def shapes(self) -> BuiltShapes:
        return self.model.shapes

    @property
    def chunk(self) -> int:
        return self.model.chunk


def build_serving_model(path: str, *, backend: str, device: str | torch.device, dtype: torch.dtype, num_views: int,
                        chunk: int | None, prompt_len: int | None, max_batch: int, max_prefix: int,
                        tokenizer: str | None = None, num_steps: int = 10) -> ServingModel:  # fmt: skip
    """Loads the checkpoint once and builds the stages. `chunk` / `prompt_len` None: the checkpoint's."""
    model = load_stages(path, backend=backend, device=device, dtype=dtype, num_views=num_views, chunk=chunk,
                        prompt_len=prompt_len, expert_buckets=batch_buckets(max_batch),
                        prefix_buckets=batch_buckets(max_prefix), num_steps=num_steps)  # fmt: skip
    policy = Pi0Policy(model, camera_names=MODEL_VIEWS[:num_views], tokenizer=tokenizer,
                       prompt_len=model.shapes.prompt_len, num_steps=num_steps)  # fmt: skip
    return ServingModel(model, policy)
