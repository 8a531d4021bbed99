"""vla-rt: π0 at the hardware limit, in a real-time robot loop.

The public API is small on purpose:

- `load_pi0(path, backend=..., device=..., dtype=..., num_views=..., chunk=..., prompt_len=...)` → a model whose
  `sample_actions(images, state, tokens=None, noise=None, num_steps=10)` maps normalized inputs to actions;
  `path` is an openpi checkpoint, a LeRobot π0 dir, a native `.safetensors` or `"random:<preset>[:seed]"`.
- `Pi0Policy.from_pretrained(path, ...)` and `policy.infer(obs)`: raw robot observations in, robot-unit actions out.
- `Pi0Config` / `preset(name)`: model dimensions (`pi0`, `tiny`, `dummy`).
"""

import os as _os


def _map_checkout_folders() -> None:
    """In a source checkout, let `vla_rt.triton_kernels`, `vla_rt.graph_passes` and `vla_rt.robot` resolve to the
    root folders even when no installer mapped them (old setuptools' editable mode, or PYTHONPATH=. on a GPU box).
    Installed wheels carry them inside `vla_rt/` and never reach this."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    pyproject = _os.path.join(root, "pyproject.toml")
    if not _os.path.isfile(pyproject) or 'name = "vla-rt"' not in open(pyproject, encoding="utf-8").read():
        return
    if all(_os.path.isdir(_os.path.join(root, n)) for n in ("triton_kernels", "graph_passes", "robot")):
        __path__.append(root)  # noqa: F821  (the package's own search path)


_map_checkout_folders()

from vla_rt.config import Pi0Config, preset  # noqa: E402
from vla_rt.inference import Pi0Inference, build_pi0, load_pi0  # noqa: E402
from vla_rt.policy import Pi0Policy  # noqa: E402

__all__ = ["Pi0Config", "Pi0Inference", "Pi0Policy", "build_pi0", "load_pi0", "preset"]
__version__ = "0.1.0"
