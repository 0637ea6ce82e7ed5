"""The watchdog thread's own lifecycle (its hang detection runs in the multi-process tests)."""

import json
import threading
import time

from pytscope_core import watchdog
from pytscope_core.recorder import StepRecorder
from pytscope_core.timeline import Mark
from pytscope_core.watchdog import Watchdog, classify_hang


class SlowStore:
    """A key-value store whose writes take a while, like a TCPStore on a loaded machine."""

    def __init__(self) -> None:
        self.writing = threading.Event()

    def set(self, key: str, value: str) -> None:
        self.writing.set()
        time.sleep(0.3)

    def check(self, keys: list[str]) -> bool:
        return False


def test_stop_waits_for_a_store_call_in_flight(tmp_path, monkeypatch):
    # A daemon thread still inside a (C++) store call when the interpreter exits can abort the process.
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)
    store = SlowStore()
    dog = Watchdog(
        StepRecorder(),
        store,
        rank=1,
        world_size=2,
        run_dir=tmp_path,
        timeout_s=lambda: None,
        on_hang="abort",
        report=lambda finding: None,
    )
    dog.start()
    assert store.writing.wait(5.0)
    dog.stop()
    assert not dog.is_alive()


def test_stop_before_start_and_twice_is_harmless(tmp_path):
    dog = Watchdog(StepRecorder(), None, 0, 1, tmp_path, lambda: None, "abort", lambda finding: None)
    dog.stop()
    dog.stop()
    assert not dog.is_alive()


class DictStore:
    def __init__(self, **keys: str) -> None:
        self.keys = dict(keys)

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key].encode()


def test_rank_0_stops_watching_once_a_peer_disabled_its_scope(tmp_path, monkeypatch):
    # A rank whose scope hit an internal error stops beating; rank 0 must not take that for a hang.
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)
    reported = []
    dog = Watchdog(
        StepRecorder(),
        DictStore(**{"pytscope/disabled": "1"}),
        rank=0,
        world_size=2,
        run_dir=tmp_path,
        timeout_s=lambda: 0.0,  # anything not progressing would be a hang at once
        on_hang="report",
        report=reported.append,
        disabled_key="pytscope/disabled",
    )
    dog.start()
    dog.join(5.0)
    assert not dog.is_alive() and reported == []


# -- the warm-up rule ----------------------------------------------------------------------------------------


def _beat(phase: str, step: int = 2) -> dict:
    return {"step": step, "phase": phase, "idle_s": 400.0, "syncs": step}


def test_ranks_left_waiting_in_a_collective_of_the_loops_own_name_the_rank_they_wait_for():
    # Rank 1 waits in a barrier, a metric's all-reduce or Lightning's per-batch broadcast (timed); rank 0 is
    # alive at the same step after its optimizer step: work of rank 0 only between steps (a sample, a
    # checkpoint) looks the same as rank 0 stuck there, so it is named, MED, and the job is not ended, for up
    # to as long as a paused rank gets (4 timeouts).
    waiting = _beat(watchdog.LOOP_COLLECTIVE)  # idle 400 s
    f = classify_hang({0: _beat("after the optimizer step"), 1: waiting}, 2, 300.0)
    assert f is not None and f.severity.name == "MED" and f.ranks == (0,)
    assert f.title == "rank 0 kept the others waiting for 400 s", f.title
    assert "waiting in a collective the training loop calls" in f.detail and "HIGH hang at 1200 s" in f.detail
    # Rank 0 inside the step (its data, its forward: it never reached the metric's all-reduce in it), left
    # the loop, is a step behind, its heartbeat went stale, or it kept them waiting 4 timeouts: HIGH.
    for gone in (
        _beat("data"),
        _beat("forward"),
        _beat("finished"),
        _beat("after the optimizer step", step=1),
        {**_beat("after the optimizer step"), "age_s": 400.0},
    ):
        f = classify_hang({0: gone, 1: waiting}, 2, 300.0)
        assert f is not None and f.severity.name == "HIGH" and f.ranks == (0,), gone
        assert f.title == f"rank 0 never reached {watchdog.LOOP_WAIT}", f.title
    f = classify_hang({0: _beat("after the optimizer step"), 1: waiting}, 2, 99.0)  # 400 s > 4 x 99 s
    assert f is not None and f.severity.name == "HIGH"
    f = classify_hang({1: waiting}, 2, 300.0)  # no heartbeat at all
    assert f is not None and f.severity.name == "HIGH" and f.ranks == (0,)
    beats = {0: _beat("forward"), 1: waiting}
    warm_up = classify_hang(beats, 2, 300.0, collective_only=True)  # the warm-up rule takes it too
    assert warm_up is not None and warm_up.severity.name == "HIGH" and warm_up.ranks == (0,)


