"""Text checks of the rendered summary: every section, shares that add to 100, small output for long runs."""

from __future__ import annotations

import io
import re

import numpy as np

from pytscope_core.arrays import RunArrays
from pytscope_core.context import RunContext
from pytscope_core.findings import Finding, Severity
from pytscope_core.render import percentages, render_findings, render_summary, sparkline
from pytscope_core.summary import summarize


def text_of(renderable) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def run(
    steps: int = 300, ranks: int = 4, slow_rank: int | None = 3, loss: np.ndarray | None = None
) -> RunArrays:
    rng = np.random.default_rng(0)
    compute = 10.0 * (1 + 0.04 * rng.standard_normal((steps, ranks)))
    if slow_rank is not None:
        compute[:, slow_rank] *= 1.15
    ph = np.zeros((steps, ranks, 6), dtype=np.float32)
    ph[:, :, 0], ph[:, :, 1], ph[:, :, 2], ph[:, :, 4], ph[:, :, 5] = (
        0.2,
        0.4 * compute,
        0.6 * compute,
        0.5,
        0.3,
    )
    local = ph.sum(axis=2)
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + 0.5
    if loss is None:
        loss = np.linspace(3, 1, steps)
    return RunArrays.from_arrays(ph, loss=loss)


def test_every_section_is_rendered():
    out = text_of(render_summary(summarize(run(), RunContext(world_size=4))))
    for heading in (
        "Run summary",
        "Step-time breakdown",
        "Convergence",
        "Distributed",
        "Efficiency budget",
        "Findings",
    ):
        assert heading in out
    assert "world size  4" in out and "restarts    0" in out and "goodput" in out
    assert "trend: improving" in out
    assert "◀ straggler" in out and "DIST.STRAGGLER" in out and "Rank 3 is a straggler" in out
    assert "sync wait (imbalance)" in out and "MFU n/a" in out
    assert "estimate" in out


def test_printed_phase_shares_sum_to_100():
    out = text_of(render_summary(summarize(run(), RunContext(world_size=4))))
    breakdown = out.split("Step-time breakdown")[1].split("Convergence")[0]
    shares = [
        float(m)
        for m in re.findall(
            r"^\s*(?:data|forward|backward|comm|optimizer|other)\s+([\d.]+)%", breakdown, re.M
        )
    ]
    assert len(shares) == 6 and abs(sum(shares) - 100.0) < 1e-9
    budget = out.split("Efficiency budget")[1].split("recoverable ")[0]
    lines = [float(m) for m in re.findall(r"\s([\d.]+)%\s", budget)]
    assert abs(sum(lines) - 100.0) < 1e-6


def test_percentages_largest_remainder():
    assert [round(p * 10) for p in percentages([1 / 3, 1 / 3, 1 / 3])] == [334, 333, 333]
    assert percentages([0.0, 0.0]) == [0.0, 0.0]
    assert round(sum(percentages([0.123, 0.456, 0.421, float("nan")])) * 10) == 1000


def test_nonfinite_loss_renders():
    loss = np.linspace(3, 1, 300)
    loss[100], loss[200] = np.inf, np.nan
    out = text_of(render_summary(summarize(run(loss=loss), RunContext(world_size=4))))
    assert "non-finite loss first at step 101" in out and "CONVERGENCE.NONFINITE" in out


def test_sparkline_handles_nonfinite_and_flat():
    assert sparkline([float("nan")]) == ""
    assert sparkline([1.0, 1.0]) == "▁▁"
    assert sparkline([0.0, float("inf"), 1.0]) == "▁ █"


def test_many_ranks_table_is_truncated():
    out = text_of(render_summary(summarize(run(200, 40, slow_rank=7), RunContext(world_size=40))))
    assert "28 ranks omitted" in out
    table = out.split("Distributed")[1].split("omitted")[0]
    assert re.search(r"^7\s", table, re.M)  # the slowest rank is shown


def test_long_run_renders_small():
    steps = 100_000
    out = text_of(render_summary(summarize(run(steps, 2, slow_rank=None), RunContext(world_size=2))))
    assert len(out.encode()) < 20_000
    spark = next(line for line in out.splitlines() if line.startswith("loss  "))
    assert len(spark) <= 6 + 40


def test_empty_run_renders():
    arrays = RunArrays.from_arrays(np.zeros((0, 2, 6)))
    out = text_of(render_summary(summarize(arrays, RunContext(world_size=2, scope_errors=("hook failed",)))))
    assert "No findings." in out and "hook failed" in out and "n/a" in out


