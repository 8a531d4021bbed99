"""`Pi0Policy`: raw robot observations in, actions in robot units out (openpi's input conventions).

Pre-processing: uint8 images of any size are resized with padding to the model's square size (aspect kept, black
bars, as openpi's `resize_with_pad`) and scaled to [-1, 1]; missing cameras become masked zero views; the state is
normalized with the checkpoint's norm stats and zero-padded to the action dim; prompt token ids are padded to the
built prompt length with a False mask. Post-processing: actions are un-normalized and cropped to the robot's dims.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vla_rt import prompt as pi05_prompt
from vla_rt.arguments import LIMITS, check_device, check_int, check_optional_int, check_seed
from vla_rt.checkpoints.common import asset_choice_error, relative_actions_error
from vla_rt.checkpoints.norm_stats import load_norm_stats
from vla_rt.errors import ArgumentError, CheckpointError, InputError
from vla_rt.inference import Pi0Inference, load_pi0
from vla_rt.inputs import images_to_model_range
from vla_rt.observation import (
    camera_images,
    check_image,
    check_noise,
    check_norm_stats,
    check_obs,
    check_one_prompt,
    check_prompt,
    check_prompt_tokens,
    check_state,
)

OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
log = logging.getLogger("vla_rt.policy")


def resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (size, size, 3): bilinear resize keeping aspect, centred on black (openpi's rule)."""
    h, w = image.shape[:2]
    if (h, w) == (size, size):
        return image
    ratio = max(w / size, h / size)
    rh, rw = max(1, int(h / ratio)), max(1, int(w / ratio))  # a 1x5000 strip keeps one row, not zero
    resized = np.asarray(Image.fromarray(image).resize((rw, rh), resample=Image.BILINEAR))
    out = np.zeros((size, size, 3), dtype=np.uint8)
    top, left = max(0, int((size - rh) / 2)), max(0, int((size - rw) / 2))
    out[top : top + rh, left : left + rw] = resized
    return out


@dataclass
class PreparedObservation:
    """One observation in the model's normalized space, batch dim 1 (the arguments of `sample_actions`)."""

    images: torch.Tensor  # (1, V, S, S, 3) float32 in [-1, 1] (uint8 pixels with `prepare(uint8_images=True)`)
    image_masks: torch.Tensor  # (1, V) bool, False for a missing camera (a zero view)
    state: torch.Tensor  # (1, A) float32, normalized and zero-padded to the action dim
    tokens: torch.Tensor | None  # (1, P) int64 prompt ids padded to the built prompt length, or None
    token_mask: torch.Tensor | None  # (1, P) bool, True for the real ids
    noise: torch.Tensor | None  # (1, H, A) float32 given by the caller, or None (drawn at sampling)


class SentencePieceTokenizer:
    """PaliGemma prompt tokenization as openpi does it (BOS + cleaned prompt + '\\n'); needs a user's .model file."""

    def __init__(self, model_path: str | Path):
        if not isinstance(model_path, str | Path) or not Path(model_path).is_file():
            raise ArgumentError("tokenizer", "the path of a SentencePiece .model file", model_path)
        try:
            import sentencepiece
        except ImportError:
            raise ImportError(
                "tokenizer: a text prompt needs the sentencepiece package (pip install sentencepiece)"
            ) from None
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(model_path, f"not a SentencePiece model ({e})") from None

    def __call__(self, prompt: str) -> np.ndarray:
        return np.asarray(pi05_prompt.prompt_token_ids(self.sp, prompt, None), dtype=np.int64)


