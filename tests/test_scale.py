"""Past one machine, without processes: placement, node findings, the one-way gather, heartbeat load, and
rank 0's ingest thread (the real multi-node job is in test_nodes.py)."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest

from pytscope_core import watchdog
from pytscope_core.analysis import diagnose
from pytscope_core.arrays import RunArrays
from pytscope_core.context import RunContext, Segment
from pytscope_core.findings import Finding, Severity
from pytscope_core.gather import HEADER
from pytscope_core.ingest import BackgroundIngest, Gathered
from pytscope_core.live import LiveDiagnosis
from pytscope_core.placement import Placement, local_place
from pytscope_core.records import COL, NCOLS
from pytscope_core.render import render_summary
from pytscope_core.reporter import RunReporter
from pytscope_core.rundir import read_events
from pytscope_core.summary import summarize
from pytscope_core.watchdog import beat_period, classify_hang, read_beats

TWO_NODES = Placement(("h00",) * 4 + ("h01",) * 4, (0, 1, 2, 3, 0, 1, 2, 3))


def job(slow: dict[int, float], ranks: int = 8, steps: int = 300, seed: int = 0) -> RunArrays:
    """DDP-like steps: every rank waits in comm for the slowest rank's local work."""
    rng = np.random.default_rng(seed)
    compute = 10.0 * (1 + 0.04 * rng.standard_normal((steps, ranks)))
    for rank, factor in slow.items():
        compute[:, rank] *= 1 + factor
    ph = np.zeros((steps, ranks, 6))
    ph[:, :, 0], ph[:, :, 1], ph[:, :, 2], ph[:, :, 4], ph[:, :, 5] = (
        0.2,
        0.4 * compute,
        0.6 * compute,
        0.5,
        0.3,
    )
    local = ph.sum(axis=2)
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + 0.5
    return RunArrays.from_arrays(ph, loss=2.0 * np.exp(-np.arange(steps) / 150) + 0.5)


def by_code(findings):
    return {f.code: f for f in findings if f.severity >= Severity.MED}


# -- placement ------------------------------------------------------------------------------------------------


def test_local_place_reads_the_override_and_local_rank(monkeypatch):
    monkeypatch.setenv("PYTSCOPE_HOST", "rack3-node07")
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert local_place() == ("rack3-node07", 5)
    monkeypatch.delenv("LOCAL_RANK")
    assert local_place() == ("rack3-node07", -1)


def test_placement_fills_local_ranks_and_round_trips_through_meta():
    p = Placement.of([("a", -1), ("a", -1), ("b", -1), ("b", 7)])
    assert p.local_ranks == (0, 1, 0, 7)
    assert Placement.from_meta(p.to_meta()) == p
    assert RunContext.from_meta({"world_size": 4, **p.to_meta()}).placement == p
    assert RunContext.from_meta({"world_size": 4}).placement == Placement()  # runs from before: unknown
    assert p.describe(3) == "rank 3 on host b, local rank 7" and Placement().describe(3) == "rank 3"


def test_whole_hosts_only_when_the_ranks_are_exactly_some_nodes():
    assert TWO_NODES.whole_hosts([4, 5, 6, 7]) == ("h01",)
    assert TWO_NODES.whole_hosts([4, 5, 6]) == ()  # part of a node
    assert TWO_NODES.whole_hosts([3, 4, 5, 6, 7]) == ()  # a node and a rank elsewhere
    assert TWO_NODES.whole_hosts(range(8)) == ()  # every node: nothing to compare with
    assert Placement(("a", "b"), (0, 0)).whole_hosts([1]) == ()  # a one-rank node is a straggler


# -- findings name the node -----------------------------------------------------------------------------------


def test_a_slow_node_is_one_finding_naming_the_host():
    found = by_code(diagnose(job({4: 0.3, 5: 0.3, 6: 0.3, 7: 0.3}), RunContext(8, placement=TWO_NODES)))
    assert found["DIST.SLOW_NODE"].ranks == (4, 5, 6, 7) and "h01" in found["DIST.SLOW_NODE"].title
    assert "DIST.LOAD_IMBALANCE" not in found and "DIST.STRAGGLER" not in found
    # Without hosts the same ranks are a load imbalance, as before.
    assert "DIST.LOAD_IMBALANCE" in by_code(diagnose(job({4: 0.3, 5: 0.3, 6: 0.3, 7: 0.3}), RunContext(8)))