def test_render_findings_lists_severity_code_detail_recommendation():
    f = Finding(
        "DATA.INPUT_BOUND", Severity.HIGH, "Training waits for input", "5.00 ms per step", "More workers"
    )
    out = text_of(render_findings([f]))
    assert "[HIGH] Training waits for input" in out and "(DATA.INPUT_BOUND)" in out
    assert "5.00 ms per step" in out and "More workers" in out
    assert text_of(render_findings([])).strip() == "No findings."


def test_a_rank_that_wrote_its_own_rows_to_the_end_is_not_said_to_end_early():
    # Rank 1 wrote its own rows (finish() after the process group was gone) and they reach the last step;
    # rank 2's stop two steps short.
    full = run(steps=100, ranks=3, slow_rank=None)
    phases = full.phases.copy()
    phases[-2:, 2, :] = np.nan
    arrays = RunArrays.from_arrays(phases, loss=np.asarray(full.loss))
    ctx = RunContext(world_size=3, rank_notes=((1, "finish() after the process group was destroyed"),))
    text = text_of(render_summary(summarize(arrays, ctx)))
    assert "records run to the last step (100), written by the rank itself: finish() after" in text
    assert "rank 2" in text and "records end at step 98" in text


def test_a_run_that_sigterm_stopped_on_every_rank_is_not_said_to_be_killed():
    full = run(steps=100, ranks=2, slow_rank=None)
    notes = ((0, "SIGTERM"), (1, "SIGTERM while at step 100 in `forward` for 15 s"))
    text = " ".join(
        text_of(
            render_summary(summarize(full, RunContext(world_size=2, rank_notes=notes, ended=False)))
        ).split()
    )
    assert "no end-of-run summary: SIGTERM stopped every rank" in text and "SIGKILL" not in text
    # One rank's SIGTERM (the launcher's, after the other rank died): the other may have been killed.
    text = " ".join(
        text_of(
            render_summary(summarize(full, RunContext(world_size=2, rank_notes=notes[:1], ended=False)))
        ).split()
    )
    assert "no end-of-run summary: killed (SIGKILL" in text


def test_many_ranks_own_records_stay_a_few_lines():
    # A launcher's SIGTERM on 64 ranks: each wrote its own rows and why; the report lists the ranks whose records
    # end earliest and counts the rest.
    full = run(steps=100, ranks=64, slow_rank=None)
    phases = full.phases.copy()
    phases[-5:, 63, :] = np.nan  # rank 63's records end first
    arrays = RunArrays.from_arrays(phases, loss=np.asarray(full.loss))
    notes = tuple((r, "SIGTERM while at step 100 in `forward`") for r in range(64))
    text = text_of(render_summary(summarize(arrays, RunContext(world_size=64, rank_notes=notes))))
    assert text.count("records run to the last step") == 7 and "rank 63" in text and "end at step 95" in text
    assert "... and 56 more ranks' own records" in text


def test_a_job_relaunched_many_times_on_other_ranks_lists_its_first_and_last_launches(tmp_path):
    from runfactory import write_launches

    from pytscope_core.rundir import load_run

    run_dir = write_launches(tmp_path / "r", [(2 if i % 2 else 4, 20, 10.0) for i in range(40)])
    loaded = load_run(run_dir)
    text = " ".join(text_of(render_summary(summarize(loaded.arrays, loaded.context))).split())
    assert "4 (steps 1-20), then 2 (steps 21-40)" in text
    assert "... 34 more launches ..." in text and "(steps 781-800)" in text


def test_a_report_before_the_first_gather_says_so_not_that_no_loss_was_logged():
    # A running job polled before its first gather read "no loss was logged: pass it to scope.log(loss=...)",
    # elapsed 0.0 s, and 0.0% for every phase and budget line (shares that add up to nothing).
    empty = RunArrays.from_arrays(np.zeros((0, 2, 6)), loss=np.zeros(0))
    out = " ".join(text_of(render_summary(summarize(empty, RunContext(world_size=2, ended=False)))).split())
    assert "no loss was logged" not in out and "0.0%" not in out and "elapsed 0.0 s" not in out
    assert "trend: unknown (no step records yet: each gather, every `interval` steps, writes them" in out
    assert "step time: no step records yet" in out and "elapsed n/a goodput n/a" in out
    assert "forward n/a n/a" in out and "useful compute n/a n/a" in out and "recoverable n/a of wall" in out
    ended = text_of(render_summary(summarize(empty, RunContext(world_size=2))))
    assert "trend: unknown (no step was recorded)" in ended
    # A run with steps and no loss logged is still told how to log it.
    unlogged = text_of(render_summary(summarize(run(loss=np.full(300, np.nan)), RunContext(world_size=4))))
    assert "no loss was logged: pass it to scope.log(loss=...)" in " ".join(unlogged.split())
