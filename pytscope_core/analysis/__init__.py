"""Analysis of a run's dense step arrays: pure functions from `RunArrays` + `RunContext` to dataclasses.

`analyze` computes every statistic once (timing, distributed, convergence, efficiency, memory); `diagnose`
runs the registered finding rules over it. Nothing here reads files, imports torch, or mutates its inputs.
"""

from __future__ import annotations

from ..arrays import RunArrays
from ..context import RunContext
from ..findings import Finding
from .rules import RULES, rule, run_rules
from .run import RunAnalysis, analyze


def diagnose(arrays: RunArrays, ctx: RunContext, *, strict: bool = False) -> list[Finding]:
    """Every finding for the run, HIGH first. `strict` re-raises a failing rule instead of reporting it."""
    return run_rules(analyze(arrays, ctx), strict=strict)


__all__ = ["RULES", "RunAnalysis", "analyze", "diagnose", "rule", "run_rules"]
