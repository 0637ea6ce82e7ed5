"""What changed between two runs of a job: step time, where it goes, per-rank local work, and the findings.

Both runs are summarised the same way as `pytscope report` (counted steps only, so a shorter warm-up does not
read as a speed-up); the comparison is a frozen dataclass built from the two summaries, rendered by a pure
function. A finding is the same finding in both runs when its code and ranks agree (`Finding.key`), so a
straggler that moved from rank 3 to rank 5 reads as one disappearing and one appearing. Changes are B
relative to A: positive step-time change means B is slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .analysis.timing import launch_sequence
from .findings import Finding, format_ranks
from .summary import Summary, _plain, summarize

if TYPE_CHECKING:
    from rich.console import RenderableType

    from .rundir import Run

MAX_RANK_ROWS = 16
"""Above this many ranks the console shows the ranks whose local work changed most."""


@dataclass(frozen=True)
class PhaseChange:
    name: str
    share_a: float
    share_b: float
    median_ms_a: float
    median_ms_b: float
    measured_a: bool = True  # False: the run could not time this phase (comm under FSDP1, DeepSpeed ...)
    measured_b: bool = True

    @property
    def share_change(self) -> float:
        """Change in share of the step, in percentage points (B - A)."""
        return 100.0 * (self.share_b - self.share_a)


@dataclass(frozen=True)
class RankChange:
    rank: int
    local_ms_a: float  # NaN when the rank is absent from run A
    local_ms_b: float
    straggler_a: bool
    straggler_b: bool
    in_a: bool = True  # False: the run had no such rank (a job on fewer ranks)
    in_b: bool = True

    @property
    def change_pct(self) -> float:
        return pct_change(self.local_ms_a, self.local_ms_b)

    @property
    def mark(self) -> str:
        """The rank's straggler status, A to B ("" when it straggled in neither)."""
        if not (self.in_a and self.in_b):
            return f"not in {'A' if not self.in_a else 'B'}" + (
                "; straggler" if self.straggler_a or self.straggler_b else ""
            )
        return {
            (False, True): "straggler now",
            (True, False): "no longer a straggler",
            (True, True): "straggler",
        }.get((self.straggler_a, self.straggler_b), "")


