"""report --plots: three real PNGs, including for a long many-rank run with spikes and a non-finite loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
from runfactory import phases_of, write_run

from pytscope_core.cli import main
from pytscope_core.plots import block_reduce, write_report_plots
from pytscope_core.rundir import load_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAMES = {"local_work.png", "phases.png", "loss.png"}


def test_report_plots_writes_three_pngs(tmp_path, capsys):
    ph = phases_of(300, 2, {"data": 1, "forward": 4, "backward": 4, "comm": 1, "optimizer": 1}, noise=0.05)
    ph[:, 1, 1] += 1.0  # rank 1 straggles
    loss = 2.0 - np.linspace(0, 1, 300)
    loss[150] = 5.0  # a spike
    run = write_run(tmp_path / "run", ph, loss=loss, samples=32.0)
    out = tmp_path / "plots"
    assert main(["report", str(run), "--plots", str(out)]) == 0
    printed = "".join(capsys.readouterr().out.split())  # rich wraps long paths
    assert {p.name for p in out.iterdir()} == NAMES
    for name in NAMES:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC and name in printed
    # With --json the plots are written too, and said on stderr: stdout stays one JSON document.
    assert main(["report", str(run), "--json", "--plots", str(tmp_path / "json-plots")]) == 0
    captured = capsys.readouterr()
    assert {p.name for p in (tmp_path / "json-plots").iterdir()} == NAMES
    assert json.loads(captured.out)["run"]["steps"] == 300 and "wrote" in captured.err


def test_long_many_rank_run_with_nonfinite_loss(tmp_path):
    steps, ranks = 3000, 40
    ph = phases_of(steps, ranks, {"data": 1, "forward": 4, "backward": 4, "comm": 1}, noise=0.05)
    loss = np.linspace(3, 1, steps)
    loss[2500:] = np.inf
    run = load_run(write_run(tmp_path / "run", ph, loss=loss))
    paths = write_report_plots(run, tmp_path / "plots")
    assert {p.name for p in paths} == NAMES
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def test_empty_run_still_writes_plots(tmp_path):
    run = load_run(write_run(tmp_path / "run", np.zeros((0, 2, 6))))
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in write_report_plots(run, tmp_path / "plots"))


def test_block_reduce_takes_block_medians():
    steps = np.arange(1, 1001)
    values = np.stack([np.arange(1000.0), np.full(1000, 7.0)], axis=1)
    x, y = block_reduce(steps, values, 10)
    assert x.shape == (10,) and y.shape == (10, 2)
    assert x[0] == pytest.approx(50.5) and y[0, 0] == pytest.approx(49.5) and np.all(y[:, 1] == 7.0)
    short_x, short_y = block_reduce(steps[:5], values[:5], 10)
    assert short_y is values[:5] or np.array_equal(short_y, values[:5])
