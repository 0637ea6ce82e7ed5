"""trace: the Chrome trace of a recorded run loads, holds every rank and phase, and keeps time in order."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from runfactory import T0, phases_of, write_run

from pytscope_core.cli import main
from pytscope_core.findings import Finding, Severity
from pytscope_core.records import PHASES

STEPS, RANKS, RESTART_AT = 60, 3, 40


@pytest.fixture
def run_dir(tmp_path):
    ph = phases_of(STEPS, RANKS, {p: 1.0 + i for i, p in enumerate(PHASES)}, seed=1, noise=0.1)
    segment = (np.arange(1, STEPS + 1) >= RESTART_AT).astype(float)  # a resume at step 40
    finding = Finding("TEST.MARK", Severity.MED, "marked", "d", "r", ranks=(1,), steps=(12, 13))
    return write_run(
        tmp_path / "run", ph, loss=np.linspace(2, 1, STEPS), segment=segment, findings=(finding,)
    )


def _trace(run_dir, tmp_path, capsys, *extra):
    out = tmp_path / "trace.json"
    assert main(["trace", str(run_dir), "-o", str(out), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_every_rank_and_phase_with_monotonic_time(run_dir, tmp_path, capsys):
    trace, printed = _trace(run_dir, tmp_path, capsys)
    assert trace["displayTimeUnit"] == "ms"
    assert "canonical" in trace["otherData"]["phase_order"]
    assert trace["otherData"]["origin_epoch_s"] == pytest.approx(T0)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(RANKS)}
    slices = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            slices[e["pid"]].append(e)
    assert set(slices) == set(range(RANKS))
    for _pid, xs in slices.items():
        assert {e["name"] for e in xs if e["cat"] == "phase"} == set(PHASES)
        ts = [e["ts"] for e in xs]
        assert ts == sorted(ts)
        steps = [e for e in xs if e["cat"] == "step"]
        assert len(steps) == STEPS
        # Every phase lies inside its step's slice, and a step's phases add up to its wall.
        by_step = {e["args"]["step"]: e for e in steps}
        for e in xs:
            if e["cat"] == "phase":
                outer = by_step[e["args"]["step"]]
                assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1e-3
    first = min(s["ts"] for s in slices[0])
    assert first == 0.0
    assert f"all {STEPS} steps" in printed


def test_restart_and_findings_are_instants(run_dir, tmp_path, capsys):
    trace, _ = _trace(run_dir, tmp_path, capsys)
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    restarts = [e for e in instants if e["cat"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["args"]["first_step"] == RESTART_AT
    marks = [e for e in instants if e["cat"] == "finding" and e["args"]["code"] == "TEST.MARK"]
    assert [e["pid"] for e in marks] == [1]
    step12 = next(
        e
        for e in trace["traceEvents"]
        if e.get("cat") == "step" and e["pid"] == 1 and e["args"]["step"] == 12
    )
    assert marks[0]["ts"] == pytest.approx(step12["ts"])


def test_max_steps_keeps_the_latest(run_dir, tmp_path, capsys):
    trace, printed = _trace(run_dir, tmp_path, capsys, "--max-steps", "10")
    steps = {e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"}
    assert steps == set(range(STEPS - 9, STEPS + 1))
    assert "latest 10 of 60 steps" in printed
    assert not [
        e for e in trace["traceEvents"] if e.get("cat") == "finding" and e["args"]["code"] == "TEST.MARK"
    ]


@pytest.mark.parametrize("make", ["missing", "junk", "unwritable"])
def test_bad_input_exits_2_with_one_line(run_dir, tmp_path, capsys, make):
    target, out = str(run_dir), tmp_path / "t.json"
    if make == "missing":
        target = str(tmp_path / "nope")
    elif make == "junk":
        (tmp_path / "junk").mkdir()
        target = str(tmp_path / "junk")
    else:
        out.mkdir()  # the output path is a directory
    rc = main(["trace", target, "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_missing_output_flag_exits_2(run_dir, capsys):
    assert main(["trace", str(run_dir)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
