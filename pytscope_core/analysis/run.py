"""One pass of analysis over a run: every statistic the rules and the summary need, computed once.

`analyze` is the only place that touches the big (steps x ranks) arrays; rules and the summary read the
small frozen dataclasses it returns, so diagnosing and summarising a run costs one pass, not two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..arrays import RunArrays, step_segments
from ..context import RunContext
from ..records import COL
from .convergence import Convergence, LossHistory, convergence
from .data import DuplicateShards, duplicate_shards
from .distributed import DistributedTiming, JoinWait, distributed_timing, join_waits, with_placement
from .efficiency import Efficiency, efficiency, unrecorded_steps
from .memory import MemoryStats, memory_stats
from .timing import StepTiming, launch_sizes, phase_ms_per_step, statistics_steps, step_timing, step_wall_ms


@dataclass(frozen=True)
class RankEnd:
    """A rank whose records stop before the run's last step, or that wrote its own rows, and why."""

    rank: int
    last_step: int | None  # its last recorded step (None: no record at all)
    reason: str


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
    duplicates: DuplicateShards
    rank_ends: tuple[RankEnd, ...] = ()
    unrecorded: tuple[tuple[int, int], ...] = ()  # step ranges a killed launch ran and never wrote
    join_waits: tuple[JoinWait, ...] = ()  # ranks out of batches inside torch's Join (uneven inputs)
    # The last step each launch (segment) recorded, replayed steps included; only where the run holds hang
    # reports (a hang a launch ended is not one the run went on past: `rules._gone_past`).
    launch_last_steps: Mapping[int, int] = field(default_factory=dict)


def analyze(arrays: RunArrays, ctx: RunContext, loss_history: LossHistory | None = None) -> RunAnalysis:
    """`loss_history`: the whole run's loss, where `arrays` holds only its latest steps (live diagnosis)."""
    sel = statistics_steps(arrays)
    wall = step_wall_ms(arrays)
    sizes = {s.index: s.world_size for s in ctx.segments}
    launch_size = launch_sizes(arrays.segment, sizes) if len(set(sizes.values())) > 1 else None
    hang_steps = [int(s) for h in ctx.hang_reports for s in h.get("steps", ())]
    timing = step_timing(arrays, wall, phase_ms_per_step(arrays), launch_size, hang_steps)
    dist = distributed_timing(arrays, sel, ctx.comm_measured, ctx.parallelism, ctx.records_lost, ctx.joins)
    dist = with_placement(dist, ctx.placement)  # hosts and local ranks, for the report's per-rank table
    eff = efficiency(arrays, ctx, timing, dist, wall, sel)
    return RunAnalysis(
        ctx=ctx,
        world_size=max(
            arrays.world_size, ctx.world_size
        ),  # (a rank killed before its first gather has no row)
        steps=arrays.n_steps,
        first_step=int(arrays.steps[0]) if arrays.n_steps else None,
        last_step=int(arrays.steps[-1]) if arrays.n_steps else None,
        timing=timing,
        distributed=dist,
        convergence=convergence(arrays, sel, ctx.first_nonfinite, loss_history),
        efficiency=eff,
        unrecorded=unrecorded_steps(eff.goodput.segments, arrays.steps),
        memory=memory_stats(arrays, ctx, sel),
        duplicates=duplicate_shards(arrays),
        rank_ends=rank_ends(arrays, ctx),
        join_waits=join_waits(arrays, ctx.joins, wall),
        launch_last_steps=launch_last_steps(arrays) if ctx.hang_reports else {},
    )


def launch_last_steps(arrays: RunArrays) -> dict[int, int]:
    """{segment: its last recorded step}, from the rows kept and those a resume superseded."""
    seg = step_segments(arrays.segment)
    known = np.isfinite(seg)
    pairs = [(seg[known], np.asarray(arrays.steps)[known])]
    if arrays.replayed.size:
        pairs.append((arrays.replayed[:, COL["segment"]], arrays.replayed[:, COL["step"]]))
    out: dict[int, int] = {}
    for segments, steps in pairs:
        for value in np.unique(segments):
            last = int(steps[segments == value].max())
            out[int(value)] = max(out.get(int(value), last), last)
    return out


JOINED_EARLY = "it ran out of batches and waited inside join() while the others trained on (uneven inputs)"
NEVER_GATHERED = "its last steps were never gathered (killed?)"
NO_RECORDS = "none gathered nor written by it (killed before its first gather?)"
KILLED = (NEVER_GATHERED, NO_RECORDS)
"""The reasons of a rank whose records end with nothing said by the rank itself: its process died at once."""


def rank_ends(arrays: RunArrays, ctx: RunContext) -> tuple[RankEnd, ...]:
    """Which ranks' records end early, where, and the likeliest reason: what the rank itself said when it
    wrote its own rows (a hang, SIGTERM, an exception), else the run's hang report, a disabled scope, or a
    rank whose last steps were never gathered (killed)."""
    if arrays.n_steps == 0:
        return ()
    present = np.isfinite(arrays.wall_ms)
    has_any = present.any(axis=0)
    last_index = present.shape[0] - 1 - present[::-1].argmax(axis=0)
    notes = dict(ctx.rank_notes)
    early_or_noted = ~has_any | (last_index < arrays.n_steps - 1) | np.isin(arrays.ranks, list(notes))
    out = []
    for i in np.flatnonzero(early_or_noted).tolist():  # not a Python loop over 16k healthy ranks
        rank = int(arrays.ranks[i])
        last = int(arrays.steps[last_index[i]]) if has_any[i] else None
        early = last is None or last_index[i] < arrays.n_steps - 1
        if not early and rank not in notes:
            continue
        ended_in = arrays.segment[last_index[i], i] if has_any[i] else -1  # the segment of its last record
        later = [seg for seg in ctx.segments if seg.index > ended_in and seg.world_size <= rank]
        if rank in notes:
            reason = notes[rank]
        elif (rank, last) in ctx.joins:
            reason = JOINED_EARLY
        elif later:  # an elastic restart with fewer ranks
            reason = (
                f"the job resumed from step {later[0].resumed_from_step} with {later[0].world_size} rank(s)"
            )
        elif ctx.hang_reports:
            reason = "hang"
        elif ctx.scope_disabled:
            reason = "scope disabled"
        elif _took_fewer_steps(ctx, rank):
            reason = "it took fewer optimizer steps than other ranks (DIST.DESYNC)"
        else:
            reason = NEVER_GATHERED
        out.append(RankEnd(rank, last, reason))
    out += [  # ranks of the run without a single record: gone before their first gather and their own file
        RankEnd(
            r,
            None,
            dict(ctx.rank_notes).get(
                r,
                JOINED_EARLY if any(rank == r for rank, _ in ctx.joins) else NO_RECORDS,
            ),
        )
        for r in sorted(set(range(ctx.world_size)) - set(arrays.ranks.tolist()))
    ]
    return tuple(out)


def _took_fewer_steps(ctx: RunContext, rank: int) -> bool:
    """Whether a gather saw this rank count fewer optimizer steps than another rank."""
    for check in ctx.counts_checks:
        steps = check.compared("steps")
        if rank < len(steps) and steps[rank] < max((s for s in steps if s == s), default=steps[rank]):
            return True
    return False