def test_a_rank_out_of_batches_inside_join_waits_for_the_others_and_is_not_the_one_named():
    # Rank 1 shadows the others' collectives inside torch's Join; rank 0, still training, is stuck in its
    # forward: rank 0 never reached the collective rank 1 waits in.
    joined = {**_beat(watchdog.JOINED, step=24), "syncs": 30}  # (its syncs go on: it shadows the others')
    f = classify_hang({0: _beat("forward", step=30), 1: joined}, 2, 300.0)
    assert f is not None and f.ranks == (0,) and f.steps == (31,), f
    assert f.title == "rank 0 never reached the 31st gradient all-reduce", f.title
    assert "rank 1 has been waiting inside join(), out of batches, for the gradient all-reduce" in f.detail


def test_after_a_collective_of_the_loops_a_rank_is_placed_where_it_was_before_it():
    from pytscope_core.recorder import place_mark

    b, e = int(Mark.LOOP_COMM_BEGIN), int(Mark.LOOP_COMM_END)
    after = int(Mark.OPTIMIZER_END)
    assert place_mark([int(Mark.DATA_BEGIN), after, b, e], 4) == after
    assert place_mark([int(Mark.DATA_BEGIN), after, b, b, e, e], 6) == after  # nested: gather_for_metrics
    assert (
        place_mark([int(Mark.DATA_BEGIN), after, b, e, b, e], 6) == after
    )  # back to back: two sync_dist logs
    assert place_mark([after, b, e, b], 4) == b  # inside the next one: in it
    assert place_mark([b, e], 2) == e  # nothing before it


def test_during_warm_up_only_ranks_left_waiting_in_a_collective_are_a_hang():
    # Every rank compiling its first forward, or starting its loaders: slow, never a hang.
    for phase in ("forward", "data", "optimizer"):
        assert classify_hang({0: _beat(phase), 1: _beat(phase)}, 2, 300.0, collective_only=True) is None
    # Rank 0 waits in the first all-reduce, rank 1 never came: a hang, said as a warm-up one.
    f = classify_hang({0: _beat("comm"), 1: _beat("forward")}, 2, 300.0, collective_only=True)
    assert f is not None and f.ranks == (1,) and "during warm-up: 300 s inside a collective" in f.detail
    # Every rank between one FSDP2 unit's collective marks may be a long compile; pytscope's own gather has
    # its own timeout: neither is a warm-up hang.
    assert (
        classify_hang({0: _beat("collective"), 1: _beat("collective")}, 2, 300.0, collective_only=True)
        is None
    )
    assert classify_hang({0: _beat("gather"), 1: _beat("forward")}, 2, 300.0, collective_only=True) is None
    # After warm-up, the same heartbeats of a slow start are a hang as before.
    assert classify_hang({0: _beat("forward"), 1: _beat("forward")}, 2, 300.0) is not None


