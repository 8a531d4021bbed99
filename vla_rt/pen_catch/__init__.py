"""The pen-catch task (arXiv 2510.26742): collect expert demonstrations in the simulated rig, train π0 on them,
and evaluate the trained policy live in the runtime threads, in simulation or on the real rig.

Modules: collect (demonstration dataset), samples (training samples and batches), train (the recipe), evaluate
(simulated trials and their summary), hardware (operator-paced trials on the rig), plot (reaction timelines). The
hydra entry points in experiments/ read the config and call these; docs/pen_catch.md has the choices and results.
"""


class PenCatchSetupError(RuntimeError):
    """What a run needs is absent or inconsistent (no checkpoint, no sidecar, no dataset, no rig); the message says
    what and how to make it. The entry points turn it into a one-line exit."""
