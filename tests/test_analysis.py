"""Golden synthetic runs with known answers for the analysis and the rules."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import numpy as np
import pytest
from rich.console import Console
from runfactory import phases_of

from pytscope_core.analysis import analyze, diagnose, run_rules
from pytscope_core.analysis.convergence import Convergence, find_spikes, loss_trend, plateau_start, rise_start
from pytscope_core.arrays import RunArrays
from pytscope_core.context import CountsCheck, ReplicaCheck, RunContext, Segment
from pytscope_core.findings import Severity
from pytscope_core.records import COL, NCOLS
from pytscope_core.render import render_convergence, render_distributed, render_summary
from pytscope_core.shards import uneven_shards_finding
from pytscope_core.summary import summarize, summary_of

TRANSFER_MS = 0.5


def make_run(
    steps: int = 500,
    ranks: int = 4,
    *,
    seed: int = 0,
    noise: float = 0.04,
    slow: dict[int, float] | None = None,
    data_ms: float = 0.2,
    loss: np.ndarray | None = None,
) -> RunArrays:
    """DDP-like steps: every rank's wall is the slowest rank's local work plus the transfer."""
    rng = np.random.default_rng(seed)
    compute = 10.0 * (1 + noise * rng.standard_normal((steps, ranks)))
    for rank, factor in (slow or {}).items():
        compute[:, rank] *= 1 + factor
    ph = np.zeros((steps, ranks, 6))
    ph[:, :, 0] = data_ms
    ph[:, :, 1] = 0.4 * compute
    ph[:, :, 2] = 0.6 * compute
    ph[:, :, 4] = 0.5
    ph[:, :, 5] = 0.3
    local = ph.sum(axis=2)
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    if loss is None:
        loss = 2.0 * np.exp(-np.arange(steps) / 150) + 0.5 + 0.02 * rng.standard_normal(steps)
    return RunArrays.from_arrays(ph, loss=loss)


def codes(findings, at_least=Severity.LOW):
    return {f.code for f in findings if f.severity >= at_least}


def test_ten_percent_straggler_is_the_only_one_within_200_steps():
    for seed in range(5):
        arrays = make_run(200, 4, seed=seed, slow={3: 0.10})
        a = analyze(arrays, RunContext(world_size=4))
        assert a.distributed.stragglers == (3,)
        found = [
            f for f in diagnose(arrays, RunContext(world_size=4), strict=True) if f.code == "DIST.STRAGGLER"
        ]
        assert len(found) == 1 and found[0].ranks == (3,)
        assert found[0].severity >= Severity.MED
        assert a.distributed.rank(3).critical_share > 0.8


def test_a_large_straggler_on_noisy_oversubscribed_ranks_is_named_and_the_same_noise_alone_is_not():
    # 4 ranks on 2 cores: per-step noise of 35% made a rank 25% slower by median the slower one in only
    # 67-69% of steps (seeds 0 and 2), under the 70% persistence gate; a median excess 3x the floor needs 60%.
    for seed in (0, 2):
        d = analyze(
            make_run(300, 4, seed=seed, noise=0.35, slow={1: 0.25}), RunContext(world_size=4)
        ).distributed
        assert d.stragglers == (1,) and d.per_rank[1].slower_share < 0.70, d.per_rank[1]
    for seed in range(4):
        assert (
            analyze(make_run(300, 4, seed=seed, noise=0.35), RunContext(world_size=4)).distributed.stragglers
            == ()
        )


def _late_straggler() -> RunArrays:
    """4 ranks x 1,200 steps; rank 1 takes 1.5x longer from step 801."""
    rng = np.random.default_rng(0)
    compute = 10.0 * (1 + 0.04 * rng.standard_normal((1200, 4)))
    compute[800:, 1] *= 1.5
    ph = np.zeros((1200, 4, 6))
    ph[:, :, 1], ph[:, :, 2] = 0.4 * compute, 0.6 * compute
    ph[:, :, 3] = compute.max(axis=1, keepdims=True) - compute + TRANSFER_MS
    return RunArrays.from_arrays(ph, loss=np.linspace(2, 1, 1200))


def test_a_straggler_that_begins_late_is_named_from_where_it_began():
    # Rank 1 takes 1.5x longer from step 801 of 1,200: the whole run's medians barely move (two thirds of
    # its steps are healthy), so the whole window names nobody; its last half does, and says since when.
    a = analyze(_late_straggler(), RunContext(world_size=4))
    assert a.distributed.stragglers == () and a.distributed.late is not None
    assert a.distributed.late.stragglers == (1,) and abs(a.distributed.late.since - 801) <= 10
    found = {f.code: f for f in run_rules(a)}
    assert found["DIST.STRAGGLER"].ranks == (1,) and "since around step" in found["DIST.STRAGGLER"].title
    assert "slow now and then" not in found.get("TIMING.JITTER", found["DIST.STRAGGLER"]).title
    s = summary_of(a, run_rules(a)).to_dict()["distributed"]
    assert s["stragglers"] == [1] and s["late"]["since"] == a.distributed.late.since
    # The same noise with no slow rank: no late straggler either, on any tail.
    healthy = analyze(make_run(1200, 4, seed=1), RunContext(world_size=4)).distributed
    assert healthy.stragglers == () and healthy.late is None


def _straggler_for_a_while(
    ranks: int, slow: slice, extra_ms: float, seed: int = 0, steps: int = 300
) -> RunArrays:
    """`ranks` ranks x `steps` steps (warm-up 5) with the noise of benchmarks/detection.py (a fixed offset per
    rank, machine-wide and per-rank jitter, 1% of steps 1.2-2x); rank 1 does `extra_ms` more work in `other`
    in the steps of `slow` (0-based: slice(150, 300) is steps 151-300). Local work is about 10 ms."""
    rng = np.random.default_rng(seed)
    offset = np.exp(0.012 * rng.standard_normal(ranks))
    shared = np.exp(0.03 * rng.standard_normal((steps, 1)))
    own = np.exp(0.04 * rng.standard_normal((steps, ranks)))
    spikes = np.where(rng.random((steps, ranks)) < 0.01, rng.uniform(1.2, 2.0, (steps, ranks)), 1.0)
    compute = 9.5 * offset * shared * own * spikes
    ph = np.zeros((steps, ranks, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 5] = 0.4 * compute, 0.55 * compute, 0.05 * compute
    ph[slow, 1, 5] += extra_ms
    local = ph.sum(axis=2)
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    return RunArrays.from_arrays(ph, loss=np.linspace(2, 1, steps), warmup=5)


def _window_share(arrays: RunArrays, span) -> float:
    """What a straggler's span cost, as a share of the wall time of every counted step."""
    return span.lost_ms_per_step * span.steps_counted / arrays.wall_ms[arrays.counted].mean(axis=1).sum()


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_straggler_from_halfway_through_is_named_from_there_even_where_the_whole_run_names_it(ranks):
    # Rank 1 does +90% from step 151 of 300 (a real 2-rank gloo run: 23.0 ms of local work before, 43.1
    # after): the whole run passes the gates (on 2 ranks the healthy half is slower by chance in half of its
    # steps), which once kept its onset from being looked for and blended its numbers (+52.6%, "slower in
    # 71.5% of 295 steps", no onset). Its onset, and its numbers over the steps since, are what it is.
    for seed in range(3):
        arrays = _straggler_for_a_while(ranks, slice(150, 300), 9.0, seed)
        a = analyze(arrays, RunContext(world_size=ranks, warmup=5))
        d = a.distributed
        assert d.stragglers == (1,) and d.ended is None and d.late is not None and d.effective is d.late
        late = d.late
        assert late.stragglers == (1,) and abs(late.since - 151) <= 3 and late.until is None
        assert abs(late.steps_counted - 150) <= 3
        me = late.rank(1)
        assert me.slower_share > 0.95 and 0.8 < me.excess < 1.0
        assert me.extra_phase == "other" and me.extra_phase_ms == pytest.approx(9.0, rel=0.1)
        assert late.lost_ms_per_step == pytest.approx(9.0, rel=0.15)  # its cost over its span, not blended
        assert late.lost_share_of_window == pytest.approx(_window_share(arrays, late), rel=1e-3)
        findings = run_rules(a)
        (f,) = [f for f in findings if f.code == "DIST.STRAGGLER"]
        assert f.title.endswith(f"have waited for it since around step {late.since}")
        assert f.severity == Severity.HIGH and f.evidence["since_step"] == late.since
        assert "(before it, no rank was)" in f.detail and "since then" in f.detail
        s = summary_of(a, findings).to_dict()["distributed"]
        assert s["stragglers"] == [1] and s["late"]["since"] == late.since and s["ended"] is None
        assert s["late"]["lost_share_of_run"] == pytest.approx(late.lost_share_of_window)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_straggler_that_stopped_halfway_through_is_said_as_past(ranks):
    # Rank 1 does +90% until step 150 of 300 and is as fast as the others after (a real gloo run read
    # "[HIGH] Rank 1 is a straggler: the other ranks wait for it", +16.5%, "+2.76 ms" of extra work beside
    # "10.27 ms" of waiting for it, and advice to check its host now). It stopped at step 151: said as past,
    # with its numbers over the steps it ran slow, severity by its share of the whole run's wall, and advice
    # about those steps.
    for seed in range(3):
        arrays = _straggler_for_a_while(ranks, slice(0, 150), 9.0, seed)
        a = analyze(arrays, RunContext(world_size=ranks, warmup=5))
        d = a.distributed
        assert d.stragglers == (1,) and d.late is None and d.ended is not None and d.effective is d.ended
        ended = d.ended
        assert ended.stragglers == (1,) and ended.since is None and abs(ended.until - 151) <= 3
        me = ended.rank(1)
        assert me.slower_share > 0.95 and me.extra_phase == "other"
        assert me.extra_phase_ms == pytest.approx(
            ended.lost_ms_per_step, rel=0.15
        )  # the same 9 ms, both ways
        assert ended.cost_share == ended.lost_share_of_window
        assert ended.lost_share_of_window == pytest.approx(_window_share(arrays, ended), rel=1e-3)
        findings = run_rules(a)
        (f,) = [f for f in findings if f.code == "DIST.STRAGGLER"]
        assert f.title.startswith(f"Rank 1 was a straggler until around step {ended.until}")
        assert f.title.endswith("and no longer do") and f.evidence["until_step"] == ended.until
        assert f.severity == Severity.HIGH and "since_step" not in f.evidence  # ~30% of the run's wall
        assert "nothing on rank 1's host is slow now" in f.recommendation and "Check" not in f.recommendation
        summary = summary_of(a, findings)
        s = summary.to_dict()["distributed"]
        assert s["late"] is None and s["ended"]["until"] == ended.until and s["ended"]["since"] is None
        console = Console(file=io.StringIO(), width=100, color_system=None)
        console.print(render_distributed(summary))
        text = console.file.getvalue()
        assert f"until around step {ended.until}: rank 1 was a straggler" in text and "◀ straggled" in text
    # Its severity is by its share of the whole run's wall: +2 ms (20%) over the first 150 of 600 steps cost
    # over 10% of those steps' wall (HIGH while it lasted), under that of the run's.
    a = analyze(_straggler_for_a_while(4, slice(0, 150), 2.0, steps=600), RunContext(world_size=4, warmup=5))
    ended = a.distributed.ended
    (f,) = [f for f in run_rules(a) if f.code == "DIST.STRAGGLER"]
    assert ended is not None and ended.lost_to_imbalance >= 0.10 > ended.lost_share_of_window
    assert f.severity == Severity.MED and f.evidence["window_lost_share"] == ended.lost_share_of_window


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_straggler_all_along_has_no_course(ranks):
    # The same noise with rank 1 slow in every step: named over the whole run, with no onset and no end.
    for seed in range(3):
        for extra in (1.0, 9.0):
            d = analyze(
                _straggler_for_a_while(ranks, slice(0, 300), extra, seed),
                RunContext(world_size=ranks, warmup=5),
            ).distributed
            assert d.stragglers == (1,) and d.late is None and d.ended is None and d.effective is d


def test_straggler_wait_is_not_billed_as_communication():
    arrays = make_run(400, 4, slow={3: 0.10})
    healthy = analyze(make_run(400, 4), RunContext(world_size=4))
    a = analyze(arrays, RunContext(world_size=4))
    assert a.distributed.transfer_ms == pytest.approx(TRANSFER_MS, abs=0.01)
    assert a.distributed.transfer_ms == pytest.approx(healthy.distributed.transfer_ms, abs=0.01)
    assert "DIST.COMM_BOUND" not in codes(diagnose(arrays, RunContext(world_size=4), strict=True))
    waits = {r.rank: r.sync_wait_ms for r in a.distributed.per_rank}
    assert waits[3] < 0.05 and all(waits[r] > 0.5 for r in (0, 1, 2))
    budget = {x.name: x.share for x in a.efficiency.budget}
    assert budget["sync wait (imbalance)"] > budget["exposed transfer"]


def test_the_wait_for_one_straggler_is_advised_once_by_its_rank_and_phase():
    ph = np.array(make_run(400, 4, slow={3: 0.3}).phases)
    ph[:, :, 5] += 1.0  # `other` a recoverable line of its own...
    ph[:, 3, 5] += 2.0  # ...where the straggler's extra work is: two budget lines, one cause
    local = ph[:, :, [0, 1, 2, 4, 5]].sum(axis=2)
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    arrays = RunArrays.from_arrays(ph, loss=2.0 * np.exp(-np.arange(400) / 150) + 0.5)
    found = {f.code: f for f in diagnose(arrays, RunContext(world_size=4))}
    advice = found["EFFICIENCY.RECOVERABLE"].recommendation
    assert found["DIST.STRAGGLER"].ranks == (3,)
    assert "other 1" in found["EFFICIENCY.RECOVERABLE"].detail  # (both lines listed)
    assert advice.count("straggler") == 1 and "in `other` on rank 3, the straggler" in advice, advice