def test_a_hang_says_which_collective_the_waiting_ranks_are_in():
    # Waiting in the all-reduce: the count of all-reduces is an ordinal, not a number that reads as a step.
    f = classify_hang({0: {**_beat("comm"), "syncs": 29}, 1: _beat("forward")}, 2, 10.0)
    assert f is not None and f.title == "rank 1 never reached the 30th gradient all-reduce"
    # Waiting in pytscope's own gather between steps (the peer hung after its backward): not "in backward".
    f = classify_hang({0: _beat("gather"), 1: _beat("optimizer")}, 2, 10.0)
    assert f is not None and "gather of step records" in f.title and "backward" not in f.detail
    # Waiting in one the loop calls (Lightning's broadcast at the top of a batch): not "in backward" either,
    # though its list of such collectives names a metric's all-reduce.
    f = classify_hang({0: _beat(watchdog.LOOP_COLLECTIVE), 1: _beat("forward")}, 2, 10.0)
    assert f is not None and f.detail.startswith(
        f"At step 3, rank 0 has been waiting in {watchdog.LOOP_WAIT}"
    )


def _watch(tmp_path, monkeypatch, rec, peer, timeout_s, warmup_timeout_s=None) -> tuple[list, Watchdog]:
    """Rank 0 of 2 with recorder `rec`, rank 1 publishing heartbeat `peer`; returns what was reported and
    the (running) watchdog."""
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)
    reported: list = []
    dog = Watchdog(
        rec,
        DictStore(**{"pytscope/hb/1": json.dumps({**peer, "t": time.time()})}),
        rank=0,
        world_size=2,
        run_dir=tmp_path,
        timeout_s=lambda: timeout_s,
        on_hang="report",
        report=reported.append,
        warmup_timeout_s=warmup_timeout_s,
    )
    dog.start()
    return reported, dog


def _first_report(reported: list, dog: Watchdog, wait_s: float = 30.0) -> list:
    """What the watchdog reported once it reported and dumped its stacks (it goes on watching without
    on_hang="abort"); the watchdog is stopped."""
    deadline = time.monotonic() + wait_s
    while not (reported and (dog.run_dir / "stacks" / "rank0.txt").exists()) and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    return reported


def _watch_warmup(tmp_path, monkeypatch, last_mark: Mark) -> tuple[list, Watchdog]:
    """Rank 0 in warm-up (no timeout in force) with `last_mark` as its last mark, rank 1 in its first
    forward, watched with a warm-up rule of 0.05 s."""
    rec = StepRecorder()
    rec.loop_top(Mark.FORWARD_BEGIN)
    rec.mark(last_mark)
    peer = {"step": 1, "phase": "forward", "idle_s": 100.0, "syncs": 1}
    return _watch(tmp_path, monkeypatch, rec, peer, None, warmup_timeout_s=lambda: 0.05)


def test_the_warm_up_rule_applies_while_no_timeout_is_in_force(tmp_path, monkeypatch):
    reported, dog = _watch_warmup(tmp_path, monkeypatch, Mark.GRAPH_DONE)  # waiting in the all-reduce
    (finding,) = _first_report(reported, dog)
    assert finding.code == "DIST.HANG" and finding.ranks == (1,) and "during warm-up" in finding.detail
    assert (tmp_path / "stacks" / "rank0.txt").exists()


def test_a_long_first_forward_is_not_a_warm_up_hang(tmp_path, monkeypatch):
    reported, dog = _watch_warmup(tmp_path, monkeypatch, Mark.FORWARD_BEGIN)
    deadline = time.monotonic() + 30.0
    # Two beats published after the rank went idle for 4x the rule: the check after the first one is done.
    seen = []
    while len(seen) < 2 and time.monotonic() < deadline:
        idle = dog._local_beat.get("idle_s", 0.0)
        if idle > 0.2 and idle not in seen:
            seen.append(idle)
        time.sleep(0.01)
    dog.stop()
    assert len(seen) == 2 and reported == []


