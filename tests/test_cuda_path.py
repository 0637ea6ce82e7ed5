"""The CUDA glue, driven on CPU through a stand-in for `torch.cuda`: events go on the model's device's stream,
memory is that device's allocator high-water mark and is never reset, meta.json names that device.
`benchmarks/gpu_check.py` checks the same on a real GPU."""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pytscope_core import Scope
from pytscope_core.clocks import CudaEventClock
from pytscope_core.records import PHASES
from pytscope_core.rundir import load_run


class FakeEvent:
    """What the clock uses of `torch.cuda.Event`, timed on the host."""

    recorded_on: list[str] = []
    selected_stream = ""  # the stream the training code has made current; "" for the default one

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.t = 0.0

    def record(self, stream: str) -> None:
        FakeEvent.recorded_on.append(stream)
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3


def as_device(device) -> torch.device:
    """What torch's CUDA calls accept as a device: an index, a name or a `torch.device`."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


@pytest.fixture
def two_gpus(monkeypatch):
    """Device 0 is current; the model lives on device 1, which has its own allocator peak."""
    FakeEvent.recorded_on = []
    FakeEvent.selected_stream = ""
    peaks = {0: 1e9, 1: 3e9}

    def never(*_, **__):
        raise AssertionError("pytscope reset the allocator's peak: the user's max_memory_allocated() is lost")

    def current_stream(device=None):
        return f"{FakeEvent.selected_stream or 'stream'} of {as_device(device)}"

    def memory_stats_as_nested_dict(device=None):
        # Only what the clock reads; torch.cuda.max_memory_allocated flattens the whole of it.
        return {"allocated_bytes": {"all": {"peak": peaks[as_device(device).index], "current": 0}}}

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Event", FakeEvent)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "current_stream", current_stream)
    monkeypatch.setattr(cuda, "memory_stats_as_nested_dict", memory_stats_as_nested_dict)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", never)
    monkeypatch.setattr(
        cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(name=f"GPU {torch.device(device).index}", total_memory=80 * 2**30),
    )
    return peaks


def test_the_models_device_is_timed_and_measured_not_the_current_one(tmp_path, two_gpus):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=10, warmup=2)
    scope.use_cuda_clock(torch.device("cuda", 1))  # what watch() does for a model whose parameters are there
    scope.watch(model, opt)
    for step in range(40):
        if step == 20:
            two_gpus[1] = 5e9  # one long batch: the high-water mark rises for good
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    summary = scope.finish()
    assert FakeEvent.recorded_on and set(FakeEvent.recorded_on) == {"stream of cuda:1"}
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["device"] == "GPU 1" and meta["mem_limit_bytes"] == 80 * 2**30
    mem = load_run(tmp_path).arrays.mem_bytes[:, 0]
    assert set(mem.tolist()) == {3e9, 5e9} and mem[-1] == 5e9  # read every 8th step, never device 0's 1e9
    assert summary.memory.peak_bytes == 5e9 and summary.scope_errors == ()


def test_marks_go_on_the_stream_current_when_they_are_made(two_gpus):
    """The training code may switch streams (`with torch.cuda.stream(s):`): each mark is recorded on the
    device's current stream of that moment, not on one looked up once."""
    from pytscope_core.clocks import CudaEventClock

    clock = CudaEventClock("cuda:1")
    clock.now()
    FakeEvent.selected_stream = "side stream"
    clock.now()
    FakeEvent.selected_stream = ""
    clock.now()
    assert FakeEvent.recorded_on == ["stream of cuda:1", "side stream of cuda:1", "stream of cuda:1"]


def test_peak_memory_is_the_allocators_peak_on_the_clocks_device(two_gpus, monkeypatch):
    from pytscope_core.clocks import CudaEventClock

    clock = CudaEventClock("cuda:1")
    assert clock.peak_memory() == 3e9
    two_gpus[1] = 4e9
    assert clock.peak_memory() == 4e9
    # Before CUDA is initialised torch gives no statistics: nothing has been allocated yet.
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})
    assert CudaEventClock("cuda:1").peak_memory() == 0.0


def test_a_bare_cuda_device_means_the_current_one(two_gpus):
    from pytscope_core.clocks import CudaEventClock

    assert CudaEventClock("cuda").device == torch.device("cuda", 0)
    assert CudaEventClock().device == torch.device("cuda", 0)
    assert CudaEventClock("cuda:1").device == torch.device("cuda", 1)


def test_each_cuda_event_stamps_one_mark_and_returns_to_the_pool_once(tmp_path, two_gpus):
    """A backward without gradient sync ends with two marks at once: each needs its own event. Shared, the
    event went back to the pool twice, two later marks got one event, and re-recording it moved the
    earlier mark: after a few gathers the time between backward and the optimizer (other) read as backward."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=10, warmup=2)
    scope.use_cuda_clock(torch.device("cuda", 1))
    scope.watch(model, opt)
    for _ in range(60):
        model(torch.randn(4, 8)).sum().backward()
        time.sleep(0.002)  # between backward and the optimizer: other
        opt.step()
        opt.zero_grad()
    pool = scope.recorder.clock._pool
    assert len(pool) == len({id(ev) for ev in pool})
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 60
    other = arrays.phases[:, 0, PHASES.index("other")]
    backward = arrays.phases[:, 0, PHASES.index("backward")]
    # Every step sleeps 2 ms in other; a backward of microseconds passes 1.5 ms only when preempted.
    assert (other[5:] > 1.5).all() and np.quantile(backward[5:], 0.9) < 1.5


def test_stamps_hours_into_a_window_keep_their_sub_millisecond_steps(two_gpus):
    # `elapsed_time` is single precision: measured from a window's first event, a 0.1 ms step four hours in
    # (a long pause inside the window) rounded to 0 or 1 ms. Each stamp from the one before keeps it.
    class Float32Event(FakeEvent):
        def elapsed_time(self, other: "FakeEvent") -> float:
            return float(np.float32((other.t - self.t) * 1e3))

    clock = CudaEventClock("cuda:0")
    stamps = [Float32Event(enable_timing=True) for _ in range(4)]
    for ev, t in zip(stamps, (0.0, 4 * 3600.0, 4 * 3600.0 + 1e-4, 4 * 3600.0 + 2e-4), strict=True):
        ev.t = t
    ms = clock.to_ms(stamps)
    assert np.diff(ms)[1:] == pytest.approx([0.1, 0.1], rel=1e-3), ms
