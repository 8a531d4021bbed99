"""Test-session setup shared by every test module.

Without CUDA, Triton kernels run in Triton's interpreter, and Triton fixes interpreter-vs-compiler mode when it is
first imported; torch itself may import Triton early (e.g. for its own bmm kernels), so the switch must be set
before any test imports torch.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
