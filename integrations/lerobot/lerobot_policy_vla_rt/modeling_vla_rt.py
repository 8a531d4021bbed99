"""`VlaRtPolicy`: LeRobot's policy interface over one vla-rt engine, built once at load.

The policy sits where LeRobot's own `PI0Policy` / `PI05Policy` sit: between the checkpoint's pre-processor (which
normalises the state and tokenises the prompt) and its post-processor (which un-normalises the actions). It takes
the same batch and returns actions in the same normalised space, so the two are interchangeable in `lerobot-eval`,
`lerobot-record` and `lerobot-rollout`.

Noise: when none is given, a chunk's noise is drawn with LeRobot's own flow-matching sampler
(`lerobot.policies.common.flow_matching.sample_noise`: standard normal, float32, shape (B, chunk, 32), from torch's
global generator on the policy's device), once per chunk, as LeRobot's π0 does. With the same torch seed (LeRobot's
`set_seed`, e.g. `lerobot-eval --seed`) and the same calls in between, the plugin and LeRobot's π0 therefore start
every chunk from the same noise. `predict_action_chunk(batch, noise=...)` takes explicit noise, as LeRobot's does.
"""

from __future__ import annotations

import builtins
import json
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lerobot.policies.common.flow_matching import sample_noise
from lerobot.policies.pretrained import PreTrainedPolicy
from torch import Tensor

import vla_rt
from vla_rt.checkpoints import load_checkpoint
from vla_rt.errors import ArgumentError, InputError

