"""Live diagnosis on rank 0: what each gather brings is stored, checked across ranks and, often enough to be
useful and rarely enough to stay cheap, diagnosed.

Rank 0 is on every rank's critical path while it diagnoses (the others wait for it in the next all-reduce),
so a diagnosis runs only as often as keeps its cost under LIVE_BUDGET of wall time, over the last LIVE_STEPS
steps, in one analysis pass whose result feeds both the findings and the metrics. Its context comes from the
same builder as the final report's (`RunContext.from_meta`), so live and final findings judge the same facts.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .arrays import RunArrays
from .context import CountsCheck, ReplicaCheck, RunContext, Segment
from .findings import Finding, Severity
from .reporter import RunReporter

LIVE_STEPS = 1000  # steps kept in memory on rank 0 for live diagnosis: bounds its cost on long runs
LIVE_BUDGET = 0.005  # live diagnosis may take at most this share of wall time; other gathers only store rows

MetricsSink = Callable[[dict[str, float], int], None]


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
        self.warmup = 0 if segment.index else warmup  # a resumed segment is warm already
        self.errors = errors  # the scope's internal errors, shared
        self.metrics_sink = metrics_sink
        self.findings: list[Finding] = []  # the latest diagnosis, with the integration's findings
        self.extra_findings: list[Finding] = []
        self.counts_checks: list[CountsCheck] = []
        self.replica_checks: list[ReplicaCheck] = []
        self.hang_reports: list[dict[str, Any]] = []
        self._clock = clock
        self._recent: collections.deque[np.ndarray] = collections.deque()
        self._recent_steps = 0
        self._reported: dict[tuple[str, tuple[int, ...]], Severity] = {}
        self._cost_s = 0.0
        self._at = clock()

    def ingest(self, headers: np.ndarray, rows: np.ndarray, gather: int, step: int, final: bool) -> None:
        """One gather: `headers` (ranks x gather.HEADER), every rank's `rows`, the gather's number and the
        step label it happened at."""
        self.reporter.rows(rows)
        self._check_counts(headers, gather)
        self._check_replicas(headers, step)
        if final:
            return
        self._remember(rows)
        now = self._clock()
        if self._cost_s > LIVE_BUDGET * (now - self._at):
            return
        self._at = now
        try:
            self.diagnose(step)
        finally:
            self._cost_s = self._clock() - now

    def add(self, finding: Finding, step: int) -> None:
        """A finding an integration made itself (e.g. DATA.UNEVEN_SHARDS): kept, printed and stored."""
        self.extra_findings.append(finding)
        self._reported[finding.key] = finding.severity
        self.reporter.findings([finding], step, source="integration")

    def hang(self, finding: Finding, step: int) -> None:
        self.hang_reports.append(finding.to_dict())
        self.reporter.hang(finding, step)

    def context(self) -> RunContext:
        return RunContext.from_meta(
            self.reporter.meta,
            warmup=self.warmup,
            segments=(self.segment,),
            counts_checks=tuple(self.counts_checks),
            replica_checks=tuple(self.replica_checks),
            hang_reports=tuple(self.hang_reports),
            scope_errors=tuple(self.errors),
        )

    def diagnose(self, step: int) -> None:
        """Diagnose the recent steps once; publish findings that are new or got worse, and the metrics."""
        from .analysis import analyze, run_rules
        from .summary import summary_of

        arrays = RunArrays.from_rows(np.concatenate(list(self._recent)), warmup=self.warmup)
        if arrays.n_steps == 0:
            return
        analysis = analyze(arrays, self.context())
        self.findings = run_rules(analysis) + self.extra_findings
        fresh = [f for f in self.findings if self._reported.get(f.key, Severity.LOW - 1) < f.severity]
        for f in fresh:
            self._reported[f.key] = f.severity
        if fresh:
            self.reporter.findings(fresh, step)
        if self.metrics_sink is not None:
            summary = summary_of(analysis, self.findings)
            self.metrics_sink(metrics(summary.to_dict(), self.findings), int(arrays.steps[-1]))

    # -- helpers ------------------------------------------------------------------------------------------
    def _check_counts(self, headers: np.ndarray, gather: int) -> None:
        steps, syncs, micro = (tuple(int(v) for v in headers[:, i]) for i in range(3))
        if len(set(steps)) > 1 or len(set(syncs)) > 1 or len(set(micro)) > 1:
            check = CountsCheck(gather, steps, syncs, micro)
            self.counts_checks.append(check)
            self.reporter.writer.event(
                "counts_check", gather=gather, steps=steps, grad_syncs=syncs, micro_batches=micro
            )

    def _check_replicas(self, headers: np.ndarray, step: int) -> None:
        sums = headers[:, 4]
        if (
            len(sums) > 1
            and np.isfinite(sums).all()
            and np.ptp(sums) > 1e-9 * max(1.0, float(np.abs(sums).max()))
        ):
            check = ReplicaCheck(step, tuple(float(s) for s in sums))
            self.replica_checks.append(check)
            self.reporter.writer.event("replica_check", step=check.step, checksums=list(check.checksums))

    def _remember(self, rows: np.ndarray) -> None:
        world = max(1, len(np.unique(rows[:, 0]))) if rows.size else 1
        self._recent.append(rows)
        self._recent_steps += rows.shape[0] // world
        while len(self._recent) > 1 and self._recent_steps - self._recent[0].shape[0] // world >= LIVE_STEPS:
            self._recent_steps -= self._recent.popleft().shape[0] // world


def metrics(summary: dict[str, Any], findings: list[Finding]) -> dict[str, float]:
    """The scalars logged at each live diagnosis (Lightning's loggers, `accelerator.log`)."""
    timing = summary.get("timing", {})
    phases = timing.get("phases", {})
    dist_ = summary.get("distributed", {})
    efficiency = summary.get("efficiency", {})
    out = {
        "pytscope/step_ms": timing.get("median_ms"),
        "pytscope/comm_share": phases.get("comm", {}).get("share"),
        "pytscope/data_share": phases.get("data", {}).get("share"),
        "pytscope/lost_to_imbalance": dist_.get("lost_to_imbalance"),
        "pytscope/mfu": efficiency.get("mfu"),
        "pytscope/findings_high": sum(f.severity == Severity.HIGH for f in findings),
        "pytscope/findings_med": sum(f.severity == Severity.MED for f in findings),
    }
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and math.isfinite(v)}