@dataclass(frozen=True)
class Comparison:
    name_a: str
    name_b: str
    world_size_a: int
    world_size_b: int
    steps_a: int
    steps_b: int
    median_ms_a: float
    median_ms_b: float
    p95_ms_a: float
    p95_ms_b: float
    phases: tuple[PhaseChange, ...]
    ranks: tuple[RankChange, ...]
    appeared: tuple[Finding, ...]  # in B, not in A (by code and ranks)
    disappeared: tuple[Finding, ...]  # in A, not in B
    unchanged: tuple[Finding, ...]  # in both (B's version)
    comm_note_a: str | None = None  # why run A's communication is not measured, when it is not
    comm_note_b: str | None = None
    launches_a: tuple[int, ...] = ()  # each launch's number of ranks, when run A was resumed on another
    launches_b: tuple[int, ...] = ()
    # The mean step: what the job's wall time follows (the median hides rare slow steps).
    mean_ms_a: float = math.nan
    mean_ms_b: float = math.nan
    ms_per_sample_a: float = math.nan  # counted wall per sample, all ranks' samples: NaN when not recorded
    ms_per_sample_b: float = math.nan
    # By `Finding.key`: A's severity of each finding in `unchanged` (B's may differ).
    severity_in_a: dict[tuple[str, tuple[int, ...]], str] = field(default_factory=dict)
    # comm split into transfer and sync wait (the straggler's bill), as shares of wall; NaN where not measured
    transfer_share_a: float = math.nan
    transfer_share_b: float = math.nan
    sync_wait_share_a: float = math.nan
    sync_wait_share_b: float = math.nan

    @property
    def median_change_pct(self) -> float:
        """How much slower B's median step is than A's, in percent (negative: faster)."""
        return pct_change(self.median_ms_a, self.median_ms_b)

    @property
    def p95_change_pct(self) -> float:
        return pct_change(self.p95_ms_a, self.p95_ms_b)

    @property
    def mean_change_pct(self) -> float:
        return pct_change(self.mean_ms_a, self.mean_ms_b)

    @property
    def per_sample_change_pct(self) -> float:
        return pct_change(self.ms_per_sample_a, self.ms_per_sample_b)

    @property
    def slowdown(self) -> tuple[str, float]:
        """(what, percent) by which B is slower than A: the time per sample when both runs recorded their
        batch sizes (a run with more samples per step is not slower for its longer steps), else the mean step
        time (the median misses a slow step every tenth)."""
        if math.isfinite(self.per_sample_change_pct):
            return "time per sample", self.per_sample_change_pct
        return "mean step time", self.mean_change_pct

    def regressed(self, threshold_pct: float) -> bool:
        """True when B is slower than A (`slowdown`) by more than `threshold_pct` percent."""
        change = self.slowdown[1]
        return math.isfinite(change) and change > threshold_pct

    def to_dict(self) -> dict[str, Any]:
        out = {
            "a": {
                "run": self.name_a,
                "world_size": self.world_size_a,
                "steps": self.steps_a,
                "comm_measured": self.comm_note_a is None,
                "launch_world_sizes": list(self.launches_a) or None,
            },
            "b": {
                "run": self.name_b,
                "world_size": self.world_size_b,
                "steps": self.steps_b,
                "comm_measured": self.comm_note_b is None,
                "launch_world_sizes": list(self.launches_b) or None,
            },
            "timing": {
                "median_ms": {
                    "a": self.median_ms_a,
                    "b": self.median_ms_b,
                    "change_pct": self.median_change_pct,
                },
                "p95_ms": {"a": self.p95_ms_a, "b": self.p95_ms_b, "change_pct": self.p95_change_pct},
                "mean_ms": {"a": self.mean_ms_a, "b": self.mean_ms_b, "change_pct": self.mean_change_pct},
                "ms_per_sample": {
                    "a": self.ms_per_sample_a,
                    "b": self.ms_per_sample_b,
                    "change_pct": self.per_sample_change_pct,
                },
                "slowdown": {"measure": self.slowdown[0], "change_pct": self.slowdown[1]},
                "comm_split": {
                    name: {"a": a, "b": b, "change_points": 100.0 * (b - a)}
                    for name, a, b in (
                        ("transfer_share", self.transfer_share_a, self.transfer_share_b),
                        ("sync_wait_share", self.sync_wait_share_a, self.sync_wait_share_b),
                    )
                },
                "phases": {
                    p.name: {
                        "share_a": p.share_a,
                        "share_b": p.share_b,
                        "share_change_points": p.share_change,
                        "median_ms_a": p.median_ms_a,
                        "median_ms_b": p.median_ms_b,
                        "measured_a": p.measured_a,
                        "measured_b": p.measured_b,
                    }
                    for p in self.phases
                },
            },
            "per_rank": [
                {
                    "rank": r.rank,
                    "local_ms_a": r.local_ms_a,
                    "local_ms_b": r.local_ms_b,
                    "change_pct": r.change_pct,
                    "straggler_a": r.straggler_a,
                    "straggler_b": r.straggler_b,
                    "in_a": r.in_a,
                    "in_b": r.in_b,
                }
                for r in self.ranks
            ],
            "findings": {
                "appeared": [f.to_dict() for f in self.appeared],
                "disappeared": [f.to_dict() for f in self.disappeared],
                "unchanged": [
                    {**f.to_dict(), "severity_in_a": self.severity_in_a.get(f.key, f.severity.name)}
                    for f in self.unchanged
                ],
            },
        }
        return dict(_plain(out))


def pct_change(a: float, b: float) -> float:
    """(b - a) / a in percent; NaN when either is unknown or a is not positive."""
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0:
        return math.nan
    return 100.0 * (b - a) / a


