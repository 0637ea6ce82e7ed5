"""Signals, chained: a handler of ours runs a callback, then whatever was installed before it, so pytscope
never changes what a signal does to a job.

SIGTERM: launchers send it before SIGKILL, and a rank should leave its ungathered steps behind; the previous
handler is Lightning's own, or the default action (end the process). SIGINT (Ctrl-C), only where something
catches the KeyboardInterrupt it raises and ends the process quietly (`swallowing_frame`), and only over
Python's own handler: the callback notes the interrupt, which nothing else would leave behind. Fatal signals
(SIGABRT, SIGSEGV ...), which no Python handler survives: faulthandler's C handler writes the rank's Python
stacks, then hands the signal on (`ProcessEnds`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pickle
import signal
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any


class SignalChain:
    """Installs a handler for `signum` that calls `before()` and then the previous handler; `restore()` puts
    the previous one back unless someone replaced ours in the meantime. `only_over`: installed only where the
    handler in place is that one (otherwise not at all)."""

    def __init__(
        self, before: Callable[[], None], signum: int = signal.SIGTERM, only_over: Any = None
    ) -> None:
        self.before = before
        self.signum = signum
        self.only_over = only_over
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        try:
            self._previous = signal.getsignal(self.signum)
            if self.only_over is not None and self._previous is not self.only_over:
                return
            signal.signal(self.signum, self._handle)
        except (ValueError, OSError):
            return
        self._installed = True

    def restore(self) -> None:
        if not self._installed:
            return
        self._installed = False
        with contextlib.suppress(ValueError, OSError, TypeError):
            if signal.getsignal(self.signum) == self._handle:
                signal.signal(self.signum, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        try:
            self.before()
        except Exception:  # whatever happens here, the signal must still do what it did before
            pass
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(self.signum, signal.SIG_DFL)
            os.kill(os.getpid(), self.signum)


SWALLOWS_INTERRUPTS = (("torch.multiprocessing.spawn", "_wrap"),)
"""(module, function) that run a process's work and catch a KeyboardInterrupt out of it: the worker of
`torch.multiprocessing.spawn`/`start_processes` (its parent's Ctrl-C, or its parent's death, delivered as
SIGINT) then exits with code 0, and no exception is left for the interpreter's exit (`sys.last_value`)."""


def swallowing_frame() -> FrameType | None:
    """The frame of a function of SWALLOWS_INTERRUPTS the calling thread runs inside, if any. Elsewhere an
    interrupt that ends a process is the exception the interpreter exits with, and a chained SIGINT handler
    would only put its own frame into every Ctrl-C's traceback."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in SWALLOWS_INTERRUPTS:
            return frame
        frame = frame.f_back
    return None


def swallowed_error(error_file: str | None) -> str | None:
    """The last line of the traceback a `torch.multiprocessing.spawn` worker left in its `error_file` (its
    `_wrap` catches the work's exception, pickles the formatted traceback there for the parent and exits 1:
    the interpreter exits with no exception of its own), e.g. "ValueError: bad batch"; None if there is none."""
    if not error_file:
        return None
    try:
        with open(error_file, "rb") as fh:
            text = pickle.load(fh)
    except Exception:  # no file (no exception), or not what torch writes: nothing said
        return None
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


class ProcessEnds:
    """What would otherwise leave no word of how this rank's process ended: a Ctrl-C that a worker of
    torch.multiprocessing.spawn swallows (`interrupted`: it exits with code 0, no exception left for the
    scope's at-exit end), and a fatal signal, in whose handler no Python runs (SIGABRT: a C++ error that calls
    abort(), e.g. gloo's enforce on a collective mismatch, NCCL's watchdog; SIGSEGV, SIGBUS, SIGILL, SIGFPE).

    The fatal signals: faulthandler's dump of every Python thread, written by its C handler into
    ranks/rank<N>.fatal under a header line of ours (the launch, the main thread's id), which then hands the
    signal to the handler before it: the process dies as it would have, with the same signal and exit code.
    Not where faulthandler is on already (the user's own, or torchrun's @record: theirs is kept); never in
    a process forked from this one (a DataLoader worker's crash is not this rank's); a launch that ends
    without one leaves the file as it found it (`restore`)."""

    def __init__(self, run_dir: Path, rank: int, segment: int) -> None:
        self.path = run_dir / "ranks" / f"rank{rank}.fatal"
        self.header = json.dumps(
            {"pytscope": "fatal", "rank": rank, "segment": segment, "main_thread": thread_id()}
        )
        self.interrupted = False
        self.error_file: str | None = None  # where a spawn worker's wrapper leaves an exception it caught
        self._sigint = SignalChain(self._interrupt, signal.SIGINT, only_over=signal.default_int_handler)
        self._file: Any = None
        self._size = 0  # the file's size before our header

    def install(self) -> None:
        wrapper = swallowing_frame()
        if wrapper is not None:
            error_file = wrapper.f_locals.get("error_file")
            self.error_file = error_file if isinstance(error_file, str) else None
            self._sigint.install()
        if faulthandler.is_enabled():
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")  # (kept open: the handler writes to its descriptor)
            self._size = self._file.tell()
            self._file.write(self.header + "\n")
            self._file.flush()
            faulthandler.enable(file=self._file, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            self._close()
            return
        _DUMPING.add(self)
        _forget_in_children()

    def restore(self) -> None:
        self._sigint.restore()
        if self._file is not None:
            _DUMPING.discard(self)
            faulthandler.disable()
            self._close()

    def _close(self) -> None:
        """Close the file, cut back to what it held before (no fatal signal came), removed if that was nothing."""
        file, self._file = self._file, None
        if file is None:
            return
        with contextlib.suppress(OSError, ValueError):
            file.truncate(self._size)
        with contextlib.suppress(OSError, ValueError):
            file.close()
            if self._size == 0:
                self.path.unlink()
                self.path.parent.rmdir()  # (where it is empty: the ranks' own records go there too)

    def _interrupt(self) -> None:
        self.interrupted = True

    def swallowed_error(self) -> str | None:
        """The exception a spawn worker's wrapper caught and exited with (`swallowed_error`)."""
        return swallowed_error(self.error_file)


def thread_id() -> str:
    """The main thread's id as faulthandler writes it ("0x" and zero-padded hex of the pointer's width)."""
    ident = threading.main_thread().ident or 0
    return f"0x{ident:0{2 * struct.calcsize('P')}x}"


_DUMPING: set[ProcessEnds] = set()  # those whose dump is on (faulthandler's setting is the process's)
_HOOKED: list[bool] = []  # the fork hook, registered once a process (it cannot be removed)


def _forget_in_children() -> None:
    if not _HOOKED and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_child_forgets)
        _HOOKED.append(True)


def _child_forgets() -> None:
    """A forked process (a DataLoader worker) does not write into its parent's file: a crash of its own would
    read as the rank's. It ends as it would have without pytscope, with faulthandler off."""
    if _DUMPING:
        _DUMPING.clear()
        faulthandler.disable()
