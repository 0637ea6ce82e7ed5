"""Live diagnosis on rank 0: what each gather brings is stored, checked across ranks and, often enough to be
useful and rarely enough to stay cheap, diagnosed.

It runs on rank 0's ingest thread (`ingest.BackgroundIngest`), off every rank's critical path; it still
shares rank 0's CPU and interpreter with training, so a diagnosis runs only as often as keeps its cost under
LIVE_BUDGET of wall time, over the last LIVE_STEPS steps (fewer on large jobs: LIVE_CELLS rank-steps at
most), in one analysis pass whose result feeds both the findings and the metrics; the loss's course is judged
over every step of the run, earlier segments included (`convergence.LossHistory`), as the final report judges
it. Its context comes from the same builder as the final report's (`RunContext.from_meta`), so live and final
findings judge the same facts.
State is guarded by one lock: the ingest thread, the training thread (integration findings, metrics) and the
watchdog thread (a hang) all reach it. Metrics are handed to the training thread (`publish_metrics`), since
loggers expect to be called there.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import RunArrays
from .context import CountsCheck, ReplicaCheck, RunContext, Segment
from .findings import Finding, Severity, with_predicted
from .gather import HEADER
from .output import say
from .records import COL, NCOLS
from .reporter import RunReporter
from .rundir import iter_rows, run_columns, run_world, sound_rows
from .said import SaidFindings

if TYPE_CHECKING:
    from .analysis import RunAnalysis
    from .analysis.convergence import LossHistory
    from .summary import Summary

LIVE_STEPS = 1000  # steps kept in memory on rank 0 for live diagnosis: bounds its cost on long runs
LIVE_CELLS = 800_000
"""...and at most this many rank-steps (about one 50-step interval of 16,384 ranks): bounds the cost and the
memory of a live diagnosis on large jobs. Statistics need 50 counted steps (timing.MIN_STATISTIC_STEPS), and
the window always holds the latest gather whole."""
LIVE_BUDGET = 0.005  # live diagnosis may take at most this share of wall time; other gathers only store rows

MetricsSink = Callable[[dict[str, float], int], None]
LossSums = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""(steps, the sums of their finite losses, how many, how many non-finite ones)"""


