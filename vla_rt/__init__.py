"""vla-rt: π0 at the hardware limit, in a real-time robot loop."""

from vla_rt.config import Pi0Config, preset

__all__ = ["Pi0Config", "preset"]
__version__ = "0.1.0"
