"""SIGTERM, chained: launchers send it before SIGKILL, and a rank should leave its ungathered steps behind.

The handler runs a callback first, then whatever was installed before it (Lightning's own handler, or the
default action: end the process), so pytscope never changes what SIGTERM does to a job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any


class SigtermChain:
    """Installs a SIGTERM handler that calls `before()` and then the previous handler; `restore()` puts the
    previous one back unless someone replaced ours in the meantime."""

    def __init__(self, before: Callable[[], None]) -> None:
        self.before = before
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        try:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
        except (ValueError, OSError):
            return
        self._installed = True

    def restore(self) -> None:
        if not self._installed:
            return
        self._installed = False
        with contextlib.suppress(ValueError, OSError, TypeError):
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        try:
            self.before()
        except Exception:  # whatever happens here, the signal must still do what it did before
            pass
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
