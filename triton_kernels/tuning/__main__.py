"""`python -m vla_rt.triton_kernels.tuning` = `vla-rt tune` (the tuner's command line)."""

import sys

from vla_rt.triton_kernels.tuning.run import main

sys.exit(main())
