"""The console, shared with others: standard output that outlives its reader (`pytscope report RUN | head`,
or `pytscope demo | head`, must not end in a traceback or a worker's crash once the reader stops reading),
and live output that does not cut into the training's progress bars."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

_monotonic = time.monotonic  # (bound at import: code that patches time.monotonic must not move this clock)

PROGRESS_LOCK_WAIT_S = 1.0
"""How long a print waits for tqdm's locks, in all, before it goes out without clearing the bars."""


def show(console: Any, *items: Any, **options: Any) -> None:
    """Each of `items` printed on `console` (rich), out of the way of the training's progress bars: above a
    rich live display (Lightning's default `RichProgressBar`, `rich.progress`), which is drawn again below
    it, and with tqdm's bars cleared and drawn again after (`progress_bars_cleared`)."""
    live = live_console()
    with progress_bars_cleared():
        (live or console).print(*items, sep="\n", **options)  # (one print: the display is drawn again once)


def live_console() -> Any:
    """rich's global console while a live display draws on it, else None. Text printed through that console
    goes above the display; another console would write straight to the terminal, into the display (rich's
    redirection of `sys.stdout` hands rich consoles the real file)."""
    if "rich.live" not in sys.modules:  # no live display without it
        return None
    from rich import get_console

    console = get_console()
    return console if getattr(console, "_live_stack", None) or getattr(console, "_live", None) else None


@contextlib.contextmanager
def progress_bars_cleared(wait_s: float = PROGRESS_LOCK_WAIT_S, redraw: bool = True) -> Iterator[None]:
    """tqdm's progress bars (Lightning's `TQDMProgressBar`, a loop's own `tqdm(loader)`) cleared while pytscope
    prints, and drawn again after, as `tqdm.write` does: else a live finding starts mid-line, after half a bar.

    It never waits long, so a hang report cannot be held up by a bar that is stuck writing: when tqdm's
    lock is not free within `wait_s`, the text goes out as it is. Nothing is done, and no lock is made,
    while no bar exists (tqdm makes its multiprocessing lock lazily; making it early would fix the
    process's start method). `redraw=False` leaves them cleared (the process is ending)."""
    tqdm_std = sys.modules.get("tqdm.std")
    bar_class: Any = getattr(tqdm_std, "tqdm", None)  # (every tqdm bar's class derives from it)
    if not getattr(bar_class, "_instances", None):
        yield
        return
    # The locks under every bar class's own write lock (Lightning's bar makes its own), read without making
    # one: making it waits, without a limit, for a lock a stuck bar may hold.
    shared = getattr(tqdm_std, "TqdmDefaultWriteLock", None)
    locks = [lock for lock in (getattr(shared, "mp_lock", None), getattr(shared, "th_lock", None)) if lock]
    if not locks:
        yield
        return
    taken = []
    deadline = _monotonic() + wait_s
    for lock in locks:
        if not lock.acquire(timeout=max(0.0, deadline - _monotonic())):
            break
        taken.append(lock)
    cleared = None
    try:
        if len(taken) == len(locks):
            cleared = _entered(bar_class.external_write_mode(nolock=True))
        yield
    finally:
        if cleared is not None and redraw:
            _exited(cleared)
        for lock in reversed(taken):
            lock.release()


def say(rank: int, message: str) -> None:
    """One line from the scope on this rank's standard error (a warning, an error of its own). A rich live
    display that redirects `sys.stderr` puts it above itself; tqdm's bars are cleared for it. Another rank
    cannot clear rank 0's bar in the terminal they share: its line starts on a line of its own."""
    with progress_bars_cleared():
        _print_line(_line(rank, message))


def say_last(rank: int, message: str | None) -> None:
    """The scope's last line before it ends the process (a hang's abort), or none: tqdm's bars are left
    cleared, and a rich display's hidden cursor is shown again, so that the shell's prompt or the launcher's
    report starts on a line of its own in a usable terminal."""
    live = live_console()
    with progress_bars_cleared(redraw=False):
        if message is not None:
            _print_line(_line(rank, message))
    if live is not None:
        with contextlib.suppress(Exception):
            live.show_cursor(True)
            live.file.write("\n")  # (below the display, which stays drawn)
            live.file.flush()


def _print_line(line: str) -> None:
    """`line` on standard error, or nowhere when it cannot be written (closed, its reader gone): what the
    scope says must never stop what it does next (a hang's abort exits right after)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _line(rank: int, message: str) -> str:
    prefix = "\n" if rank != 0 and _isatty(sys.stderr) else ""  # (below rank 0's bar in a shared terminal)
    return f"{prefix}pytscope[rank {rank}]: {message}"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # (a closed or stand-in stream)
        return False


def _entered(context: Any) -> Any:
    """`context`, entered; None if entering failed (a bar whose file is closed): pytscope prints all the same."""
    try:
        context.__enter__()
        return context
    except Exception:
        return None


def _exited(context: Any) -> None:
    try:
        context.__exit__(None, None, None)
    except Exception:  # (the bars are tqdm's to draw: a failure there is not pytscope's output)
        pass


class PipeSafeStdout:
    """`stream` until its reader leaves (a closed pipe); from then on what is written goes nowhere, and the
    program goes on to its own exit code (a `--fail-on` verdict, a job's end)."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._gone = stream, False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                written = self._stream.write(text)
                return len(text) if written is None else int(written)  # (a stand-in stream may say None)
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def _reader_left(self) -> None:
        self._gone = True
        try:  # what is still buffered goes nowhere at exit, rather than to the closed pipe (a second error)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # (not a real file)
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
