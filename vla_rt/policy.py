"""`Pi0Policy`: raw robot observations in, actions in robot units out (openpi's input conventions).

Pre-processing: uint8 images of any size are resized with padding to the model's square size (aspect kept, black
bars, as openpi's `resize_with_pad`) and scaled to [-1, 1]; missing cameras become masked zero views; the state is
normalized with the checkpoint's norm stats and zero-padded to the action dim; prompt token ids are padded to the
built prompt length with a False mask. Post-processing: actions are un-normalized and cropped to the robot's dims.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vla_rt import prompt as pi05_prompt
from vla_rt.checkpoints.norm_stats import load_norm_stats
from vla_rt.inference import Pi0Inference, load_pi0

OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (size, size, 3): bilinear resize keeping aspect, centred on black (openpi's rule)."""
    h, w = image.shape[:2]
    if (h, w) == (size, size):
        return image
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = np.asarray(Image.fromarray(image).resize((rw, rh), resample=Image.BILINEAR))
    out = np.zeros((size, size, 3), dtype=np.uint8)
    top, left = max(0, int((size - rh) / 2)), max(0, int((size - rw) / 2))
    out[top : top + rh, left : left + rw] = resized
    return out


@dataclass
class PreparedObservation:
    """One observation in the model's normalized space, batch dim 1 (the arguments of `sample_actions`)."""

    images: torch.Tensor  # (1, V, S, S, 3) float32 in [-1, 1]
    image_masks: torch.Tensor  # (1, V) bool, False for a missing camera (a zero view)
    state: torch.Tensor  # (1, A) float32, normalized and zero-padded to the action dim
    tokens: torch.Tensor | None  # (1, P) int64 prompt ids padded to the built prompt length, or None
    token_mask: torch.Tensor | None  # (1, P) bool, True for the real ids
    noise: torch.Tensor | None  # (1, H, A) float32 given by the caller, or None (drawn at sampling)


class SentencePieceTokenizer:
    """PaliGemma prompt tokenization as openpi does it (BOS + cleaned prompt + '\\n'); needs a user's .model file."""

    def __init__(self, model_path: str):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model_path))

    def __call__(self, prompt: str) -> np.ndarray:
        return np.asarray(pi05_prompt.prompt_token_ids(self.sp, prompt, None), dtype=np.int64)


