"""Scaling: throughput, speedup and efficiency checked against the formula on recorded runs of 1, 2, 4 workers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from runfactory import phases_of, write_run

from pytscope_core.cli import main
from pytscope_core.compare import compare_runs
from pytscope_core.records import COL, NCOLS
from pytscope_core.rundir import load_run
from pytscope_core.scaling import render_scaling, scaling_points, write_scaling_plot

STEPS = 200
WARMUP = 5
STEP_MS = {1: 10.0, 2: 11.0, 4: 12.5}  # counted step time per worker count
GLOBAL_BATCH = 64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, w: int, per_rank_batch: float | None, loss=None, name: str | None = None, meta=None):
    comm = STEP_MS[w] - 10.0
    ph = phases_of(STEPS, w, {"data": 1.0, "forward": 4.0, "backward": 4.0, "comm": comm, "optimizer": 1.0})
    ph[:WARMUP] *= 10  # slow warm-up steps must not count in throughput
    return write_run(
        tmp_path / (name or f"w{w}"), ph, samples=per_rank_batch, loss=loss, warmup=WARMUP, meta=meta
    )


@pytest.fixture
def strong_runs(tmp_path):
    """Same global batch (64) split over 1, 2, 4 workers; the loss falls 0.01 per step from 2.0."""
    loss = 2.0 - 0.01 * np.arange(1, STEPS + 1)
    return [_run(tmp_path, w, GLOBAL_BATCH / w, loss=loss) for w in (4, 1, 2)]  # any order in


def test_numbers_match_the_formula(strong_runs):
    s = scaling_points([load_run(p) for p in strong_runs])
    assert s.unit == "samples/s"
    assert [p.world_size for p in s.points] == [1, 2, 4]
    t1 = GLOBAL_BATCH / (STEP_MS[1] / 1e3)
    for p in s.points:
        t_w = GLOBAL_BATCH / (STEP_MS[p.world_size] / 1e3)
        assert p.throughput == pytest.approx(t_w, rel=1e-9)
        assert p.speedup == pytest.approx(t_w / t1, rel=1e-9)
        assert p.efficiency == pytest.approx(t_w / (p.world_size * t1), rel=1e-9)
        assert p.global_batch == pytest.approx(GLOBAL_BATCH)
        assert p.median_step_ms == pytest.approx(STEP_MS[p.world_size])
    assert s.base_is_single_worker and not s.warnings
    four = s.points[2]
    assert four.comm_share == pytest.approx(2.5 / 12.5)
    assert four.data_share == pytest.approx(1.0 / 12.5)
    assert sum(four.phase_shares.values()) == pytest.approx(1.0)


def test_time_and_worker_seconds_to_target(strong_runs):
    s = scaling_points([load_run(p) for p in strong_runs], target_loss=1.0)
    for p in s.points:
        # loss 2 - 0.01 * step reaches 1.0 at step 100: five slow warm-up steps, then 95 counted ones.
        expected = (WARMUP * 10 + (100 - WARMUP)) * STEP_MS[p.world_size] / 1e3
        assert p.step_at_target == 100
        assert p.seconds_to_target == pytest.approx(expected)
        assert p.worker_seconds_to_target == pytest.approx(expected * p.world_size)


def test_target_never_reached_is_null(strong_runs, capsys):
    rc = main(["scaling", *map(str, strong_runs), "--json", "--target-loss", "-5"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert all(
        p["seconds_to_target"] is None and p["worker_seconds_to_target"] is None for p in data["points"]
    )
    assert any("never reached" in w for w in data["warnings"])


def test_json_keys_and_plot_is_a_png(strong_runs, tmp_path, capsys):
    plot = tmp_path / "out" / "scaling.png"
    rc = main(["scaling", *map(str, strong_runs), "--json", "--plot", str(plot), "--target-loss", "1.0"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["unit"] == "samples/s"
    for key in (
        "world_size",
        "throughput",
        "speedup",
        "efficiency",
        "seconds_to_target",
        "worker_seconds_to_target",
    ):
        assert all(key in p for p in data["points"])
    assert [p["world_size"] for p in data["points"]] == [1, 2, 4]
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert plot.stat().st_size > 5000  # a drawn figure, not an empty canvas


def test_global_batch_warning(tmp_path):
    weak = [load_run(_run(tmp_path, w, 32.0)) for w in (1, 2, 4)]  # per-rank 32: global 32, 64, 128
    s = scaling_points(weak)
    assert len(s.warnings) == 1 and "global batch" in s.warnings[0]
    assert "4 workers: 128" in s.warnings[0]
    # The same throughput formula still holds: the global batch is per-rank samples x W.
    assert s.points[2].throughput == pytest.approx(128 / 0.0125)
    assert not scaling_points(weak, weak=True).warnings  # the per-rank batch is held, as stated


def test_steps_per_second_when_a_batch_size_is_missing(tmp_path):
    runs = [load_run(_run(tmp_path, 1, 64.0)), load_run(_run(tmp_path, 2, None))]
    s = scaling_points(runs)
    assert s.unit == "steps/s"
    assert s.points[0].throughput == pytest.approx(100.0)
    assert s.points[1].throughput == pytest.approx(1e3 / 11.0)
    assert any("steps/s" in w for w in s.warnings)


def test_no_single_worker_run_uses_the_smallest_as_base(tmp_path):
    runs = [load_run(_run(tmp_path, w, GLOBAL_BATCH / w)) for w in (2, 4)]
    s = scaling_points(runs)
    assert s.base_world_size == 2 and not s.base_is_single_worker
    t2, t4 = GLOBAL_BATCH / 0.011, GLOBAL_BATCH / 0.0125
    assert s.points[1].speedup == pytest.approx(t4 / t2)
    assert s.points[1].efficiency == pytest.approx(t4 / (2 * t2))
    assert any("no 1-worker run" in w for w in s.warnings)


def test_render_lists_every_worker_count(strong_runs, tmp_path):
    import io

    from rich.console import Console

    s = scaling_points([load_run(p) for p in strong_runs], target_loss=1.0)
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(render_scaling(s))
    text = console.file.getvalue()
    assert "throughput in samples/s" in text and "to target s" in text and "worker-s" in text
    assert "6400.0" in text and "1.00x" in text
    assert write_scaling_plot(s, tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


def test_an_80_column_terminal_shows_every_header_and_number_whole(strong_runs):
    import io

    from rich.console import Console

    s = scaling_points([load_run(p) for p in strong_runs], target_loss=1.0)
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(render_scaling(s))
    text = console.file.getvalue()
    assert "…" not in text
    for header in ("workers  samples/s  speedup  efficiency  step ms", "compute   comm  wait   data  run"):
        assert header in text
    assert "6400.0" in text and "7.2  w4" in text


@pytest.mark.parametrize("make", ["missing", "junk", "file"])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, make):
    good = _run(tmp_path, 1, 64.0)
    bad = tmp_path / "bad"
    if make == "junk":
        bad.mkdir()
        (bad / "notes.txt").write_text("not a run")
    elif make == "file":
        bad.write_text("x")
    rc = main(["scaling", str(good), str(bad)])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and str(bad) in err


def test_a_run_without_counted_steps_is_left_out_and_changes_no_other_point(strong_runs, tmp_path, capsys):
    """A 1-worker run killed before its first gather sorts first and has no batch sizes: it is neither the
    base nor a reason to fall back to steps/s."""
    from pytscope_core.rundir import RunWriter

    RunWriter(tmp_path / "early", {"world_size": 1}).close()
    warm = phases_of(3, 1, {"forward": 1.0})  # 3 quick steps, all in the 5-step warm-up
    warm_only = write_run(tmp_path / "warm", warm, samples=64.0, warmup=WARMUP)
    whole = scaling_points([load_run(p) for p in strong_runs])
    s = scaling_points([load_run(p) for p in [tmp_path / "early", warm_only, *strong_runs]])
    assert s.unit == "samples/s" and [p.world_size for p in s.points] == [1, 2, 4]
    assert [p.efficiency for p in s.points] == [p.efficiency for p in whole.points]
    assert any("early has no counted steps" in n for n in s.warnings)
    assert any("warm has no counted steps" in n for n in s.warnings)
    assert main(["scaling", str(tmp_path / "early")]) == 2
    assert "nothing to scale" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_a_plot_that_cannot_be_written_exits_2_before_the_table_is_printed(
    strong_runs, tmp_path, capsys, where
):
    (tmp_path / "a_file").write_text("")
    plot = tmp_path if where == "folder" else tmp_path / "a_file" / "scaling.png"
    rc = main(["scaling", *map(str, strong_runs), "--plot", str(plot)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith(f"pytscope scaling: cannot write {plot}: ") and len(err.strip().splitlines()) == 1


def test_bad_target_loss_exits_2(tmp_path, capsys):
    rc = main(["scaling", str(_run(tmp_path, 1, 64.0)), "--target-loss", "nan"])
    assert rc == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_run_whose_communication_is_not_measured_says_so(tmp_path, capsys):
    """FSDP1 (or DeepSpeed) hides communication in compute: its comm and wait are unknown, not zero."""
    blind = {"parallelism": "fsdp1", "comm_measured": False}
    runs = [_run(tmp_path, 1, 64.0), _run(tmp_path, 4, 16.0, meta=blind)]
    s = scaling_points([load_run(p) for p in runs])
    measured, four = s.points
    assert measured.comm_share == pytest.approx(0.0) and four.world_size == 4
    assert np.isnan(four.comm_share) and np.isnan(four.sync_wait_share)
    assert np.isnan(four.phase_shares["comm"])
    assert four.throughput == pytest.approx(64 / 0.0125)  # throughput does not depend on the phases
    (warning,) = s.warnings
    assert str(runs[1]) in warning and "FSDP1" in warning and "not measured" in warning
    assert main(["scaling", *map(str, runs), "--json"]) == 0
    point = json.loads(capsys.readouterr().out)["points"][1]
    assert point["comm_share"] is None and point["phases"]["comm"] is None


def test_a_job_resumed_on_fewer_ranks_is_a_point_at_each_size(tmp_path, capsys):
    # 2 ranks x 16 samples in 10 ms, then 1 rank x 16 samples in 8 ms: 3,200 and 2,000 samples/s. One point at
    # 2 workers would credit 2 workers with the blend of both.
    from runfactory import write_launches

    run = write_launches(tmp_path / "elastic", [(2, 100, 10.0), (1, 100, 8.0)])
    s = scaling_points([load_run(run)])
    assert [(p.world_size, p.segments) for p in s.points] == [(1, (1,)), (2, (0,))]
    assert [p.throughput for p in s.points] == pytest.approx([2000.0, 3200.0])
    assert s.points[1].efficiency == pytest.approx(3200.0 / (2 * 2000.0))
    assert any("ran on 2 and then 1 ranks" in w for w in s.warnings)
    assert main(["scaling", str(run), "--json"]) == 0
    assert [p["segments"] for p in json.loads(capsys.readouterr().out)["points"]] == [[1], [0]]
    assert main(["scaling", str(run)]) == 0
    assert "elastic (segment 0)" in " ".join(capsys.readouterr().out.split())


def test_a_job_resumed_on_fewer_ranks_from_an_earlier_checkpoint_keeps_each_size_apart(tmp_path):
    # 4 ranks run steps 1-200 (10 ms); 2 ranks resume from step 150's checkpoint (8 ms). Steps 151-200 of the
    # first launch are replayed work on every rank, the 2 ranks the resumed job no longer has included.
    from runfactory import write_launches

    run = load_run(write_launches(tmp_path / "r", [(4, 200, 10.0), (2, 100, 8.0, 151)]))
    s = scaling_points([run])
    assert [(p.world_size, p.steps_counted) for p in s.points] == [(2, 100), (4, 150)]
    assert [p.throughput for p in s.points] == pytest.approx([2 * 16 / 8e-3, 4 * 16 / 10e-3])


def test_steps_a_killed_ranks_lost_records_leave_out_are_not_read_as_less_throughput(tmp_path):
    # Rank 1 killed after step 120: its rows since its last gather are lost, rank 0's are written. Summed over
    # the ranks that are there, those steps had half the samples: the run read as 25-105% slower in `compare`
    # and `scaling` (a failed --fail-on-regression), with no word of why.
    base = _run(tmp_path, 2, GLOBAL_BATCH / 2, name="base")
    killed = _run(tmp_path, 2, GLOBAL_BATCH / 2, name="killed")
    rows = np.fromfile(killed / "steps.f64").reshape(-1, NCOLS)
    lost = (rows[:, COL["rank"]] == 1) & (rows[:, COL["step"]] > 120)
    rows[~lost].tofile(killed / "steps.f64")
    s = scaling_points([load_run(base), load_run(killed)])
    assert s.points[1].throughput == pytest.approx(s.points[0].throughput, rel=1e-9)
    assert any("killed: 80 counted step(s) with some ranks' records missing" in w for w in s.warnings)
    assert compare_runs(load_run(base), load_run(killed)).ms_per_sample_b == pytest.approx(
        compare_runs(load_run(base), load_run(base)).ms_per_sample_b, rel=1e-9
    )
