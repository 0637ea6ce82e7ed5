"""The watchdog thread's own lifecycle (its hang detection runs in the multi-process tests)."""

import threading
import time

from pytscope_core import watchdog
from pytscope_core.recorder import StepRecorder
from pytscope_core.watchdog import Watchdog


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