def test_slow_ranks_on_two_nodes_are_imbalance_with_their_hosts():
    found = by_code(diagnose(job({3: 0.3, 4: 0.3}), RunContext(8, placement=TWO_NODES)))
    assert "DIST.SLOW_NODE" not in found
    assert "host h00 (rank 3), host h01 (rank 4)" in found["DIST.LOAD_IMBALANCE"].detail


def test_a_straggler_is_named_with_host_and_local_rank():
    f = by_code(diagnose(job({6: 0.3}), RunContext(8, placement=TWO_NODES)))["DIST.STRAGGLER"]
    assert f.title.startswith("Rank 6 on host h01 is a straggler")
    assert f.detail.startswith("Rank 6 on host h01, local rank 2 does")


def test_the_rank_table_groups_by_node():
    placement = Placement(("b", "a", "b", "a"), (0, 0, 1, 1))
    summary = summarize(job({2: 0.3}, ranks=4), RunContext(4, placement=placement))
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(render_summary(summary))
    table = console.file.getvalue().split("Distributed", 1)[1].split("Efficiency", 1)[0]
    rows = [line.split()[:3] for line in table.splitlines() if line[:2] in ("a ", "b ")]
    assert rows == [["a", "1", "0"], ["a", "3", "1"], ["b", "0", "0"], ["b", "2", "1"]]
    assert "host" in table and summary.to_dict()["distributed"]["per_rank"][2]["host"] == "b"


def test_a_hang_names_the_missing_ranks_hosts_and_stays_short_at_scale():
    beats = {r: {"step": 29, "phase": "comm", "idle_s": 50.0, "syncs": 29} for r in range(4)}
    beats[6] = {"step": 29, "phase": "data", "idle_s": 50.0, "syncs": 29}
    f = classify_hang(beats, 8, 10.0, TWO_NODES)
    assert f is not None and f.ranks == (4, 5, 6, 7)
    assert "on host h01" in f.title and "rank 6 on host h01, local rank 2 is at step 30 in `data`" in f.detail
    assert "every rank of host h01" in f.detail
    # 8 ranks wait in the all-reduce, 4,088 never came: the missing ones are listed 8 at most.
    many = {
        r: {"step": 9, "phase": "comm" if r < 8 else "data", "idle_s": 50.0, "syncs": 9} for r in range(4096)
    }
    f = classify_hang(many, 4096, 10.0)
    assert f is not None and len(f.detail) < 1000 and "and 4080 more" in f.detail
    # Every rank idle at one place: no hang proven, and said as briefly.
    same = {r: {"step": 9, "phase": "data", "idle_s": 50.0, "syncs": 9} for r in range(4096)}
    f = classify_hang(same, 4096, 10.0)
    assert f is not None and f.severity.name == "MED" and len(f.detail) < 1000


# -- heartbeats -----------------------------------------------------------------------------------------------


def test_beat_period_grows_with_the_world_but_stays_under_the_timeout():
    assert beat_period(8, 120.0) == watchdog.BEAT_S
    assert beat_period(16384, None) == pytest.approx(16.384)
    assert beat_period(16384, 20.0) == pytest.approx(5.0)  # a hang is still seen within a quarter timeout
    assert beat_period(16384, 2.0) == watchdog.BEAT_S
    # The store's load: all ranks' beats per second stay bounded at any world size.
    for world in (8, 1024, 16384, 100_000):
        assert world / beat_period(world, None) <= watchdog.STORE_BEATS_PER_S


class CountingStore:
    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys
        self.calls: list[str] = []

    def check(self, keys: list[str]) -> bool:
        self.calls.append("check")
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        self.calls.append("get")
        return self.keys[key].encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls.append("multi_get")
        return [self.keys[k].encode() for k in keys]


def test_heartbeats_seen_once_are_read_in_one_round_trip():
    keys = [f"hb/{r}" for r in range(1000)]
    store = CountingStore({k: "x" for k in keys[:-1]})  # the last rank never beat
    present: set[int] = set()
    assert len(read_beats(store, keys, present)) == 999
    store.keys[keys[-1]] = "x"
    store.calls.clear()
    assert len(read_beats(store, keys, present)) == 1000
    assert store.calls == ["multi_get", "check", "multi_get"]  # the known ones, then the newcomer
    store.calls.clear()
    read_beats(store, keys, present)
    assert store.calls == ["multi_get"]