def test_a_rank_after_its_optimizer_step_is_named_at_the_step_it_just_took(tmp_path, monkeypatch):
    # Rank 0 took step 1's optimizer step and stopped before the next loop top; rank 1 waits in step 2's
    # all-reduce. Rank 0 is still in step 1 (the step closes at the next loop top), not in step 2.
    rec = StepRecorder()
    rec.loop_top(Mark.FORWARD_BEGIN)
    rec.mark(Mark.OPTIMIZER_BEGIN)
    rec.optimizer_stepped()
    peer = {"step": 1, "phase": "comm", "idle_s": 100.0, "syncs": 1}
    reported, dog = _watch(tmp_path, monkeypatch, rec, peer, 0.05)
    (finding,) = _first_report(reported, dog)
    assert finding.ranks == (0,) and finding.steps == (2,)
    assert "At step 2, rank 1 has been waiting" in finding.detail
    assert "is at step 1 in `after the optimizer step`" in finding.detail


def test_a_wait_after_the_optimizer_step_is_named_by_the_next_step(tmp_path, monkeypatch):
    # Lightning (steps from 0): rank 0 took step 79's optimizer step and waits in the broadcast at the top of
    # the next batch, which comes before the fetch that ends step 79; rank 1 is stuck after its own step 79
    # (a callback's on_train_batch_end). A hang writes step 79 as done on both ranks: named step 79, the
    # records would read as a run that went on past it. It is step 80, which neither rank reached.
    rec = StepRecorder(step_origin=0)
    rec.restore({"step": 79})
    rec.loop_top(Mark.DATA_BEGIN)
    rec.mark(Mark.BACKWARD_END)
    rec.optimizer_stepped()
    rec.mark(Mark.LOOP_COMM_BEGIN)
    stuck = {"step": 79, "origin": 0, "stepped": True, "phase": "after the optimizer step", "syncs": 80}
    reported, dog = _watch(tmp_path, monkeypatch, rec, {**stuck, "idle_s": 100.0}, 0.05)
    (finding,) = _first_report(reported, dog)
    assert finding.severity.name == "HIGH" and finding.ranks == (1,) and finding.steps == (80,), finding
    assert finding.detail.startswith(f"At step 80, rank 0 has been waiting in {watchdog.LOOP_WAIT}"), finding
    assert "is at step 79 in `after the optimizer step`" in finding.detail
    # Before 4 timeouts, rank 1 may be working between steps (MED): the same step, and it is still MED.
    waiting = {**stuck, "phase": watchdog.LOOP_COLLECTIVE, "idle_s": 400.0}
    f = classify_hang({0: {**stuck, "idle_s": 400.0}, 1: waiting}, 2, 300.0)
    assert f is not None and f.severity.name == "MED" and f.steps == (80,), f
    # A wait inside the step, before its optimizer step (a metric's all-reduce in training_step), is in it.
    inside = {**stuck, "stepped": False, "phase": "forward", "idle_s": 400.0}
    f = classify_hang({0: inside, 1: {**waiting, "stepped": False}}, 2, 300.0)
    assert f is not None and f.severity.name == "HIGH" and f.steps == (79,), f


def test_a_pause_is_never_a_hang_when_every_rank_is_in_it_and_outlasts_four_timeouts_otherwise():
    # A long validation (Lightning pauses it) or a checkpoint in `scope.paused()` on every rank: not training.
    assert classify_hang({0: _beat("paused"), 1: _beat("paused")}, 2, 6.0) is None
    gone = {**_beat("paused"), "age_s": 30.0}  # its last heartbeat is old: the rank is gone, not paused
    assert classify_hang({0: _beat("paused"), 1: gone}, 2, 6.0) is not None
    waiting = {**_beat("comm"), "idle_s": 20.0}  # rank 1 waits for rank 0's evaluation on its own
    assert classify_hang({0: {**_beat("paused"), "idle_s": 20.0}, 1: waiting}, 2, 6.0) is None
    f = classify_hang({0: {**_beat("paused"), "idle_s": 25.0}, 1: waiting}, 2, 6.0)
    assert f is not None and f.ranks == (0,) and f.severity.name == "HIGH"


