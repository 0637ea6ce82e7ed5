"""Waits in collectives the loop calls itself (pytscope_core/collectives.py): timed as communication, in
whatever phase they fall, never inside a pause; the methods wrapped on an instance are put back as they
were."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from test_recorder import FakeClock

from pytscope_core.collectives import (
    TORCH_COLLECTIVES,
    TorchCollectives,
    collective_wait,
    time_methods,
    untime_methods,
)
from pytscope_core.hooks import TorchHooks
from pytscope_core.recorder import StepRecorder
from pytscope_core.records import COL
from pytscope_core.timeline import Mark


def _recorded(waits: list[str]) -> tuple[Any, list[BaseException]]:
    """One step per entry of `waits`, on a clock that moves 1 ms per reading: a wait of one reading in the
    forward ("forward"), after the optimizer step ("after"), inside a pause ("paused"), or none ("")."""
    errors: list[BaseException] = []
    rec = StepRecorder(clock=FakeClock())
    hooks = TorchHooks(rec, errors.append)
    for where in waits:
        rec.loop_top(int(Mark.DATA_BEGIN))
        rec.mark(int(Mark.DATA_END))
        rec.mark(int(Mark.FORWARD_BEGIN))
        if where == "forward":
            with collective_wait(hooks, errors.append):
                pass
        rec.forward_ended(8.0)
        rec.mark(int(Mark.OPTIMIZER_BEGIN))
        rec.optimizer_stepped()
        if where == "paused":
            hooks.pause()
        if where in ("after", "paused"):
            with collective_wait(hooks, errors.append):
                pass
        if where == "paused":
            hooks.resume()
    rec.close()
    return rec.drain(rank=0, segment=0, epoch_offset_s=0.0), errors


def test_a_wait_in_a_collective_is_comm_wherever_it_falls_and_nothing_inside_a_pause():
    rows, errors = _recorded(["", "forward", "after", "paused"])
    assert errors == []
    assert rows[:, COL["comm_ms"]].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert rows[3, COL["excluded_ms"]] >= 1.0  # the paused one: excluded, not communication
    phases = rows[:, COL["data_ms"] : COL["other_ms"] + 1].sum(axis=1)
    assert abs(phases - rows[:, COL["wall_ms"]]).max() < 1e-9


def test_a_wait_that_raises_still_ends_and_the_error_is_the_callers():
    rec = StepRecorder(clock=FakeClock())
    hooks = TorchHooks(rec, lambda exc: None)
    rec.loop_top(int(Mark.DATA_BEGIN))
    with pytest.raises(TimeoutError), collective_wait(hooks, lambda exc: None):
        raise TimeoutError("the peer is gone")
    assert rec._marks[-2:] == [int(Mark.LOOP_COMM_BEGIN), int(Mark.LOOP_COMM_END)]


def test_the_scopes_own_failure_in_a_mark_never_reaches_the_collective():
    class Broken:
        recording = True

        class recorder:  # noqa: N801
            @staticmethod
            def mark(mark: int) -> None:
                raise RuntimeError("broken clock")

    errors: list[BaseException] = []
    with collective_wait(Broken(), errors.append):
        result = 42
    assert result == 42 and [str(e) for e in errors] == ["broken clock"]  # (no end for a start not marked)


class Strategy:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def reduce(self, value: float) -> float:
        self.calls.append("reduce")
        return value * 2

    def barrier(self) -> None:
        self.calls.append("barrier")


def test_methods_are_timed_on_the_instance_and_put_back_as_they_were():
    rec = StepRecorder(clock=FakeClock())
    hooks = TorchHooks(rec, lambda exc: None)
    strategy, other = Strategy(), Strategy()
    before = strategy.barrier  # an instance-level wrapper from another tool, from before ours
    strategy.barrier = lambda: before()  # type: ignore[method-assign]
    previous_barrier = strategy.__dict__["barrier"]
    time_methods(strategy, ("reduce", "barrier", "absent"), hooks, lambda exc: None)
    time_methods(strategy, ("reduce",), hooks, lambda exc: None)  # again (a later scope): wrapped once
    rec.loop_top(int(Mark.DATA_BEGIN))
    assert strategy.reduce(3.0) == 6.0 and strategy.reduce.__name__ == "reduce"
    strategy.barrier()
    assert rec._marks.count(int(Mark.LOOP_COMM_BEGIN)) == 2 and strategy.calls == ["reduce", "barrier"]
    assert "reduce" not in other.__dict__  # nothing global: the class and other instances are untouched
    untime_methods(strategy, ("reduce", "barrier", "absent"))
    assert "reduce" not in strategy.__dict__ and strategy.__dict__["barrier"] is previous_barrier


def test_a_plain_loops_own_barrier_is_comm(tmp_path):
    import time

    import torch

    from pytscope_core import Scope
    from pytscope_core.rundir import load_run

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = Scope(tmp_path, console=False, hang_timeout=None).watch(model, opt)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        with scope.collective():  # as around `dist.barrier()`
            time.sleep(0.02)
    scope.finish()
    comm = load_run(tmp_path).arrays.comm_ms[:, 0]
    # (The last step's, after its optimizer step, with no step after it, reads as the loop's epilogue: an
    # evaluation's gathered metric, a barrier before saving. Not the step's, as `recorder.cut_epilogue` says.)
    assert (comm[:-1] >= 15.0).all() and comm[-1] < 15.0, comm


def test_the_loops_own_torch_collectives_are_waits_while_the_scope_records(tmp_path, one_rank_group):
    import threading

    import torch
    import torch.distributed as dist

    from pytscope_core import Scope
    from pytscope_core.rundir import load_run

    originals = {name: getattr(dist, name) for name in TORCH_COLLECTIVES if hasattr(dist, name)}
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = Scope(tmp_path, console=False, hang_timeout=None).watch(model, opt)
    waits = []
    for _ in range(5):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # a wait
        dist.all_reduce(total, async_op=True).wait()  # returns before its wait: not one
        dist.all_reduce(total, dist.ReduceOp.SUM, None, True).wait()  # (the same, positionally)
        with scope.collective():
            dist.barrier()  # one wait, marked once
        with scope.paused():
            dist.barrier()  # not the step's
        other = threading.Thread(target=dist.all_gather_object, args=([None], 1))
        other.start()  # another thread's: not the loop's
        other.join()
        waits.append(scope.recorder._marks.count(int(Mark.LOOP_COMM_BEGIN)))
    scope.finish()
    assert waits == [2] * 5
    assert {name: getattr(dist, name) for name in originals} == originals  # torch's own functions again
    comm = load_run(tmp_path).arrays.comm_ms[:, 0]
    assert (comm > 0).all(), comm


def test_torch_collectives_are_put_back_by_the_last_scope_and_left_inside_another_tools_wrapper():
    import torch.distributed as dist

    rec = StepRecorder(clock=FakeClock())
    hooks = TorchHooks(rec, lambda exc: None)
    original = dist.barrier
    first, second = TorchCollectives(hooks, lambda exc: None), TorchCollectives(hooks, lambda exc: None)
    first.install()
    ours = dist.barrier
    second.install()
    assert ours is not original and dist.barrier is ours and ours.__wrapped__ is original
    first.remove()
    assert dist.barrier is ours  # the second scope still records
    second.remove()
    assert dist.barrier is original
    first.install()
    dist.barrier = theirs = functools.wraps(dist.barrier)(lambda *a, **k: None)  # another tool's, over ours
    first.remove()
    assert dist.barrier is theirs
    dist.barrier = original


def test_a_timed_method_equals_the_one_it_wraps_and_another_tools_wrapper_over_it_stays():
    # Lightning keeps the reduce function each logged metric was logged with, and refuses a later log whose
    # function is not equal to it: the sanity check logs with the strategy's own, the fit with ours.
    rec = StepRecorder(clock=FakeClock())
    hooks = TorchHooks(rec, lambda exc: None)
    strategy = Strategy()
    original = strategy.reduce
    time_methods(strategy, ("reduce",), hooks, lambda exc: None)
    first = strategy.reduce
    assert first == original and original == first and hash(first) == hash(original)
    time_methods(strategy, ("reduce",), hooks, lambda exc: None)  # a second fit's
    assert strategy.reduce == first and strategy.reduce is not first

    @functools.wraps(strategy.reduce)
    def theirs(*args: Any, **kwargs: Any) -> Any:  # another tool's, around ours
        return first(*args, **kwargs)

    strategy.reduce = theirs  # type: ignore[method-assign]
    untime_methods(strategy, ("reduce",))
    assert strategy.__dict__["reduce"] is theirs


def test_a_pause_that_begins_inside_a_wait_does_not_leave_the_wait_open():
    rec = StepRecorder(clock=FakeClock())
    hooks = TorchHooks(rec, lambda exc: None)
    rec.loop_top(int(Mark.DATA_BEGIN))
    with collective_wait(hooks, lambda exc: None):
        hooks.pause()  # (an evaluation that starts with a barrier, say)
    hooks.resume()
    marks = [Mark(m).name for m in rec._marks]
    assert marks == ["DATA_BEGIN", "LOOP_COMM_BEGIN", "PAUSE_BEGIN", "LOOP_COMM_END", "PAUSE_END"], marks