# -- the gather -----------------------------------------------------------------------------------------------


def rows_of(rank: int, steps: range) -> np.ndarray:
    rows = np.full((len(steps), NCOLS), 1.0)
    rows[:, COL["rank"]], rows[:, COL["step"]] = rank, list(steps)
    rows[:, COL["wall_ms"]] = 6.0  # the six phases' 1 ms each
    return rows


def test_a_window_longer_than_the_block_still_arrives_whole(tmp_path):
    import torch.distributed as dist

    from pytscope_core.gather import Gatherer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = Gatherer(timeout_s=30, capacity=4)
        counters = (10.0, 10.0, 10.0, 0.5, 24.0)  # (joined_at: out of batches inside a Join after step 24)
        ex = g.exchange(counters, rows_of(0, range(1, 11)))  # 10 rows, 4 fit the block
        assert ex is not None and ex.rows[:, COL["step"]].tolist() == list(range(1, 11))
        assert ex.headers.tolist() == [[10.0, 10.0, 10.0, 10.0, 0.5, 24.0]] and len(HEADER) == 6
        assert g.exchange(counters, rows_of(0, range(0))).rows.shape == (0, NCOLS)
        assert g.gather_places("héte", 3) == [("héte", 3)]
        g.destroy()
    finally:
        dist.destroy_process_group()


# -- rank 0's ingest thread -----------------------------------------------------------------------------------


def live_of(tmp_path) -> LiveDiagnosis:
    reporter = RunReporter(tmp_path, {"world_size": 2, "interval": 10, "warmup": 0}, console=False)
    return LiveDiagnosis(reporter, Segment(0, time.time(), 0, 2), warmup=0, errors=[])


def gathered(n: int, final: bool = False) -> Gathered:
    rows = np.concatenate(
        [rows_of(0, range(10 * n + 1, 10 * n + 11)), rows_of(1, range(10 * n + 1, 10 * n + 11))]
    )
    headers = np.tile([10.0 * (n + 1), 10.0 * (n + 1), 10.0 * (n + 1), 10.0, np.nan, np.nan], (2, 1))
    return Gathered(headers, rows, n + 1, 10 * (n + 1), final, [], None)


def test_ingest_thread_writes_every_gather_and_drains_at_close(tmp_path):
    live = live_of(tmp_path)
    ingest = BackgroundIngest(live)
    for n in range(5):
        ingest.submit(gathered(n))
    ingest.submit(gathered(5, final=True))
    assert ingest.close(timeout_s=30)
    live.reporter.close()
    written = np.fromfile(tmp_path / "steps.f64").reshape(-1, NCOLS)
    assert written.shape[0] == 6 * 20 and live.diagnoses >= 1
    assert len(ingest.handoff_ms) == 6 and len(ingest.ingest_ms) + ingest.skipped == 6


def test_the_first_diagnosis_with_enough_steps_for_timing_findings_runs_whatever_its_budget(tmp_path):
    # Each diagnosis looks costly (every clock reading is a second on), so the budget allows one at the start.
    # Its 10 steps cap timing findings at LOW: the one that has 50 must still come, or a straggler said as
    # LOW live is HIGH only in the end-of-run summary.
    ticks = iter(range(10**6))
    reporter = RunReporter(tmp_path, {"world_size": 2, "interval": 10, "warmup": 0}, console=False)
    live = LiveDiagnosis(reporter, Segment(0, time.time(), 0, 2), 0, [], clock=lambda: float(next(ticks)))
    seen = []
    for n in range(8):
        g = gathered(n)
        live.record(g.headers, g.rows, g.gather, g.step)
        live.diagnose_if_due(g.step)
        seen.append(live.diagnoses)
    assert seen == [1, 1, 1, 1, 2, 2, 2, 2]  # at step 10, then at step 50


