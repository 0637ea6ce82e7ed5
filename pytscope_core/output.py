"""The console, shared with others: standard output that outlives its reader (`pytscope report RUN | head`,
or `pytscope demo | head`, must not end in a traceback or a worker's crash once the reader stops reading),
and live output that does not cut into the training's progress bars."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROGRESS_LOCK_WAIT_S = 1.0
"""How long a print waits for tqdm's lock before it goes out without clearing the bars."""


@contextmanager
def progress_bars_cleared(wait_s: float = PROGRESS_LOCK_WAIT_S) -> Iterator[None]:
    """tqdm's progress bars (Lightning's default bar, a loop's own `tqdm(loader)`) cleared while pytscope
    prints, and drawn again after, as `tqdm.write` does: else a live finding starts mid-line, after half a bar.

    It never waits long, so a hang report cannot be held up by a bar that is stuck writing: when tqdm's
    lock is not free within `wait_s`, the text goes out as it is. Nothing is done, and no lock is made,
    while no bar exists (tqdm makes its multiprocessing lock lazily; making it early would fix the
    process's start method)."""
    bar_class = getattr(
        sys.modules.get("tqdm.std"), "tqdm", None
    )  # (tqdm.auto's and Lightning's derive from it)
    locks = getattr(getattr(bar_class, "_lock", None), "locks", None)
    if not getattr(bar_class, "_instances", None) or not locks:
        yield
        return
    taken = []
    for lock in locks:
        if not lock.acquire(timeout=wait_s):
            break
        taken.append(lock)
    cleared = None
    try:
        if len(taken) == len(locks):
            cleared = _entered(bar_class.external_write_mode(nolock=True))  # type: ignore[union-attr]
        yield
    finally:
        if cleared is not None:
            _exited(cleared)
        for lock in reversed(taken):
            lock.release()


def say(rank: int, message: str) -> None:
    """One line from the scope on this rank's standard error (a warning, an error of its own)."""
    with progress_bars_cleared():
        print(f"pytscope[rank {rank}]: {message}", file=sys.stderr, flush=True)


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