def compare_summaries(
    a: Summary,
    b: Summary,
    name_a: str = "A",
    name_b: str = "B",
    ms_per_sample: tuple[float, float] = (math.nan, math.nan),
) -> Comparison:
    """The comparison of two summaries (B relative to A); `compare_runs` summarises and delegates here.
    `ms_per_sample`: each run's counted wall per sample, when its batch sizes were recorded."""
    phases_b = {p.name: p for p in b.timing.phases}
    nan = math.nan
    phases = []
    for p in a.timing.phases:
        pb = phases_b[p.name]
        measured_a = p.name != "comm" or a.run.comm_measured
        measured_b = p.name != "comm" or b.run.comm_measured
        phases.append(
            PhaseChange(
                p.name,
                p.share if measured_a else nan,
                pb.share if measured_b else nan,
                p.median_ms if measured_a else nan,
                pb.median_ms if measured_b else nan,
                measured_a,
                measured_b,
            )
        )
    ranks_a = {r.rank: r for r in a.distributed.per_rank}
    ranks_b = {r.rank: r for r in b.distributed.per_rank}
    ranks = []
    for rank in sorted(set(ranks_a) | set(ranks_b)):
        ra, rb = ranks_a.get(rank), ranks_b.get(rank)
        ranks.append(
            RankChange(
                rank,
                ra.local_ms if ra else math.nan,
                rb.local_ms if rb else math.nan,
                bool(ra and ra.straggler),
                bool(rb and rb.straggler),
                ra is not None,
                rb is not None,
            )
        )
    keys_a = {f.key for f in a.findings}
    keys_b = {f.key for f in b.findings}
    return Comparison(
        name_a=name_a,
        name_b=name_b,
        world_size_a=a.run.world_size,
        world_size_b=b.run.world_size,
        steps_a=a.timing.steps_counted,
        steps_b=b.timing.steps_counted,
        median_ms_a=a.timing.median_ms,
        median_ms_b=b.timing.median_ms,
        p95_ms_a=a.timing.p95_ms,
        p95_ms_b=b.timing.p95_ms,
        phases=tuple(phases),
        ranks=tuple(ranks),
        appeared=tuple(f for f in b.findings if f.key not in keys_a),
        disappeared=tuple(f for f in a.findings if f.key not in keys_b),
        unchanged=tuple(f for f in b.findings if f.key in keys_a),
        severity_in_a={f.key: f.severity.name for f in a.findings if f.key in keys_b},
        comm_note_a=a.run.comm_note,
        comm_note_b=b.run.comm_note,
        transfer_share_a=a.distributed.transfer_share if a.run.comm_measured else math.nan,
        transfer_share_b=b.distributed.transfer_share if b.run.comm_measured else math.nan,
        sync_wait_share_a=a.distributed.sync_wait_share if a.run.comm_measured else math.nan,
        sync_wait_share_b=b.distributed.sync_wait_share if b.run.comm_measured else math.nan,
        launches_a=_launches(a),
        launches_b=_launches(b),
        mean_ms_a=a.timing.mean_ms,
        mean_ms_b=b.timing.mean_ms,
        ms_per_sample_a=ms_per_sample[0],
        ms_per_sample_b=ms_per_sample[1],
    )


def _launches(s: Summary) -> tuple[int, ...]:
    """Each launch's number of ranks, when a run was resumed on another number of ranks; else ()."""
    return launch_sequence([seg.world_size for seg in s.efficiency.goodput.segments if seg.steps > 0])


def compare_runs(run_a: Run, run_b: Run) -> Comparison:
    """What changed from run A to run B: step time, phase shares, per-rank local work, findings."""
    from .scaling import counted_work

    sa = summarize(run_a.arrays, run_a.context, extra_findings=tuple(run_a.extra_findings))
    sb = summarize(run_b.arrays, run_b.context, extra_findings=tuple(run_b.extra_findings))
    per_sample = []
    for run in (run_a, run_b):
        work = counted_work(run)
        per_sample.append(1e3 * work.seconds / work.samples if work.samples > 0 else math.nan)
    return compare_summaries(sa, sb, str(run_a.path), str(run_b.path), (per_sample[0], per_sample[1]))


def _fmt(x: float, fmt: str = ".2f", unit: str = "") -> str:
    return f"{x:{fmt}}{unit}" if math.isfinite(x) else "n/a"


def _signed(x: float, unit: str = "%") -> str:
    return f"{x:+.1f}{unit}" if math.isfinite(x) else "n/a"


def _finding_line(f: Finding) -> str:
    ranks = f" rank{'s' if len(f.ranks) > 1 else ''} {format_ranks(f.ranks)}" if f.ranks else ""
    return f"[{f.severity.name}] {f.title} ({f.code}{ranks})"


