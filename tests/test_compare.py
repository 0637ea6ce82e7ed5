"""compare: two recorded runs with a known 20% slowdown, a straggler that appears, findings that come and go."""

from __future__ import annotations

import io
import json
import math

import pytest
from runfactory import phases_of, write_run

from pytscope_core.cli import main
from pytscope_core.compare import compare_runs, render_comparison
from pytscope_core.findings import Finding, Severity
from pytscope_core.rundir import load_run

STEPS = 200


def _finding(code: str, ranks: tuple[int, ...]) -> Finding:
    return Finding(code, Severity.LOW, f"test {code}", "detail", "do nothing", ranks=ranks, steps=(10,))


@pytest.fixture
def pair(tmp_path):
    """A: 10 ms steps on 4 ranks. B: 12 ms steps (+20%) because rank 3 does 2 ms more forward work."""
    a = phases_of(STEPS, 4, {"data": 1.0, "forward": 4.0, "backward": 4.0, "comm": 0.5, "optimizer": 0.5})
    b = phases_of(STEPS, 4, {"data": 1.0, "forward": 4.0, "backward": 4.0, "comm": 2.5, "optimizer": 0.5})
    b[:, 3, 1] = 6.0  # rank 3's forward: the others wait 2 ms longer in the all-reduce
    b[:, 3, 3] = 0.5
    kept, moved = _finding("TEST.KEPT", ()), _finding("TEST.MOVED", (1,))
    run_a = write_run(tmp_path / "a", a, findings=(kept, moved, _finding("TEST.GONE", ())))
    run_b = write_run(tmp_path / "b", b, findings=(kept, _finding("TEST.MOVED", (2,))))
    return run_a, run_b


def test_known_slowdown(pair):
    c = compare_runs(load_run(pair[0]), load_run(pair[1]))
    assert c.median_ms_a == pytest.approx(10.0) and c.median_ms_b == pytest.approx(12.0)
    assert c.median_change_pct == pytest.approx(20.0)
    assert c.p95_change_pct == pytest.approx(20.0)
    comm = next(p for p in c.phases if p.name == "comm")
    # B's comm share: (3 x 2.5 + 0.5) / (4 x 12) against A's 0.5 / 10.
    assert comm.share_change == pytest.approx(100 * ((3 * 2.5 + 0.5) / 48 - 0.05))
    rank3 = c.ranks[3]
    assert rank3.local_ms_a == pytest.approx(9.5) and rank3.local_ms_b == pytest.approx(11.5)
    assert rank3.straggler_b and not rank3.straggler_a
    # Of B's comm, the 2 ms the others wait for rank 3 is sync wait, not transfer: said apart.
    assert c.transfer_share_b == pytest.approx(0.5 / 12) and c.sync_wait_share_b == pytest.approx(3 * 2 / 48)
    assert c.sync_wait_share_a == pytest.approx(0.0)
    assert c.ranks[0].change_pct == pytest.approx(0.0)
    assert c.regressed(10.0) and not c.regressed(25.0)


def test_a_slow_step_every_tenth_is_a_regression_the_median_hides(tmp_path, capsys):
    # Rank 1's forward takes 50 ms more every 10th step; the others wait in the all-reduce. The median step
    # does not move, the job's wall time grows by half.
    a = phases_of(STEPS, 2, {"data": 1.0, "forward": 4.0, "backward": 4.0, "comm": 0.5, "optimizer": 0.5})
    b = a.copy()
    b[::10, 1, 1] += 50.0
    b[::10, 0, 3] += 50.0
    run_a, run_b = write_run(tmp_path / "a", a), write_run(tmp_path / "b", b)
    c = compare_runs(load_run(run_a), load_run(run_b))
    assert c.median_change_pct == pytest.approx(0.0)
    assert c.slowdown == ("mean step time", pytest.approx(50.0, abs=2))
    assert main(["compare", str(run_a), str(run_b), "--fail-on-regression", "10"]) == 1
    assert "mean step time +" in capsys.readouterr().err


