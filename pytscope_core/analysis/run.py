"""One pass of analysis over a run: every statistic the rules and the summary need, computed once.

`analyze` is the only place that touches the big (steps x ranks) arrays; rules and the summary read the
small frozen dataclasses it returns, so diagnosing and summarising a run costs one pass, not two.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arrays import RunArrays
from ..context import RunContext
from .convergence import Convergence, convergence
from .distributed import DistributedTiming, distributed_timing
from .efficiency import Efficiency, efficiency
from .memory import MemoryStats, memory_stats
from .timing import StepTiming, phase_ms_per_step, statistics_steps, step_timing, step_wall_ms


@dataclass(frozen=True)
class RunAnalysis:
    ctx: RunContext
    world_size: int
    steps: int  # steps recorded (first to last step index present)
    first_step: int | None
    last_step: int | None
    timing: StepTiming
    distributed: DistributedTiming
    convergence: Convergence
    efficiency: Efficiency
    memory: MemoryStats


def analyze(arrays: RunArrays, ctx: RunContext) -> RunAnalysis:
    sel = statistics_steps(arrays)
    wall = step_wall_ms(arrays)
    timing = step_timing(arrays, wall, phase_ms_per_step(arrays))
    dist = distributed_timing(arrays, sel)
    return RunAnalysis(
        ctx=ctx,
        world_size=arrays.world_size or ctx.world_size,
        steps=arrays.n_steps,
        first_step=int(arrays.steps[0]) if arrays.n_steps else None,
        last_step=int(arrays.steps[-1]) if arrays.n_steps else None,
        timing=timing,
        distributed=dist,
        convergence=convergence(arrays, sel),
        efficiency=efficiency(arrays, ctx, timing, dist, wall, sel),
        memory=memory_stats(arrays, ctx, sel),
    )
