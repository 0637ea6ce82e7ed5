"""Waits in the collectives a training loop calls besides the gradient all-reduce: a barrier, a metric's
all-reduce (Lightning's `self.log(..., sync_dist=True)`, `accelerator.reduce`), Lightning's broadcast at the
top of every batch.

A rank blocked in one waits for its slower peers, so the time is communication, not its own work: counted
in the phase it falls in, it made the rank everyone waits for look no slower than the ranks waiting for it
(local work = wall - comm). Each wait is marked as a nested wait (LOOP_COMM_BEGIN/END, attributed as FSDP's
collectives are), in whatever phase it falls; outside recording (a pause, between epochs) nothing is marked.
A rank left waiting in one by a rank that never came is a hang the watchdog can prove.
Integrations time their framework's collectives by wrapping the methods on the instance (`time_methods`).
torch.distributed's own blocking collectives (`dist.barrier()`, `dist.all_reduce(loss)`) are timed while a
scope records, when the loop calls them on its own thread (`TorchCollectives`); anything else the loop waits
in (an asynchronous collective's `wait()`, another library's) it wraps in `Scope.collective()`. A wait inside
another is marked once, by the outer one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from .compiled import is_compiling_function
from .patches import Patch
from .timeline import Mark

_BEGIN = int(Mark.LOOP_COMM_BEGIN)
_END = int(Mark.LOOP_COMM_END)

# torch.distributed's blocking collectives a training loop calls itself (point-to-point calls are not waits
# for every rank, and the asynchronous form of these returns before the wait).
TORCH_COLLECTIVES = (
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
)
# Callers whose calls are not the loop's: torch's own (FSDP2's collectives, timed by `fsdp.py`; DDP's join;
# the distributed optimizers; a collective built on another) and the scope's.
_NOT_THE_LOOPS = ("torch.", "pytscope_core.")

_inside = threading.local()  # `.wait`: this thread is in a wait already marked (an outer one marks alone)


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
        if hooks.recording and not getattr(_inside, "wait", False):
            hooks.recorder.mark(_BEGIN)
            _inside.wait = True
            return True
    except Exception as exc:
        on_error(exc)
    return False


def _end(hooks: _Hooks, on_error: Callable[[BaseException], None]) -> None:
    _inside.wait = False
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


DDP_BUFFER_SYNC = ("_sync_buffers",)
"""DDP's broadcast of its buffers (BatchNorm's statistics, `broadcast_buffers=True`) from rank 0, at the start
of each forward: the ranks ahead wait there for the one behind."""


def time_buffer_sync(
    model: Any, hooks: _Hooks, on_error: Callable[[BaseException], None]
) -> Callable[[], None]:
    """Time the buffer broadcast of `model`, if a DDP model, as a wait (`time_methods`, on the instance);
    return the undo."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return lambda: None
    time_methods(model, DDP_BUFFER_SYNC, hooks, on_error)
    return functools.partial(untime_methods, model, DDP_BUFFER_SYNC)


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


class TorchCollectives:
    """Times torch.distributed's blocking collectives (`TORCH_COLLECTIVES`) that the loop calls on the thread
    that installed it, for as long as it is installed. One wrapper per function serves every installed
    scope (the latest on the calling thread marks); the last to leave puts torch's functions back, unless
    another tool wrapped one since (ours, inside it, then marks nothing)."""

    _installed: list[TorchCollectives] = []

    def __init__(self, hooks: _Hooks, on_error: Callable[[BaseException], None]) -> None:
        self.hooks, self.on_error = hooks, on_error
        self.thread = threading.get_ident()

    def install(self) -> None:
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if self in self._installed or not dist.is_available():
            return
        for name, patch in _COLLECTIVE_PATCHES.items():
            if callable(getattr(dist, name, None)):
                patch.install(dist, name)
        self._installed.append(self)

    def remove(self) -> None:
        if self not in self._installed:
            return
        self._installed.remove(self)
        if self._installed:
            return
        import torch.distributed as dist

        for name, patch in _COLLECTIVE_PATCHES.items():
            patch.remove(dist, name)

    @classmethod
    def on_this_thread(cls) -> TorchCollectives | None:
        thread = threading.get_ident()
        for installed in reversed(cls._installed):
            if installed.thread == thread:
                return installed
        return None


def _timed_collective(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (a torch.distributed collective), with its blocking calls from the loop timed as waits."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        parameters = []
    at = parameters.index("async_op") if "async_op" in parameters else None
    is_compiling = is_compiling_function()

    @functools.wraps(function)
    def collective(*args: Any, **kwargs: Any) -> Any:
        timed = None if is_compiling() else TorchCollectives.on_this_thread()
        if (
            timed is None
            or getattr(_inside, "wait", False)  # (inside a framework's collective, timed already)
            or kwargs.get("async_op", at is not None and len(args) > at and args[at])
            or sys._getframe(1).f_globals.get("__name__", "").startswith(_NOT_THE_LOOPS)
        ):
            return function(*args, **kwargs)
        marked = _begin(timed.hooks, timed.on_error)
        try:
            return function(*args, **kwargs)
        finally:
            if marked:
                _end(timed.hooks, timed.on_error)

    collective.pytscope_collective = True  # type: ignore[attr-defined]
    return collective


_COLLECTIVE_PATCHES = {name: Patch(_timed_collective) for name in TORCH_COLLECTIVES}