def test_a_full_queue_skips_diagnoses_never_rows_and_errors_reach_the_training_thread(tmp_path):
    live = live_of(tmp_path)
    release = threading.Event()
    slow_diagnosis = live.diagnose

    def blocked(step: int) -> None:
        release.wait(10)
        slow_diagnosis(step)

    live.diagnose = blocked  # type: ignore[method-assign]
    ingest = BackgroundIngest(live)
    for n in range(6):  # one in diagnosis, two queued, the rest recorded here without a diagnosis
        ingest.submit(gathered(n))
    assert ingest.skipped >= 3
    release.set()
    assert ingest.close(timeout_s=30)
    live.reporter.close()
    assert np.fromfile(tmp_path / "steps.f64").reshape(-1, NCOLS).shape[0] == 6 * 20

    broken = BackgroundIngest(live_of(tmp_path / "b"))
    broken.live.diagnose = lambda step: 1 / 0  # type: ignore[method-assign]
    broken.submit(gathered(0))
    broken.drain(10)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        broken.submit(gathered(1))
    broken.close(10)


def test_rows_in_gather_order_give_the_same_arrays_as_any_order():
    rows = np.concatenate([rows_of(r, range(1, 31)) for r in range(4)])  # rank after rank, as gathered
    rows[:, COL["wall_ms"]] = np.arange(rows.shape[0])
    shuffled = rows[np.random.default_rng(0).permutation(rows.shape[0])]
    fast, general = RunArrays.from_rows(rows, warmup=5), RunArrays.from_rows(shuffled, warmup=5)
    for name in (
        "steps",
        "ranks",
        "phases",
        "wall_ms",
        "start_s",
        "loss",
        "grad_syncs",
        "segment",
        "counted",
    ):
        np.testing.assert_array_equal(getattr(fast, name), getattr(general, name))
    assert fast.wall_ms[3, 2] == 2 * 30 + 3  # step 4 of rank 2


def test_a_live_alarm_that_goes_away_is_said_to_and_said_again_when_it_returns(tmp_path, monkeypatch):
    # A straggler said live from a transient slowdown must not stand on the console (nor keep the real one,
    # later, from being said): gone at the next diagnosis, it is said to be gone, and said again on return.
    from pytscope_core import analysis

    alarm = Finding("DIST.STRAGGLER", Severity.HIGH, "Rank 1 is a straggler", "d", "r", ranks=(1,))
    verdicts = iter([[alarm], [], [alarm]])
    monkeypatch.setattr(analysis, "run_rules", lambda a: next(verdicts))
    live = live_of(tmp_path)
    g = gathered(0)
    live.record(g.headers, g.rows, g.gather, g.step)
    for step in (10, 20, 30):
        live.diagnose(step)
    live.reporter.close()
    events, _ = read_events(tmp_path)
    said = [(e["type"], e["step"]) for e in events if e["type"] in ("finding", "cleared")]
    assert said == [("finding", 10), ("cleared", 20), ("finding", 30)]


def test_a_live_straggler_that_stopped_is_cleared_and_said_as_past(tmp_path, monkeypatch):
    # Said live as a straggler, then found to have stopped (DIST.STRAGGLER with its `until_step`): the alarm
    # is said to be gone, then the finding as it now reads, once; when the window no longer holds it, it
    # goes without a word, and a straggler on the same rank later is said again.
    from pytscope_core import analysis

    now = Finding("DIST.STRAGGLER", Severity.HIGH, "Rank 1 is a straggler", "d", "r", ranks=(1,))
    past = Finding(
        "DIST.STRAGGLER",
        Severity.HIGH,
        "Rank 1 was a straggler until around step 150",
        "d",
        "r",
        ranks=(1,),
        evidence={"until_step": 150.0},
    )
    verdicts = iter([[now], [past], [past], [], [now]])
    monkeypatch.setattr(analysis, "run_rules", lambda a: next(verdicts))
    live = live_of(tmp_path)
    g = gathered(0)
    live.record(g.headers, g.rows, g.gather, g.step)
    for step in (100, 200, 300, 400, 500):
        live.diagnose(step)
    live.reporter.close()
    events, _ = read_events(tmp_path)
    said = [
        (e["type"], e["step"], e["finding"]["title"] if e["type"] == "finding" else e["findings"])
        for e in events
        if e["type"] in ("finding", "cleared")
    ]
    assert said == [
        ("finding", 100, now.title),
        ("cleared", 200, ["DIST.STRAGGLER"]),
        ("finding", 200, past.title),
        ("finding", 500, now.title),
    ]