def test_more_samples_per_step_is_not_a_regression(tmp_path):
    # Gradient accumulation 1 -> 4: steps 3.5x longer, 4x the samples: faster per sample.
    a = phases_of(STEPS, 2, {"data": 0.5, "forward": 1.0, "backward": 1.0, "comm": 0.3, "optimizer": 0.2})
    b = phases_of(STEPS, 2, {"data": 2.0, "forward": 4.0, "backward": 4.0, "comm": 1.0, "optimizer": 0.5})
    c = compare_runs(
        load_run(write_run(tmp_path / "a", a, samples=32.0)),
        load_run(write_run(tmp_path / "b", b, samples=128.0)),
    )
    assert c.median_change_pct > 200
    what, change = c.slowdown
    assert what == "time per sample" and change == pytest.approx(100 * (11.5 / 128 / (3.0 / 32) - 1))
    assert not c.regressed(0.0)
    assert c.to_dict()["timing"]["ms_per_sample"]["a"] == pytest.approx(3.0 / 64)


def test_findings_that_appeared_and_disappeared(pair):
    c = compare_runs(load_run(pair[0]), load_run(pair[1]))
    appeared = {f.key for f in c.appeared}
    disappeared = {f.key for f in c.disappeared}
    assert ("DIST.STRAGGLER", (3,)) in appeared
    assert ("TEST.MOVED", (2,)) in appeared and ("TEST.MOVED", (1,)) in disappeared
    assert ("TEST.GONE", ()) in disappeared
    assert ("TEST.KEPT", ()) in {f.key for f in c.unchanged}
    assert not appeared & disappeared


def test_fail_on_regression_exit_codes(pair, capsys):
    a, b = map(str, pair)
    assert main(["compare", a, b, "--fail-on-regression", "10"]) == 1
    assert "+20.0%" in capsys.readouterr().err
    assert main(["compare", a, b, "--fail-on-regression", "25"]) == 0
    assert main(["compare", b, a, "--fail-on-regression", "0"]) == 0  # B -> A is a speed-up


