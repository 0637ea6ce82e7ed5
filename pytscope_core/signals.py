"""Signals, chained: a handler of ours runs a callback, then whatever was installed before it, so pytscope
never changes what a signal does to a job.

SIGTERM: launchers send it before SIGKILL, and a rank should leave its ungathered steps behind; the previous
handler is Lightning's own, or the default action (end the process). SIGINT (Ctrl-C), only where something
catches the KeyboardInterrupt it raises and ends the process quietly (`interrupts_swallowed`), and only over
Python's own handler: the callback notes the interrupt, which nothing else would leave behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
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


def interrupts_swallowed() -> bool:
    """Whether the calling thread runs inside a function of SWALLOWS_INTERRUPTS. Elsewhere an interrupt that
    ends a process is the exception the interpreter exits with, and a chained SIGINT handler would only put
    its own frame into every Ctrl-C's traceback."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in SWALLOWS_INTERRUPTS:
            return True
        frame = frame.f_back
    return False


class InterruptNote:
    """Notes a SIGINT (`seen`) where the process's work runs inside a function that swallows the
    KeyboardInterrupt (`interrupts_swallowed`), chained over Python's own handler: the rank then reads as
    interrupted at exit, not as one that forgot finish(). Nothing is installed elsewhere."""

    def __init__(self) -> None:
        self.seen = False
        self._chain = SignalChain(self._note, signal.SIGINT, only_over=signal.default_int_handler)

    def install(self) -> None:
        if interrupts_swallowed():
            self._chain.install()

    def restore(self) -> None:
        self._chain.restore()

    def _note(self) -> None:
        self.seen = True