def creeping_loss(steps: int) -> np.ndarray:
    """A loss that fell fast and then crept down under noise: its last 1,000 steps alone read flat."""
    t = np.arange(1, steps + 1)
    return 0.3 + 2.0 * np.exp(-t / 40) - 2e-5 * t + 0.15 * np.random.default_rng(0).standard_normal(steps)


def record_launch(live: LiveDiagnosis, loss: np.ndarray, first: int, last: int, segment: int) -> None:
    """Steps `first`..`last` of a 2-rank launch, gathered every 50 steps, each step's loss on both ranks."""
    for start in range(first, last + 1, 50):
        steps = range(start, min(start + 50, last + 1))
        rows = np.concatenate([rows_of(r, steps) for r in (0, 1)])
        rows[:, COL["segment"]] = segment
        rows[:, COL["loss"]] = np.tile(loss[steps[0] - 1 : steps[-1]], 2)
        live.record(
            np.tile([steps[-1]] * 3 + [10.0, np.nan, np.nan], (2, 1)), rows, start // 50 + 1, steps[-1]
        )


def test_the_live_diagnosis_judges_the_loss_over_the_whole_run_as_the_final_report_does(tmp_path):
    """Live said "stopped improving" (MED) from its window of the last 1,000 steps, and the summary never did."""
    from pytscope_core.rundir import load_run

    loss = creeping_loss(2500)
    live = live_of(tmp_path)
    record_launch(live, loss, 1, 2500, segment=0)
    live.diagnose(2500)
    live.reporter.close()
    final = summarize(load_run(tmp_path).arrays, RunContext(world_size=2))
    assert final.convergence.trend.trend == "improving"
    codes = {f.code for f in live.findings}
    assert "CONVERGENCE.NO_PROGRESS" not in codes | {f.code for f in final.findings}


def test_a_loss_that_stays_non_finite_on_one_rank_reads_so_live_as_in_the_final_report(tmp_path):
    """Rank 1 logs NaN (+inf in its rows) from step 40 to the end of 1,200 steps, rank 0 a falling loss: the
    live diagnosis, whose window no longer holds step 40, judges it from the run's loss history (per-step
    sums and counts), and says what the final report says."""
    from pytscope_core.rundir import load_run

    loss = 3.0 * np.exp(-np.arange(1200) / 300) + 0.1
    live = live_of(tmp_path)
    for start in range(1, 1201, 50):
        steps = range(start, start + 50)
        rows = np.concatenate([rows_of(r, steps) for r in (0, 1)])
        rows[:, COL["loss"]] = np.tile(loss[start - 1 : start + 49], 2)
        rows[50:, COL["loss"]] = np.where(np.asarray(steps) >= 40, np.inf, rows[50:, COL["loss"]])
        live.record(
            np.tile([steps[-1]] * 3 + [10.0, np.nan, np.nan], (2, 1)), rows, start // 50 + 1, steps[-1]
        )
    live.diagnose(1200)
    live.reporter.close()
    final = summarize(load_run(tmp_path).arrays, RunContext(world_size=2))
    assert final.convergence.trend.trend == "non-finite"
    said = {f.code: f for f in live.findings}
    (nonfinite,) = [f for f in final.findings if f.code == "CONVERGENCE.NONFINITE"]
    assert said["CONVERGENCE.NONFINITE"].detail == nonfinite.detail
    assert "The loss of rank(s) 1 stayed non-finite from step 40 to the end (1161 step(s)" in nonfinite.detail
    assert "CONVERGENCE.NO_PROGRESS" not in said