def test_every_rank_idle_at_one_place_is_said_but_never_ends_the_job(tmp_path, monkeypatch):
    # All ranks busy at one place (an evaluation outside paused(), a slow step) look the same as all waiting
    # in a collective pytscope does not see: MED, no abort, and reported again after progress resumes.
    f = classify_hang({0: _beat("forward", 25), 1: _beat("forward", 25)}, 2, 6.0)
    assert f is not None and f.severity.name == "MED" and f.ranks == () and "does not end the job" in f.detail
    exits: list = []
    monkeypatch.setattr(watchdog.os, "_exit", exits.append)
    rec = StepRecorder()
    rec.loop_top(Mark.FORWARD_BEGIN)
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)
    reported: list = []
    store = DictStore(**{"pytscope/hb/1": json.dumps({**_beat("forward", 0), "t": time.time()})})
    dog = Watchdog(rec, store, 0, 2, tmp_path, lambda: 0.05, "abort", reported.append)
    dog.start()
    deadline = time.monotonic() + 30.0
    while not reported and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # still idle: not reported twice
    assert len(reported) == 1 and dog.is_alive() and store.keys["pytscope/hang"] == "1:report"
    rec.mark(Mark.FORWARD_BEGIN)  # progress (still in forward, as rank 1), then idle again: a new report
    while len(reported) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert len(reported) == 2 and exits == [] and store.keys["pytscope/hang"] == "2:report"


def test_a_rank_behind_the_others_is_named_when_they_wait_where_pytscope_cannot_see():
    # BatchNorm's buffer broadcast in forward: rank 0 waits inside step 25's forward, rank 1 never left its
    # data loader. Neither is in a collective pytscope times, but rank 1 is behind: a hang, and its rank.
    f = classify_hang({0: _beat("forward", 24), 1: _beat("data", 24)}, 2, 6.0)
    assert f is not None and f.severity.name == "HIGH" and f.ranks == (1,)
    assert f.title == "rank 1 stopped behind the others" and "furthest behind" in f.detail


def _aborting(tmp_path, monkeypatch, report) -> list:
    """Rank 0 of 2 idle in step 8's forward while rank 1 waits in its all-reduce (rank 0 is the missing one:
    a hang proven by positions), on_hang="abort": the exit codes the watchdog ended the process with."""
    exits: list = []
    monkeypatch.setattr(watchdog.os, "_exit", exits.append)
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)
    monkeypatch.setattr(watchdog, "DUMP_WAIT_S", 0.1)
    rec = StepRecorder()
    rec.loop_top(Mark.FORWARD_BEGIN)
    peer = {"step": 7, "phase": "comm", "idle_s": 100.0, "syncs": 8, "t": time.time()}
    dog = Watchdog(
        rec, DictStore(**{"pytscope/hb/1": json.dumps(peer)}), 0, 2, tmp_path, lambda: 0.05, "abort", report
    )
    dog.start()
    deadline = time.monotonic() + 30.0
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    return exits


def test_a_failing_hang_report_does_not_cancel_the_abort(tmp_path, monkeypatch, capsys):
    # The abort is decided before anything else runs; an error while reporting must not leave the job hung.
    def broken(finding):
        raise OSError("disk full")

    assert _aborting(tmp_path, monkeypatch, broken) == [watchdog.HANG_EXIT_CODE]
    assert "could not report the hang: OSError: disk full" in capsys.readouterr().err
    assert (tmp_path / "stacks" / "rank0.txt").exists()  # the dump still happened


def test_user_code_that_mocks_the_clock_does_not_blind_the_watchdog(tmp_path, monkeypatch):
    # Tests and libraries patch time.monotonic (Lightning's own test suite does); the watchdog keeps its own.
    monkeypatch.setattr(time, "monotonic", lambda: 1000.0)  # frozen, as under unittest.mock.patch
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    reported: list = []
    assert _aborting(tmp_path, monkeypatch, reported.append) == [watchdog.HANG_EXIT_CODE]
    assert reported[0].ranks == (0,)


