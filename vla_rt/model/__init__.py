"""The eager π0 reference (the spec in code) and its canonical weight layout."""

from vla_rt.model.pi0 import Pi0Model, make_attn_mask, posemb_sincos
from vla_rt.model.weights import (
    CheckpointError,
    infer_config,
    is_pi05,
    param_shapes,
    random_weights,
    validate_weights,
)

__all__ = [
    "Pi0Model",
    "make_attn_mask",
    "posemb_sincos",
    "CheckpointError",
    "infer_config",
    "is_pi05",
    "param_shapes",
    "random_weights",
    "validate_weights",
]