def test_after_a_resume_the_live_diagnosis_still_judges_the_loss_over_the_whole_run(tmp_path):
    """The resumed launch's steps alone read "stopped improving"; the run's, as the final report reads them
    (the steps replayed since the checkpoint counted once, from the resume), read improving."""
    from pytscope_core.analysis.convergence import loss_per_step
    from pytscope_core.rundir import load_run

    loss = creeping_loss(2500)
    first = live_of(tmp_path)
    record_launch(first, loss, 1, 1600, segment=0)
    first.reporter.close()
    loss_resumed = loss.copy()
    loss_resumed[1500:1600] += 1e-3  # the replayed steps have new losses: only the resume's count
    reporter = RunReporter(tmp_path, {}, console=False)
    live = LiveDiagnosis(reporter, Segment(1, time.time(), 1500, 2), warmup=3, errors=[])
    record_launch(live, loss_resumed, 1501, 2500, segment=1)
    live.diagnose(2500)
    reporter.close()

    run = load_run(tmp_path, warmup=3)
    history = live._loss_history()
    np.testing.assert_array_equal(history.steps, run.arrays.steps)
    np.testing.assert_allclose(history.loss, loss_per_step(run.arrays))
    np.testing.assert_array_equal(history.counted, run.arrays.counted)
    assert "CONVERGENCE.NO_PROGRESS" not in {f.code for f in live.findings}

    resumed_only = LiveDiagnosis(RunReporter(tmp_path / "alone", {}, console=False), live.segment, 3, [])
    record_launch(resumed_only, loss_resumed, 1501, 2500, segment=1)
    resumed_only.diagnose(2500)
    assert "CONVERGENCE.NO_PROGRESS" in {f.code for f in resumed_only.findings}  # (what live said before)


def test_the_earlier_segments_loss_is_read_in_chunks_as_the_reader_reads_the_run(tmp_path, monkeypatch):
    """Chunked, with a replayed step, rows a rank wrote itself (one also gathered; one of a step a gather
    brought for the other rank only) and corrupt rows (a negative time; a rank beyond the run's world): the
    same per-step loss and warm-up as the run's arrays."""
    import functools

    from pytscope_core import live as live_module
    from pytscope_core.analysis.convergence import any_rank, loss_per_step, nonfinite_losses
    from pytscope_core.rundir import append_rank_rows, load_run

    reporter = RunReporter(tmp_path, {"world_size": 2}, console=False)
    for segment, steps in ((0, range(1, 31)), (1, range(21, 41)), (2, range(41, 46))):
        rows = np.concatenate([rows_of(r, steps) for r in (0, 1)])
        rows[:, COL["segment"]] = segment
        rows[:, COL["loss"]] = np.arange(rows.shape[0]) + 10.0 * segment
        rows[3, COL["loss"]] = np.inf  # a non-finite loss: not in the mean
        reporter.rows(rows)
    corrupt = rows_of(0, range(50, 52))
    corrupt[0, COL["wall_ms"]] = -1.0
    corrupt[1, COL["rank"]], corrupt[1, COL["loss"]] = 9, 1e6
    late = rows_of(0, range(46, 47))  # rank 0's step 46 gathered; rank 1's in its own file
    late[:, COL["segment"]] = 2
    reporter.rows(np.concatenate([corrupt, late]))
    reporter.close()
    own = np.concatenate([rows_of(1, range(45, 48))])  # step 45 was gathered too
    own[:, COL["segment"]], own[:, COL["loss"]] = 2, [100.0, 7.0, 8.0]
    append_rank_rows(tmp_path, 1, own, "SIGTERM")
    monkeypatch.setattr(live_module, "iter_rows", functools.partial(live_module.iter_rows, chunk_rows=7))

    history = live_module.earlier_loss_history(tmp_path, segment=3, warmup=2)
    run = load_run(tmp_path, warmup=2)
    np.testing.assert_array_equal(history.steps, run.arrays.steps)
    np.testing.assert_allclose(history.loss, loss_per_step(run.arrays))
    np.testing.assert_array_equal(history.counted, run.arrays.counted)
    nonfinite = any_rank(nonfinite_losses(run.arrays))
    assert nonfinite.any() and (history.nonfinite == nonfinite).all()
    assert live_module.earlier_loss_history(tmp_path, segment=1, warmup=2).steps.tolist() == list(
        range(1, 31)
    )