class Pi0Policy:
    """A π0 model plus the transforms between a robot's raw observation and the model's normalized space."""

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
        self.model = model
        views = model.shapes.num_views or 3
        self.camera_names = tuple(camera_names) if camera_names is not None else OPENPI_CAMERAS[:views]
        if model.shapes.num_views is not None and len(self.camera_names) != model.shapes.num_views:
            raise ValueError(
                f"camera_names: expected {model.shapes.num_views} names (the model's views), "
                f"found {len(self.camera_names)}: {self.camera_names}"
            )
        if isinstance(norm_stats, (str, Path)):
            norm_stats = load_norm_stats(norm_stats)
        self.norm_stats = norm_stats if norm_stats is not None else model.norm_stats
        pi05 = model.config.pi05
        if norm_mode is None:  # the checkpoint's recorded mode, else openpi's default (π0 z-score, π0.5 quantiles)
            quantiles = model.use_quantile_norm if model.use_quantile_norm is not None else pi05
            norm_mode = "quantile" if quantiles else "zscore"
        if norm_mode not in ("zscore", "quantile"):
            raise ValueError(f"norm_mode: expected 'zscore' or 'quantile', found {norm_mode!r}")
        self._use_quantiles = norm_mode == "quantile"
        self.action_dim = action_dim
        self.num_steps = num_steps
        self.prompt_len = prompt_len or model.shapes.prompt_len or model.config.max_token_len
        self.tokenizer = SentencePieceTokenizer(tokenizer) if tokenizer else None
        # π0.5 reads the state from the prompt (openpi's `discrete_state_input`, True by default for π0.5; configs
        # such as pi05_libero set it False and the state is not used at all). π0 takes the state as a token.
        if discrete_state_input and not pi05:
            raise ValueError("discrete_state_input: π0 takes the state as its own token; True is for π0.5 only")
        self.discrete_state_input = pi05 if discrete_state_input is None else discrete_state_input
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
        **policy_kwargs: Any,
    ) -> Pi0Policy:
        """Loads the checkpoint (any format `load_pi0` reads) and wraps it. Defaults: CUDA + bf16 when available."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        camera_names = policy_kwargs.get("camera_names")
        if num_views is None and camera_names is not None:
            num_views = len(camera_names)
        model = load_pi0(
            path, backend=backend, device=device, dtype=dtype, num_views=num_views, chunk=chunk, prompt_len=prompt_len
        )
        return cls(model, prompt_len=prompt_len, **policy_kwargs)

    # ----- pre-processing -------------------------------------------------------------------------------------------
    def _images(self, images: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(images, Mapping):
            images = dict(zip(self.camera_names, images))
        unknown = set(images) - set(self.camera_names)
        if unknown:
            raise ValueError(f"images: expected camera names from {self.camera_names}, found unknown {sorted(unknown)}")
        size = self.model.config.vision.image_size
        views, mask = [], []
        for name in self.camera_names:
            img = images.get(name)
            if img is None:
                views.append(np.zeros((size, size, 3), np.uint8))
                mask.append(False)
                continue
            img = np.asarray(img)
            if img.dtype != np.uint8:
                raise ValueError(f"images[{name!r}]: expected dtype uint8 (0..255), found {img.dtype}")
            if img.ndim != 3 or img.shape[2] != 3 or min(img.shape[:2]) < 1:
                raise ValueError(f"images[{name!r}]: expected shape (H, W, 3) RGB, found {img.shape}")
            views.append(resize_with_pad(img, size))
            mask.append(True)
        if not any(mask):
            raise ValueError(f"images: expected at least one of {self.camera_names}, found none")
        batch = torch.from_numpy(np.stack(views)[None]).float() / 255.0 * 2.0 - 1.0
        return batch, torch.tensor([mask])

    def _normalized_state(self, state: Any) -> np.ndarray:
        """(s,) float64: checked, normalised with the checkpoint's stats, unpadded."""
        a = self.model.config.action_dim
        x = np.asarray(state, dtype=np.float64)
        if x.ndim != 1 or x.shape[0] > a:
            raise ValueError(f"state: expected a 1-D vector of at most {a} values, found shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError(
                f"state: expected finite values, found NaN or inf at index {np.flatnonzero(~np.isfinite(x)).tolist()}"
            )
        if self.norm_stats is not None and "state" in self.norm_stats:
            x = self.norm_stats["state"].normalize(x, use_quantiles=self._use_quantiles)
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
                raise ValueError(
                    "prompt_tokens: a π0.5 policy with discrete_state_input builds its tokens from the text prompt "
                    "and the current state at every call; pass 'prompt' (text) instead, or discrete_state_input=False"
                )
            return self._tokens(obs)
        if obs.get("prompt") is None:
            raise ValueError(
                "prompt: π0.5 needs a text prompt (it reads the state from it, as openpi's tokenizer writes it) or "
                "prompt_tokens; found neither"
            )
        if self.tokenizer is None:
            raise ValueError("prompt: a text prompt needs a SentencePiece tokenizer file (tokenizer=...)")
        tokens, mask = pi05_prompt.tokenize(
            self.tokenizer.sp, obs["prompt"], state if self.discrete_state_input else None, self.prompt_len
        )
        return torch.from_numpy(tokens)[None], torch.from_numpy(mask)[None]

    def _tokens(self, obs: Mapping[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ids = obs.get("prompt_tokens")
        if ids is None and obs.get("prompt") is not None:
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a SentencePiece tokenizer file (tokenizer=...)")
            ids = self.tokenizer(obs["prompt"])
        if ids is None:
            return None, None
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_tokens: expected a 1-D array of integer token ids, found {ids.dtype} {ids.shape}")
        if len(ids) > self.prompt_len:
            raise ValueError(f"prompt_tokens: expected at most {self.prompt_len} tokens, found {len(ids)}")
        tokens = np.zeros(self.prompt_len, np.int64)
        tokens[: len(ids)] = ids
        mask = np.arange(self.prompt_len) < len(ids)
        return torch.from_numpy(tokens)[None], torch.from_numpy(mask)[None]

    # ----- inference ----------------------------------------------------------------------------------------------
    def prepare(self, obs: Mapping[str, Any]) -> PreparedObservation:
        """obs (as `infer` takes it) -> the model's inputs for it, batch dim 1. Raises ValueError on bad input.

        `infer` is `prepare` -> model -> `finish`; a server that batches many robots calls the three itself.
        """
        if "images" not in obs or "state" not in obs:
            raise ValueError(f"obs: expected keys 'images' and 'state', found {sorted(obs)}")
        images, image_masks = self._images(obs["images"])
        normalized = self._normalized_state(obs["state"])
        state = self._state(normalized)
        if self.model.config.pi05:
            tokens, token_mask = self._pi05_tokens(obs, normalized)
        else:
            tokens, token_mask = self._tokens(obs)
        noise = obs.get("noise")
        if noise is not None:
            noise = torch.as_tensor(np.asarray(noise, np.float32))[None]
        return PreparedObservation(images, image_masks, state, tokens, token_mask, noise)

    def finish(self, actions: np.ndarray) -> np.ndarray:
        """Model actions (H, A) in the normalized space -> (H, action_dim) float32 in robot units."""
        if self.norm_stats is not None and "actions" in self.norm_stats:
            actions = self.norm_stats["actions"].unnormalize(actions, use_quantiles=self._use_quantiles)
        dim = self.action_dim or actions.shape[-1]
        return np.ascontiguousarray(actions[:, :dim], dtype=np.float32)

    def infer(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        """obs: {"images": {camera: uint8 (H, W, 3)}, "state": (s,), optional "prompt_tokens" or "prompt"}.

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
