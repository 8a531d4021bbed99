"""Graph passes: equivalent rewrites of π0's weights for fixed shapes (arXiv:2510.26742 §3.2, §4).

Each pass is a pure function from weights (+ static shapes) to weights, in its own module, composed by
`apply_passes`. The `folded` backend (`vla_rt.engine.folded`) runs the result in the engine's order.
"""

from vla_rt.graph_passes.base import GraphPass, PassContext, PassReport, PassState
from vla_rt.graph_passes.pipeline import (
    PASSES,
    PI05_PASSES,
    apply_passes,
    format_report_table,
    pass_reports,
    passes_for,
    report_rows,
)

__all__ = [
    "GraphPass",
    "PassContext",
    "PassReport",
    "PassState",
    "PASSES",
    "PI05_PASSES",
    "passes_for",
    "apply_passes",
    "format_report_table",
    "pass_reports",
    "report_rows",
]