def test_a_hang_abort_is_said_once_per_host_not_once_per_rank():
    said = {
        (rank, local): watchdog.abort_line(rank, local)
        for rank, local in [(0, 0), (1, 1), (4, 0), (5, 1), (3, -1)]
    }
    assert said[(0, 0)] == "hang detected: every rank exits with code 86 (on_hang='abort')"
    assert said[(4, 0)] == said[(0, 0)]  # another host's first rank: that host's own log
    assert said[(1, 1)] is None and said[(5, 1)] is None
    assert said[(3, -1)] == said[(0, 0)]  # no LOCAL_RANK from the launcher: its host may have no other line


def test_a_hangs_abort_ends_rank_0_first_and_the_others_once_it_said_so(tmp_path, monkeypatch):
    # A rank that ended while rank 0 still waited in a collective for it made rank 0 raise first (a lost
    # connection), and the launcher then ended rank 0 with SIGTERM instead of the hang's exit code.
    ended: list = []
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: ended.append((code, time.monotonic())))
    monkeypatch.setattr(watchdog, "dump_stacks", lambda run_dir, rank: None)
    store = DictStore()
    others = Watchdog(StepRecorder(), store, 1, 2, tmp_path, lambda: 5.0, "abort", lambda f: None)
    rank_0 = Watchdog(StepRecorder(), store, 0, 2, tmp_path, lambda: 5.0, "abort", lambda f: None)
    rank_0._raise_flag(True)
    assert others._hang_flag() is True
    waiting = threading.Thread(target=others._on_hang, args=(True,))
    waiting.start()
    time.sleep(0.3)
    assert ended == [] and store.keys["pytscope/dumped/1/1"] == "1"  # dumped, then waiting for rank 0
    rank_0._on_hang(True)
    said = time.monotonic()
    waiting.join(5.0)
    assert [code for code, _ in ended] == [86, 86] and ended[1][1] >= said - 0.01


def test_stacks_dumped_for_a_report_that_did_not_end_the_job_do_not_count_for_a_later_abort(
    tmp_path, monkeypatch
):
    # A MED report (rank 1 kept the others waiting, working between steps: stacks dumped, the job goes on),
    # then, 4 timeouts later, the abort. Rank 0 took the first report's dumps for this one's and ended at
    # once; rank 1, busy in a callback, its store gone with rank 0, never saw the abort and ran on.
    ended: list = []
    monkeypatch.setattr(watchdog.os, "_exit", ended.append)
    monkeypatch.setattr(watchdog, "dump_stacks", lambda run_dir, rank: None)
    store = DictStore()
    rank_0, rank_1 = (
        Watchdog(StepRecorder(), store, rank, 2, tmp_path, lambda: 5.0, "abort", lambda f: None)
        for rank in (0, 1)
    )
    rank_0._raise_flag(False)  # the MED report: every rank dumps its stacks, nobody ends
    assert rank_1._hang_flag() is False
    rank_1._on_hang(False)
    rank_0._on_hang(False)
    rank_0._raise_flag(True)  # the abort
    aborting = threading.Thread(target=rank_0._on_hang, args=(True,))
    aborting.start()
    time.sleep(0.3)
    assert ended == [] and aborting.is_alive()  # waiting for rank 1's stacks of this hang
    assert rank_1._hang_flag() is True
    rank_1._on_hang(True)
    aborting.join(5.0)
    assert ended == [watchdog.HANG_EXIT_CODE, watchdog.HANG_EXIT_CODE]