def test_a_budget_line_with_no_time_in_it_is_not_recoverable():
    one_rank = make_run(300, 1, data_ms=0.0)
    one_rank.phases[:, :, 3] = 0.0  # one process: no gradient communication, no peers to wait for
    budget = {x.name: x for x in analyze(one_rank, RunContext(world_size=1)).efficiency.budget}
    for name in ("exposed transfer", "sync wait (imbalance)", "data wait"):
        assert budget[name].share == 0.0 and not budget[name].recoverable
    assert budget["other"].recoverable


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_exposed_communication_advice_fits_the_wrapper_and_one_rank_has_none(parallelism):
    # 3 ms of the 10 ms step is transfer on every rank: DIST.COMM_BOUND, with what to change in that wrapper.
    ph = np.zeros((200, 2, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 3.0, 4.0, 3.0
    (found,) = [
        f
        for f in diagnose(RunArrays.from_arrays(ph), RunContext(world_size=2, parallelism=parallelism))
        if f.code == "DIST.COMM_BOUND"
    ]
    assert ("reshard_after_forward" in found.recommendation) == (parallelism == "fsdp2")
    assert ("bucket_cap_mb" in found.recommendation) == (parallelism == "ddp")
    one = RunArrays.from_arrays(ph[:, :1])  # one rank: FSDP2's brackets hold its own copies, no collective
    found = diagnose(one, RunContext(world_size=1, parallelism=parallelism))
    assert "DIST.COMM_BOUND" not in codes(found)
    # Two ranks, one rank's records only: its comm is its wait for the other, not transfer.
    assert "DIST.COMM_BOUND" not in codes(diagnose(one, RunContext(world_size=2, parallelism=parallelism)))


@pytest.mark.parametrize("integration", [None, "lightning"])
def test_exposed_communication_in_the_loops_own_collectives_is_not_blamed_on_the_gradients(integration):
    # Lightning broadcasts its SIGTERM flag at every batch's top: with 4 micro-batches per step, 4 collectives
    # made most of the "gradient communication" the finding spoke of, and its advice (accumulate over more
    # micro-batches) added to them.
    ph = np.zeros((200, 2, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 3.0, 4.0, 3.0
    ctx = RunContext(world_size=2, parallelism="ddp", integration=integration)

    def comm_bound(loop_ms):
        arrays = RunArrays.from_arrays(ph, loop_comm_ms=np.full((200, 2), loop_ms))
        (found,) = [f for f in diagnose(arrays, ctx, strict=True) if f.code == "DIST.COMM_BOUND"]
        return found

    loop = comm_bound(2.5)
    assert loop.title == "The loop's own collectives are a large, exposed share of the step"
    assert "2.50 ms of it in collectives the loop calls itself" in loop.detail
    assert ("SIGTERM flag Lightning broadcasts" in loop.detail) == (integration == "lightning")
    assert "bucket_cap_mb" not in loop.recommendation and "fewer collectives per step" in loop.recommendation
    some = comm_bound(0.5)
    assert some.title == "Gradient communication is a large, exposed share of the step"
    assert "0.50 ms of it in collectives the loop calls itself" in some.detail
    assert "collectives the loop" not in comm_bound(0.0).detail
    assert "collectives the loop" not in comm_bound(math.nan).detail  # (a run recorded before the column)


def test_a_step_stalled_on_one_rank_is_named_with_its_rank_and_phase():
    # A 20 s checkpoint left out of paused() on rank 0 at step 40 of 120 ten-millisecond steps: rank 0's
    # `other` holds it, rank 1 waits in its all-reduce. Jitter statistics barely move (one step of 120).
    ph = np.zeros((120, 2, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 4.0, 5.0, 1.0
    ph[39, 0, 5] = 20_000.0
    ph[39, 1, 3] += 20_000.0
    a = analyze(RunArrays.from_arrays(ph), RunContext(world_size=2))
    (found,) = [f for f in run_rules(a) if f.code == "TIMING.STALL"]
    assert found.severity == Severity.MED and found.ranks == (0,) and found.steps == (40,)
    assert "rank 0 spent 20.00 s in `other` while the other rank waited" in found.detail
    assert "scope.paused()" in found.recommendation
    recoverable = next(f for f in run_rules(a) if f.code == "EFFICIENCY.RECOVERABLE")
    assert "TIMING.STALL" in recoverable.recommendation and "balance" not in recoverable.recommendation
    # A 3 s pause on rank 1 after its all-reduce (a checkpoint before optimizer.step()) at step 137 of 300 on
    # 3 ranks: the other two wait in step 138's all-reduce. One stall, at step 137 on rank 1, 3 s long (not
    # the job's mean over ranks, 1 s at step 137 and 2 s at step 138, blamed on rank 1's `forward`).
    three = np.zeros((300, 3, 6))
    three[:, :, 1], three[:, :, 2], three[:, :, 3] = 4.0, 5.0, 1.0
    three[136, 1, 5] = 3_000.0
    three[137, [0, 2], 3] += 3_000.0
    a = analyze(RunArrays.from_arrays(three), RunContext(world_size=3))
    (found,) = [f for f in run_rules(a) if f.code == "TIMING.STALL"]
    assert found.steps == (137,) and found.ranks == (1,) and a.timing.stall_count == 1
    assert found.title == "Step 137 stalled for 3.0 s" and "took 3.01 s" in found.detail
    assert "rank 1 spent 3.00 s in `other` while the other ranks waited" in found.detail
    assert a.timing.stall_share == pytest.approx(3_000 / (295 * 10 + 3_000), abs=0.01)  # warm-up: 5 steps
    # Every rank held 20 s in the all-reduce (the network): nobody's own work, so no rank's phase is blamed.
    ph[39, 0, 5] = 0.0
    ph[39, 0, 3] += 20_000.0
    (found,) = [
        f for f in diagnose(RunArrays.from_arrays(ph), RunContext(world_size=2)) if f.code == "TIMING.STALL"
    ]
    assert (
        "every rank waited in communication" in found.detail and "collective itself" in found.recommendation
    )
    # One rank, 2.8 s split between data and other: no phase holds half of it, and nobody communicated.
    one = np.zeros((120, 1, 6))
    one[:, 0, 1], one[:, 0, 2] = 4.0, 6.0
    one[39, 0, 0], one[39, 0, 5] = 1_300.0, 1_500.0
    (found,) = [
        f for f in diagnose(RunArrays.from_arrays(one), RunContext(world_size=1)) if f.code == "TIMING.STALL"
    ]
    assert "rank 0 spent 1.50 s in `other`" in found.detail
    # A 100 ms garbage collection in one 1 ms step of 2,000 is not a stall worth a finding (0.1% of wall)...
    ph = np.ones((2000, 2, 6)) / 6
    ph[1000, :, 5] += 100.0
    a = analyze(RunArrays.from_arrays(ph), RunContext(world_size=2))
    assert a.timing.stalls and "TIMING.STALL" not in codes(run_rules(a))
    # ...and 10x the median under 100 ms is not a stall at all.
    ph[1000, :, 5] = 9.0
    assert analyze(RunArrays.from_arrays(ph), RunContext(world_size=2)).timing.stalls == ()


@pytest.mark.parametrize("phase, line, advice", [(4, "optimizer", "fused"), (5, "other", ".item()")])
def test_a_step_mostly_spent_outside_forward_and_backward_is_a_med_finding(phase, line, advice):
    # 30 ms of a 36 ms step in the optimizer (a slow custom step) or in `other` (user code): most of the
    # wall time is not training compute.
    ph = np.zeros((200, 2, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 2.0, 3.0, 1.0
    ph[:, :, phase] = 30.0
    (found,) = [
        f
        for f in run_rules(analyze(RunArrays.from_arrays(ph), RunContext(world_size=2)))
        if f.code == "EFFICIENCY.RECOVERABLE"
    ]
    assert (
        found.severity == Severity.MED and f"{line} 83.3%" in found.detail and advice in found.recommendation
    )
    # A compute-dominated step says nothing: 2 ms of optimizer in a 15 ms step is needed work.
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3], ph[:, :, 4], ph[:, :, 5] = 5.0, 7.7, 0.3, 2.0, 0.0
    assert "EFFICIENCY.RECOVERABLE" not in codes(
        run_rules(analyze(RunArrays.from_arrays(ph), RunContext(world_size=2)))
    )


def test_a_rank_slow_every_tenth_step_is_named_by_the_jitter_finding():
    # Rank 1's forward takes 50 ms more every 10th step, the other rank waits in its all-reduce: the medians
    # do not move (no DIST.STRAGGLER), the job loses a third of its wall time.
    ph = np.zeros((300, 2, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 4.0, 5.0, 1.0
    ph[9::10, 1, 1] += 50.0
    ph[9::10, 0, 3] += 50.0
    a = analyze(RunArrays.from_arrays(ph), RunContext(world_size=2))
    who = a.distributed.intermittent
    assert who is not None and (who.rank, who.phase, who.every) == (1, "forward", 10)
    assert who.extra_ms == pytest.approx(50.0) and who.steps == who.slow_steps
    found = {f.code: f for f in run_rules(a)}
    assert "DIST.STRAGGLER" not in found
    jitter = found["TIMING.JITTER"]
    assert jitter.ranks == (1,) and jitter.title == "Step time is unstable: rank 1 is slow now and then"
    assert "every 10 steps" in jitter.detail and "most in `forward`" in jitter.detail
    assert "TIMING.JITTER" in found["EFFICIENCY.RECOVERABLE"].recommendation
    summary = summarize(RunArrays.from_arrays(ph), RunContext(world_size=2))
    assert summary.to_dict()["distributed"]["intermittent"]["every"] == 10
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_distributed(summary))
    assert "rank 1 is slow now and then: 30 of the 30 steps of 1.5x the median" in console.file.getvalue()
    # Every 20th step, 30 ms: still rank 1's, every 20 steps.
    ph[:, :, :] = 0.0
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 4.0, 5.0, 1.0
    ph[19::20, 1, 1] += 30.0
    ph[19::20, 0, 3] += 30.0
    who = analyze(RunArrays.from_arrays(ph), RunContext(world_size=2)).distributed.intermittent
    assert who is not None and (who.rank, who.every, who.steps) == (1, 20, 15)
    # The same slow steps on a different rank each time (the host, not a rank): nobody is named.
    ph = np.zeros((300, 4, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 4.0, 5.0, 1.0
    for k, i in enumerate(range(9, 300, 10)):
        ph[i, :, 3] += 50.0
        ph[i, k % 4, 1] += 50.0
        ph[i, k % 4, 3] -= 50.0
    a = analyze(RunArrays.from_arrays(ph), RunContext(world_size=4))
    assert a.distributed.intermittent is None
    jitter = next(f for f in run_rules(a) if f.code == "TIMING.JITTER")
    assert jitter.ranks == () and "now and then" not in jitter.title


def _slow_now_and_then(slow: int, lag: float, lag_phase: int, spike: float) -> RunArrays:
    """2 ranks x 300 steps of 5 ms: rank `slow` does `lag` ms more in phase `lag_phase` every step and
    `spike` ms more in `other` every 10th; the other rank waits for it in `comm`."""
    ph = np.zeros((300, 2, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 3] = 2.0, 2.0, 1.0
    ph[:, slow, lag_phase] += lag
    ph[:, 1 - slow, 3] += lag
    ph[9::10, slow, 5] += spike
    ph[9::10, 1 - slow, 3] += spike
    return RunArrays.from_arrays(ph)


def test_a_rank_slow_now_and_then_and_a_little_slower_always_is_billed_for_each_where_it_belongs():
    # Rank 0 does 150 ms of its own work every 10th step (a rank-0-only checkpoint or sample) and 5% more
    # than rank 1 in every step (its logging): the stalls are TIMING.STALL's (and JITTER's). Billed to a
    # persistent straggler, they made a HIGH DIST.STRAGGLER "in `forward` (+0.2 ms)", costing 74% of wall.
    a = analyze(_slow_now_and_then(slow=0, lag=0.2, lag_phase=1, spike=150.0), RunContext(world_size=2))
    found = {f.code: f for f in run_rules(a)}
    assert "DIST.STRAGGLER" not in found and a.distributed.intermittent.rank == 0
    assert (
        found["TIMING.STALL"].ranks == (0,)
        and "rank 0 spent 0.15 s in `other`" in found["TIMING.STALL"].detail
    )
    # A rank 30% slower in every step, and now and then much slower: still a straggler, for its usual lag.
    dist = analyze(_slow_now_and_then(slow=1, lag=1.5, lag_phase=1, spike=100.0), RunContext(world_size=2))
    dist = dist.distributed
    assert dist.stragglers == (1,) and dist.lost_ms_per_step == pytest.approx(1.5)
    # 5% slower in every step of 100 ms among 8 noisy ranks, and 100 ms more every 5th: its usual lag is
    # billed in every step (its spikes included), so it stays named.
    ph = phases_of(400, 8, {"forward": 40.0, "backward": 60.0}, seed=1, noise=0.02)
    ph[:, 3, 1:3] *= 1.05
    ph[::5, 3, 2] += 100.0
    ph[:, :, 3] += ph.sum(axis=2).max(axis=1, keepdims=True) - ph.sum(axis=2)
    assert analyze(RunArrays.from_arrays(ph), RunContext(world_size=8)).distributed.stragglers == (3,)


def _with_stall(arrays: RunArrays, step: int, rank: int, ms: float) -> RunArrays:
    """`arrays` with `ms` more of `rank`'s own work (`other`) in `step` (0-based), the others waiting for it."""
    ph = np.array(arrays.phases)
    ph[step, rank, 5] += ms
    local = ph.sum(axis=2) - ph[:, :, 3]
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    return RunArrays.from_arrays(ph, loss=arrays.loss[:, 0])


def test_one_stall_on_a_stragglers_rank_is_not_billed_as_its_usual_lag():
    # Rank 3 of 4 is 10% slower in every step and once stalls 6 s (a checkpoint on that rank alone). The mean
    # over every step billed the stall as 20.76 ms per step, 64% of wall: a HIGH straggler next to the
    # TIMING.STALL of the same 6 s, and the recoverable budget's advice began with the straggler.
    base = make_run(300, 4, slow={3: 0.10})
    usual = analyze(base, RunContext(world_size=4)).distributed
    stalled = _with_stall(base, 150, 3, 6_000.0)
    a = analyze(stalled, RunContext(world_size=4))
    d = a.distributed
    assert d.stragglers == (3,) and d.lost_ms_per_step == pytest.approx(usual.lost_ms_per_step, rel=0.02)
    wall = float(stalled.wall_ms.mean(axis=1).sum())
    assert d.lost_to_imbalance == pytest.approx(d.lost_ms_per_step * 300 / wall)  # its lag, in every step
    found = {f.code: f for f in run_rules(a)}
    assert f"costs {usual.lost_ms_per_step:.2f} ms per step" in found["DIST.STRAGGLER"].detail
    assert found["DIST.STRAGGLER"].severity == Severity.LOW and found["TIMING.STALL"].steps == (151,)
    advice = found["EFFICIENCY.RECOVERABLE"].recommendation
    assert advice.startswith("Start with the largest line: the stalled step (see TIMING.STALL)"), advice
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_distributed(summary_of(a, run_rules(a))))
    assert f"persistent stragglers cost {100 * d.lost_to_imbalance:.1f}%" in console.file.getvalue()
    # A rank a little slower (a 6% edge, 5% of wall) and one 20 s stall on it: no straggler at all (it
    # costs 0.2% of this wall), where the stall made it a HIGH one costing 85% of wall.
    edge = _with_stall(make_run(300, 2, slow={0: 0.06}), 150, 0, 20_000.0)
    d = analyze(edge, RunContext(world_size=2)).distributed
    assert d.candidates == (0,) and d.stragglers == () and d.lost_to_imbalance == 0.0


@pytest.mark.parametrize("ranks", [4, 64])
def test_healthy_runs_have_no_high_or_med_finding(ranks):
    for seed in range(50):
        arrays = make_run(300, ranks, seed=seed, noise=0.05)
        found = diagnose(arrays, RunContext(world_size=ranks), strict=True)
        assert not codes(found, Severity.MED), (seed, [f.detail for f in found])
        assert analyze(arrays, RunContext(world_size=ranks)).distributed.stragglers == ()


def test_recoverable_other_time_that_is_the_stragglers_own_work_says_so():
    ph = np.array(make_run(400, 4).phases)
    ph[:, 3, 5] += 4.0  # rank 3 does 4 ms of its own work after the optimizer step (code in `other`)
    local = ph.sum(axis=2) - ph[:, :, 3]
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    arrays = RunArrays.from_arrays(ph, loss=make_run(400, 4).loss[:, 0])
    found = {f.code: f for f in diagnose(arrays, RunContext(world_size=4), strict=True)}
    assert found["DIST.STRAGGLER"].ranks == (3,)
    advice = found["EFFICIENCY.RECOVERABLE"].recommendation
    assert "the extra work in `other` on rank 3, the straggler" in advice and "logging" not in advice, advice


def test_two_rank_alternating_difference_is_not_a_straggler():
    # docs/MEASUREMENTS.md item 3: healthy 2-rank runs differ by up to ~7% in median with the faster rank alternating.
    rng = np.random.default_rng(1)
    steps = 600
    arrays = make_run(steps, 2, noise=0.0)
    ahead = rng.random(steps) < 0.6
    ph = np.array(arrays.phases)
    ph[:, 1, 2] += np.where(ahead, 0.9, -0.2)  # ~+7% in 60% of steps, a little faster in the rest
    local = ph.sum(axis=2) - ph[:, :, 3]
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    found = diagnose(RunArrays.from_arrays(ph), RunContext(world_size=2), strict=True)
    assert "DIST.STRAGGLER" not in codes(found)


def test_load_imbalance_when_several_ranks_are_slow():
    arrays = make_run(400, 8, slow={2: 0.12, 5: 0.12})
    found = diagnose(arrays, RunContext(world_size=8), strict=True)
    imb = [f for f in found if f.code == "DIST.LOAD_IMBALANCE"]
    assert imb and imb[0].ranks == (2, 5)
    assert "DIST.STRAGGLER" not in codes(found)


def test_flat_noisy_loss_is_rarely_called_worsening():
    rng = np.random.default_rng(2)
    worse = sum(loss_trend(2.0 + 0.3 * rng.standard_normal(500)).trend == "worsening" for _ in range(1000))
    assert worse < 10


def test_decreasing_loss_is_improving_without_finding():
    arrays = make_run(500, 4)
    a = analyze(arrays, RunContext(world_size=4))
    assert a.convergence.trend.trend == "improving"
    assert not {"CONVERGENCE.NO_PROGRESS", "CONVERGENCE.SPIKE"} & codes(
        diagnose(arrays, RunContext(world_size=4))
    )


def test_a_fast_early_drop_or_one_spike_does_not_hide_a_falling_loss():
    # The noise of the block means comes from their successive differences: the one steep first block of a
    # fast exponential decay, or a single spike, must not pass for noise and make a -90% change "flat".
    t = np.arange(195)
    for seed in range(10):
        noise = 0.02 * np.random.default_rng(seed).standard_normal(195)
        assert loss_trend(0.05 + 2.0 * np.exp(-t / 5) + noise).trend == "improving"
    descent = 1.0 - 0.5 * t / 195 + 0.01 * np.random.default_rng(1).standard_normal(195)
    descent[120] = 30.0
    assert loss_trend(descent).trend == "improving"


def test_a_fast_fall_then_flat_through_heavy_noise_is_unclear_not_stopped_improving():
    # Small batches: 30% noise per step on a loss that halves its excess in 14 steps and then sits flat (a
    # healthy run). Its first-to-last quarter fall (about 20%) is not significant; half of these curves used to
    # be MED "the loss has stopped improving ... no significant decrease of at least 5%".
    t = np.arange(200)
    trends, said = [], []
    for seed in range(30):
        loss = (1.2 + 0.8 * np.exp(-t / 20)) * (1 + 0.3 * np.random.default_rng(seed).standard_normal(200))
        arrays = make_run(200, 2, seed=seed, loss=loss)
        trends.append(analyze(arrays, RunContext(world_size=2)).convergence.trend.trend)
        found = diagnose(arrays, RunContext(world_size=2))
        said += [seed for f in found if f.code == "CONVERGENCE.NO_PROGRESS" and f.severity >= Severity.MED]
    assert trends.count("unclear") >= 10 and len(said) <= 2, (trends, said)  # 16 of 30 were MED before
    # A constant loss under the same noise is still "flat" (MED) but in a few seeds.
    stuck = [
        loss_trend(1.5 * (1 + 0.3 * np.random.default_rng(s).standard_normal(200))).trend for s in range(100)
    ]
    assert stuck.count("flat") >= 90
    # The report says what it is: a fall, within the noise.
    from pytscope_core.render import render_summary
    from pytscope_core.summary import summarize

    for seed in range(30):
        loss = (1.2 + 0.8 * np.exp(-t / 20)) * (1 + 0.3 * np.random.default_rng(seed).standard_normal(200))
        summary = summarize(make_run(200, 2, seed=seed, loss=loss), RunContext(world_size=2))
        if summary.convergence.trend.trend == "unclear":
            console = Console(file=io.StringIO(), width=200, color_system=None)
            console.print(render_summary(summary))
            assert "trend: unclear (" in console.file.getvalue()
            assert "a fall within the noise" in console.file.getvalue()
            break


def test_flat_loss_gives_no_progress_and_short_runs_unknown():
    rng = np.random.default_rng(3)
    flat = make_run(500, 2, loss=1.0 + 0.01 * rng.standard_normal(500))
    assert "CONVERGENCE.NO_PROGRESS" in codes(diagnose(flat, RunContext(world_size=2), strict=True))
    short = make_run(60, 2, loss=np.ones(60))
    assert analyze(short, RunContext(world_size=2)).convergence.trend.trend == "unknown"
    assert "CONVERGENCE.NO_PROGRESS" not in codes(diagnose(short, RunContext(world_size=2)))


def test_a_loss_that_fell_then_went_flat_is_said_to_have_stopped_improving():
    # Falls over the first 100 steps, flat (1% noise) for the 300 after: the run as a whole is "improving",
    # but it has learnt nothing since about step 100.
    t = np.arange(400)
    level = np.where(t < 100, 0.5 + 3.0 * np.exp(-t / 25), 0.5 + 3.0 * np.exp(-4))
    loss = level * (1 + 0.01 * np.random.default_rng(5).standard_normal(t.size))
    a = analyze(make_run(400, 2, loss=loss), RunContext(world_size=2))
    assert a.convergence.trend.trend == "improving"
    assert a.convergence.plateau is not None and 95 <= a.convergence.plateau.step <= 140
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.NO_PROGRESS"]
    assert found.severity == Severity.LOW and found.steps == (a.convergence.plateau.step,)
    assert "stopped improving around step" in found.title
    # At 10% noise per step the tail cannot show a 1% bound, but it moved far less than the 86% it fell.
    noisy = level * (1 + 0.10 * np.random.default_rng(7).standard_normal(t.size))
    found_at = plateau_start(noisy)
    assert found_at is not None and 75 <= found_at[0] <= 175


def test_a_loss_that_fell_then_rose_is_said_to_be_rising():
    # Falls until step 150, flat until 300, then up 20% by step 600: the run as a whole is still "improving"
    # (its last quarter is far below its first), and neither flat nor a plateau.
    t = np.arange(600)
    fell = np.where(t < 150, 0.5 + 3.0 * np.exp(-t / 25), 0.5 + 3.0 * np.exp(-6))
    rose = np.where(t < 300, fell, fell[-1] * (1 + 0.2 * (t - 300) / 300))
    run = make_run(600, 2, loss=rose * (1 + 0.05 * np.random.default_rng(8).standard_normal(t.size)))
    a = analyze(run, RunContext(world_size=2))
    assert a.convergence.trend.trend == "improving" and a.convergence.plateau is None
    rise = a.convergence.rise
    assert rise is not None and 270 <= rise.step <= 400 and rise.t >= 5
    assert rise.last > 1.1 * rise.lowest
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.NO_PROGRESS"]
    assert found.severity == Severity.MED and found.steps == (rise.step,)
    assert found.title == f"The loss has been rising since around step {rise.step}"
    summary = summarize(run, RunContext(world_size=2))
    assert summary.to_dict()["convergence"]["rise"]["step"] == rise.step
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_convergence(summary))
    assert f"rising since about step {rise.step}" in console.file.getvalue()
    # The same curve without the rise: a plateau (LOW), no rise.
    flat = fell * (1 + 0.05 * np.random.default_rng(8).standard_normal(t.size))
    assert rise_start(flat) is None and plateau_start(flat) is not None
    # A rise so large that the run as a whole reads "unclear" (2.26 -> 0.34 by step 200, back to 1.14 by 400:
    # a fall from its first quarter, within the noise the rise makes): still a rise, not "stopped improving".
    t = np.arange(400)
    back = np.where(t < 200, 0.34 + 1.92 * np.exp(-t / 40), 0.34 + 0.8 * (t - 200) / 200)
    a = analyze(
        make_run(400, 2, loss=back * (1 + 0.05 * np.random.default_rng(9).standard_normal(400))),
        RunContext(world_size=2),
    )
    assert a.convergence.trend.trend == "unclear" and a.convergence.rise is not None
    assert 190 <= a.convergence.rise.step <= 260
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.NO_PROGRESS"]
    assert (
        found.severity == Severity.MED
        and "rising since" in found.title
        and "reads as unclear" in found.detail
    )
    # A loss flat from the start, even with slowly wandering noise, has not risen after a fall.
    rng = np.random.default_rng(10)
    for _ in range(50):
        wander = rng.standard_normal(500)
        for i in range(1, 500):
            wander[i] += 0.9 * wander[i - 1]
        assert rise_start(2.0 * (1 + 0.05 * np.sqrt(1 - 0.81) * wander)) is None


@pytest.mark.parametrize("noise", [0.01, 0.05])
def test_a_loss_still_falling_slowly_is_not_a_plateau(noise):
    # A power-law descent (as language models fall) and a slow exponential: still learning, nothing to say.
    t = np.arange(1, 1001)
    rng = np.random.default_rng(6)
    for level in (2.0 + 3.0 * t**-0.3, 0.5 + 3.0 * t**-0.5, 0.3 + 2.0 * np.exp(-t / 300), 3.0 - 0.002 * t):
        for _ in range(20):
            loss = level * (1 + noise * rng.standard_normal(t.size))
            assert plateau_start(loss) is None and rise_start(loss) is None
    assert plateau_start(np.full(500, 2.0)) is None  # flat from the start: "flat", not a plateau after a fall


def test_infinite_loss_is_nonfinite_and_breaks_nothing():
    loss = np.linspace(3, 1, 300)
    loss[120] = np.inf
    arrays = make_run(300, 4, loss=loss)
    found = [
        f
        for f in diagnose(arrays, RunContext(world_size=4), strict=True)
        if f.code == "CONVERGENCE.NONFINITE"
    ]
    assert found and found[0].steps == (121,) and found[0].severity == Severity.HIGH
    # The loss just before the bad step, not the run's last finite one (1.0 at step 300).
    assert f"the last finite loss before it was {loss[119]:.4g} (the mean over ranks)." in found[0].detail
    summary = summarize(arrays, RunContext(world_size=4))
    assert summary.convergence.nonfinite_step == 121
    assert summary.convergence.trend.trend == "improving"  # finite again after it (a skipped step, say)
    json.dumps(summary.to_dict(), allow_nan=False)


def test_nan_after_dense_logging_is_nonfinite_but_sparse_logging_is_not():
    # Recorded before a logged NaN became +inf (and before optimizer steps were recorded: NaN).
    dense = np.linspace(3, 1, 200)
    dense[150:] = np.nan
    old = dataclasses.replace(make_run(200, 2, loss=dense), optimizer_steps=np.full((200, 2), np.nan))
    c = analyze(old, RunContext(world_size=2)).convergence
    assert c.nonfinite_step == 151
    assert c.trend.trend == "non-finite"  # never finite again: not "improving" for what fell before it
    sparse = np.full(200, np.nan)
    sparse[::10] = np.linspace(3, 1, 20)
    assert analyze(make_run(200, 2, loss=sparse), RunContext(world_size=2)).convergence.nonfinite_step is None


def _stopped_logging(per_rank: bool, **counts: np.ndarray) -> Convergence:
    """The convergence of a 2-rank run whose loss was logged on steps 1-150 only (NaN from step 151)."""
    loss = np.linspace(3, 1, 200)
    loss[150:] = np.nan
    arrays = make_run(200, 2, loss=np.stack([loss, loss * 1.01], axis=1) if per_rank else loss)
    return analyze(dataclasses.replace(arrays, **counts), RunContext(world_size=2)).convergence


@pytest.mark.parametrize("per_rank", [False, True])
def test_a_loop_that_stops_logging_its_loss_and_trains_on_has_no_nonfinite_loss(per_rank):
    # NaN in the records is a loss not logged: the loop stopped calling scope.log at step 151 and every step
    # after it ran its backward and its optimizer step. It read "non-finite at step 151 and never recovered".
    c = _stopped_logging(per_rank)
    assert c.nonfinite_step is None and c.nonfinite_tail is None and c.trend.trend == "improving"
    # No optimizer watched (none recorded, 0): the backwards alone say it trained on.
    c = _stopped_logging(per_rank, optimizer_steps=np.zeros((200, 2)))
    assert c.nonfinite_step is None and c.trend.trend == "improving"
    # One rank stops logging, the other logs on: still a loss not logged.
    loss = np.linspace(3, 1, 200)
    ranks = np.stack([loss, loss * 1.01], axis=1)
    ranks[150:, 1] = np.nan
    c = analyze(make_run(200, 2, loss=ranks), RunContext(world_size=2)).convergence
    assert c.nonfinite_step is None and c.trend.trend == "improving"


@pytest.mark.parametrize("per_rank", [False, True])
def test_a_loss_that_stops_with_the_training_for_good_is_a_nonfinite_loss(per_rank):
    # A NaN guard that skips the rest of each step: a Lightning training_step returning None logs no loss and
    # runs no backward (its optimizer still steps); a guard's `continue` before the backward, none of either.
    no_backward = np.ones((200, 2))
    no_backward[150:] = 0.0
    c = _stopped_logging(per_rank, micro_batches=no_backward)
    assert c.nonfinite_step == 151 and c.trend.trend == "non-finite"
    assert c.nonfinite_tail is not None and not c.nonfinite_tail.stepped
    c = _stopped_logging(per_rank, micro_batches=no_backward, optimizer_steps=no_backward)
    assert c.nonfinite_step == 151 and c.trend.trend == "non-finite"
    # It trained again later (a backward and an optimizer step at step 190): not a loss that stopped training.
    no_backward[189] = 1.0
    assert _stopped_logging(per_rank, micro_batches=no_backward).nonfinite_step is None


def test_a_loss_that_stays_non_finite_on_one_rank_is_non_finite_not_improving():
    # Rank 1 logged NaN (recorded as +inf) from step 40 to the end while rank 0's loss fell: the mean of the
    # finite losses read "improving (-95.6%)", and the finding read as for one transient Inf.
    t = np.arange(150)
    fell = 3.0 * np.exp(-t / 30) + 0.1
    loss = np.stack([fell, fell * 1.01], axis=1)
    loss[39:, 1] = np.inf
    a = analyze(make_run(150, 2, loss=loss), RunContext(world_size=2))
    c = a.convergence
    assert c.trend.trend == "non-finite" and c.nonfinite_step == 40 and c.nonfinite_ranks == (1,)
    assert c.nonfinite_tail is not None and (c.nonfinite_tail.step, c.nonfinite_tail.ranks) == (40, (1,))
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.NONFINITE"]
    assert "never recovered" in found.title
    assert "The loss of rank(s) 1 stayed non-finite from step 40 to the end (111 step(s)" in found.detail
    assert found.evidence["nonfinite_to_end_steps"] == 111 and found.evidence["nonfinite_steps"] == 111
    assert not [f for f in run_rules(a) if f.code == "CONVERGENCE.NO_PROGRESS"]
    # The last finite loss is the last step every rank's loss was finite in, as the finding says: not rank 0's
    # alone at step 40, the first step rank 1's went NaN.
    assert c.last_loss == pytest.approx(loss[38].mean()) and c.loss_before_nonfinite == c.last_loss
    assert len(c.sparkline_values) == 39
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(
        render_convergence(summarize(make_run(150, 2, loss=loss), RunContext(world_size=2)))
    )
    assert "non-finite to the end from step 40 on rank(s) 1" in out.getvalue()

    # A transient one (an Inf on rank 1 at step 40 only; it went on): "improving", and said to be transient.
    loss[40:, 1] = fell[40:] * 1.01
    a = analyze(make_run(150, 2, loss=loss), RunContext(world_size=2))
    assert a.convergence.trend.trend == "improving" and a.convergence.nonfinite_tail is None
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.NONFINITE"]
    assert found.title == "The loss became non-finite at step 40"
    assert "It was finite again after it (1 step(s) in all had a non-finite loss)." in found.detail
    assert "nonfinite_to_end_step" not in found.evidence

    # Finite again, then non-finite for good later: judged by what the loss did before it stayed so.
    loss[119:, 1] = np.inf
    a = analyze(make_run(150, 2, loss=loss), RunContext(world_size=2))
    c = a.convergence
    assert c.trend.trend == "non-finite" and c.nonfinite_step == 40 and c.nonfinite_tail.step == 120
    assert c.trend.finite_steps == 119 and c.trend.relative_change < -0.5  # (before step 120)
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.NONFINITE"]
    assert found.title == "The loss became non-finite at step 40, for good from step 120"

    # Recorded before a logged NaN became +inf (no optimizer steps recorded): rank 1 logged every step, then
    # NaN to the end.
    loss[39:, 1] = np.nan
    old = dataclasses.replace(make_run(150, 2, loss=loss), optimizer_steps=np.full((150, 2), np.nan))
    c = analyze(old, RunContext(world_size=2)).convergence
    assert c.trend.trend == "non-finite" and c.nonfinite_step == 40 and c.nonfinite_tail.ranks == (1,)


def test_input_bound_needs_share_and_absolute_floor():
    slow_input = make_run(300, 4, data_ms=5.0)  # ~30% of a ~16.5 ms step
    found = [
        f for f in diagnose(slow_input, RunContext(world_size=4), strict=True) if f.code == "DATA.INPUT_BOUND"
    ]
    assert found and found[0].severity >= Severity.MED and found[0].ranks == ()

    ph = np.zeros((300, 2, 6))
    ph[:, :, 0], ph[:, :, 1], ph[:, :, 2] = 0.3, 0.3, 0.4  # 0.3 ms fetch on a 1 ms step
    tiny = diagnose(RunArrays.from_arrays(ph), RunContext(world_size=2), strict=True)
    assert not codes(tiny, Severity.MED)


def test_input_bound_reads_a_bursty_loader_by_its_mean_wait_as_its_share_is():
    # Workers that prefetch deliver in bursts: 40 ms of wait every 4th step, 0.2 ms in the others (rank 1 a
    # little longer). The median wait (0.2 ms) was gated on and printed beside a share made of the mean: no
    # finding at 45% of wall, or "up to 0.20 ms per step (median), 45% of its wall time".
    ph = np.array(make_run(300, 2).phases)
    ph[:, :, 0] = 0.2
    ph[::4, 0, 0], ph[::4, 1, 0] = 40.0, 44.0
    local = ph.sum(axis=2) - ph[:, :, 3]
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    a = analyze(RunArrays.from_arrays(ph, loss=make_run(300, 2).loss[:, 0]), RunContext(world_size=2))
    (found,) = [f for f in run_rules(a) if f.code == "DATA.INPUT_BOUND"]
    mean = ph[:, 1, 0].mean()
    share = ph[:, 1, 0].sum() / ph[:, 1].sum()
    assert found.severity == Severity.HIGH and found.evidence["data_share"] == pytest.approx(share)
    assert found.detail.startswith(
        f"Every rank waits for the next batch, rank 1 the largest share of its step: {mean:.2f} ms per step "
        f"on average, {100 * share:.1f}% of its wall time. It comes in bursts: the median wait is 0.20 ms"
    ), found.detail
    assert a.distributed.rank(1).data_mean_ms == pytest.approx(mean) and "up to" not in found.detail


def test_input_bound_names_the_ranks_when_only_some():
    arrays = make_run(300, 4)
    ph = np.array(arrays.phases)
    ph[:, 1, 0] = 6.0
    local = ph.sum(axis=2) - ph[:, :, 3]
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + TRANSFER_MS
    found = [
        f
        for f in diagnose(RunArrays.from_arrays(ph), RunContext(world_size=4))
        if f.code == "DATA.INPUT_BOUND"
    ]
    assert found and found[0].ranks == (1,)


def test_spikes_found_at_their_steps():
    rng = np.random.default_rng(4)
    loss = 1.0 + 0.01 * rng.standard_normal(600)
    loss[[200, 401]] = 3.0
    a = analyze(make_run(600, 2, loss=loss), RunContext(world_size=2))
    assert [s.step for s in a.convergence.spikes] == [201, 402]
    assert all(s.ranks == () for s in a.convergence.spikes)  # the same loss on every rank: no rank named
    # Rank 1 alone x20 at step 151 (its batch): the mean over ranks spikes, and the rank is named.
    per_rank = np.repeat(1.0 + 0.01 * rng.standard_normal((600, 1)), 3, axis=1)
    per_rank[150, 1] = 20.0
    a = analyze(make_run(600, 3, loss=per_rank), RunContext(world_size=3))
    (spike,) = a.convergence.spikes
    assert spike.step == 151 and spike.ranks == (1,)
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.SPIKE"]
    assert (
        found.ranks == (1,) and "on rank(s) 1 only" in found.detail and "the mean over ranks" in found.detail
    )
    one = analyze(make_run(600, 1, loss=loss), RunContext(world_size=1))
    (alone,) = [f for f in run_rules(one) if f.code == "CONVERGENCE.SPIKE"]
    assert "mean over ranks" not in alone.detail  # one rank: no mean over ranks to speak of


def test_a_spike_early_in_a_fast_fall_is_found_and_the_fall_alone_is_not_one():
    # The first counted steps have no 50-step history; from the 21st, a spike is judged against all earlier
    # steps, with the noise taken from their successive differences (the fall itself is not noise).
    rng = np.random.default_rng(5)
    t = np.arange(120)
    loss = (0.3 + 2.0 * np.exp(-t / 10)) * (1 + 0.02 * rng.standard_normal(t.size))
    assert find_spikes(loss, t) == ()
    loss[30] *= 2.5
    assert [s.step for s in find_spikes(loss, t)] == [30]
    assert find_spikes(loss[:20], t[:20]) == ()  # too little history: nothing is judged


def test_desync_from_counts_and_from_grad_syncs():
    ctx = RunContext(
        world_size=4,
        counts_checks=(
            CountsCheck(1, (50, 50, 50, 50), (50, 50, 50, 50), (50, 50, 50, 50)),
            CountsCheck(2, (100, 100, 100, 100), (100, 100, 99, 100), (100, 100, 100, 100)),
        ),
    )
    base = make_run(100, 4)
    syncs = np.ones((100, 4))
    syncs[70, 1] = 0
    arrays = RunArrays.from_arrays(
        np.asarray(base.phases), loss=np.asarray(base.loss[:, 0]), grad_syncs=syncs
    )
    # One problem, one finding: the per-step divergence, which names the step, is kept over the gather's.
    (from_arrays,) = [f for f in diagnose(arrays, ctx, strict=True) if f.code == "DIST.DESYNC"]
    assert from_arrays.ranks == (1,) and from_arrays.steps == (71,) and from_arrays.severity == Severity.HIGH
    plain = RunArrays.from_arrays(np.asarray(base.phases), loss=np.asarray(base.loss[:, 0]))
    (from_counts,) = [f for f in diagnose(plain, ctx, strict=True) if f.code == "DIST.DESYNC"]
    assert from_counts.ranks == (2,) and "gather 2" in from_counts.title


def test_with_two_ranks_a_desync_blames_nobody_the_counts_cannot_single_out():
    # Rank 1 skipped one optimizer step (its step 40 merged two iterations, two syncs). At the gather the
    # step counts tie 1-1: no majority singles a rank out there; the per-step sync counts do single rank 1
    # out (one sync per step is what every other step has), and that finding is the one kept. Its records
    # end a step early because it took one step fewer, not because it was killed.
    ctx = RunContext(world_size=2, counts_checks=(CountsCheck(2, (50, 49), (50, 50), (50, 50)),))
    base = make_run(50, 2)
    syncs = np.ones((50, 2))
    syncs[39, 1] = 2
    syncs[49, 1] = np.nan
    phases = np.asarray(base.phases).copy()
    phases[49, 1] = np.nan
    arrays = RunArrays.from_arrays(phases, loss=np.asarray(base.loss[:, 0]), grad_syncs=syncs)
    (per_step,) = [f for f in diagnose(arrays, ctx, strict=True) if f.code == "DIST.DESYNC"]
    assert per_step.steps == (40,) and per_step.ranks == (1,)
    assert "rank 1: 2, against 1 on the other rank." in per_step.detail
    by_gather = [f for f in diagnose(make_run(50, 2), ctx, strict=True) if f.code == "DIST.DESYNC"]
    assert by_gather[0].ranks == (0, 1) and "rank 0: steps 50; rank 1: steps 49" in by_gather[0].detail
    assert "an optimizer step that did not happen there" in per_step.detail
    (end,) = analyze(arrays, ctx).rank_ends
    assert end.rank == 1 and "fewer optimizer steps" in end.reason


def test_a_rank_that_waited_inside_join_is_no_desync_and_its_wait_is_measured():
    # Rank 1 ran out of batches after step 30 of each 40-step epoch and waited inside torch's Join: its steps
    # stop at gathers during the join (left out of the comparison, its syncs still counted) and its records
    # miss steps 31-40 and 71-80 (as numbered after each join); none of that is a desync. The start-time
    # prediction for rank 1 gives way to the measured finding, whose severity follows the share of the run.
    base = make_run(80, 2)
    phases = np.asarray(base.phases).copy()
    gaps = [*range(30, 40), *range(70, 80)]
    phases[gaps, 1] = np.nan
    syncs = np.ones((80, 2))
    syncs[gaps, 1] = np.nan
    arrays = RunArrays.from_arrays(phases, loss=np.asarray(base.loss[:, 0]), grad_syncs=syncs)
    ctx = RunContext(
        world_size=2,
        counts_checks=(CountsCheck(7, (35, 30), (35, 35), (35, 30), joined=(1,)),),
        joins=((1, 30), (1, 70)),
    )
    predicted = uneven_shards_finding([40, 30])
    summary = summarize(arrays, ctx, extra_findings=(predicted,))
    assert "DIST.DESYNC" not in {f.code for f in summary.findings}
    (uneven,) = [f for f in summary.findings if f.code == "DATA.UNEVEN_SHARDS"]
    assert uneven.title == "Rank 1 ran out of batches first and waited inside join()" and uneven.steps == (
        30,
    )
    assert uneven.evidence["steps_missed"] == 20 and uneven.severity == Severity.MED  # a quarter of the run
    assert "in 2 joins" in uneven.detail and 0.2 < uneven.evidence["share"] < 0.3
    one_step = RunContext(world_size=2, joins=((1, 79),))
    (short,) = [f for f in diagnose(arrays, one_step, strict=True) if f.code == "DATA.UNEVEN_SHARDS"]
    assert short.severity == Severity.LOW and short.evidence["steps_missed"] == 1
    # Without the joins, the same gaps are a desync, and so are the same counts.
    found = diagnose(arrays, RunContext(world_size=2), strict=True)
    assert [f.steps for f in found if f.code == "DIST.DESYNC"] == [(31,)]
    assert CountsCheck(7, (35, 30), (35, 35), (35, 30)).differs and not ctx.counts_checks[0].differs


def test_a_predicted_finding_gives_way_to_measured_ones_that_cover_its_ranks():
    from pytscope_core.findings import Finding, with_predicted

    def uneven(*ranks: int) -> Finding:
        return Finding("DATA.UNEVEN_SHARDS", Severity.MED, "t", "d", "r", ranks=ranks)

    predicted = [uneven(1, 2), Finding("DATA.UNEVEN_SHARDS", Severity.HIGH, "t", "d", "r", ranks=(3,))]
    assert with_predicted([uneven(1), uneven(2)], predicted) == [uneven(1), uneven(2), predicted[1]]
    assert with_predicted([uneven(1)], predicted) == [uneven(1), *predicted]  # (rank 2 not measured)


def test_an_extra_optimizer_step_on_one_rank_is_a_desync_at_its_step():
    # Rank 1 called optimizer.step() twice in step 37: both calls fall in one step (the loop top closes it),
    # so no count of steps or syncs differs, only the optimizer steps in that step. Two optimizers stepping
    # in every step on every rank (a GAN) are no desync.
    base = make_run(50, 2)
    stepped = np.ones((50, 2))
    stepped[36, 1] = 2
    phases, loss = np.asarray(base.phases), np.asarray(base.loss[:, 0])
    arrays = RunArrays.from_arrays(phases, loss=loss, optimizer_steps=stepped)
    # From then on the two replicas differ: with no majority, the drift is pinned on the rank that desynced.
    ctx = RunContext(
        world_size=2, replica_checks=(ReplicaCheck(25, (1.0, 1.0)), ReplicaCheck(50, (2.0, 2.1)))
    )
    findings = {f.code: f for f in diagnose(arrays, ctx, strict=True)}
    found = findings["DIST.DESYNC"]
    assert found.ranks == (1,) and found.steps == (37,) and found.severity == Severity.HIGH
    assert found.title == "Optimizer steps diverge at step 37"
    assert "an optimizer step the other ranks did not take" in found.detail
    drift = findings["DIST.REPLICA_DRIFT"]
    assert drift.ranks == (1,)
    assert "No majority singles a rank out; DIST.DESYNC names rank 1 at step 37" in drift.detail
    gan = RunArrays.from_arrays(phases, loss=loss, optimizer_steps=np.full((50, 2), 2.0))
    assert not [f for f in diagnose(gan, RunContext(world_size=2)) if f.code == "DIST.DESYNC"]


@pytest.mark.parametrize(
    "error, reason",
    [
        ("rank 1 did not come to the final gather", "its last steps were never gathered (killed?)"),
        ("internal error, scope disabled, training continues: ValueError: x", "scope disabled"),
    ],
)
def test_a_rank_that_ends_early_is_called_disabled_only_after_its_scope_was(error, reason):
    # A note in the scope's errors (a rank missing at the final gather, a late diagnosis) is not a disabled
    # scope: the rank whose records stop is most likely gone.
    phases = np.asarray(make_run(50, 2).phases).copy()
    phases[40:, 1] = np.nan
    (end,) = analyze(RunArrays.from_arrays(phases), RunContext(world_size=2, scope_errors=(error,))).rank_ends
    assert (end.rank, end.last_step, end.reason) == (1, 40, reason)


def test_a_rank_killed_before_its_first_gather_is_still_a_rank_of_the_run():
    # Rank 1 of 2 died at step 10 with an interval of 20: no row of it anywhere, but the run had two ranks.
    only_rank_0 = RunArrays.from_arrays(np.asarray(make_run(9, 2).phases)[:, :1].copy())
    a = analyze(only_rank_0, RunContext(world_size=2))
    assert a.world_size == 2
    assert [(e.rank, e.last_step) for e in a.rank_ends] == [(1, None)] and "killed" in a.rank_ends[0].reason


def test_replica_drift_names_ranks_and_first_step():
    ctx = RunContext(
        world_size=3,
        replica_checks=(
            ReplicaCheck(50, (1.5, 1.5, 1.5)),
            ReplicaCheck(100, (2.0, 2.0, 2.1)),
            ReplicaCheck(150, (2.5, 2.5 * (1 + 1e-9), 2.7)),
        ),
    )
    found = [f for f in diagnose(make_run(150, 3), ctx, strict=True) if f.code == "DIST.REPLICA_DRIFT"]
    assert found and found[0].ranks == (2,) and found[0].steps[0] == 100


def test_replica_drift_counts_a_step_checked_twice_once():
    # The interval gather at step 120 and the final gather at finish() (step 120 again) both checked the same
    # parameters: a run recorded so has four checks that disagree, not five.
    checks = [ReplicaCheck(step, (2.0, 2.1)) for step in (60, 80, 100, 120, 120)]
    ctx = RunContext(world_size=2, replica_checks=tuple(checks))
    (drift,) = [f for f in diagnose(make_run(120, 2), ctx, strict=True) if f.code == "DIST.REPLICA_DRIFT"]
    assert drift.steps == (60, 80, 100, 120)
    assert "4 checks disagree." in drift.detail
    agreeing = RunContext(world_size=2, replica_checks=(ReplicaCheck(40, (2.0, 2.0)), *checks))
    (drift,) = [f for f in diagnose(make_run(120, 2), agreeing) if f.code == "DIST.REPLICA_DRIFT"]
    assert "4 of 5 checks disagree." in drift.detail


def test_hang_reports_are_reemitted():
    report = {
        "code": "DIST.HANG",
        "severity": "HIGH",
        "title": "Rank 1 never reached the all-reduce",
        "detail": "rank 1 in forward for 300 s",
        "recommendation": "see stacks",
        "ranks": [1],
        "steps": [40],
    }
    (hang,) = [
        f
        for f in diagnose(make_run(39, 2), RunContext(world_size=2, hang_reports=(report,)))
        if f.code == "DIST.HANG"
    ]
    assert hang.ranks == (1,) and hang.severity == Severity.HIGH and hang.detail == report["detail"]
    # on_hang="report": the run went on past the hang, to step 50 on every rank. It was a stall that long.
    (late,) = [
        f
        for f in diagnose(make_run(50, 2), RunContext(world_size=2, hang_reports=(report,)))
        if f.code == "DIST.HANG"
    ]
    assert (
        late.severity == Severity.MED
        and "The run went on" in late.detail
        and "the run reached step 50" in late.detail
    )


def test_a_hang_whose_abort_ended_every_rank_at_its_step_did_not_go_on():
    # Lightning: rank 1 stuck after step 79's optimizer step (in on_train_batch_end), rank 0 in the broadcast
    # at the top of the next batch, which comes before the fetch that ends step 79. The abort had every rank
    # write its rows, step 79 among them (its optimizer had stepped): the records reach the report's step,
    # as a run that went on past it would. Reported as step 79 (a run recorded so), it was still the hang.
    report = {
        "code": "DIST.HANG",
        "severity": "HIGH",
        "title": "rank 1 never reached a collective the training loop calls",
        "detail": "rank 1 in `after the optimizer step` for 24 s",
        "recommendation": "see stacks",
        "ranks": [1],
        "steps": [79],
        "segment": 0,
    }
    aborted = RunContext(world_size=2, hang_reports=(report,), rank_notes=((0, "hang"), (1, "hang")))
    (hang,) = [f for f in diagnose(make_run(79, 2), aborted) if f.code == "DIST.HANG"]
    assert hang.severity == Severity.HIGH and "went on" not in hang.detail, hang.detail
    # Named by the step after the wait (as the watchdog names it now): the same, by the records alone.
    after = {**report, "steps": [80]}
    for ctx in (
        dataclasses.replace(aborted, hang_reports=(after,)),
        RunContext(world_size=2, hang_reports=(after,)),
    ):
        (hang,) = [f for f in diagnose(make_run(79, 2), ctx) if f.code == "DIST.HANG"]
        assert hang.severity == Severity.HIGH and "went on" not in hang.detail, hang.detail
    # A hang reported earlier in that launch, that every rank went on past before the abort, was a stall.
    cleared = {**report, "steps": [40]}
    ctx = dataclasses.replace(aborted, hang_reports=(cleared,))
    (stall,) = [f for f in diagnose(make_run(79, 2), ctx) if f.code == "DIST.HANG"]
    assert stall.severity == Severity.MED and "The run went on" in stall.detail


def test_a_hang_every_rank_went_on_past_is_the_stall_it_was():
    # on_hang="report": rank 1 held up 12 s at step 40, the watchdog said rank 0 waited at step 41's
    # all-reduce for a rank that never came, then every rank went on. One finding, TIMING.STALL (MED), that
    # names the report; not also a DIST.HANG that says the rank never reached the collective.
    report = {
        "code": "DIST.HANG",
        "severity": "HIGH",
        "title": "rank 1 never reached the 41st gradient all-reduce",
        "detail": "rank 1 in `other` for 10 s",
        "recommendation": "see stacks",
        "ranks": [1],
        "steps": [41],
    }
    rng = np.random.default_rng(0)
    ph = np.zeros((300, 2, 6))
    ph[:, :, 1], ph[:, :, 2] = 4.0 + 0.1 * rng.standard_normal((300, 2)), 6.0
    ph[39, 1, 5] += 12_000.0  # rank 1's own work at step 40
    ph[39, 0, 3] += 12_000.0  # rank 0 waits for it in the all-reduce
    loss = 2.0 * np.exp(-np.arange(300) / 100) + 0.5
    findings = diagnose(
        RunArrays.from_arrays(ph, loss=loss), RunContext(world_size=2, hang_reports=(report,))
    )
    codes = [f.code for f in findings]
    assert "DIST.HANG" not in codes, codes
    (stall,) = [f for f in findings if f.code == "TIMING.STALL"]
    assert stall.severity == Severity.MED and stall.steps == (40,) and stall.ranks == (1,)
    assert "reported step 40 as a hang at the time (rank 1 never reached the 41st" in stall.detail
    # A stall on a rank the report did not name is another event: the report stays a hang that went on.
    other = ph.copy()
    other[39, 1, 5], other[39, 0, 5] = ph[39, 0, 5], ph[39, 1, 5]
    other[39, 0, 3], other[39, 1, 3] = 0.0, 12_000.0
    elsewhere = diagnose(
        RunArrays.from_arrays(other, loss=loss), RunContext(world_size=2, hang_reports=(report,))
    )
    assert [f.severity for f in elsewhere if f.code == "DIST.HANG"] == [Severity.MED]
    # Where the run never got past it, it is the hang.
    hung = diagnose(
        RunArrays.from_arrays(ph[:40], loss=loss[:40]), RunContext(world_size=2, hang_reports=(report,))
    )
    assert [f.severity for f in hung if f.code == "DIST.HANG"] == [Severity.HIGH]


def test_a_hang_reported_in_warm_up_that_every_rank_went_on_past_is_slow_start_up():
    # hang_timeout=5 and every rank 10 s in its first step (lazy initialisation): the watchdog said "no rank
    # has progressed" (MED) at step 1, then the run went on to step 30. Warm-up steps are not judged for
    # stalls, so the summary kept a DIST.HANG that said it was "a stall of about that length, not a hang".
    report = {
        "code": "DIST.HANG",
        "severity": "MED",
        "title": "no rank has progressed for 5 s",
        "detail": "Every rank has been at step 1 in `between data and forward` for 5 s",
        "recommendation": "see stacks",
        "ranks": [],
        "steps": [1],
    }
    rng = np.random.default_rng(0)
    ph = np.zeros((30, 2, 6))
    ph[:, :, 1], ph[:, :, 2] = 4.0 + 0.1 * rng.standard_normal((30, 2)), 6.0
    ph[0, :, 5] += 10_000.0  # every rank's own work at step 1
    loss = 2.0 * np.exp(-np.arange(30) / 100) + 0.5
    arrays = RunArrays.from_arrays(ph, loss=loss, warmup=5)
    findings = diagnose(arrays, RunContext(world_size=2, hang_reports=(report,)))
    codes = [f.code for f in findings]
    assert "DIST.HANG" not in codes, codes
    (stall,) = [f for f in findings if f.code == "TIMING.STALL"]
    assert stall.severity == Severity.MED and stall.steps == (1,), stall
    assert stall.title == "Step 1 stalled for 10.0 s in warm-up", stall.title
    assert "reported step 1 as a hang at the time (no rank has progressed for 5 s" in stall.detail
    assert "slow start-up" in stall.detail and "not a hang" in stall.detail and "auto" in stall.recommendation
    # The counted steps' statistics are as they were: the warm-up stall is not billed to them.
    t = analyze(arrays, RunContext(world_size=2, hang_reports=(report,))).timing
    assert t.stalls == () and t.stall_share == 0.0 and [x.step for x in t.warm_up_stalls] == [1]
    # A slow first step with no hang report is warm-up as before; a run that never got past it is the hang.
    assert "TIMING.STALL" not in {f.code for f in diagnose(arrays, RunContext(world_size=2))}
    hung = RunArrays.from_arrays(ph[:1], loss=loss[:1], warmup=5)
    kept = diagnose(hung, RunContext(world_size=2, hang_reports=(report,)))
    assert "DIST.HANG" in {f.code for f in kept} and "TIMING.STALL" not in {f.code for f in kept}


def _rows(segment: int, steps: range, t0: float, ranks: int = 2) -> np.ndarray:
    rows = np.zeros((len(steps) * ranks, NCOLS))
    for i, step in enumerate(steps):
        for r in range(ranks):
            row = rows[i * ranks + r]
            row[COL["rank"]], row[COL["segment"]], row[COL["step"]] = r, segment, step
            row[COL["start_s"]] = t0 + i * 0.01
            row[COL["wall_ms"]], row[COL["forward_ms"]], row[COL["backward_ms"]] = 10.0, 4.0, 6.0
            row[COL["loss"]], row[COL["grad_syncs"]], row[COL["micro_batches"]] = 1.0, 1, 1
    return rows


def test_goodput_across_two_segments_with_replayed_rows():
    first = _rows(0, range(1, 101), 1000.0)  # ends at 1001.0 s
    second = _rows(1, range(81, 201), 1011.0)  # resumed 10 s later from step 80: 81-100 replayed
    arrays = RunArrays.from_rows(np.vstack([first, second]), warmup=0)
    ctx = RunContext(
        world_size=2,
        segments=(Segment(0, 1000.0, 0, 2), Segment(1, 1011.0, 80, 2)),
    )
    s = summarize(arrays, ctx)
    g = s.efficiency.goodput
    assert s.run.restarts == 1 and len(g.segments) == 2
    assert g.downtime_s == pytest.approx(10.0, abs=1e-6)
    assert g.replayed_s == pytest.approx(0.2, abs=1e-6)
    assert g.productive_s == pytest.approx(2.0, abs=1e-6)
    assert g.elapsed_s == pytest.approx(12.2, abs=1e-6)
    assert g.goodput == pytest.approx(2.0 / 12.2, rel=1e-6)
    d = s.to_dict()
    assert d["run"]["restarts"] == 1 and d["run"]["goodput"]["downtime_s"] == pytest.approx(10.0)


@pytest.mark.parametrize("stride", [1, 2])  # 2: Lightning's numbers with two optimizers, no gap
def test_steps_a_killed_launch_ran_but_never_wrote_are_named_after_the_resume(stride):
    # Launch 0 was killed at step 95 after a checkpoint at step 60; its records since its last gather (step 50)
    # went with it. The resumed launch starts at step 61: nothing said steps 51-60 have no records.
    first = _rows(0, range(stride, 50 * stride + 1, stride), 1000.0)
    second = _rows(1, range(61 * stride, 151 * stride, stride), 1030.0)
    arrays = RunArrays.from_rows(np.vstack([first, second]), warmup=0)
    ctx = RunContext(world_size=2, segments=(Segment(0, 1000.0, 0, 2), Segment(1, 1030.0, 60, 2)))
    s = summarize(arrays, ctx)
    assert s.run.unrecorded == ((51 * stride, 60 * stride),) and s.to_dict()["run"]["unrecorded_steps"] == [
        [51 * stride, 60 * stride]
    ]
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_summary(s))
    text = " ".join(console.file.getvalue().split())
    assert (
        f"none recorded for {51 * stride}-{60 * stride}: run by a launch that ended before it wrote" in text
    )
    # A resume from the last recorded step, or one that replays recorded steps, leaves no gap.
    for resumed in (50, 40):
        second = _rows(1, range((resumed + 1) * stride, 151 * stride, stride), 1030.0)
        arrays = RunArrays.from_rows(np.vstack([first, second]), warmup=0)
        ctx = RunContext(world_size=2, segments=(Segment(0, 1000.0, 0, 2), Segment(1, 1030.0, resumed, 2)))
        assert summarize(arrays, ctx).run.unrecorded == ()


def test_the_step_a_launch_resumed_from_is_in_the_frameworks_numbers():
    # Lightning with two optimizers numbers its steps 0, 2, 4 ... (global_step): a checkpoint after 60 steps is
    # "step=120", and the resumed launch's first step is 120. The segment said 60, pytscope's own count.
    first = _rows(0, range(0, 100, 2), 1000.0)
    second = _rows(1, range(120, 300, 2), 1030.0)
    arrays = RunArrays.from_rows(np.vstack([first, second]), warmup=0)
    segments = (Segment(0, 1000.0, 0, 2), Segment(1, 1030.0, 60, 2))
    s = summarize(arrays, RunContext(world_size=2, segments=segments, step_origin=0)).to_dict()
    assert [g["resumed_from_step"] for g in s["run"]["segments"]] == [0, 120]
    # A plain loop numbers its steps from 1: resumed after step 60, its first step is 61.
    first, second = _rows(0, range(1, 51), 1000.0), _rows(1, range(61, 151), 1030.0)
    arrays = RunArrays.from_rows(np.vstack([first, second]), warmup=0)
    s = summarize(arrays, RunContext(world_size=2, segments=segments)).to_dict()
    assert [g["resumed_from_step"] for g in s["run"]["segments"]] == [0, 60]


def test_a_hang_that_ended_its_launch_stays_a_hang_after_the_resume_replays_its_step():
    # on_hang="abort": launch 0 hung at step 41 and exited; the launcher resumed from the step-30 checkpoint
    # and the new launch went on past step 41. That hang was not "a stall the run went on past".
    report = {
        "code": "DIST.HANG",
        "severity": "HIGH",
        "title": "rank 1 never reached the 41st gradient all-reduce",
        "detail": "rank 1 in `data` for 300 s",
        "recommendation": "see stacks",
        "ranks": [1],
        "steps": [41],
    }
    first = _rows(0, range(1, 41), 1000.0)
    second = _rows(1, range(31, 101), 1400.0)
    at_41 = second[:, COL["step"]] == 41  # the new launch stalls there too (rank 1, 20 s; rank 0 waits)
    second[at_41 & (second[:, COL["rank"]] == 1), COL["other_ms"]] += 20_000.0
    second[at_41 & (second[:, COL["rank"]] == 0), COL["comm_ms"]] += 20_000.0
    second[at_41, COL["wall_ms"]] += 20_000.0
    segments = (Segment(0, 1000.0, 0, 2), Segment(1, 1400.0, 30, 2))
    arrays = RunArrays.from_rows(np.concatenate([first, second]), warmup=0)
    for segment in (0, 1, None):
        ctx = RunContext(world_size=2, segments=segments, hang_reports=({**report, "segment": segment},))
        findings = diagnose(arrays, ctx)
        hangs = [f.severity for f in findings if f.code == "DIST.HANG"]
        (stall,) = [f for f in findings if f.code == "TIMING.STALL"]
        said_as_stall = "as a hang at the time" in stall.detail
        if segment == 0:  # the hang ended its launch: a hang, and the new launch's stall is its own
            assert hangs == [Severity.HIGH] and not said_as_stall
        else:  # the report's launch went on (or, with no segment, a run written before reports had one)
            assert hangs == [] and said_as_stall


def test_a_rank_left_out_of_a_smaller_resumed_job_is_not_called_killed():
    first = _rows(0, range(1, 51), 1000.0)
    second = _rows(1, range(41, 101), 1010.0, ranks=1)  # resumed from the step-40 checkpoint on one rank
    ctx = RunContext(world_size=2, segments=(Segment(0, 1000.0, 0, 2), Segment(1, 1010.0, 40, 1)))
    ends = summarize(RunArrays.from_rows(np.vstack([first, second]), warmup=0), ctx).to_dict()["run"][
        "rank_ends"
    ]
    # Steps 41-50 were replayed by the resumed job: rank 1's records of them are replayed work, not its last.
    assert ends == [{"rank": 1, "last_step": 40, "reason": "the job resumed from step 40 with 1 rank(s)"}]


def test_a_job_resumed_on_other_ranks_is_not_a_desync_but_a_skipped_step_still_is():
    # 4 ranks, resumed on 2 from step 40, then on 4 again from step 80: ranks 2 and 3 are missing from the
    # middle launch, not diverged. A rank that skips a step inside its own launch still is.
    rows = np.vstack(
        [
            _rows(0, range(1, 51), 1000.0, ranks=4),
            _rows(1, range(41, 91), 1010.0, ranks=2),
            _rows(2, range(81, 121), 1020.0, ranks=4),
        ]
    )
    segments = (Segment(0, 1000.0, 0, 4), Segment(1, 1010.0, 40, 2), Segment(2, 1020.0, 80, 4))
    ctx4 = RunContext(world_size=4, segments=segments)
    assert not [f for f in diagnose(RunArrays.from_rows(rows, warmup=0), ctx4) if f.code == "DIST.DESYNC"]
    grown = np.vstack([_rows(0, range(1, 41), 1000.0, ranks=1), _rows(1, range(41, 101), 1010.0, ranks=2)])
    ctx = RunContext(world_size=2, segments=(Segment(0, 1000.0, 0, 1), Segment(1, 1010.0, 40, 2)))
    assert not [f for f in diagnose(RunArrays.from_rows(grown, warmup=0), ctx) if f.code == "DIST.DESYNC"]
    skipped = (rows[:, COL["segment"]] == 2) & (rows[:, COL["rank"]] == 3) & (rows[:, COL["step"]] == 100)
    (desync,) = [
        f for f in diagnose(RunArrays.from_rows(rows[~skipped], warmup=0), ctx4) if f.code == "DIST.DESYNC"
    ]
    assert desync.steps == (100,) and desync.ranks == (3,)
    # Ranks of one launch that resume from different steps do diverge: rank 3 joins 10 steps late.
    late = (rows[:, COL["segment"]] == 2) & (rows[:, COL["rank"]] == 3) & (rows[:, COL["step"]] <= 90)
    (desync,) = [
        f for f in diagnose(RunArrays.from_rows(rows[~late], warmup=0), ctx4) if f.code == "DIST.DESYNC"
    ]
    assert desync.steps == (81,) and desync.ranks == (3,)


def test_a_pause_on_rank_0_and_the_wait_for_it_count_once_in_goodput():
    # Rank 0 evaluates for 1 s inside `paused()` after step 10; rank 1 waits for it in step 11's all-reduce.
    rows = _rows(0, range(1, 101), 1000.0)
    late = rows[:, COL["step"]] > 10
    rows[late, COL["start_s"]] += 1.0
    rows[(rows[:, COL["step"]] == 10) & (rows[:, COL["rank"]] == 0), COL["excluded_ms"]] = 1000.0
    waited = (rows[:, COL["step"]] == 11) & (rows[:, COL["rank"]] == 1)
    rows[waited, COL["comm_ms"]] += 1000.0
    rows[waited, COL["wall_ms"]] += 1000.0
    summary = summarize(RunArrays.from_rows(rows, warmup=0), RunContext(world_size=2))
    g = summary.efficiency.goodput
    assert g.excluded_s == pytest.approx(1.0, abs=1e-6)
    assert g.elapsed_s == pytest.approx(2.0, abs=1e-6)  # 100 steps of 10 ms and the pause, as the clock says
    assert g.goodput == pytest.approx(0.5, abs=1e-6)
    console = Console(record=True, width=160)
    console.print(render_summary(summary))  # the console says where the other half went
    assert (
        "50.0% (downtime 0.0 s, replayed 0.0 s, warm-up 0.0 s, paused (validation, checkpoints) 1.0 s)"
        in (console.export_text())
    )


@pytest.mark.parametrize("steps,ranks", [(0, 2), (1, 2), (1, 1), (50, 1)])
def test_tiny_runs_summarize(steps, ranks):
    ph = np.ones((steps, ranks, 6))
    arrays = RunArrays.from_arrays(ph, warmup=5)
    s = summarize(arrays, RunContext(world_size=ranks))
    d = s.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["run"]["steps"] == steps and d["convergence"]["trend"] == "unknown"


def test_all_nan_loss_and_memory_summarize():
    arrays = make_run(200, 2, loss=np.full(200, np.nan))
    summary = summarize(arrays, RunContext(world_size=2))
    d = summary.to_dict()
    assert d["convergence"]["first_loss"] is None and d["convergence"]["nonfinite_step"] is None
    json.dumps(d, allow_nan=False)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_convergence(summary))  # no loss at all is not "0 finite losses"
    assert "no loss was logged: pass it to scope.log(loss=...)" in console.file.getvalue()


def test_summary_keys_and_phase_shares_sum_to_one():
    d = summarize(make_run(300, 4, slow={1: 0.1}), RunContext(world_size=4)).to_dict()
    assert sum(p["share"] for p in d["timing"]["phases"].values()) == pytest.approx(1.0)
    assert d["distributed"]["stragglers"] == [1] and d["distributed"]["split_is_estimate"] is True
    rank = d["distributed"]["per_rank"][1]
    assert {"rank", "local_ms", "comm_ms", "sync_wait_ms", "critical_share", "straggler"} <= set(rank)
    assert sum(x["share"] for x in d["efficiency"]["budget"]) == pytest.approx(1.0)
    assert d["efficiency"]["mfu"] is None and d["scope"]["errors"] == []
    assert {"code", "severity", "ranks", "steps"} <= set(d["findings"][0])


def test_memory_growth_and_pressure():
    mem = np.linspace(4e9, 6e9, 400)
    ctx = RunContext(world_size=2, mem_limit_bytes=6.1e9)
    arrays = RunArrays.from_arrays(np.asarray(make_run(400, 2).phases), mem_bytes=mem)
    found = codes(diagnose(arrays, ctx, strict=True))
    assert {"MEMORY.GROWTH", "MEMORY.PRESSURE"} <= found


def test_a_one_off_peak_in_a_high_water_mark_is_not_growth():
    # The recorded memory only grows (allocator max, peak RSS): one long batch lifts it for good.
    ctx = RunContext(world_size=2)
    phases = np.asarray(make_run(400, 2).phases)
    for at in (240, 230):  # on a block edge (one rise) and mid-block (two halves)
        mem = np.where(np.arange(400) < at, 4e9, 5e9)
        found = codes(diagnose(RunArrays.from_arrays(phases, mem_bytes=mem), ctx, strict=True))
        assert "MEMORY.GROWTH" not in found, at
    # A leak that climbs a little with each of several epochs still reads as growth.
    epochs = np.repeat(4e9 + 0.25e9 * np.arange(8), 50)
    found = codes(diagnose(RunArrays.from_arrays(phases, mem_bytes=epochs), ctx, strict=True))
    assert "MEMORY.GROWTH" in found


def test_low_mfu_only_when_known():
    arrays = make_run(200, 2)
    assert "EFFICIENCY.LOW_MFU" not in codes(diagnose(arrays, RunContext(world_size=2)))
    ctx = RunContext(world_size=2, flops_per_step=1e9, peak_flops=1e15)
    (low,) = [f for f in diagnose(arrays, ctx, strict=True) if f.code == "EFFICIENCY.LOW_MFU"]
    assert "bf16 autocast" in low.recommendation
    # A run that trains in bf16 already is not told to.
    ctx = dataclasses.replace(ctx, precision="bf16")
    (low,) = [f for f in diagnose(arrays, ctx, strict=True) if f.code == "EFFICIENCY.LOW_MFU"]
    assert "bf16" not in low.recommendation and "fused kernels" in low.recommendation


def test_steps_of_more_micro_batches_are_not_jitter():
    # An accumulation schedule (1 micro-batch per step, then 4, then 2), each micro-batch the same 3 ms: a
    # step of 4 is 4x one of 1, not an unstable step; a stall in a step of 4 still is one.
    micro = np.repeat([1.0, 4.0, 2.0], 100)
    ph = np.zeros((300, 2, 6))
    ph[:, :, 1] = 3.0 * micro[:, None]
    ph[:, :, 4] = 0.2
    arrays = RunArrays.from_arrays(ph, micro_batches=np.broadcast_to(micro[:, None], (300, 2)))
    timing = analyze(arrays, RunContext(world_size=2)).timing
    assert timing.jitter_cost_share == 0.0 and timing.stall_count == 0
    assert "TIMING.JITTER" not in codes(run_rules(analyze(arrays, RunContext(world_size=2))))
    ph[150, 0, 5] = 500.0
    timing = analyze(
        RunArrays.from_arrays(ph, micro_batches=arrays.micro_batches), RunContext(world_size=2)
    ).timing
    assert timing.stall_count == 1 and timing.stalls[0].step == 151


def test_jitter_names_the_phase_that_grows_in_slow_steps():
    rng = np.random.default_rng(3)
    phases = np.tile(np.array([0.3, 2.0, 4.0, 0.5, 0.3, 0.2]), (400, 2, 1)) * rng.uniform(
        0.97, 1.03, (400, 2, 6)
    )
    phases[::8, :, 3] += 6.0  # every 8th step the all-reduce stalls on both ranks
    findings = diagnose(RunArrays.from_arrays(phases), RunContext(world_size=2))
    jitter = [f for f in findings if f.code == "TIMING.JITTER"]
    assert jitter and "`comm` grows the most" in jitter[0].detail


# -- duplicate shards -----------------------------------------------------------------------------------------


def fingerprinted(ranks: int, same_as: dict[int, int], steps: int = 200, seed: int = 0) -> RunArrays:
    """Every 8th step fingerprinted; rank r's batch equals rank same_as[r]'s."""
    rng = np.random.default_rng(seed)
    fp = np.full((steps, ranks), np.nan)
    fp[::8] = rng.integers(0, 2**48, size=(len(fp[::8]), ranks)).astype(np.float64)
    for r, other in same_as.items():
        fp[::8, r] = fp[::8, other]
    base = make_run(steps, ranks, seed=seed)
    return RunArrays.from_arrays(base.phases, batch_fp=fp)


def test_ranks_on_identical_batches_are_named_with_the_compute_they_waste():
    found = [
        f
        for f in diagnose(fingerprinted(4, {1: 0, 2: 0, 3: 0}), RunContext(world_size=4))
        if f.code == "DATA.DUPLICATE_SHARDS"
    ]
    assert len(found) == 1 and found[0].ranks == (0, 1, 2, 3) and found[0].severity == Severity.HIGH
    assert "3 of 4 ranks (1, 2, 3) repeat rank 0's data" in found[0].detail
    assert found[0].evidence["duplicated_share"] == pytest.approx(0.75)
    # An IterableDataset takes no sampler: the advice says how to shard one (Lightning's flag cannot).
    assert "IterableDataset" in found[0].recommendation and "__iter__" in found[0].recommendation


def test_two_pairs_sharing_data_are_half_the_compute():
    a = analyze(fingerprinted(4, {1: 0, 3: 2}), RunContext(world_size=4))
    assert a.duplicates.duplicated_share == pytest.approx(0.5) and a.duplicates.groups == ((0, 1), (2, 3))


@pytest.mark.parametrize("seed", range(20))
def test_different_shards_are_never_called_duplicates(seed):
    codes = {f.code for f in diagnose(fingerprinted(8, {}, seed=seed), RunContext(world_size=8))}
    assert "DATA.DUPLICATE_SHARDS" not in codes


def test_no_fingerprints_no_finding():
    a = analyze(make_run(100, 2), RunContext(world_size=2))
    assert a.duplicates.steps_checked == 0
    assert "DATA.DUPLICATE_SHARDS" not in {
        f.code for f in diagnose(make_run(100, 2), RunContext(world_size=2))
    }


def test_advice_on_other_time_fits_the_integration():
    # Under Lightning the loss is inside training_step (forward and backward): not the first suspect in `other`.
    ph = np.zeros((300, 2, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 5] = 2.0, 3.0, 5.0  # half of each step in `other`
    arrays = RunArrays.from_arrays(ph, loss=np.linspace(2, 1, 300))
    advice = {
        integration: next(
            f.recommendation
            for f in diagnose(arrays, RunContext(world_size=2, integration=integration))
            if f.code == "EFFICIENCY.RECOVERABLE"
        )
        for integration in ("torch", "lightning")
    }
    assert "a loss computed outside the model" in advice["torch"]
    assert "training_step's loss is timed as forward and backward" in advice["lightning"]


def test_time_a_job_spent_hung_counts_against_goodput():
    # 50 steps of 10 ms from t=1000 s, then stuck until the hang was reported at t=1006 s and the job ended.
    rows = _rows(0, range(1, 51), 1000.0)
    ctx = RunContext(world_size=2, segments=(Segment(0, 1000.0, 0, 2),), alive=((0, 1006.0),))
    g = summarize(RunArrays.from_rows(rows, warmup=0), ctx).efficiency.goodput
    assert g.elapsed_s == pytest.approx(6.0, abs=1e-6) and g.goodput == pytest.approx(0.5 / 6.0, rel=1e-3)
    g = summarize(RunArrays.from_rows(rows, warmup=0), dataclasses.replace(ctx, alive=())).efficiency.goodput
    assert g.elapsed_s == pytest.approx(0.5, abs=1e-6)  # without the report: the steps alone


def test_goodput_names_the_time_a_launch_was_hung_not_start_up():
    # A reviewer's 2-rank Accelerate run hung at step 50 (rank 1 skipped a batch); the 20 s rank 0 then waited
    # in the all-reduce until DIST.HANG read "outside steps (start-up, gathers, teardown) 20.4 s".
    # Launch 0: 50 steps of 10 ms from t=1000 s, stuck until its hang report at t=1006 s. Launch 1, resumed at
    # t=1010 s, hung before its first step was recorded: reported at t=1020 s after 7 s without progress, so
    # 3 s of it were start-up.
    rows = _rows(0, range(1, 51), 1000.0)
    report = {"code": "DIST.HANG", "segment": 1, "evidence": {"idle_s_rank0": 7.0, "idle_s_rank1": 6.5}}
    ctx = RunContext(
        world_size=2,
        segments=(Segment(0, 1000.0, 0, 2), Segment(1, 1010.0, 50, 2)),
        hang_reports=({"code": "DIST.HANG", "segment": 0, "evidence": {"idle_s_rank0": 5.4}}, report),
        alive=((0, 1006.0), (1, 1020.0)),
    )
    s = summarize(RunArrays.from_rows(rows, warmup=0), ctx)
    g = s.efficiency.goodput
    assert g.elapsed_s == pytest.approx(20.0, abs=1e-6) and g.downtime_s == pytest.approx(4.0, abs=1e-6)
    assert g.hang_s == pytest.approx(5.5 + 7.0, abs=1e-6)
    assert g.unaccounted_s == pytest.approx(3.0, abs=1e-6)
    assert s.to_dict()["run"]["goodput"]["hang_s"] == pytest.approx(12.5, abs=1e-6)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_summary(s))
    out = " ".join(console.file.getvalue().split())
    assert "hung (DIST.HANG) 12.5 s" in out and "teardown) 3.0 s" in out
    # A report the launch's steps went on past was a stall inside a step: its time is the step's.
    went_on = dataclasses.replace(ctx, segments=ctx.segments[:1], hang_reports=(), alive=((0, 1000.2),))
    g = summarize(RunArrays.from_rows(rows, warmup=0), went_on).efficiency.goodput
    assert g.hang_s == 0.0 and g.elapsed_s == pytest.approx(0.5, abs=1e-6)


def test_a_spike_while_the_loss_still_falls_fast_is_found_and_the_fall_alone_is_not_one():
    # An audit's 2-rank run logged 6.51 and 4.98 at step 80 against about 0.7 at steps 79 and 81 and read
    # "spikes: none": the trailing 50 steps' median (1.71) lagged the fall, and the fall's spread (0.88)
    # passed for noise. The same held for x5 at step 130 and x10 at step 100 of a replay.
    rng = np.random.default_rng(7)
    t = np.arange(1, 151)
    for level in (0.3 + 4.7 * np.exp(-t / 25), 5.0 / np.sqrt(t)):
        loss = level * (1 + 0.05 * rng.standard_normal(t.size))
        assert find_spikes(loss, t) == ()
        for at, factor in ((80, 8.0), (100, 5.0), (130, 6.0)):
            spiked = loss.copy()
            spiked[at - 1] *= factor
            (spike,) = find_spikes(spiked, t)
            assert spike.step == at and spike.loss / spike.baseline > 0.8 * factor, (at, spike)
    # Both ranks' losses spike at step 80 (no rank named); then rank 1's alone at step 100 (it is named).
    per_rank = np.repeat(loss[:, None], 2, axis=1) * (1 + 0.02 * rng.standard_normal((t.size, 2)))
    per_rank[79] *= (9.2, 7.0)
    per_rank[99, 1] *= 10.0
    a = analyze(make_run(150, 2, loss=per_rank), RunContext(world_size=2))
    assert [(s.step, s.ranks) for s in a.convergence.spikes] == [(80, ()), (100, (1,))]
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.SPIKE"]
    assert found.severity == Severity.MED  # (x8, far out of the noise: not a converged loss's batch swing)


def test_one_nan_on_the_last_step_is_not_a_loss_that_stayed_non_finite():
    loss = np.linspace(3.0, 1.0, 200)
    loss[-1] = np.nan  # (logged as NaN: the rows hold +inf for a logged non-finite loss)
    arrays = RunArrays.from_arrays(np.ones((200, 1, 6)), loss=np.where(np.isnan(loss), np.inf, loss))
    c = analyze(arrays, RunContext(world_size=1)).convergence
    assert c.trend.trend != "non-finite" and c.nonfinite_step == 200
    (found,) = [
        f for f in run_rules(analyze(arrays, RunContext(world_size=1))) if f.code == "CONVERGENCE.NONFINITE"
    ]
    # (It read "It was finite again after it": no step came after it.)
    assert "The run's last 1 step(s) had a non-finite loss (1 in all): too few to tell" in found.detail
    loss[-3:] = np.inf  # three: it stayed
    arrays = RunArrays.from_arrays(np.ones((200, 1, 6)), loss=loss)
    assert analyze(arrays, RunContext(world_size=1)).convergence.trend.trend == "non-finite"


def test_one_nan_on_the_last_step_after_which_the_optimizer_never_stepped_is_where_the_run_was_going():
    # A NaN guard skipped every batch from step 200 on: they closed as one step without an optimizer step.
    loss = np.linspace(3.0, 1.0, 200)
    loss[-1] = np.inf
    stepped = np.ones((200, 2))
    stepped[-1] = 0.0
    arrays = RunArrays.from_arrays(np.ones((200, 2, 6)), loss=loss, optimizer_steps=stepped)
    a = analyze(arrays, RunContext(world_size=2))
    assert a.convergence.trend.trend == "non-finite" and a.convergence.nonfinite_tail is not None
    (found,) = [f for f in run_rules(a) if f.code == "CONVERGENCE.NONFINITE"]
    assert "never recovered" in found.title
    assert (
        "(1 step(s) with a non-finite loss, and no optimizer step updated the weights again)" in found.detail
    )
    stepped[-1, 1] = 1.0  # one rank's optimizer stepped after it: one NaN the run ended on, as above
    a = analyze(
        RunArrays.from_arrays(np.ones((200, 2, 6)), loss=loss, optimizer_steps=stepped),
        RunContext(world_size=2),
    )
    assert a.convergence.nonfinite_tail is None and a.convergence.nonfinite_last_steps == 1


def _discounted(comm: list[list[float]], paused: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """`discount_peer_pauses` on steps x ranks of comm and pause times: (comm, excluded) after it."""
    from pytscope_core.arrays import _COMM, discount_peer_pauses

    c, excluded = np.array(comm, dtype=float), np.array(paused, dtype=float)
    phases = np.zeros((*c.shape, 6))
    phases[:, :, _COMM] = c
    wall = c + 1.0
    discount_peer_pauses(phases, wall, excluded)
    assert np.allclose(wall + excluded, c + 1.0 + np.array(paused))  # time moves, none is lost
    return phases[:, :, _COMM], excluded


def test_only_a_wait_for_another_ranks_pause_is_discounted():
    # Rank 0 evaluates alone (50 ms) in step 1: rank 1's waits in steps 1 and 2 are the pause's, rank 0's own
    # comm in the step after its pause is not.
    comm, _ = _discounted([[1, 1], [0, 40], [5, 20], [5, 5]], [[0, 0], [50, 0], [0, 0], [0, 0]])
    assert comm.tolist() == [[1, 1], [0, 0], [5, 0], [5, 5]]
    # Every rank evaluates together: nobody waited for anybody.
    comm, _ = _discounted([[1, 1], [2, 2], [5, 20]], [[0, 0], [50, 50], [0, 0]])
    assert comm.tolist() == [[1, 1], [2, 2], [5, 20]]
    # One rank alone has no peer to wait for.
    comm, excluded = _discounted([[3], [4]], [[50], [0]])
    assert comm.tolist() == [[3], [4]] and excluded.tolist() == [[50], [0]]


def test_memory_pressure_names_the_ranks_by_id_when_a_rank_has_no_rows():
    # Ranks 1, 2 and 3 have rows (rank 0 none): the arrays' columns are ranks 1-3, and rank 3 is the full one.
    mem = np.full((60, 3), 10e9)
    mem[:, 2] = 99e9
    arrays = RunArrays.from_arrays(np.ones((60, 3, 6)), mem_bytes=mem, ranks=np.array([1, 2, 3]))
    a = analyze(arrays, RunContext(world_size=4, mem_limit_bytes=100e9))
    (found,) = [f for f in run_rules(a) if f.code == "MEMORY.PRESSURE"]
    assert found.ranks == (3,) and "on rank 3" in found.detail
    assert a.memory.ranks == (1, 2, 3) and a.memory.peak_rank == 3


def test_one_desync_is_one_finding_with_one_majority_rule():
    # 2 ranks; rank 1 syncs twice in step 61. The gather's cumulative counts tie 1-1 (no majority there);
    # the per-step counts single rank 1 out (one sync is what every other step has). One finding, rank 1.
    syncs = np.ones((100, 2))
    syncs[60, 1] = 2
    arrays = RunArrays.from_arrays(np.ones((100, 2, 6)), grad_syncs=syncs)
    ctx = RunContext(world_size=2, counts_checks=(CountsCheck(2, (100, 100), (100, 101), (100, 100)),))
    (found,) = [f for f in diagnose(arrays, ctx, strict=True) if f.code == "DIST.DESYNC"]
    assert found.ranks == (1,) and found.steps == (61,)
    # Rank 1 syncs twice in every step: the run's history ties too, so nobody is singled out.
    both = RunArrays.from_arrays(np.ones((100, 2, 6)), grad_syncs=np.tile([1.0, 2.0], (100, 1)))
    (found,) = [f for f in diagnose(both, RunContext(world_size=2), strict=True) if f.code == "DIST.DESYNC"]
    assert found.ranks == (0, 1) and "with no majority to single a rank out" in found.detail
    from pytscope_core.analysis.distributed import majority

    assert majority(np.array([1.0, 2.0])) is None and majority(np.array([1.0, 2.0]), syncs) == 1.0
    assert majority(np.array([3.0, 3.0, 4.0, np.nan])) == 3.0


def test_a_late_straggler_is_the_one_the_plot_the_table_and_the_live_metric_count(monkeypatch, tmp_path):
    # As in test_a_straggler_that_begins_late_is_named_from_where_it_began: rank 1 is 1.5x slower from step 801.
    from types import SimpleNamespace

    from pytscope_core import plots
    from pytscope_core.live import metrics

    arrays = _late_straggler()
    a = analyze(arrays, RunContext(world_size=4))
    d = a.distributed
    assert d.stragglers == () and d.late is not None and d.late.stragglers == (1,)
    findings = run_rules(a)
    assert metrics(a, findings)["pytscope/lost_to_imbalance"] == d.late.lost_to_imbalance > 0
    summary = summary_of(a, findings)
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(render_distributed(summary))
    marked = [line for line in console.file.getvalue().splitlines() if "◀ straggler" in line]
    assert len(marked) == 1 and marked[0].split()[0] == "1"
    axes = []

    def figure():
        fig, ax = plots_figure()
        axes.append(ax)
        return fig, ax

    plots_figure = plots._figure
    monkeypatch.setattr(plots, "_figure", figure)
    plots.plot_local_work(SimpleNamespace(arrays=arrays), summary, tmp_path / "local.png")
    assert [line.get_label() for line in axes[0].get_lines() if "straggler" in line.get_label()] == [
        "rank 1 (straggler)"
    ]
    assert d.effective is d.late


def test_the_live_replica_check_keeps_what_the_drift_rule_flags(tmp_path):
    import time

    from pytscope_core.live import LiveDiagnosis
    from pytscope_core.reporter import RunReporter

    live = LiveDiagnosis(RunReporter(tmp_path, {}, console=False), Segment(0, time.time(), 0, 2), 0, [])
    for relative in (1e-8, 1e-5):  # summation-order noise, then a real difference
        sums = (1.0, 1.0 + relative)
        live.replica_checks.clear()
        live._check_replicas(np.array([[10, 10, 10, 10, s] for s in sums], dtype=float), step=10)
        ctx = RunContext(world_size=2, replica_checks=(ReplicaCheck(10, sums),))
        flagged = any(f.code == "DIST.REPLICA_DRIFT" for f in diagnose(make_run(50, 2), ctx, strict=True))
        assert bool(live.replica_checks) == flagged == (relative > 1e-6)


def test_a_loss_falling_steadily_by_a_few_percent_is_improving_not_stalled():
    # 1.37 -> 1.30 over the run (about -4.5%), every block lower than the one before: it used to read "flat",
    # a MED finding that the loss had stopped improving.
    rng = np.random.default_rng(0)
    steps = np.arange(400)
    trend = loss_trend(1.37 - 0.0002 * steps + rng.normal(0, 0.01, steps.size))
    assert trend.trend == "improving" and -0.06 < trend.relative_change < -0.03, trend
    flat = loss_trend(1.37 + rng.normal(0, 0.01, steps.size))  # the same noise with no fall stays flat
    assert flat.trend == "flat", flat


def test_timing_statistics_leave_out_batches_skipped_after_their_forward_only_where_forwards_are_seen():
    from pytscope_core.analysis.timing import statistics_steps
    from pytscope_core.arrays import RunArrays

    rows = np.zeros((6, NCOLS))
    rows[:, COL["step"]] = np.arange(1, 7)
    rows[:, COL["micro_batches"]] = [1, 1, 0, 0, 1, 1]  # steps 3-4: a NaN guard's batches (forward alone)
    rows[:, COL["optimizer_steps"]] = [1, 1, 0, 0, 0, 1]  # step 5: the GradScaler skipped it (trained)
    arrays = RunArrays.from_rows(rows, warmup=0)
    assert statistics_steps(arrays).tolist() == [True, True, False, False, True, True]
    rows[:, COL["micro_batches"]] = 0  # no forward seen (no model watched): every step is one that trained
    assert statistics_steps(RunArrays.from_rows(rows, warmup=0)).all()


def _stepping(
    ranks: int, stepped: list[int], micro: list[int] | None = None, loss: list[float] | None = None
):
    """`len(stepped)` steps of 10 ms on `ranks` ranks: optimizer steps, micro-batches (1 each by default)
    and a slowly falling loss (every rank alike unless given)."""
    from pytscope_core.records import PHASES

    n = len(stepped)
    rows = np.zeros((ranks, n, NCOLS))
    rows[:, :, COL["step"]] = np.arange(1, n + 1)
    rows[:, :, COL["rank"]] = np.arange(ranks)[:, None]
    rows[:, :, COL["wall_ms"]] = rows[:, :, COL[f"{PHASES[1]}_ms"]] = 10.0
    rows[:, :, COL["optimizer_steps"]] = stepped
    rows[:, :, COL["micro_batches"]] = micro if micro is not None else 1
    rows[:, :, COL["loss"]] = loss if loss is not None else 2.0 - np.arange(n) / n
    return rows.reshape(-1, NCOLS)


def _skipped_findings(rows: np.ndarray, ranks: int = 1) -> list:
    a = analyze(RunArrays.from_rows(rows), RunContext(world_size=ranks))
    return [f for f in run_rules(a, strict=True) if f.code == "CONVERGENCE.SKIPPED_STEPS"]


def test_steps_no_optimizer_step_trained_with_a_finite_loss_are_reported():
    # A GradScaler skipping every step from step 151 on (gradients NaN, loss finite): the run stopped training.
    (f,) = _skipped_findings(_stepping(1, [1] * 150 + [0] * 50))
    assert f.severity == Severity.HIGH and f.steps == (151,) and f.evidence["tail_steps"] == 50
    assert "since step 151" in f.title
    # A Lightning training_step returning None: Lightning still calls optimizer.step, on no gradient.
    (f,) = _skipped_findings(_stepping(1, [1] * 200, micro=[1] * 150 + [0] * 50))
    assert f.severity == Severity.HIGH and f.steps == (151,)
    # Every 5th step skipped, training between them: a share of the run, not its end.
    (f,) = _skipped_findings(_stepping(2, [0 if i % 5 == 4 else 1 for i in range(200)]), ranks=2)
    assert (
        f.severity == Severity.MED
        and f.evidence["skipped_steps"] == 39
        and f.evidence["counted_steps"] == 195
    )
    assert f.title == "The optimizer skipped 39 of 195 steps"
    assert f.steps == (10,)  # the first past warm-up (step 5 is the fifth of its five steps)


def test_skipped_steps_that_are_no_finding():
    # A healthy fp16 run: the scaler's calibration in warm-up and one skip later; a tail too short to tell.
    assert _skipped_findings(_stepping(1, [0, 0, 0] + [1] * 100 + [0] + [1] * 96)) == []
    assert _skipped_findings(_stepping(1, [1] * 191 + [0] * 9)) == []
    # A GradScaler settling its scale on large gradients: 15 of a 100-step run's first 17 steps, then none.
    calibrating = [0] * 5 + [1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0] + [1] * 82
    assert _skipped_findings(_stepping(1, calibrating)) == []
    # A non-finite loss is CONVERGENCE.NONFINITE's (it says whether the optimizer stepped again).
    loss = [1.0] * 150 + [math.inf] * 50
    assert _skipped_findings(_stepping(1, [1] * 150 + [0] * 50, loss=loss)) == []
    # No optimizer watched: no step is recorded anywhere.
    assert _skipped_findings(_stepping(1, [0] * 200)) == []
    # One rank stepped where the other did not: DIST.DESYNC's, not a step that trained nothing.
    rows = _stepping(2, [1] * 200)
    rows[200 + 150 :, COL["optimizer_steps"]] = 0
    assert _skipped_findings(rows, ranks=2) == []
    # A run recorded before the optimizer_steps column (NaN): nothing to tell; nor of its steps in a run that
    # holds both.
    assert _skipped_findings(_stepping(1, [math.nan] * 200)) == []
    assert _skipped_findings(_stepping(1, [math.nan] * 100 + [1] * 100)) == []
