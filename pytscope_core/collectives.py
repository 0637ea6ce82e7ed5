"""Waits in the collectives a training loop calls besides the gradient all-reduce: a barrier, a metric's
all-reduce (Lightning's `self.log(..., sync_dist=True)`, `accelerator.reduce`), Lightning's broadcast at the
top of every batch.

A rank blocked in one waits for its slower peers, so the time is communication, not its own work: counted
in the phase it falls in, it made the rank everyone waits for look no slower than the ranks waiting for it
(local work = wall - comm). Each wait is marked as a nested wait (LOOP_COMM_BEGIN/END, attributed as FSDP's
collectives are), in whatever phase it falls; outside recording (a pause, between epochs) nothing is marked.
A rank left waiting in one by a rank that never came is a hang the watchdog can prove.
Integrations time their framework's collectives by wrapping the methods on the instance (`time_methods`);
a plain loop wraps its own calls in `Scope.collective()`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from .timeline import Mark

_BEGIN = int(Mark.LOOP_COMM_BEGIN)
_END = int(Mark.LOOP_COMM_END)


class _Recorder(Protocol):
    def mark(self, mark: int) -> None: ...


class _Hooks(Protocol):
    @property
    def recording(self) -> bool: ...

    @property
    def recorder(self) -> _Recorder: ...


@contextlib.contextmanager
def collective_wait(hooks: _Hooks, on_error: Callable[[BaseException], None]) -> Iterator[None]:
    """Time inside is a wait in a collective. Its end is marked only where its start was, so a pause that
    begins inside it cannot leave the wait open to the step's end."""
    marked = _begin(hooks, on_error)
    try:
        yield
    finally:
        if marked:
            _end(hooks, on_error)


def _begin(hooks: _Hooks, on_error: Callable[[BaseException], None]) -> bool:
    try:
        if hooks.recording:
            hooks.recorder.mark(_BEGIN)
            return True
    except Exception as exc:
        on_error(exc)
    return False


def _end(hooks: _Hooks, on_error: Callable[[BaseException], None]) -> None:
    try:
        hooks.recorder.mark(_END)
    except Exception as exc:
        on_error(exc)


def time_methods(
    owner: Any, names: Iterable[str], hooks: _Hooks, on_error: Callable[[BaseException], None]
) -> None:
    """Wrap each method `owner.name` on the instance (nothing global) so that its calls are collective waits;
    `untime_methods` puts them back. A name `owner` lacks is skipped; one an earlier scope timed (and never
    put back) is timed for these hooks instead."""
    for name in names:
        method = getattr(owner, name, None)
        if isinstance(method, TimedMethod):
            method = method.method
        if callable(method):
            setattr(owner, name, TimedMethod(method, hooks, on_error))


class TimedMethod:
    """A method whose calls are collective waits. Equal to the method it wraps: Lightning keeps the reduce
    function of each metric `self.log` logs and refuses a later log of it whose function differs (the
    sanity check's, before the fit's wrapper; the first fit's, in a second fit)."""

    pytscope_collective = True

    def __init__(self, method: Callable[..., Any], hooks: _Hooks, on_error: Callable[[BaseException], None]):
        functools.update_wrapper(self, method)
        self.method, self._hooks, self._on_error = method, hooks, on_error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        marked = _begin(
            self._hooks, self._on_error
        )  # (not `collective_wait`: Lightning calls one every batch)
        try:
            return self.method(*args, **kwargs)
        finally:
            if marked:
                _end(self._hooks, self._on_error)

    def __eq__(self, other: object) -> bool:
        return bool(self.method == (other.method if isinstance(other, TimedMethod) else other))

    def __hash__(self) -> int:
        return hash(self.method)


def untime_methods(owner: Any, names: Iterable[str]) -> None:
    """Each `owner.name` as it was before `time_methods`, unless another tool wrapped it since (that wrapper
    keeps ours inside it, which marks nothing once its scope has ended)."""
    for name in names:
        restore_method(owner, name, "pytscope_collective")


def restore_method(owner: Any, name: str, marker: str) -> None:
    """Undo an instance-level wrapper of `owner.name` that carries the attribute `marker` (and the wrapped
    method as `__wrapped__`): the class's own method again, or the instance's wrapper from before ours."""
    ours = owner.__dict__.get(name)
    if not getattr(ours, marker, False):
        return
    previous = ours.__wrapped__
    if getattr(previous, marker, False):  # another tool's wrapper around ours (it copied our attributes)
        return
    if getattr(previous, "__func__", None) is getattr(type(owner), name, None):
        del owner.__dict__[name]
    else:
        setattr(owner, name, previous)