from .batch_inputs import _batch_size, engine_inputs
from .configuration_vla_rt import VlaRtConfig, _lerobot_config
from .processor_vla_rt import make_vla_rt_pre_post_processors, prompt_tokenizer_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VlaRtPolicy(PreTrainedPolicy):
    """π0 / π0.5 on vla-rt: `select_action` plays an action queue filled one chunk at a time."""

    config_class = VlaRtConfig
    name = "vla_rt"

    def __init__(self, config: VlaRtConfig, **_factory_kwargs: Any):
        # make_policy passes dataset_stats / dataset_meta: normalisation belongs to the processors, not the model
        super().__init__(config)
        config.validate_features()
        self.config = config
        source = config.checkpoint_source
        backend, device = config.resolved_backend(), torch.device(config.resolved_device())
        if backend == "triton" and device.type != "cuda":
            raise ArgumentError("policy.backend", "folded or reference on a CPU (triton needs CUDA)", backend)
        # The dims first (tensor shapes, no data), so the engine is captured for the prompt length the
        # checkpoint's tokenizer step pads to.
        model_cfg = load_checkpoint(source, shapes_only=True).config
        self.camera_keys = list(config.image_features)
        self.engine = vla_rt.load_pi0(
            source,
            backend=backend,
            device=device,
            dtype=DTYPES[config.resolved_dtype()],
            num_views=len(self.camera_keys),
            prompt_len=model_cfg.max_token_len,
            batch_size=config.batch_size if backend == "triton" else None,
        )
        self.n_action_steps = config.n_action_steps or self.engine.chunk
        self.num_steps = config.resolved_num_steps()
        if self.n_action_steps > self.engine.chunk:
            raise ArgumentError(
                "policy.n_action_steps", f"at most the checkpoint's chunk of {self.engine.chunk}", self.n_action_steps
            )
        self._prompt_tokenizer = None  # loaded on the first prompt that fills prompt_len (see _check_prompt_fits)
        self.action_dim = config.action_feature.shape[0]
        folder = config.lerobot_checkpoint_dir()
        if folder is not None:  # make_policy sets output_features from the env or dataset, whatever the checkpoint's
            saved = (_lerobot_config(folder).get("output_features") or {}).get("action") or {}
            if isinstance(saved.get("shape"), list) and tuple(saved["shape"]) != tuple(config.action_feature.shape):
                raise ArgumentError(
                    "policy.output_features['action']",
                    f"shape {tuple(saved['shape'])}, the action of the checkpoint ({folder / 'config.json'}): the "
                    "env's or dataset's action must be the robot the checkpoint was trained on",
                    None,
                    found_text=f"shape {tuple(config.action_feature.shape)} (from the env or dataset)",
                )
        if self.action_dim > self.engine.config.action_dim:
            raise ArgumentError(
                "policy.output_features['action']",
                f"at most {self.engine.config.action_dim} dims (the model's action width)",
                self.action_dim,
            )
        self.reset()

    @classmethod
    def from_pretrained(
        cls: builtins.type[VlaRtPolicy],
        pretrained_name_or_path: str | Path,
        *,
        config: VlaRtConfig | None = None,
        **kwargs: Any,
    ) -> VlaRtPolicy:
        """`--policy.pretrained_path=DIR` with `--policy.type=vla_rt` (make_policy calls this): DIR is the checkpoint
        unless `checkpoint` names another. Without a config: a dir the plugin saved (config.json of type vla_rt)
        loads its config; any other checkpoint (e.g. `VlaRtPolicy.from_pretrained("/ckpts/pi0")`) gets the defaults."""
        if config is None:
            if _saved_type(Path(pretrained_name_or_path)) == VlaRtPolicy.name:
                config = VlaRtConfig.from_pretrained(pretrained_name_or_path)
            else:
                config = VlaRtConfig(checkpoint=str(pretrained_name_or_path))
        if config.checkpoint is None and config.pretrained_path is None:
            config.pretrained_path = Path(pretrained_name_or_path)
        policy = cls(config)
        policy.eval()
        return policy

    def _save_pretrained(self, save_directory: Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """Writes config.json (type vla_rt, naming the checkpoint by absolute path: the weights stay there) and the
        processors, so `--policy.path=save_directory` loads this policy with its normalisation."""
        self.config.checkpoint = self.config.checkpoint_source
        if Path(self.config.checkpoint).exists():
            self.config.checkpoint = str(Path(self.config.checkpoint).resolve())
        self.config._save_pretrained(save_directory)
        for pipeline in make_vla_rt_pre_post_processors(self.config):
            pipeline.save_pretrained(save_directory)

    # ----- LeRobot's policy interface ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forgets the queued actions (LeRobot calls this at the start of each episode)."""
        self._action_queue: deque[Tensor] = deque(maxlen=self.n_action_steps)

    def get_optim_params(self) -> dict:
        return {}

    def forward(self, batch: dict[str, Tensor], reduction: str = "mean") -> tuple[Tensor, dict]:
        raise NotImplementedError(
            "vla_rt runs inference only: train with --policy.type=pi0 or pi05, then run that checkpoint with "
            "--policy.type=vla_rt --policy.checkpoint=<its pretrained_model dir>"
        )

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor], noise: Tensor | None = None, **_: Any) -> Tensor:
        """One chunk (B, chunk, action_dim) in the normalised action space (the post-processor un-normalises it).

        noise: (B, chunk, 32) float32, or None to draw it as LeRobot's π0 does (see the module docstring).
        """
        cfg = self.engine.config
        x = engine_inputs(batch, self.camera_keys, cfg.vision.image_size, cfg.action_dim, self.engine.device)
        self._check_prompt_fits(batch, x.token_mask)
        if noise is None:
            noise = sample_noise((x.images.shape[0], self.engine.chunk, cfg.action_dim), self.engine.device)
        actions = self.engine.sample_actions(
            x.images,
            x.state,
            x.tokens,
            noise,
            self.num_steps,
            image_masks=x.image_masks,
            token_mask=x.token_mask,
        )
        return actions[:, :, : self.action_dim]

    def _check_prompt_fits(self, batch: dict[str, Tensor], token_mask: Tensor) -> None:
        """LeRobot's tokenizer step cuts a prompt longer than its max_length, silently: π0 then acts on part of the
        instruction, and π0.5 (which writes the state into the prompt) loses the state's end and 'Action: ', so a new
        state gives the old actions. vla-rt refuses such a prompt, as its own policy does. Only a row whose tokens
        fill the whole prompt can have been cut: its text (`task`, which π0.5's pre-processor rewrites to the full
        prompt) is tokenised again, uncut, to tell."""
        full = token_mask.all(dim=1)
        if not bool(full.any()):
            return
        prompt_len = token_mask.shape[1]
        tasks = _row_tasks(batch, token_mask.shape[0], prompt_len)
        for row in full.nonzero().flatten().tolist():
            n = len(self._tokenizer()(str(tasks[row]))["input_ids"])
            if n > prompt_len:
                raise InputError("task", _cut_prompt_expected(self.engine.config.pi05, prompt_len), None,
                                 found_text=f"{n} tokens in row {row}")  # fmt: skip

    def _tokenizer(self) -> Any:
        """The checkpoint's prompt tokenizer, loaded on first use (most prompts never fill prompt_len)."""
        if self._prompt_tokenizer is None:
            from lerobot.processor import tokenizer_processor  # the loader LeRobot's tokenizer step uses

            self._prompt_tokenizer = tokenizer_processor.AutoTokenizer.from_pretrained(
                prompt_tokenizer_name(self.config)
            )
        return self._prompt_tokenizer

    @torch.no_grad()
    def select_action(self, batch: dict[str, Tensor], **_: Any) -> Tensor:
        """The next action (B, action_dim): a new chunk's first `n_action_steps` when the queue is empty."""
        if not self._action_queue:
            chunk = self.predict_action_chunk(batch)[:, : self.n_action_steps]
            self._action_queue.extend(chunk.transpose(0, 1))  # (steps, B, action_dim)
        else:  # the queued actions are those of the rows that filled it: another batch must reset() first
            b, queued = _batch_size(batch, self.camera_keys), self._action_queue[0].shape[0]
            if b != queued:
                raise InputError(
                    "batch",
                    f"{queued} rows, those the queued actions were computed for (call reset() when the batch changes)",
                    None,
                    found_text=f"{b} rows",
                )
        return self._action_queue.popleft()


def _row_tasks(batch: dict[str, Any], rows: int, prompt_len: int) -> list | tuple:
    """The batch's prompt text, one per row: what the tokenizer step tokenised."""
    tasks = batch.get("task")
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list | tuple) or len(tasks) != rows:
        raise InputError(
            "task",
            f"the prompt text of each of the {rows} rows (its tokens fill all {prompt_len}, so vla-rt checks that "
            "LeRobot's tokenizer step did not cut it)",
            None,
            found_text="missing" if tasks is None else type(tasks).__name__,
        )
    return tasks


def _cut_prompt_expected(pi05: bool, prompt_len: int) -> str:
    """What a prompt cut by LeRobot's tokenizer step should have been, and what the cut lost."""
    if pi05:
        return (
            f"a π0.5 prompt of at most {prompt_len} tokens with the state written in (the checkpoint's "
            "tokenizer_max_length; LeRobot's tokenizer step cut it, dropping the state's end and 'Action: ': "
            "shorten the task)"
        )
    return (
        f"a π0 prompt of at most {prompt_len} tokens (the checkpoint's tokenizer_max_length; LeRobot's tokenizer "
        "step cut it, dropping the task's end: shorten the task)"
    )


def _saved_type(folder: Path) -> str | None:
    """The `type` in folder/config.json, or None when there is no readable one."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("type") if isinstance(config, dict) else None
