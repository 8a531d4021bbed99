"""LeRobot policy plugin: `--policy.type=vla_rt` runs π0 / π0.5 checkpoints on vla-rt's engines.

LeRobot's entry points (lerobot-eval, -record, -rollout, -train) import every installed distribution whose name
starts with `lerobot_policy_`; importing this package registers `VlaRtConfig` under "vla_rt", and LeRobot's factory
finds `VlaRtPolicy` and `make_vla_rt_pre_post_processors` beside it by naming convention.
"""

from .configuration_vla_rt import VlaRtConfig
from .modeling_vla_rt import VlaRtPolicy
from .processor_vla_rt import make_vla_rt_pre_post_processors

__all__ = ["VlaRtConfig", "VlaRtPolicy", "make_vla_rt_pre_post_processors"]