def test_ranks_all_waiting_but_in_different_collectives_name_the_one_the_others_went_past():
    # Rank 0 alone calls a barrier after step 33 (under `if is_main_process`); rank 1 went on to step 34's
    # gradient all-reduce. Both wait: it used to read as one stuck collective (the network), naming nobody.
    beats = {
        0: {"step": 32, "phase": watchdog.LOOP_COLLECTIVE, "idle_s": 400.0, "syncs": 33},
        1: {"step": 33, "phase": "comm", "idle_s": 400.0, "syncs": 33},
    }
    f = classify_hang(beats, 2, 300.0)
    assert f is not None and f.severity.name == "HIGH" and f.ranks == (0,) and f.steps == (33,)
    assert f.title == "rank 0 waits in a collective the others are not in", f.title
    assert "network" not in f.detail and "is_main_process" in f.detail
    # Both in the same place: the collective itself is stuck.
    same = {r: {"step": 33, "phase": "comm", "idle_s": 400.0, "syncs": 33} for r in (0, 1)}
    f = classify_hang(same, 2, 300.0)
    assert f is not None and f.ranks == () and "network" in f.detail


def test_under_fsdp_a_rank_that_skipped_its_backward_is_named_not_the_network():
    # Rank 1 `continue`s after its forward at step 30 (no backward, no optimizer step), rank 0 runs its
    # backward: rank 1 waits in the next batch's forward all-gather (or, where gloo paired that with one of rank
    # 0's backward all-gathers, in that forward's backward), rank 0 in its backward's collectives. Same phase
    # (`collective`), same step and gradient syncs on both: it used to read as one stuck collective, naming
    # nobody.
    def fsdp(step: int, forwards: int, where: str) -> dict:
        return {**_beat("collective", step), "syncs": 29, "forwards": forwards, "pass": where}

    backward = fsdp(29, 1, "backward")
    for skipper in (
        fsdp(29, 2, "forward"),
        fsdp(29, 2, "backward"),
        fsdp(30, 1, "forward"),  # (it stepped its optimizer all the same)
    ):
        f = classify_hang({0: backward, 1: skipper}, 2, 300.0)
        assert f is not None and f.severity.name == "HIGH" and f.ranks == (1,) and f.steps == (30,), f
        assert f.title == "rank 1 waits in a collective the others are not in", f.title
        assert "Rank 1 ran a forward where the others ran a backward" in f.detail, f.detail
        assert "in its 1st forward's backward, for 400 s" in f.detail and "network" not in f.detail
        warm_up = classify_hang({0: backward, 1: skipper}, 2, 300.0, collective_only=True)  # proof in warm-up
        assert warm_up is not None and warm_up.ranks == (1,)
    # Every rank at the same place: one stuck collective, or (in warm-up) a compile between two marks.
    for same in ({0: backward, 1: backward}, {0: fsdp(29, 2, "forward"), 1: fsdp(29, 2, "forward")}):
        f = classify_hang(same, 2, 300.0)
        assert f is not None and f.ranks == () and "network" in f.detail
        assert "named rank" not in f.recommendation and "every rank's stack" in f.recommendation
        assert classify_hang(same, 2, 300.0, collective_only=True) is None


def test_the_auto_timeout_scales_with_steps_past_warm_up_not_with_pauses_between_them():
    # A validation of 600 s between two steps, seen as the gap between step closes, made "auto" 12,000 s:
    # hang detection off for hours. Once a gather brings the steps' wall times (pauses left out), those count.
    dog = Watchdog(StepRecorder(), None, 0, 1, None, lambda: None, "report", lambda finding: None)
    dog.slowest_step_s = 600.0  # the gap across the pause, before the first gather
    dog.step_walls([])  # a gather with nothing past warm-up yet: the estimate stands
    assert dog.slowest_step_s == 600.0
    dog.step_walls([120.0, 180.0])
    assert dog.slowest_step_s == 0.18
    dog.step_walls([90.0])
    assert dog.slowest_step_s == 0.18


def test_an_error_of_the_watchdogs_own_stops_it_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)

    class BrokenRecorder(StepRecorder):
        def progress(self):
            raise KeyError("a bug")

    dog = Watchdog(BrokenRecorder(), None, 1, 2, None, lambda: 10.0, "report", lambda finding: None)
    dog.start()
    dog.join(timeout=5.0)
    assert not dog.is_alive()
    err = capsys.readouterr().err
    assert "watchdog stopped by an internal error" in err and "Traceback" not in err, err