def render_comparison(c: Comparison) -> RenderableType:
    """Step time, phases and per-rank local work side by side, then the findings that came and went."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[RenderableType] = [
        Text("Comparison", style="bold underline"),
        Text(f"A: {c.name_a}  ({_ranks(c.world_size_a)}, {c.steps_a} counted steps)"),
        Text(f"B: {c.name_b}  ({_ranks(c.world_size_b)}, {c.steps_b} counted steps)"),
    ]
    blind = {label: note for label, note in (("A", c.comm_note_a), ("B", c.comm_note_b)) if note}
    parts.extend(Text(f"{label}: {note}", style="yellow") for label, note in blind.items())
    for label, launches in (("A", c.launches_a), ("B", c.launches_b)):
        if launches:
            parts.append(
                Text(
                    f"{label} ran on {' and then '.join(map(str, launches))} ranks: its step times pool every "
                    f"launch; `pytscope scaling {label}` gives each number of ranks its own point.",
                    style="yellow",
                )
            )
    if c.world_size_a != c.world_size_b:
        parts.append(
            Text(
                f"A and B ran on {c.world_size_a} and {c.world_size_b} ranks: their steps need not be the same "
                "work; `pytscope scaling A B` compares throughput and scaling efficiency.",
                style="yellow",
            )
        )
    timing = Table(box=None, pad_edge=False)
    for name in ("", "A", "B", "change"):
        timing.add_column(name, justify="left" if not name else "right")
    timing.add_row("median step ms", _fmt(c.median_ms_a), _fmt(c.median_ms_b), _signed(c.median_change_pct))
    timing.add_row("p95 step ms", _fmt(c.p95_ms_a), _fmt(c.p95_ms_b), _signed(c.p95_change_pct))
    timing.add_row("mean step ms", _fmt(c.mean_ms_a), _fmt(c.mean_ms_b), _signed(c.mean_change_pct))
    if math.isfinite(c.ms_per_sample_a) or math.isfinite(c.ms_per_sample_b):
        timing.add_row(
            "ms per sample",
            _fmt(c.ms_per_sample_a, ".4f"),
            _fmt(c.ms_per_sample_b, ".4f"),
            _signed(c.per_sample_change_pct),
        )
    parts += [Text("\nStep time", style="bold underline"), timing]

    phases = Table(box=None, pad_edge=False)
    for name in ("phase", "share A", "share B", "change", "median ms A", "median ms B"):
        phases.add_column(name, justify="left" if name == "phase" else "right")
    for p in c.phases:
        phases.add_row(
            p.name,
            _fmt(100 * p.share_a, ".1f", "%") if p.measured_a else "not measured",
            _fmt(100 * p.share_b, ".1f", "%") if p.measured_b else "not measured",
            _signed(p.share_change, " pts"),
            _fmt(p.median_ms_a),
            _fmt(p.median_ms_b),
        )
        if p.name == "comm":  # sync wait is a straggler's bill, never communication cost: said apart
            for name, a, b in (
                ("  transfer", c.transfer_share_a, c.transfer_share_b),
                ("  sync wait", c.sync_wait_share_a, c.sync_wait_share_b),
            ):
                if math.isfinite(a) or math.isfinite(b):
                    phases.add_row(
                        name,
                        _fmt(100 * a, ".1f", "%"),
                        _fmt(100 * b, ".1f", "%"),
                        _signed(100 * (b - a), " pts"),
                        "",
                        "",
                    )
    parts += [Text("\nPhases", style="bold underline"), phases]
    if len(blind) == 1:
        parts.append(
            Text(
                f"run {next(iter(blind))}'s forward and backward include its unmeasured communication: their change is not "
                "a change in compute alone",
                style="yellow",
            )
        )

    rows = list(c.ranks)
    omitted = 0
    if len(rows) > MAX_RANK_ROWS:
        # The ranks that moved most are the ones worth reading; the rest are listed in --json.
        rows = sorted(rows, key=lambda r: abs(r.change_pct) if math.isfinite(r.change_pct) else math.inf)
        rows = sorted(rows[-MAX_RANK_ROWS:], key=lambda r: r.rank)
        omitted = len(c.ranks) - len(rows)
    ranks = Table(box=None, pad_edge=False)
    for name in ("rank", "local ms A", "local ms B", "change", ""):
        ranks.add_column(name, justify="left" if name in ("", "rank") else "right")
    for r in rows:
        ranks.add_row(str(r.rank), _fmt(r.local_ms_a), _fmt(r.local_ms_b), _signed(r.change_pct), r.mark)
    parts += [Text("\nPer-rank local work", style="bold underline"), ranks]
    if omitted:
        parts.append(Text(f"... {omitted} ranks omitted (showing the {len(rows)} that changed most)"))

    parts.append(Text("\nFindings", style="bold underline"))
    for label, items, style in (
        ("appeared", c.appeared, "red"),
        ("disappeared", c.disappeared, "green"),
        ("still there", c.unchanged, "dim"),
    ):
        if items:
            parts.append(Text(f"{label}:", style=style))
            parts.extend(Text(f"  {_finding_line(f)}{_was(c, f)}") for f in items)
    if not (c.appeared or c.disappeared or c.unchanged):
        parts.append(Text("No findings in either run."))
    return Group(*parts)


def _was(c: Comparison, f: Finding) -> str:
    """How a finding found in both runs changed severity (B's is the one shown)."""
    before = c.severity_in_a.get(f.key)
    return f" (was {before} in A)" if before is not None and before != f.severity.name else ""


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"
