"""The watchdog thread's own lifecycle (its hang detection runs in the multi-process tests)."""

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


def test_during_warm_up_only_a_wait_inside_a_collective_is_a_hang():
    # Every rank compiling its first forward, or starting its loaders: slow, never a hang.
    for phase in ("forward", "data", "optimizer"):
        assert classify_hang({0: _beat(phase), 1: _beat(phase)}, 2, 300.0, collective_only=True) is None
    # Rank 0 waits in the first all-reduce, rank 1 never came: a hang, said as a warm-up one.
    f = classify_hang({0: _beat("comm"), 1: _beat("forward")}, 2, 300.0, collective_only=True)
    assert f is not None and f.ranks == (1,) and "during warm-up: 300 s inside a collective" in f.detail
    # Every rank inside the first all-reduce (NCCL that never connects): a hang too.
    f = classify_hang({0: _beat("comm"), 1: _beat("comm")}, 2, 300.0, collective_only=True)
    assert f is not None and "all ranks stuck" in f.title
    # After warm-up, the same heartbeats of a slow start are a hang as before.
    assert classify_hang({0: _beat("forward"), 1: _beat("forward")}, 2, 300.0) is not None


def _watch_warmup(tmp_path, monkeypatch, last_mark: Mark) -> list:
    """A single rank in warm-up (no timeout in force) whose last mark is `last_mark`, watched with a
    warm-up rule of 0.05 s; what it reports within a second."""
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)
    rec = StepRecorder()
    rec.loop_top(Mark.FORWARD_BEGIN)
    rec.mark(last_mark)
    reported: list = []
    dog = Watchdog(
        rec,
        None,
        rank=0,
        world_size=1,
        run_dir=tmp_path,
        timeout_s=lambda: None,
        on_hang="report",
        report=reported.append,
        warmup_timeout_s=lambda: 0.05,
    )
    dog.start()
    dog.join(1.0 if last_mark != Mark.GRAPH_DONE else 30.0)
    dog.stop()
    return reported


def test_the_warm_up_rule_applies_while_no_timeout_is_in_force(tmp_path, monkeypatch):
    (finding,) = _watch_warmup(tmp_path, monkeypatch, Mark.GRAPH_DONE)  # waiting in the all-reduce
    assert finding.code == "DIST.HANG" and "during warm-up" in finding.detail
    assert (tmp_path / "stacks" / "rank0.txt").exists()


def test_a_long_first_forward_is_not_a_warm_up_hang(tmp_path, monkeypatch):
    assert _watch_warmup(tmp_path, monkeypatch, Mark.FORWARD_BEGIN) == []
