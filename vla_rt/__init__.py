"""vla-rt: π0 at the hardware limit, in a real-time robot loop.

The public API is small on purpose:

- `load_pi0(path, backend=..., device=..., dtype=..., num_views=..., chunk=..., prompt_len=...)` → a model whose
  `sample_actions(images, state, tokens=None, noise=None, num_steps=10)` maps normalized inputs to actions;
  `path` is an openpi checkpoint, a LeRobot π0 dir, a native `.safetensors` or `"random:<preset>[:seed]"`.
- `Pi0Policy.from_pretrained(path, ...)` and `policy.infer(obs)`: raw robot observations in, robot-unit actions out.
- `Pi0Config` / `preset(name)`: model dimensions (`pi0`, `tiny`, `dummy`).
"""

from vla_rt.config import Pi0Config, preset
from vla_rt.inference import Pi0Inference, build_pi0, load_pi0
from vla_rt.policy import Pi0Policy

__all__ = ["Pi0Config", "Pi0Inference", "Pi0Policy", "build_pi0", "load_pi0", "preset"]
__version__ = "0.1.0"