class Pi0Policy:
    """A π0 model plus the transforms between a robot's raw observation and the model's normalized space.

    Every argument is checked here, once (ArgumentError / NormStatsError): the norm stats against the model's width
    and the norm mode, `action_dim` against both. With norm stats the actions are cropped to their width by default
    (dims past it have no statistics and would stay in normalised units).
    """

    def __init__(
        self,
        model: Pi0Inference,
        *,
        camera_names: Sequence[str] | None = None,
        action_dim: int | None = None,
        norm_stats: Any = None,
        norm_mode: str | None = None,
        num_steps: int = 10,
        prompt_len: int | None = None,
        tokenizer: str | None = None,
        seed: int | None = None,
        discrete_state_input: bool | None = None,
    ):
        if not isinstance(model, Pi0Inference):
            raise ArgumentError("model", "a Pi0Inference (from vla_rt.load_pi0)", model)
        if model.relative_actions:  # offsets from the state, sent to a robot as positions: never
            raise relative_actions_error(model.source or "the checkpoint", "vla-rt's policy")
        self.model = model
        width = model.config.action_dim
        views = model.shapes.num_views or 3
        self.camera_names = _camera_names(camera_names, views) if camera_names is not None else OPENPI_CAMERAS[:views]
        if model.shapes.num_views is not None and len(self.camera_names) != model.shapes.num_views:
            raise ArgumentError(
                "camera_names",
                f"{model.shapes.num_views} names (the model's views)",
                None,
                found_text=f"{len(self.camera_names)}: {self.camera_names}",
            )
        pi05 = model.config.pi05
        # π0.5 reads the state from the prompt (openpi's `discrete_state_input`, True by default for π0.5; configs
        # such as pi05_libero set it False and the state is not used at all). π0 takes the state as a token.
        if discrete_state_input not in (None, True, False):
            raise ArgumentError("discrete_state_input", "None, True or False", discrete_state_input)
        if discrete_state_input and not pi05:
            raise ArgumentError(
                "discrete_state_input", "None or False for π0 (it takes the state as its own token)", True
            )
        self.discrete_state_input = pi05 if discrete_state_input is None else discrete_state_input
        if norm_mode is None:  # the checkpoint's recorded mode, else openpi's default (π0 z-score, π0.5 quantiles)
            quantiles = model.use_quantile_norm if model.use_quantile_norm is not None else pi05
            norm_mode = "quantile" if quantiles else "zscore"
        if norm_mode not in ("zscore", "quantile"):
            raise ArgumentError("norm_mode", "'zscore' or 'quantile'", norm_mode)
        self._use_quantiles = norm_mode == "quantile"
        source = "norm_stats argument"
        if isinstance(norm_stats, str | Path):
            source, norm_stats = str(norm_stats), load_norm_stats(norm_stats)
        elif norm_stats is None:
            source, norm_stats = f"{model.source or 'the checkpoint'}: norm stats", model.norm_stats
            _check_checkpoint_stats(model)
        if norm_stats is not None:
            uses_state = not pi05 or self.discrete_state_input
            norm_stats = check_norm_stats(norm_stats, width, self._use_quantiles, source, need_state=uses_state)
        self.norm_stats = norm_stats
        stats_width = norm_stats["actions"].dim if norm_stats is not None else width
        if action_dim is not None:
            why = "the actions norm stats' width" if norm_stats is not None else "the model's action width"
            if isinstance(action_dim, bool) or not isinstance(action_dim, int) or not 1 <= action_dim <= stats_width:
                raise ArgumentError("action_dim", f"an integer in [1, {stats_width}] ({why})", action_dim)
        self.action_dim = int(action_dim) if action_dim is not None else stats_width
        self.num_steps = check_int("num_steps", num_steps, *LIMITS["num_steps"])
        built_steps = getattr(model.impl, "num_steps", None)  # a captured engine runs one step count
        if model.backend == "triton" and built_steps is not None and self.num_steps != built_steps:
            raise ArgumentError("num_steps", f"{built_steps} (the engine's captured plan)", num_steps)
        self.prompt_len = _prompt_len(check_optional_int("prompt_len", prompt_len), model)
        self.tokenizer = SentencePieceTokenizer(tokenizer) if tokenizer else None
        seed = check_seed("seed", seed)
        self._generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        backend: str = "reference",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        num_views: int | None = None,
        chunk: int | None = None,
        prompt_len: int | None = None,
        asset_id: str | None = None,
        **policy_kwargs: Any,
    ) -> Pi0Policy:
        """Loads the checkpoint (any format `load_pi0` reads) and wraps it. Defaults: CUDA + bf16 when available.

        asset_id: which openpi `assets/<asset_id>/norm_stats.json` to use; required where there are several (as
        openpi's own policy requires its config's asset_id), unless `norm_stats=` is given."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = torch.bfloat16 if check_device(device).type == "cuda" else torch.float32
        camera_names = policy_kwargs.get("camera_names")
        if num_views is None and camera_names is not None:
            num_views = len(_camera_names(camera_names, None))
        model = load_pi0(
            path, backend=backend, device=device, dtype=dtype, num_views=num_views, chunk=chunk, prompt_len=prompt_len,
            asset_id=asset_id,
        )  # fmt: skip
        return cls(model, prompt_len=prompt_len, **policy_kwargs)

    # ----- pre-processing -------------------------------------------------------------------------------------------
    def _images(self, images: Any, uint8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        by_name = camera_images(images, self.camera_names)
        size = self.model.config.vision.image_size
        views, mask = [], []
        for name in self.camera_names:
            img = by_name.get(name)
            if img is None:
                views.append(np.zeros((size, size, 3), np.uint8))
                mask.append(False)
                continue
            views.append(resize_with_pad(check_image(name, img), size))
            mask.append(True)
        if not any(mask):
            raise InputError("images", f"at least one of {list(self.camera_names)}", None, found_text="none")
        batch = torch.from_numpy(np.stack(views)[None])
        return (batch if uint8 else images_to_model_range(batch)), torch.tensor([mask])

    def _normalized_state(self, state: Any) -> np.ndarray:
        """(s,) float64: checked, normalised with the checkpoint's stats, unpadded."""
        a = self.model.config.action_dim
        stats = self.norm_stats.get("state") if self.norm_stats is not None else None
        x = check_state(state, a, stats)
        if stats is not None:
            x = stats.normalize(x, use_quantiles=self._use_quantiles)
        big = np.flatnonzero(np.abs(x) > np.finfo(np.float32).max)  # the model's float32 would hold inf
        if big.size:
            raise InputError("state", "values within float32's range (±3.4e38) after normalisation", None,
                             found_text=f"{x[big[0]]:.3g} at index {big[:8].tolist()}")  # fmt: skip
        return x

    def _state(self, x: np.ndarray) -> torch.Tensor:
        """A normalised state zero-padded to the action dim, (1, A) float32."""
        a = self.model.config.action_dim
        padded = np.zeros(a, np.float32)
        padded[: x.shape[0]] = x
        return torch.from_numpy(padded)[None]

    def _pi05_tokens(self, obs: Mapping[str, Any], state: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """π0.5: the text prompt with the normalised state in it (`vla_rt.prompt`), padded to the prompt length."""
        if obs.get("prompt_tokens") is not None:
            if self.discrete_state_input:  # fixed ids would freeze the state the model sees
                raise InputError(
                    "prompt_tokens",
                    "none (a π0.5 policy with discrete_state_input builds its tokens from the text prompt and the "
                    "current state at every call; pass 'prompt' (text) instead, or discrete_state_input=False)",
                    None,
                    found_text="fixed token ids",
                )
            return self._tokens(obs)
        if obs.get("prompt") is None:
            raise InputError(
                "prompt",
                "a text prompt or prompt_tokens (π0.5 needs a text prompt: it reads the state from it, as openpi's "
                "tokenizer writes it)",
                None,
                found_text="neither",
            )
        prompt = check_prompt(obs["prompt"])
        if self.tokenizer is None:
            raise InputError(
                "prompt", "prompt_tokens: a text prompt needs a SentencePiece tokenizer file (tokenizer=...)",
                None, found_text="a text prompt and no tokenizer",
            )  # fmt: skip
        ids = pi05_prompt.prompt_token_ids(self.tokenizer.sp, prompt, state if self.discrete_state_input else None)
        if len(ids) > self.prompt_len:  # openpi cuts it: the state and "Action: " would go, the actions would not
            raise InputError(
                "prompt",
                f"at most {self.prompt_len} tokens with the state written in (the policy's prompt_len; a cut prompt "
                "loses the state's end and 'Action: ')",
                None,
                found_text=f"{len(ids)} tokens",
            )
        tokens, mask = pi05_prompt.pad_tokens(ids, self.prompt_len)
        return torch.from_numpy(tokens)[None], torch.from_numpy(mask)[None]

    def _tokens(self, obs: Mapping[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        check_one_prompt(obs)
        ids, field = obs.get("prompt_tokens"), "prompt_tokens"
        if ids is None and obs.get("prompt") is not None:
            prompt = check_prompt(obs["prompt"])
            if self.tokenizer is None:
                raise InputError(
                    "prompt", "prompt_tokens: a text prompt needs a SentencePiece tokenizer file (tokenizer=...)",
                    None, found_text="a text prompt and no tokenizer",
                )  # fmt: skip
            ids, field = self.tokenizer(prompt), "prompt"
        if ids is None:
            return None, None
        ids = check_prompt_tokens(ids, self.prompt_len, field)
        tokens = np.zeros(self.prompt_len, np.int64)
        tokens[: len(ids)] = ids
        mask = np.arange(self.prompt_len) < len(ids)
        return torch.from_numpy(tokens)[None], torch.from_numpy(mask)[None]

    # ----- inference ----------------------------------------------------------------------------------------------
    def prepare(self, obs: Mapping[str, Any], *, uint8_images: bool = False) -> PreparedObservation:
        """obs (as `infer` takes it) -> the model's inputs for it, batch dim 1. A malformed observation raises
        InputError naming the field before anything runs; what comes out is valid model input.

        `infer` is `prepare` -> model -> `finish`; a server that batches many robots calls the three itself.
        `uint8_images`: the resized views as uint8 pixels (a quarter of the bytes to upload; the stage engine scales
        them on the device with `vla_rt.inputs.images_to_model_range`, the same ops as here).
        """
        obs = check_obs(obs)
        images, image_masks = self._images(obs["images"], uint8_images)
        normalized = self._normalized_state(obs["state"])
        state = self._state(normalized)
        if self.model.config.pi05:
            tokens, token_mask = self._pi05_tokens(obs, normalized)
        else:
            tokens, token_mask = self._tokens(obs)
        vocab = self.model.config.vocab_size
        if tokens is not None and tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
            found = f"ids in [{int(tokens.min())}, {int(tokens.max())}]"  # e.g. a tokenizer larger than the model's
            raise InputError("prompt_tokens", f"ids in [0, {vocab}) (the model's vocabulary)", None,
                             found_text=found)  # fmt: skip
        noise = obs.get("noise")
        if noise is not None:
            noise = torch.from_numpy(check_noise(noise, self.model.chunk, self.model.config.action_dim))[None]
        return PreparedObservation(images, image_masks, state, tokens, token_mask, noise)

    def finish(self, actions: np.ndarray) -> np.ndarray:
        """Model actions (H, A) in the normalized space -> (H, action_dim) float32 in robot units."""
        if self.norm_stats is not None:
            actions = self.norm_stats["actions"].unnormalize(actions, use_quantiles=self._use_quantiles)
        return np.ascontiguousarray(actions[:, : self.action_dim], dtype=np.float32)

    def infer(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        """obs: {"images": {camera: uint8 (H, W, 3)}, "state": (s,), optional "prompt_tokens" or "prompt", "noise"}.

        Returns {"actions": (H, action_dim) float32 in robot units, "timing": {stage: milliseconds}}.
        """
        t0 = time.perf_counter()
        x = self.prepare(obs)
        t1 = time.perf_counter()
        actions = self.model.sample_actions(
            x.images,
            x.state,
            x.tokens,
            x.noise,
            self.num_steps,
            image_masks=x.image_masks,
            token_mask=x.token_mask,
            generator=self._generator,
        )
        actions = actions[0].float().cpu().numpy()  # waits for the device
        t2 = time.perf_counter()
        actions = self.finish(actions)
        t3 = time.perf_counter()
        ms = 1e3
        timing = {
            "preprocess_ms": (t1 - t0) * ms,
            "model_ms": (t2 - t1) * ms,
            "postprocess_ms": (t3 - t2) * ms,
            "total_ms": (t3 - t0) * ms,
        }
        return {"actions": actions, "timing": timing}


def _check_checkpoint_stats(model: Pi0Inference) -> None:
    """The checkpoint's own norm stats, when the caller gave none: an openpi checkpoint with several assets and none
    chosen is refused (ArgumentError 'asset_id'); one with none at all (a base checkpoint, `random:` weights) runs in
    the model's normalised space, said once here, since a controller's actions would silently be in other units."""
    if model.norm_stats is not None:
        return
    if model.norm_stats_assets:
        raise asset_choice_error("asset_id", model.norm_stats_assets, "; or pass norm_stats=")
    log.warning("%s has no norm stats: states go to the model and actions come back unnormalized",
                model.source or "the checkpoint")  # fmt: skip


def _prompt_len(requested: int | None, model: Pi0Inference) -> int:
    """The length prompts are padded to: the model's built one (it takes no other; 0 is a model built without a
    prompt), else the requested one up to the model's max_token_len. Checked here, not at every infer, where the
    model would refuse the padded ids with the padded length as their count."""
    built, limit = model.shapes.prompt_len, model.config.max_token_len
    if built is not None:
        if requested is not None and requested != built:
            raise ArgumentError("prompt_len", f"None or {built} (the model was built for it)", requested)
        return built
    if requested is not None and requested > limit:
        raise ArgumentError(
            "prompt_len", f"at most {limit} (the model's max_token_len; load_pi0(prompt_len=...) builds longer)",
            requested,
        )  # fmt: skip
    return limit if requested is None else requested


def _camera_names(names: object, views: int | None) -> tuple[str, ...]:
    """Distinct non-empty strings (a bare string would become one camera per letter)."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ArgumentError("camera_names", "a list of camera names, e.g. ['base_0_rgb']", names)
    names = tuple(names)
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ArgumentError("camera_names", "distinct non-empty strings", None, found_text=str(list(names)))
    return names
