"""Standard output that outlives its reader: `pytscope report RUN | head`, or `pytscope demo | head`, must
not end in a traceback (or a worker's crash) once the reader stops reading."""

from __future__ import annotations

import os
from typing import Any


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