def test_json_output(pair, capsys):
    assert main(["compare", *map(str, pair), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["timing"]["median_ms"]["change_pct"] == pytest.approx(20.0)
    assert [r["rank"] for r in data["per_rank"]] == [0, 1, 2, 3]
    assert "DIST.STRAGGLER" in {f["code"] for f in data["findings"]["appeared"]}
    assert set(data["timing"]["phases"]) == {"data", "forward", "backward", "comm", "optimizer", "other"}


def test_render_shows_change_and_findings(pair):
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(render_comparison(compare_runs(load_run(pair[0]), load_run(pair[1]))))
    text = console.file.getvalue()
    assert "+20.0%" in text and "straggler now" in text
    assert "  transfer" in text and "  sync wait" in text  # comm's parts, the straggler's bill apart
    assert "appeared:" in text and "disappeared:" in text and "DIST.STRAGGLER rank 3" in text


@pytest.mark.parametrize("make", ["missing", "junk", "no_steps"])
def test_bad_input_exits_2_with_one_line(pair, tmp_path, capsys, make):
    from pytscope_core.rundir import RunWriter

    bad = tmp_path / "bad"
    if make == "junk":
        bad.mkdir()
        (bad / "x.bin").write_bytes(b"\x00\x01")
    elif make == "no_steps":  # killed before its first gather: a regression gate must not pass on it
        RunWriter(bad, {"world_size": 4}).close()
    rc = main(["compare", str(pair[0]), str(bad), "--fail-on-regression", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_threshold_exits_2(pair, capsys):
    assert main(["compare", *map(str, pair), "--fail-on-regression", "-3"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_communication_not_measured_in_one_run_is_not_a_change(tmp_path, capsys):
    """A DDP run against the same job under FSDP1, where communication hides in compute: B's comm is unknown,
    so no share change is claimed, and both the console and the JSON say why."""
    ph = phases_of(STEPS, 2, {"data": 1.0, "forward": 4.0, "backward": 4.0, "comm": 0.5, "optimizer": 0.5})
    blind = {"parallelism": "fsdp1", "comm_measured": False}
    a = write_run(tmp_path / "a", ph)
    b = write_run(tmp_path / "b", ph, meta=blind)
    c = compare_runs(load_run(a), load_run(b))
    comm = next(p for p in c.phases if p.name == "comm")
    assert comm.measured_a and not comm.measured_b
    assert comm.share_a == pytest.approx(0.05) and math.isnan(comm.share_b) and math.isnan(comm.share_change)
    assert all(p.measured_a and p.measured_b for p in c.phases if p.name != "comm")
    assert c.comm_note_a is None and "FSDP1" in (c.comm_note_b or "")
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(render_comparison(c))
    text = console.file.getvalue()
    assert "not measured" in text.split("Phases")[1] and "B: communication not measured" in text
    assert "run B's forward and backward include its unmeasured communication" in text
    assert main(["compare", str(a), str(b), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["a"]["comm_measured"] and not data["b"]["comm_measured"]
    assert data["timing"]["phases"]["comm"]["share_b"] is None
    assert data["timing"]["phases"]["comm"]["measured_b"] is False


def test_runs_on_different_numbers_of_ranks_point_to_scaling(tmp_path):
    from rich.console import Console

    ms = {"forward": 4.0, "backward": 4.0, "comm": 0.5}
    run_a = write_run(tmp_path / "a", phases_of(STEPS, 2, ms))
    run_b = write_run(tmp_path / "b", phases_of(STEPS, 4, ms))
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_comparison(compare_runs(load_run(run_a), load_run(run_b))))
    text = console.file.getvalue()
    assert "ran on 2 and 4 ranks" in text and text.count("not in A") == 2  # ranks 2 and 3
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_comparison(compare_runs(load_run(run_a), load_run(run_a))))
    assert "ranks:" not in console.file.getvalue()


def test_a_run_resumed_on_another_number_of_ranks_is_said_to_pool_its_launches(tmp_path, capsys):
    from runfactory import write_launches

    steady = write_run(tmp_path / "steady", phases_of(STEPS, 2, {"forward": 4.0, "backward": 6.0}))
    elastic = write_launches(tmp_path / "elastic", [(2, 100, 10.0), (1, 100, 8.0)])
    c = compare_runs(load_run(steady), load_run(elastic))
    assert c.launches_a == () and c.launches_b == (2, 1)
    assert main(["compare", str(steady), str(elastic)]) == 0
    assert "B ran on 2 and then 1 ranks" in " ".join(capsys.readouterr().out.split())
    assert main(["compare", str(steady), str(elastic), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["a"]["launch_world_sizes"] is None and data["b"]["launch_world_sizes"] == [2, 1]


def test_a_finding_in_both_runs_says_when_its_severity_changed(tmp_path, capsys):
    ph = phases_of(STEPS, 2, {"forward": 4.0, "backward": 4.0, "comm": 0.5})
    low = Finding("TEST.KEPT", Severity.LOW, "t", "d", "r")
    med = Finding("TEST.KEPT", Severity.MED, "t", "d", "r")
    a, b = write_run(tmp_path / "a", ph, findings=(low,)), write_run(tmp_path / "b", ph, findings=(med,))
    assert main(["compare", str(a), str(b)]) == 0
    assert "[MED] t (TEST.KEPT) (was LOW in A)" in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--json"]) == 0
    (kept,) = json.loads(capsys.readouterr().out)["findings"]["unchanged"]
    assert (kept["severity"], kept["severity_in_a"]) == ("MED", "LOW")


def test_a_findings_line_names_one_rank_as_a_rank_and_many_in_one_line():
    from pytscope_core.compare import _finding_line
    from pytscope_core.findings import Finding, Severity

    def line(ranks: tuple[int, ...]) -> str:
        return _finding_line(Finding("DIST.STRAGGLER", Severity.HIGH, "Straggler", "", "", ranks=ranks))

    assert line((1,)).endswith("(DIST.STRAGGLER rank 1)")
    assert line((1, 3)).endswith("(DIST.STRAGGLER ranks 1, 3)")
    assert line(tuple(range(64))).endswith("ranks 0, 1, 2, 3, 4, 5, 6, 7 and 56 more)")
