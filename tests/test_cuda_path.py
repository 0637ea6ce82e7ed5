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
from pytscope_core.records import PHASES
from pytscope_core.rundir import load_run


class FakeEvent:
    """What the clock uses of `torch.cuda.Event`, timed on the host."""

    recorded_on: list[str] = []

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


@pytest.fixture
def two_gpus(monkeypatch):
    """Device 0 is current; the model lives on device 1, which has its own allocator peak."""
    FakeEvent.recorded_on = []
    peaks = {0: 1e9, 1: 3e9}

    def never(*_, **__):
        raise AssertionError("pytscope reset the allocator's peak: the user's max_memory_allocated() is lost")

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Event", FakeEvent)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: peaks[torch.device(device).index])
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
