"""The run summary: one frozen tree with everything a report shows, and its plain-JSON form.

`summarize` runs the analysis once and the rules over it; `Summary.to_dict` is what `pytscope report --json`
prints. Non-finite numbers become None there, so `json.dumps(..., allow_nan=False)` always works.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .analysis.convergence import Convergence
from .analysis.data import DuplicateShards
from .analysis.distributed import DistributedTiming
from .analysis.efficiency import Efficiency
from .analysis.memory import MemoryStats
from .analysis.rules import run_rules, stopped_note
from .analysis.run import RankEnd, RunAnalysis, analyze
from .analysis.timing import StepTiming, few_steps_note
from .arrays import RunArrays
from .context import RunContext
from .findings import Finding, with_predicted
from .parallelism import comm_note


@dataclass(frozen=True)
class RunInfo:
    world_size: int
    steps: int
    first_step: int | None
    last_step: int | None
    device: str
    restarts: int  # segments - 1: each resume from a checkpoint starts a new segment
    rank_ends: tuple[RankEnd, ...] = ()  # ranks whose records end early, and why
    parallelism: str | None = None  # what the model was wrapped in: ddp, fsdp2, fsdp1, deepspeed ...
    comm_measured: bool = True  # False: communication hides in compute (see `comm_note`)
    ended: bool = True  # False: no end-of-run summary was written (killed, or still running)
    unrecorded: tuple[tuple[int, int], ...] = ()  # step ranges a killed launch ran and never wrote

    @property
    def comm_note(self) -> str | None:
        return comm_note(self.parallelism, self.comm_measured)


@dataclass(frozen=True)
class Summary:
    run: RunInfo
    timing: StepTiming
    distributed: DistributedTiming
    convergence: Convergence
    efficiency: Efficiency
    memory: MemoryStats
    duplicates: DuplicateShards
    findings: tuple[Finding, ...]
    scope_errors: tuple[str, ...]
    scope_notes: tuple[str, ...] = ()  # what the scope could not measure, or why it ended early (RunContext)

    def to_dict(self) -> dict[str, Any]:
        g = self.efficiency.goodput
        d = self.distributed
        c = self.convergence
        m = self.memory
        out = {
            "run": {
                "world_size": self.run.world_size,
                "steps": self.run.steps,
                "first_step": self.run.first_step,
                "last_step": self.run.last_step,
                "unrecorded_steps": [list(r) for r in self.run.unrecorded],
                "device": self.run.device,
                "restarts": self.run.restarts,
                "ended": self.run.ended,
                "parallelism": self.run.parallelism,
                "comm_measured": self.run.comm_measured,
                "comm_note": self.run.comm_note,
                "rank_ends": [
                    {"rank": e.rank, "last_step": e.last_step, "reason": e.reason} for e in self.run.rank_ends
                ],
                "segments": [
                    {
                        "index": s.index,
                        "started_s": s.started_s,
                        "ended_s": s.ended_s,
                        "first_step": s.first_step,
                        "last_step": s.last_step,
                        "steps": s.steps,
                        "resumed_from_step": s.resumed_from_step,
                        "world_size": s.world_size,
                    }
                    for s in g.segments
                ],
                "goodput": {
                    "goodput": g.goodput,
                    "elapsed_s": g.elapsed_s,
                    "productive_s": g.productive_s,
                    "downtime_s": g.downtime_s,
                    "replayed_s": g.replayed_s,
                    "warmup_s": g.warmup_s,
                    "excluded_s": g.excluded_s,
                    "hang_s": g.hang_s,
                    "unaccounted_s": g.unaccounted_s,
                },
            },
            "timing": {
                "steps_counted": self.timing.steps_counted,
                "note": few_steps_note(self.timing.steps_counted),
                "median_ms": self.timing.median_ms,
                "p95_ms": self.timing.p95_ms,
                "mean_ms": self.timing.mean_ms,
                "phases": {
                    p.name: {"share": p.share, "median_ms": p.median_ms}
                    if p.name != "comm" or self.run.comm_measured
                    else {"share": None, "median_ms": None, "measured": False}
                    for p in self.timing.phases
                },
                "stalls": [
                    {
                        "step": x.step,
                        "wall_ms": x.wall_ms,
                        "rank": x.rank,
                        "phase": x.phase,
                        "phase_ms": x.phase_ms,
                    }
                    for x in self.timing.stalls
                ],
                "stall_share": self.timing.stall_share,
            },
            "distributed": {
                "per_rank": [
                    {
                        "rank": r.rank,
                        "local_ms": r.local_ms,
                        "comm_ms": r.comm_ms,
                        "sync_wait_ms": r.sync_wait_ms,
                        "data_ms": r.data_ms,
                        "data_mean_ms": r.data_mean_ms,
                        "critical_share": r.critical_share,
                        "excess": r.excess,
                        "slower_share": r.slower_share,
                        "straggler": r.straggler,
                        "host": d.hosts[i] if d.hosts else None,
                        "local_rank": d.local_ranks[i] if d.local_ranks else None,
                    }
                    for i, r in enumerate(d.per_rank)
                ],
                "stragglers": list(d.effective.stragglers),
                # A straggler that began late and still is one, from `since` on; one that stopped at `until`
                # (and began at `since`, where it began late too); `stragglers` names it too.
                "late": _span(d.late),
                "ended": _span(d.ended),
                "intermittent": _fields(d.intermittent),
                "transfer_ms": d.transfer_ms,
                "transfer_share": d.transfer_share,
                "sync_wait_share": d.sync_wait_share,
                "lost_to_imbalance": d.lost_to_imbalance,
                "lost_ms_per_step": d.lost_ms_per_step,
                "split_is_estimate": d.split_is_estimate,
                "comm_measured": d.comm_measured,
                "note": d.note,
            },
            "convergence": {
                "trend": c.trend.trend,
                "trend_t": c.trend.t,
                "relative_change": c.trend.relative_change,
                "first_loss": c.first_loss,
                "last_loss": c.last_loss,
                "nonfinite_step": c.nonfinite_step,
                "nonfinite_ranks": list(c.nonfinite_ranks),
                "spikes": [
                    {"step": s.step, "loss": s.loss, "baseline": s.baseline, "ranks": list(s.ranks)}
                    for s in c.spikes
                ],
                "plateau": _fields(c.plateau),
                "rise": _fields(c.rise),
                "skipped_steps": _fields(c.skipped),
            },
            "efficiency": {
                "budget": [
                    {
                        "name": x.name,
                        "share": x.share,
                        "ms_per_step": x.ms_per_step,
                        "recoverable": x.recoverable,
                        "measured": x.measured,
                    }
                    for x in self.efficiency.budget
                ],
                "recoverable_share": self.efficiency.recoverable_share,
                "mfu": self.efficiency.mfu,
            },
            "data": {
                "steps_checked": self.duplicates.steps_checked,
                "duplicated_share": self.duplicates.duplicated_share,
                "identical_batch_groups": [list(g) for g in self.duplicates.groups],
            },
            "memory": {
                "peak_bytes": m.peak_bytes,
                "peak_rank": m.peak_rank,
                "growth_bytes": m.growth_bytes,
                "largest_rise_share": m.largest_rise_share,
                "limit_bytes": m.limit_bytes,
                "peak_fraction": m.peak_fraction,
            },
            "findings": [f.to_dict() for f in self.findings],
            "scope": {"errors": list(self.scope_errors), "notes": list(self.scope_notes)},
        }
        return _plain(out)


def summarize(
    arrays: RunArrays, ctx: RunContext, extra_findings: tuple[Finding, ...] | list[Finding] = ()
) -> Summary:
    """Analyse the run once, diagnose it, and add findings made elsewhere (e.g. DATA.UNEVEN_SHARDS)."""
    analysis = analyze(arrays, ctx)
    return summary_of(analysis, with_predicted(run_rules(analysis), extra_findings))


def summary_of(analysis: RunAnalysis, findings: list[Finding]) -> Summary:
    """The summary of an analysis already made and diagnosed (live diagnosis analyses once per gather)."""
    ctx = analysis.ctx
    findings = sorted(findings, key=lambda f: (-int(f.severity), f.code, f.ranks))
    return Summary(
        run=RunInfo(
            world_size=analysis.world_size,
            steps=analysis.steps,
            first_step=analysis.first_step,
            last_step=analysis.last_step,
            device=ctx.device,
            restarts=max(len(analysis.efficiency.goodput.segments) - 1, 0),
            rank_ends=analysis.rank_ends,
            parallelism=ctx.parallelism,
            comm_measured=ctx.comm_measured,
            ended=ctx.ended,
            unrecorded=analysis.unrecorded,
        ),
        timing=analysis.timing,
        distributed=analysis.distributed,
        convergence=analysis.convergence,
        efficiency=analysis.efficiency,
        memory=analysis.memory,
        duplicates=analysis.duplicates,
        findings=tuple(findings),
        scope_errors=tuple(ctx.scope_errors),
        scope_notes=tuple(stopped_note(analysis, note) for note in ctx.scope_notes),
    )


def _span(d: DistributedTiming | None) -> dict[str, Any] | None:
    """A straggler's span (`DistributedTiming.late`, `.ended`) as JSON, or None."""
    if d is None:
        return None
    return {
        "since": d.since,
        "until": d.until,
        "stragglers": list(d.stragglers),
        "lost_to_imbalance": d.lost_to_imbalance,
        "lost_ms_per_step": d.lost_ms_per_step,
        "lost_share_of_run": d.lost_share_of_window,
    }


def _fields(record: Any) -> dict[str, Any] | None:
    """A small dataclass of the analysis (a plateau, a rise, an intermittent straggler) as JSON, or None."""
    return asdict(record) if record is not None else None


def _plain(x: Any) -> Any:
    """Recursively replace non-finite floats (and numpy scalars) with JSON-safe values."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    try:
        f = float(x)
    except (TypeError, ValueError, OverflowError):
        return str(x)
    return f if math.isfinite(f) else None