class LiveDiagnosis:
    """Rank 0's ingest of each gather: rows to the run, cross-rank checks, throttled diagnosis, publishing."""

    def __init__(
        self,
        reporter: RunReporter,
        segment: Segment,
        warmup: int,
        errors: list[str],
        metrics_sink: MetricsSink | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.reporter = reporter
        self.segment = segment
        self.warmup = warmup  # the first steps of every segment, launch or resume, as in the final report
        self.errors = errors  # the scope's internal errors, shared
        self.metrics_sink = metrics_sink
        self.findings: list[Finding] = []  # the latest diagnosis, with the integration's findings
        self.extra_findings: list[Finding] = []
        self.counts_checks: list[CountsCheck] = []
        self.joins: list[tuple[int, int]] = []  # (rank, its last step): ranks out of batches inside a Join
        self.replica_checks: list[ReplicaCheck] = []
        self.hang_reports: list[dict[str, Any]] = []
        self._clock = clock
        self._recent: collections.deque[np.ndarray] = collections.deque()
        self._world = 1
        self._recent_steps = 0
        # Every step's loss since the launch, as (steps, sums, counts) of each gather's finite losses (and the
        # count of its non-finite ones), and the run's earlier segments' (read once, at the first diagnosis):
        # the loss's course is judged over all of it (`_loss_history`).
        self._losses: list[LossSums] = []
        self._earlier: LossHistory | None = None
        # (step, ranks) of the first non-finite loss: kept once the window of recent steps has moved on
        self._first_nonfinite: tuple[int, tuple[int, ...]] | None = None
        self._urgent = False  # a diagnosis is due now, whatever its budget says (the first non-finite loss)
        # The step from which a diagnosis has the steps timing findings need above LOW: due then, whatever its
        # budget says, so that a finding capped at LOW in the first diagnosis is said at its severity.
        self._full_at: int | None = None
        self._said = SaidFindings()  # the console's word on each finding
        self._cost_s = 0.0
        self._at = clock()
        self._lock = threading.RLock()
        self._metrics: dict[str, float] | None = None  # the latest diagnosis's, until published
        self.diagnoses = 0

    def ingest(self, headers: np.ndarray, rows: np.ndarray, gather: int, step: int, final: bool) -> None:
        """One gather: `headers` (ranks x gather.HEADER), every rank's `rows`, the gather's number and the
        step label it happened at."""
        self.record(headers, rows, gather, step, final)
        if not final:
            self.diagnose_if_due(step)

    def record(
        self,
        headers: np.ndarray,
        rows: np.ndarray,
        gather: int,
        step: int,
        final: bool = False,
        scalars: list[dict[str, Any]] | None = None,
        learnt: dict[str, Any] | None = None,
    ) -> None:
        """The part of a gather that is never skipped: rank 0's scalars and settings learnt since the last
        gather, the rows into the run, the counts and replica checks, and (unless final) the rows into the
        live window."""
        with self._lock:
            if scalars:
                self.reporter.writer.scalars(scalars)
            if learnt:
                self.reporter.learnt(**learnt)
            self.reporter.rows(rows)
            self._check_counts(headers, gather)
            self._check_replicas(headers, step)
            if self._first_nonfinite is None:
                self._first_nonfinite = first_nonfinite_row(rows)
                self._urgent = self._first_nonfinite is not None
            self._losses.append(step_loss_sums(rows))
            if not final:
                self._remember(rows, world=max(1, headers.shape[0]))

    def diagnose_if_due(self, step: int) -> None:
        """Diagnose unless the last diagnosis's cost says it is too soon (LIVE_BUDGET); a first non-finite
        loss is said at once."""
        self._read_earlier()  # (once per launch: not a diagnosis's cost, which paces the next)
        now = self._clock()
        full = self._full_at is not None and step >= self._full_at
        if self._cost_s > LIVE_BUDGET * (now - self._at) and not (self._urgent or full):
            return
        self._at = now
        self._urgent = False
        try:
            self.diagnose(step)
        finally:
            self._cost_s = self._clock() - now

    def add(self, finding: Finding, step: int) -> None:
        """A finding an integration made itself (e.g. DATA.UNEVEN_SHARDS): kept (its latest word, as the run
        reads them back), printed and stored."""
        with self._lock:
            self.extra_findings = [f for f in self.extra_findings if f.key != finding.key] + [finding]
            self._said.said(finding)
            self.reporter.findings([finding], step, source="integration")

    def standing(self) -> list[Finding]:
        """The live diagnosis's HIGH and MED findings still standing on the console: the end-of-run summary says
        those it no longer makes are gone."""
        with self._lock:
            return self._said.still_standing()

    def hang(self, finding: Finding, step: int) -> None:
        """Called from the watchdog thread."""
        with self._lock:
            self.hang_reports.append({**finding.to_dict(), "segment": self.segment.index})
            self.reporter.hang(finding, step, self.segment.index)

    def publish_metrics(self, step: int) -> None:
        """Hand the latest diagnosis's metrics, if not handed yet, to the sink at training step `step` (the
        step it is published at, not the one it diagnosed: trackers such as wandb drop a step that goes
        back). Call on the training thread (Lightning's loggers read the trainer's state)."""
        with self._lock:
            values, self._metrics = self._metrics, None
        if values is not None and self.metrics_sink is not None:
            try:
                self.metrics_sink(values, step)
            except Exception as exc:  # the user's logger's fault, not the scope's: only live metrics stop
                self.metrics_sink = None
                message = (
                    f"a logger raised {type(exc).__name__} ({exc}) on pytscope's metrics: live metrics off"
                )
                self.errors.append(message)
                say(0, message)

    def context(self, first_step: int | None = None) -> RunContext:
        """The run's context for a diagnosis of the steps from `first_step` on: a hang report every rank went
        on past before them (said when it came, then as the stall it was) is left out, or, with its stall out
        of the window, it would read as a hang again (`rules.hang`)."""
        with self._lock:
            hangs = tuple(
                h
                for h in self.hang_reports
                if first_step is None or not h.get("steps") or h["steps"][0] - 1 >= first_step
            )
            return RunContext.from_meta(
                dict(self.reporter.meta),
                warmup=self.warmup,
                segments=(self.segment,),
                counts_checks=tuple(self.counts_checks),
                joins=tuple(self.joins),
                replica_checks=tuple(self.replica_checks),
                hang_reports=hangs,
                scope_errors=tuple(self.errors),
                first_nonfinite=self._first_nonfinite,
            )

    def diagnose(self, step: int) -> None:
        """Diagnose the recent steps once; publish findings that are new or got worse, and the metrics."""
        from .analysis import analyze, run_rules
        from .analysis.timing import MIN_STATISTIC_STEPS

        self._read_earlier()
        with self._lock:
            window, world = list(self._recent), self._world
            history = self._loss_history()
        if not window:
            return
        arrays = RunArrays.from_rows(_rank_after_rank(window, world), warmup=self.warmup)
        if arrays.n_steps == 0:
            return
        analysis = analyze(arrays, self.context(int(arrays.steps[0])), history)
        findings = run_rules(analysis)
        missing = MIN_STATISTIC_STEPS - analysis.timing.steps_counted
        with self._lock:
            self._full_at = step + missing if missing > 0 and self.diagnoses == 0 else None  # (once)
            self.diagnoses += 1
            self.findings = with_predicted(findings, self.extra_findings)
            # New or worse findings, those whose ranks changed, and alarms the diagnosis no longer makes (a stale
            # alarm must not stand on the console): each said once.
            word = self._said.diagnosed(findings, self.findings)
            if word.gone:
                self.reporter.cleared(word.gone, step)
            if word.fresh:
                self.reporter.findings(word.fresh, step)
            if word.updated:
                self.reporter.findings(word.updated, step, updated=True)
        if self.metrics_sink is not None:
            values = metrics(analysis, self.findings)
            with self._lock:
                self._metrics = values

    # -- helpers ------------------------------------------------------------------------------------------
    def _check_counts(self, headers: np.ndarray, gather: int) -> None:
        joined_at = headers[:, HEADER.index("joined_at")]
        joined = tuple(np.flatnonzero(np.isfinite(joined_at)).tolist())
        for rank in joined:
            self.joined(rank, int(joined_at[rank]), gather)
        steps, syncs, micro = (tuple(int(v) for v in headers[:, i]) for i in range(3))
        check = CountsCheck(gather, steps, syncs, micro, joined)
        if check.differs:
            self.counts_checks.append(check)
            self.reporter.writer.event(
                "counts_check",
                gather=gather,
                steps=steps,
                grad_syncs=syncs,
                micro_batches=micro,
                joined=joined,
            )

    def joined(self, rank: int, step: int, gather: int) -> None:
        """A rank ran out of batches after its step `step` and waited inside torch's Join: said at a gather
        during the join, or, where none came, as the join ended (joins.py); kept once."""
        with self._lock:
            if (rank, step) not in self.joins:
                self.joins.append((rank, step))
                self.reporter.writer.event("joined", rank=rank, step=step, gather=gather)

    def _check_replicas(self, headers: np.ndarray, step: int) -> None:
        from .analysis.rules import replicas_differ

        sums = headers[:, HEADER.index("checksum")]
        if len(sums) > 1 and np.isfinite(sums).all() and replicas_differ(sums):
            check = ReplicaCheck(step, tuple(float(s) for s in sums))
            self.replica_checks.append(check)
            self.reporter.writer.event("replica_check", step=check.step, checksums=list(check.checksums))

    def _read_earlier(self) -> None:
        """The loss history of the run's segments before this one (a resume, a second fit), read from the run
        directory once, off the lock (a long run's rows take a while): empty for a fresh run, or where the
        run's files cannot be read (the final report says what it could not read)."""
        if self._earlier is not None:
            return
        self._earlier = _empty_history()
        if self.segment.index > 0:
            # (Any failure: the verdict then judges this launch's steps, as before; never the scope's end.)
            with contextlib.suppress(Exception):
                self._earlier = earlier_loss_history(
                    self.reporter.writer.path, self.segment.index, self.warmup
                )

    def _loss_history(self) -> LossHistory:
        """Every step's loss in the run, in step order (gathers may be recorded out of order when the ingest
        queue is full, and a rank's step may come in a later gather than the others'): the earlier segments'
        up to this launch's first step (the steps it replays are its own), then this launch's, whose first
        `warmup` steps are not counted. All are counted while the run is still in warm-up
        (`timing.statistics_steps`)."""
        from .analysis.convergence import LossHistory

        if len(self._losses) > 1:  # (merged into one: each diagnosis sorts only what came since)
            self._losses = [merge_loss_sums(self._losses)]
        steps, sums, counts, bad = self._losses[0] if self._losses else (np.empty(0),) * 4
        with np.errstate(all="ignore"):
            loss = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        counted = np.arange(steps.size) >= self.warmup
        nonfinite = bad > 0
        earlier = self._earlier or _empty_history()
        if earlier.steps.size:
            before = earlier.steps < steps[0] if steps.size else np.ones(earlier.steps.size, dtype=bool)
            steps, loss, counted, nonfinite = (
                np.concatenate([part[before], own])
                for part, own in zip(earlier, (steps, loss, counted, nonfinite), strict=True)
            )
        if not counted.any():
            counted[:] = True
        return LossHistory(steps, loss, counted, nonfinite)

    def _remember(self, rows: np.ndarray, world: int) -> None:
        self._world = world
        limit = max(1, min(LIVE_STEPS, LIVE_CELLS // world))
        self._recent.append(rows)
        self._recent_steps += rows.shape[0] // world
        while len(self._recent) > 1 and self._recent_steps - self._recent[0].shape[0] // world >= limit:
            self._recent_steps -= self._recent.popleft().shape[0] // world


def step_loss_sums(rows: np.ndarray) -> LossSums:
    """(steps, the sum of each step's finite losses, how many there were, how many non-finite ones were
    logged) over a gather's rows, in step order: a step's mean over ranks is what `convergence.loss_per_step`
    makes of the same rows in a run, and a step with a non-finite one is one `convergence.nonfinite_losses`
    marks. A gather's steps span about one interval, so they are counted into a dense range (no sort)."""
    # Two columns, each read once into a contiguous array: a gather holds W x interval rows.
    step, loss = np.ascontiguousarray(rows[:, COL["step"]]), np.ascontiguousarray(rows[:, COL["loss"]])
    known = np.isfinite(step)
    if not known.all():
        step, loss = step[known], loss[known]
    if step.size == 0:
        return np.empty(0), np.empty(0), np.empty(0), np.empty(0)
    step = step.astype(np.intp)
    first, span = int(step.min()), int(step.max() - step.min()) + 1
    if span > 4 * step.size:  # (not one interval's steps: sort instead of a mostly empty range)
        steps, index = np.unique(step, return_inverse=True)
        span = steps.size
    else:
        steps, index = np.arange(first, first + span), step - first
    finite = np.isfinite(loss)
    sums = np.bincount(index, weights=np.where(finite, loss, 0.0), minlength=span)
    counts = np.bincount(index, weights=finite, minlength=span)
    bad = np.bincount(index, weights=np.isinf(loss), minlength=span)  # (a logged NaN or Inf is +inf)
    present = np.bincount(index, minlength=span) > 0
    return steps[present].astype(np.float64), sums[present], counts[present], bad[present]


def merge_loss_sums(parts: list[LossSums]) -> LossSums:
    """One (steps, sums, counts, non-finite counts) from several, in step order, each step's added up."""
    steps, sums, counts, bad = (np.concatenate(column) for column in zip(*parts, strict=True))
    steps, index = np.unique(steps, return_inverse=True)
    return (
        steps,
        np.bincount(index, weights=sums),
        np.bincount(index, weights=counts),
        np.bincount(index, weights=bad),
    )


def earlier_loss_history(path: Path, segment: int, warmup: int) -> LossHistory:
    """The loss history of the run's segments before `segment`, as the final report reads them (`load_run`):
    each step's mean over ranks of the finite losses that its latest segment recorded (a resume replays the
    steps done since the checkpoint), the first `warmup` steps of each segment not counted, rows that cannot
    be (a rank beyond the run's largest world, impossible times) left out. The gathered rows are read a chunk
    at a time, never all held; the rows ranks wrote themselves (`ranks/`, a few intervals at most) count where
    no gather brought that rank's step."""
    from .analysis.convergence import LossHistory

    columns, world = run_columns(path), run_world(path)
    folder = path / "ranks"
    own = [
        sound_rows(rows, world)[0]
        for f in (sorted(folder.glob("rank*.f64")) if folder.is_dir() else [])
        if f.is_file()
        for rows in iter_rows(f, columns)
    ]
    own_rows = np.concatenate(own) if own else np.empty((0, NCOLS))
    own_rows = own_rows[own_rows[:, COL["segment"]] < segment]
    parts: dict[int, list[LossSums]] = collections.defaultdict(list)
    gathered_keys: set[tuple[float, ...]] = set()  # (rank, segment, step) of gathered rows own rows also have
    for rows in iter_rows(path / "steps.f64", columns) if (path / "steps.f64").is_file() else ():
        rows, _ = sound_rows(rows, world)
        _add_loss_sums(parts, rows, segment)
        if own_rows.size:
            also = rows[np.isin(rows[:, COL["step"]], own_rows[:, COL["step"]])]
            gathered_keys.update(map(tuple, also[:, _KEY_COLS].tolist()))
    keep = []  # each rank's own row once, and only where no gather brought it (`rundir.read_rank_files`)
    for key in map(tuple, own_rows[:, _KEY_COLS].tolist()):
        keep.append(key not in gathered_keys)
        gathered_keys.add(key)
    _add_loss_sums(parts, own_rows[keep], segment)
    if not parts:
        return _empty_history()
    by_segment = {seg: merge_loss_sums(p) for seg, p in parts.items()}
    steps, sums, counts, bad = (np.concatenate(column) for column in zip(*by_segment.values(), strict=True))
    segs = np.concatenate([np.full(part[0].size, seg) for seg, part in by_segment.items()])
    order = np.lexsort((segs, steps))  # by step, then segment: each step's last row is its latest segment
    steps, segs, sums, counts, bad = (column[order] for column in (steps, segs, sums, counts, bad))
    latest = np.r_[steps[1:] != steps[:-1], True]
    steps, segs, sums, counts, bad = (column[latest] for column in (steps, segs, sums, counts, bad))
    with np.errstate(all="ignore"):
        loss = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    counted = np.ones(steps.size, dtype=bool)
    for seg in np.unique(segs):
        counted[np.flatnonzero(segs == seg)[:warmup]] = False
    return LossHistory(steps, loss, counted, bad > 0)


_KEY_COLS = [COL["rank"], COL["segment"], COL["step"]]


def _add_loss_sums(parts: dict[int, list[LossSums]], rows: np.ndarray, before: int) -> None:
    """Each segment's (steps, sums, counts) of `rows`, for the segments before `before`, into `parts`."""
    segment = rows[:, COL["segment"]]
    for seg in np.unique(segment[segment < before]):
        parts[int(seg)].append(step_loss_sums(rows[segment == seg]))


def _empty_history() -> LossHistory:
    from .analysis.convergence import LossHistory

    return LossHistory(np.empty(0), np.empty(0), np.empty(0, dtype=bool), np.empty(0, dtype=bool))


def first_nonfinite_row(rows: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    """(step, ranks) of the first step in `rows` whose recorded loss is non-finite (+inf), or None."""
    bad = np.isinf(rows[:, COL["loss"]])
    if not bad.any():
        return None
    steps = rows[bad, COL["step"]]
    first = steps.min()
    return int(first), tuple(sorted({int(r) for r in rows[bad, COL["rank"]][steps == first]}))


def _rank_after_rank(window: list[np.ndarray], world: int) -> np.ndarray:
    """The window's rows, each rank's steps of every gather together, when each gather holds whole ranks in
    rank order: the order `RunArrays.from_rows` turns into arrays fastest (any order gives the same arrays)."""
    if len(window) == 1:
        return window[0]
    if all(rows.shape[0] % world == 0 for rows in window):
        width = window[0].shape[1]
        return np.concatenate([rows.reshape(world, -1, width) for rows in window], axis=1).reshape(-1, width)
    return np.concatenate(window)


def metrics(analysis: RunAnalysis | Summary, findings: list[Finding]) -> dict[str, float]:
    """The scalars logged at each live diagnosis and at the end (Lightning's loggers, `accelerator.log`): the
    summary's numbers, read live from the analysis itself (building the summary's per-rank tree costs 0.4 s
    at 16k ranks)."""
    shares = {p.name: p.share for p in analysis.timing.phases}
    out = {
        "pytscope/step_ms": analysis.timing.median_ms,
        "pytscope/comm_share": shares.get("comm"),
        "pytscope/data_share": shares.get("data"),
        "pytscope/lost_to_imbalance": analysis.distributed.effective.cost_share,
        "pytscope/mfu": analysis.efficiency.mfu,
        "pytscope/findings_high": sum(f.severity == Severity.HIGH for f in findings),
        "pytscope/findings_med": sum(f.severity == Severity.MED for f in findings),
    }
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and math.isfinite(v)}
