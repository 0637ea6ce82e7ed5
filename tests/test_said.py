"""What the console says of each finding as diagnoses follow one another, and at the end-of-run summary."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pytscope_core.context import Segment
from pytscope_core.findings import Finding, Severity
from pytscope_core.live import LiveDiagnosis
from pytscope_core.records import COL, NCOLS
from pytscope_core.reporter import RunReporter
from pytscope_core.said import same_findings


def finding(code: str, title: str, ranks: tuple[int, ...] = (), severity: Severity = Severity.MED) -> Finding:
    return Finding(code, severity, title, "d", "r", ranks=ranks)


JITTER_ON_1 = finding("TIMING.JITTER", "Step time is unstable: rank 1 is slow now and then", (1,))
JITTER = finding("TIMING.JITTER", "Step time is unstable")
SPIKES_ON_0 = finding("CONVERGENCE.SPIKE", "4 loss spike(s)", (0,))
SPIKES = finding("CONVERGENCE.SPIKE", "5 loss spike(s)")


def rows(first: int, last: int, ranks: int = 2) -> np.ndarray:
    steps = range(first, last + 1)
    out = np.full((len(steps) * ranks, NCOLS), 1.0)
    out[:, COL["rank"]] = np.repeat(np.arange(ranks), len(steps))
    out[:, COL["segment"]] = 0
    out[:, COL["step"]] = np.tile(list(steps), ranks)
    out[:, COL["wall_ms"]] = 6.0  # the six phases' 1 ms each
    return out


@pytest.fixture
def rules(monkeypatch):
    """The rules' findings of each diagnosis in turn, as a list the test fills."""
    said: list[list[Finding]] = []
    monkeypatch.setattr("pytscope_core.analysis.run_rules", lambda analysis, **_: said.pop(0))
    return said


def live_run(path, console: bool = False) -> LiveDiagnosis:
    reporter = RunReporter(path, {"world_size": 2, "interval": 10, "warmup": 0}, console=console)
    return LiveDiagnosis(reporter, Segment(0, time.time(), 0, 2), warmup=0, errors=[])


def diagnosed(live: LiveDiagnosis, step: int) -> None:
    live.record(np.tile([float(step)] * 3 + [10.0, np.nan, np.nan], (2, 1)), rows(step - 9, step), step, step)
    live.diagnose(step)


def events(path) -> list[dict]:
    return [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]


def test_a_finding_whose_ranks_or_count_changed_is_said_once_as_an_update_never_as_gone(
    tmp_path, rules, capsys
):
    # A jitter on rank 1 read as on no rank in particular, 4 spikes on rank 0 as 5 on all: each was said as new
    # and, in the same step, "no longer found" as the one before.
    live = live_run(tmp_path, console=True)
    rules += [[JITTER_ON_1, SPIKES_ON_0], [JITTER, SPIKES], [JITTER, SPIKES], []]
    for step in (10, 20, 30, 40):
        diagnosed(live, step)
    live.reporter.close()
    said = [(e["type"], e["step"]) for e in events(tmp_path) if e["type"] in ("finding", "cleared")]
    assert said == [("finding", 10)] * 2 + [("finding", 20)] * 2 + [("cleared", 40)]
    assert [e.get("updated") for e in events(tmp_path) if e["type"] == "finding"] == [None, None, True, True]
    assert [e["findings"] for e in events(tmp_path) if e["type"] == "cleared"] == [
        ["TIMING.JITTER", "CONVERGENCE.SPIKE"]
    ]
    out = " ".join(capsys.readouterr().out.split())
    assert "pytscope step 20, updated: [MED] Step time is unstable (TIMING.JITTER)" in out
    assert "no longer found: Step time is unstable: rank 1" not in out
    assert "no longer found: 4 loss spike(s)" not in out
    assert "pytscope step 40: no longer found: Step time is unstable (TIMING.JITTER)" in out


def test_an_integrations_finding_under_the_same_key_stands_in_for_the_rules_one(tmp_path, rules):
    # The untrained alert (CONVERGENCE.SKIPPED_STEPS, said by the integration) and the rule's finding share a
    # key: the rule's going leaves the alert's latest word standing, neither gone nor said again.
    live = live_run(tmp_path)
    alert = finding(
        "CONVERGENCE.SKIPPED_STEPS", "No optimizer step for 60 batches since step 5", (), Severity.HIGH
    )
    live.add(alert, 8)
    rules += [[finding("CONVERGENCE.SKIPPED_STEPS", "The optimizer skipped 6 of 10 steps")], []]
    diagnosed(live, 10)
    diagnosed(live, 20)
    live.reporter.close()
    assert [(e["type"], e["step"]) for e in events(tmp_path) if e["type"] in ("finding", "cleared")] == [
        ("finding", 8)
    ]
    assert live.findings == [alert]


def test_an_alarm_said_live_that_the_run_summary_does_not_make_is_said_gone_with_it(
    tmp_path, monkeypatch, capsys
):
    # A jitter said at step 60 was gone from the summary's findings with nothing said: the console's last word
    # on it stood, and the tracker's count of MED findings dropped by one.
    live = live_run(tmp_path, console=True)
    canned = [[JITTER, finding("EFFICIENCY.RECOVERABLE", "hint", (), Severity.LOW)]]
    monkeypatch.setattr("pytscope_core.analysis.run_rules", lambda analysis, **_: canned.pop(0))
    live.record(np.tile([60.0] * 3 + [60.0, np.nan, np.nan], (2, 1)), rows(1, 60), 1, 60)
    live.diagnose(60)
    monkeypatch.undo()  # the summary's own rules: six 1 ms phases, every step alike, make no jitter
    assert live.standing() == [JITTER]  # (a LOW hint is no alarm)
    summary = live.reporter.summary(live.standing())
    live.reporter.close()
    assert "TIMING.JITTER" not in {f.code for f in summary.findings}
    out = " ".join(capsys.readouterr().out.split())
    gone = "pytscope step 60, run summary: no longer found: Step time is unstable (TIMING.JITTER)"
    assert gone in out and out.index(gone) < out.index("Run summary")
    cleared = [e for e in events(tmp_path) if e["type"] == "cleared"]
    assert cleared == [{"type": "cleared", "step": 60, "findings": ["TIMING.JITTER"], "summary": True}]


def test_a_standing_alarm_the_summary_makes_on_other_ranks_is_not_gone():
    summary = [finding("TIMING.JITTER", "Step time is unstable: rank 3 is slow now and then", (3,))]
    assert same_findings([JITTER_ON_1], summary) == {JITTER_ON_1.key: summary[0]}
    # Several findings of one code at once (DATA.UNEVEN_SHARDS, one per rank): told apart by their ranks.
    uneven = [finding("DATA.UNEVEN_SHARDS", f"Rank {r} ran out of batches first", (r,)) for r in (1, 2, 3)]
    assert same_findings(uneven[:2], uneven[1:]) == {uneven[1].key: uneven[1]}
    assert same_findings([uneven[0]], uneven[1:]) == {}
    assert same_findings([SPIKES_ON_0, JITTER_ON_1], [SPIKES]) == {SPIKES_ON_0.key: SPIKES}