def test_a_hang_every_rank_went_on_past_is_not_said_again_when_the_live_window_moves_on(tmp_path):
    # Said as the stall it was while in the window; once the window had moved past the stall, the report
    # came back as a new DIST.HANG ("never reached the 41st gradient all-reduce") 1,000 steps later.
    from pytscope_core.findings import Finding

    report = Finding.from_dict(
        {"code": "DIST.HANG", "severity": "HIGH", "title": "rank 1 never reached the 41st gradient all-reduce",
         "detail": "rank 1 in `other` for 10 s", "recommendation": "see stacks", "ranks": [1], "steps": [41]}
    )  # fmt: skip
    live = LiveDiagnosis(RunReporter(tmp_path, {}, console=False), Segment(0, time.time(), 0, 2), 5, [])
    for gather in range(1, 25):
        steps = range((gather - 1) * 50 + 1, gather * 50 + 1)
        rows = np.concatenate([rows_of(r, steps) for r in (0, 1)])
        rows[:, COL["start_s"]] = np.tile(gather * 20.0 + np.arange(50) * 0.01, 2)
        rows[:, COL["loss"]] = np.tile(2.0 * np.exp(-np.asarray(steps) / 300) + 0.5, 2)
        if gather == 1:
            rows[39, COL["comm_ms"]] += 12_000  # rank 0 waits at step 40 for rank 1's 12 s
            rows[89, COL["other_ms"]] += 12_000
            rows[[39, 89], COL["wall_ms"]] += 12_000
            live.hang(report, 41)
        live.record(np.tile([steps[-1]] * 3 + [10.0, np.nan, np.nan], (2, 1)), rows, gather, steps[-1])
        live.diagnose(steps[-1])
    live.reporter.close()
    said = [(e["step"], e["finding"]["code"]) for e in read_events(tmp_path)[0] if e["type"] == "finding"]
    assert (50, "TIMING.STALL") in said and not [s for s in said if s[1] == "DIST.HANG"], said


def test_the_live_loss_history_is_the_runs_per_step_loss_in_step_order_past_warm_up(tmp_path):
    from pytscope_core.live import step_loss_sums

    rows = np.concatenate([rows_of(r, range(1, 4)) for r in (0, 1)])
    rows[:, COL["loss"]] = [2.0, 1.0, np.nan, 4.0, np.inf, np.nan]  # (+inf: a NaN/Inf loss was logged)
    steps, sums, counts, nonfinite = step_loss_sums(rows[::-1])  # (in any order)
    assert (
        steps.tolist() == [1.0, 2.0, 3.0]
        and sums.tolist() == [6.0, 1.0, 0.0]
        and counts.tolist() == [2, 1, 0]
        and nonfinite.tolist() == [0, 1, 0]
    )

    live = LiveDiagnosis(live_of(tmp_path).reporter, Segment(0, time.time(), 0, 2), warmup=2, errors=[])
    gathers = [range(1, 11), range(21, 31), range(11, 21), range(31, 41)]  # the queue was full: out of order
    for n, steps_in in enumerate(gathers):
        rows = np.concatenate([rows_of(r, steps_in) for r in (0, 1)])
        rows[:, COL["loss"]] = np.tile(np.array(steps_in, dtype=float), 2)
        if n == 3:  # rank 1's step 40 comes in a later gather than rank 0's (ranks out of step)
            rows = rows[:-1]
        live.record(np.c_[np.zeros((2, 5)), [np.nan, np.nan]], rows, n + 1, max(steps_in))
    lagging = rows_of(1, range(40, 41))
    lagging[:, COL["loss"]] = 42.0
    live.record(np.c_[np.zeros((2, 5)), [np.nan, np.nan]], lagging, 5, 41)
    history = live._loss_history()
    assert history.steps.tolist() == list(range(1, 41))
    assert history.loss[:39].tolist() == list(range(1, 40)) and history.loss[39] == (40.0 + 42.0) / 2
    assert history.counted.tolist() == [False, False] + [True] * 38  # the launch's first 2 steps: warm-up


def test_the_syncs_per_step_every_rank_schedules_by_is_never_stretched_by_a_skipped_step():
    from pytscope_core.gather import syncs_per_step

    def at(steps, syncs):  # HEADER rows: steps, grad_syncs, micro_batches, rows, checksum
        return np.array([[st, sy, sy, 5, 0.0] for st, sy in zip(steps, syncs, strict=True)])

    assert syncs_per_step(at([12, 12], [50, 50])) == 4  # accumulation of 4 without no_sync(), mid-window
    assert syncs_per_step(at([5, 4], [5, 5])) == 1  # a rank that skipped a step
    assert syncs_per_step(at([47, 47], [50, 50])) == 1  # a GradScaler's skipped first steps
    assert syncs_per_step(at([0, 0], [0, 0])) == 1 and syncs_per_step(at([9], [0])) == 1
