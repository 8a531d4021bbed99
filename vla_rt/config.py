"""Model dimensions of π0 / π0.5 and their named presets.

Every dimension here can be recovered from a checkpoint's tensor shapes (see `vla_rt.model.weights.infer_config`),
so a checkpoint never needs a config file to load; so can `pi05` (π0.5 has `time_mlp_in` and adaptive-norm Dense
weights where π0 has `state_proj` and RMSNorm scales). The presets exist for random-weight models (`random:pi0`,
`random:tiny`, `random:pi05`, `random:tiny_pi05`) used by tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP ViT image encoder (So400m/14 for π0)."""

    width: int = 1152
    depth: int = 27
    mlp_dim: int = 4304
    num_heads: int = 16
    patch_size: int = 14
    image_size: int = 224

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Tokens per camera view (256 for π0)."""
        return self.grid * self.grid


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma 'expert' (the 2B prefix LM or the 300M action expert)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256


@dataclass(frozen=True)
class Pi0Config:
    """All dimensions of a π0 or π0.5 model.

    `chunk` (the action horizon H) and `max_token_len` are not weight shapes: they are defaults for building
    a model and can be overridden per `load_pi0` call. `pi05` selects openpi's `Pi0Config(pi05=True)` model: no
    state token (the state is text in the prompt), a time MLP feeding adaptive RMSNorms in the action expert, gated
    residuals; openpi's default prompt length for it is 200 tokens (`PI05_MAX_TOKEN_LEN`).
    """

    vision: VisionConfig = field(default_factory=VisionConfig)
    llm: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=2048, depth=18, mlp_dim=16384))
    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=1024, depth=18, mlp_dim=4096))
    vocab_size: int = 257_152
    action_dim: int = 32
    chunk: int = 50
    max_token_len: int = 48
    rms_eps: float = 1e-6
    layernorm_eps: float = 1e-6
    pi05: bool = False

    @property
    def model_name(self) -> str:
        """'π0.5' or 'π0', for messages and `vla-rt info`."""
        return "π0.5" if self.pi05 else "π0"

    def __post_init__(self) -> None:
        if self.llm.depth != self.expert.depth:
            raise ValueError(f"llm depth {self.llm.depth} != expert depth {self.expert.depth}: experts share layers")
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            a, b = getattr(self.llm, name), getattr(self.expert, name)
            if a != b:
                raise ValueError(f"llm.{name}={a} != expert.{name}={b}: the two experts attend jointly")
        if self.llm.num_heads % self.llm.num_kv_heads:
            raise ValueError(f"num_heads {self.llm.num_heads} not a multiple of num_kv_heads {self.llm.num_kv_heads}")
        if self.vision.width % self.vision.num_heads:
            raise ValueError(f"vision width {self.vision.width} not divisible by {self.vision.num_heads} heads")
        if self.llm.head_dim % 2:
            raise ValueError(f"head_dim {self.llm.head_dim} must be even for RoPE")

    def replace(self, **changes) -> Pi0Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Pi0Config:
        d = dict(d)
        d["vision"] = VisionConfig(**d["vision"])
        d["llm"] = GemmaConfig(**d["llm"])
        d["expert"] = GemmaConfig(**d["expert"])
        return cls(**d)


def _tiny() -> Pi0Config:
    """Small dims with π0's structure (8 query heads, 1 KV head, expert narrower than the LLM, 224px images)."""
    return Pi0Config(
        vision=VisionConfig(width=64, depth=2, mlp_dim=128, num_heads=4, patch_size=14, image_size=224),
        llm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
        expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16),
        vocab_size=1024,
        action_dim=32,
        chunk=50,
        max_token_len=48,
    )


def _dummy() -> Pi0Config:
    """openpi's `dummy` Gemma variant for both experts, with the real So400m/14 vision tower."""
    g = GemmaConfig(width=64, depth=4, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16)
    return Pi0Config(llm=g, expert=g)


# openpi's `Pi0Config.__post_init__`: max_token_len defaults to 200 for π0.5 (the state is part of the prompt).
PI05_MAX_TOKEN_LEN = 200


def _pi05() -> Pi0Config:
    """The released π0.5 (`pi05_base`, `pi05_droid`, ...): π0's dims, π0.5's structure."""
    return Pi0Config(pi05=True, max_token_len=PI05_MAX_TOKEN_LEN)


def _tiny_pi05() -> Pi0Config:
    """`tiny`'s dims with π0.5's structure (tests)."""
    return _tiny().replace(pi05=True, max_token_len=PI05_MAX_TOKEN_LEN)


PRESETS = {
    "pi0": Pi0Config,
    "tiny": _tiny,
    "dummy": _dummy,
    "pi05": _pi05,
    "tiny_pi05": _tiny_pi05,
}


def preset(name: str) -> Pi0Config:
    """The named preset: `pi0` / `pi05` (the released models), `tiny` / `tiny_pi05` (tests), `dummy` (openpi's)."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}") from None
