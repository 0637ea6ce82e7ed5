"""The run directory: what rank 0 writes while training, and the tolerant reader behind every command.

Layout (all plain data, append-only while training):
  claim          empty: made exclusively by the run that took the directory (`claim_run_dir`)
  meta.json      settings and environment, written once when the run starts (atomically)
  steps.f64      step records: raw little-endian float64 rows, `meta.json["columns"]` wide
  events.jsonl   one JSON object per line: segments, counter and replica checks, live findings, hangs, errors
  scalars.jsonl  rank 0's extra logged scalars, one line per step and segment (a resume replays steps)
  ranks/rank<N>.f64, ranks/rank<N>.jsonl   rows a rank wrote itself when it could not wait for a gather (a hang,
                 SIGTERM, a rank missing at finish), and why; merged with steps.f64 on reading
  ranks/rank<N>.fatal   faulthandler's dump of a rank's Python threads where a fatal signal ended it (SIGABRT,
                 SIGSEGV ...), under a header line per launch; removed by a launch that ends without one
  summary.json / summary.txt   the end-of-run summary (atomically, at the end)
A process killed at any moment loses at most the rows not yet gathered: a torn last row or line is ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .arrays import RunArrays
from .context import (
    DIED,
    LEFT,
    NOT_FAILURES,
    RAISED,
    CountsCheck,
    RankFailure,
    ReplicaCheck,
    RunContext,
    Segment,
)
from .findings import Finding
from .records import COL, COLUMNS, NCOLS, PHASE_COLS

FORMAT = "pytscope-run/1"


T = TypeVar("T")


class RunDirError(Exception):
    """A run directory that cannot be read at all (missing, not a run, or junk)."""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):  # numpy's scalars (a float, an int, a bool) as Python's
        return _jsonable(value.item())
    return value


CLAIM = "claim"
_HANDED_OVER: set[str] = set()  # folders this process's launcher claimed for it (`hand_over_claim`)


def hand_over_claim(path: str | os.PathLike[str]) -> None:
    """Let this process's run take `path`, which the launcher that started it claimed for it (the demo claims
    its folder before its workers exist, to fail early and to name it)."""
    _HANDED_OVER.add(os.path.abspath(path))


def claim_run_dir(path: Path) -> bool:
    """Take `path` for a new run, unless a run has taken it (False). The claim is an exclusive create, so of
    two jobs started at once with one run directory exactly one takes it (a check for `meta.json`, which the
    writer makes later, let both take it, and one's records were lost). A folder that
    cannot be made or claimed (no permission, a file of that name) is left to the writer, which says why on
    every rank; failing here, on rank 0 alone, would leave the others waiting for it."""
    if (path / "meta.json").exists():
        return False
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:  # taken (unless for this process); or a file named `path`, which the writer names
        return os.path.abspath(path) in _HANDED_OVER or not path.is_dir()
    except OSError:
        return True
    return True


class RunWriter:
    """Rank 0's appender. Every write is flushed, so a SIGKILL loses only what was not yet gathered."""

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        meta_path = self.path / "meta.json"
        if not meta_path.exists():  # a resumed run keeps its original metadata
            _atomic_write(
                meta_path,
                json.dumps(_jsonable({"format": FORMAT, "columns": list(COLUMNS), **meta}), indent=1),
            )
        self.columns = run_columns(self.path)  # a run resumed by a later version keeps its layout
        self._steps = open(self.path / "steps.f64", "ab")
        self._events = open(self.path / "events.jsonl", "a")
        self._scalars = open(self.path / "scalars.jsonl", "a")
        self._lock = threading.Lock()  # the hang watchdog writes from its own thread
        self._trim_torn_row()

    def _trim_torn_row(self) -> None:
        # A SIGKILL in the middle of a write leaves a partial row; appending after it would shift every row.
        size = self._steps.tell()
        torn = size % (len(self.columns) * 8)
        if torn:
            self._steps.truncate(size - torn)
            self._steps.seek(size - torn)

    def append_rows(self, rows: np.ndarray) -> None:
        if rows.size:
            with self._lock:
                # A view, not a copy: one interval of 16,384 ranks is 112 MB.
                self._steps.write(np.ascontiguousarray(in_layout(rows, self.columns), dtype="<f8").data)
                self._steps.flush()

    def event(self, kind: str, **fields: Any) -> None:
        line = json.dumps(_jsonable({"type": kind, **fields})) + "\n"
        with self._lock:
            self._events.write(line)
            self._events.flush()

    def scalars(self, lines: list[dict[str, Any]]) -> None:
        if lines:
            self._scalars.write("".join(json.dumps(_jsonable(line)) + "\n" for line in lines))
            self._scalars.flush()

    def write_summary(self, summary: dict[str, Any], text: str) -> None:
        _atomic_write(self.path / "summary.json", json.dumps(_jsonable(summary), indent=1))
        _atomic_write(self.path / "summary.txt", text)

    def close(self) -> None:
        for f in (self._steps, self._events, self._scalars):
            f.close()


def append_rank_rows(
    path: Path, rank: int, rows: np.ndarray, reason: str, at_step: int | None = None, segment: int = 0
) -> None:
    """A rank's own rows, written by that rank (any rank: rank 0 may be hung too), with the reason, the last
    step the rank had recorded (`at_step` when no row is written) and its launch (`segment`)."""
    folder = path / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    if rows.size:
        with open(folder / f"rank{rank}.f64", "ab") as f:
            f.write(np.ascontiguousarray(in_layout(rows, run_columns(path)), dtype="<f8").tobytes())
    last = rows[:, COLUMNS.index("step")].max() if rows.size else at_step
    line = {
        "rank": rank,
        "reason": reason,
        "rows": int(rows.shape[0]),
        "last_step": last,
        "segment": segment,
        "t": time.time(),
    }
    with open(folder / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(_jsonable(line)) + "\n")


def run_columns(path: Path) -> list[str]:
    """The column layout of the run's rows (`meta.json`): this version's, unless the run began under one
    whose rows had other columns (rows are always written, and read, in the run's own layout)."""
    try:
        return _columns_of(json.loads(regular_file(path / "meta.json").read_text())) or list(COLUMNS)
    except (OSError, ValueError, AttributeError):
        return list(COLUMNS)


def _columns_of(meta: Any) -> list[str] | None:
    """`meta`'s column names, where they can be a row layout (strings, "step" among them), else None."""
    columns = meta.get("columns")
    ok = isinstance(columns, list) and all(isinstance(c, str) for c in columns) and "step" in columns
    return list(columns) if ok else None


def in_layout(rows: np.ndarray, columns: list[str]) -> np.ndarray:
    """`rows` (this version's columns) in the layout `columns`: a column this version lacks is NaN."""
    if columns == list(COLUMNS):
        return rows
    out = np.full((rows.shape[0], len(columns)), np.nan)
    for i, name in enumerate(columns):
        if name in COL:
            out[:, i] = rows[:, COL[name]]
    return out


def read_rank_files(
    path: Path, columns: list[str] | None, known: np.ndarray, problems: list[str]
) -> tuple[np.ndarray, dict[int, str], list[RankFailure]]:
    """Rows the ranks wrote themselves that are not already in `known` (the gathered rows), each such
    rank's last stated reason, unless its records go on past the step it wrote (a hang reported with
    on_hang="report" that cleared, a launch resumed: the reason did not end the rank's records), and every
    rank an exception ended, first first. A file that cannot be read is left out, said in `problems`; a
    folder that cannot be listed raises OSError."""
    folder = path / "ranks"
    if not folder.is_dir():
        if folder.exists():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder")
        return np.empty((0, NCOLS)), {}, []
    names = sorted(os.listdir(folder))  # (unlike glob, says when the folder cannot be listed)

    def rank_files(suffix: str) -> list[str]:
        return [n for n in names if n.startswith("rank") and n.endswith(suffix) and (folder / n).is_file()]

    parts = [
        _read_or_note(
            partial(read_rows, folder, columns, name=n), f"ranks/{n}", problems, np.empty((0, NCOLS))
        )
        for n in rank_files(".f64")
    ]
    rows = np.concatenate(parts) if parts else np.empty((0, NCOLS))
    if rows.size:  # keep each (rank, segment, step) once, and only if no gather brought it already
        key_cols = [COLUMNS.index(c) for c in ("rank", "segment", "step")]
        seen = {tuple(r) for r in known[:, key_cols].tolist()}
        keep = []
        for key in rows[:, key_cols].tolist():
            keep.append(tuple(key) not in seen)
            seen.add(tuple(key))
        rows = rows[keep]
    every = np.concatenate([known, rows])
    segments = every[:, COL["segment"]]
    reasons: dict[int, str] = {}
    said: dict[int, int] = {}  # the launch of each rank's reason kept
    failures: list[RankFailure] = []
    for n in rank_files(".jsonl"):
        text = _read_or_note(partial((folder / n).read_text, errors="replace"), f"ranks/{n}", problems, "")
        unreadable = 0
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                rank, last, reason = int(entry["rank"]), entry.get("last_step"), str(entry["reason"])
                if n != f"rank{rank}.jsonl":  # a rank writes its own file only
                    raise ValueError("another rank's entry")
                later = every[:, COL["step"]][every[:, COL["rank"]] == rank]
                went_on = last is not None and later.size > 0 and float(np.nanmax(later)) > float(last)
                if LEFT in reason or (
                    RAISED in reason and not reason.split(RAISED, 1)[1].startswith(NOT_FAILURES)
                ):
                    t, seg = entry.get("t"), entry.get("segment")
                    at = float(t) if isinstance(t, (int, float)) and math.isfinite(t) else None
                    step = int(last) if last is not None else None
                    launch = seg if isinstance(seg, int) else None
                    # Went on past it: a later launch recorded steps, or this rank later steps in its launch
                    # (a run from before launches were written: this rank's later steps in any launch).
                    past = went_on
                    if launch is not None:
                        in_launch = (segments == launch) & (every[:, COL["rank"]] == rank)
                        in_launch &= every[:, COL["step"]] > (last if last is not None else math.inf)
                        past = bool((segments > launch).any() or in_launch.any())
                    failures.append(RankFailure(rank, reason, step, at, past, launch))
                if went_on:
                    reasons.pop(rank, None)
                    continue
                reasons[rank] = reason
                said[rank] = entry.get("segment") if isinstance(entry.get("segment"), int) else -1
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
                unreadable += 1
        if unreadable:
            problems.append(f"{unreadable} unreadable line(s) of ranks/{n} skipped")
    for n in rank_files(".fatal"):
        text = _read_or_note(partial((folder / n).read_text, errors="replace"), f"ranks/{n}", problems, "")
        end = fatal_end(text)
        if end is None or n != f"rank{end[0]}.fatal":
            continue
        rank, launch, reason = end
        mine = every[:, COL["rank"]] == rank
        # Its own word in that launch or a later one comes first (an exception, then an abort on the way out);
        # a rank that trained on in a later launch is not ended by it.
        if said.get(rank, -2) >= launch or (segments[mine] > launch).any():
            continue
        steps = every[:, COL["step"]][mine & (segments == launch)]
        last = int(np.nanmax(steps)) if steps.size else None
        at = _written_at(folder / n)  # (the dump's time: nothing writes the file after it)
        failures.append(RankFailure(rank, reason, last, at, bool((segments > launch).any()), launch))
        reasons[rank] = reason
    failures.sort(key=lambda f: (f.t is None, f.t or 0.0, _follows_a_peer(f.reason), f.rank))
    return rows, reasons, failures


def _written_at(f: Path) -> float | None:
    try:
        return f.stat().st_mtime
    except OSError:
        return None


FATAL_SIGNALS = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
    "Floating point exception": "SIGFPE",
}
"""faulthandler's name of each fatal signal ("Fatal Python error: Aborted")."""
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
LIBRARY_PATHS = ("site-packages", "dist-packages", "/lib/python3", "pytscope_core", "pytscope_lightning")
"""In the path of a frame that is not the training code's: installed packages, Python's own, pytscope's."""


def fatal_end(text: str) -> tuple[int, int, str] | None:
    """(rank, launch, reason) of the last launch in a rank's .fatal file whose header a dump follows: "the
    process died of SIGABRT in all_reduce, called from train.py line 91" (the main thread's innermost call
    and the training code's line it came from, where its stack has them); None without one."""
    header: dict[str, Any] | None = None
    dump: list[str] = []
    found = None
    for line in [*text.splitlines(), '{"pytscope": "fatal"}']:  # (a last header closes the last dump)
        if line.startswith('{"pytscope"'):
            if header is not None and any(x.strip() for x in dump):
                found = (header, dump)
            with contextlib.suppress(ValueError):
                header, dump = json.loads(line), []
        else:
            dump.append(line)
    if found is None:
        return None
    header, dump = found
    rank, launch = header.get("rank"), header.get("segment")
    if not isinstance(rank, int) or not isinstance(launch, int):
        return None
    said = next((x.split(":", 1)[1].strip() for x in dump if x.startswith("Fatal Python error:")), "")
    reason = f"the process{DIED}{FATAL_SIGNALS.get(said, said or 'a fatal signal')}"
    frames, thread = [], None
    for line in dump:
        heading, frame = _THREAD.match(line), _FRAME.match(line)
        if heading:
            thread = heading.group(1)
        elif frame and thread == header.get("main_thread"):
            frames.append(frame.groups())
    own = next((f for f in frames if not any(part in f[0] for part in LIBRARY_PATHS)), None)
    if frames and own is frames[0]:
        reason += f" at {os.path.basename(own[0])} line {own[1]}"
    elif frames:
        reason += f" in {frames[0][2]}"
        if own is not None:
            reason += f", called from {os.path.basename(own[0])} line {own[1]}"
    return rank, launch, reason


FOLLOWS_A_PEER = ("by peer", "remote worker", "communicator was aborted")
"""In a collective's error when another rank left first: where the times do not tell (a run from before they
were written), such a failure comes after the others."""


def _follows_a_peer(reason: str) -> bool:
    return any(text in reason for text in FOLLOWS_A_PEER)


@dataclass
class Run:
    path: Path
    meta: dict[str, Any]
    arrays: RunArrays
    context: RunContext
    live_findings: list[Finding] = field(default_factory=list)  # as printed during training
    extra_findings: list[Finding] = field(default_factory=list)  # made by an integration, not by re-diagnosis
    problems: list[str] = field(default_factory=list)  # what could not be read, said in the report


def read_rows(path: Path, columns: list[str] | None = None, name: str = "steps.f64") -> np.ndarray:
    """The step rows on disk in the current column layout (a torn last row is dropped)."""
    f = path / name
    if not f.exists():
        return np.empty((0, NCOLS))
    regular_file(f)
    columns = columns or list(COLUMNS)
    width = len(columns)
    raw = np.fromfile(f, dtype="<f8")
    return _in_current_layout(raw[: raw.size - raw.size % width].reshape(-1, width), columns)


def iter_rows(f: Path, columns: list[str], chunk_rows: int = 1 << 16) -> Iterator[np.ndarray]:
    """The whole rows of file `f` in the current column layout, `chunk_rows` at a time: a large run's rows
    read without holding them all (only what the file held when this began)."""
    width = len(columns)
    rows = f.stat().st_size // (8 * width)
    if rows == 0:
        return
    held = np.memmap(f, dtype="<f8", mode="r", shape=(rows, width))
    for start in range(0, rows, chunk_rows):
        yield _in_current_layout(np.array(held[start : start + chunk_rows]), columns)


def _in_current_layout(raw: np.ndarray, columns: list[str]) -> np.ndarray:
    if columns == list(COLUMNS):
        return raw
    rows = np.full((raw.shape[0], NCOLS), np.nan)
    for i, name in enumerate(columns):
        if name in COLUMNS:
            rows[:, COLUMNS.index(name)] = raw[:, i]
    return rows


def read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Events in order, and how many lines could not be parsed (a torn last line after a kill)."""
    f = path / "events.jsonl"
    events: list[dict[str, Any]] = []
    bad = 0
    if f.exists():
        for line in regular_file(f).read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # (a torn line; nesting too deep to decode)
                bad += 1
                continue
            if isinstance(obj, dict):
                events.append(obj)
            else:
                bad += 1
    return events, bad


def next_segment(path: Path) -> int:
    """One past the highest segment the run directory's events name; 0 for none."""
    events, _ = read_events(path)
    indices = [e["index"] for e in events if e.get("type") == "segment" and isinstance(e.get("index"), int)]
    return max(indices, default=-1) + 1


def load_run(path: str | os.PathLike[str], warmup: int | None = None) -> Run:
    """The run in `path`, read as far as it can be: what cannot be read is left out and said in
    `Run.problems`. RunDirError when it is not a run directory or cannot be read at all."""
    root = Path(path)
    try:
        if not root.exists():
            raise RunDirError(f"{root}: no such run directory")
        if not root.is_dir():
            raise RunDirError(f"{root}: not a directory")
        return _load_run(root, warmup)
    except OSError as exc:  # e.g. no permission to list the folder or to look at its files
        raise RunDirError(f"{root}: cannot be read ({exc.strerror or type(exc).__name__})") from None


def _load_run(root: Path, warmup: int | None) -> Run:
    problems: list[str] = []
    meta: dict[str, Any] = {}
    meta_path = root / "meta.json"
    if meta_path.exists():
        try:
            loaded = json.loads(regular_file(meta_path).read_text())
            if not isinstance(loaded, dict) or not loaded:
                raise ValueError("not an object, or an empty one")
            meta = loaded
        except (ValueError, UnicodeDecodeError, RecursionError, OSError):
            problems.append("meta.json is unreadable; defaults assumed")
    elif (root / "steps.f64").exists():
        problems.append("meta.json is missing; defaults assumed")
    if meta and meta.get("format") != FORMAT:
        kind = meta.get("format")
        if isinstance(kind, str) and kind.startswith("pytscope-run/"):
            raise RunDirError(
                f"{root}: a run in format {kind!r}, which this pytscope cannot read (it reads {FORMAT!r})"
            )
        raise RunDirError(f"{root}: not a pytscope run directory (its meta.json is not pytscope's)")
    if not meta and not (root / "steps.f64").exists():
        raise RunDirError(f"{root}: not a pytscope run directory (no meta.json or steps.f64)")
    columns = _columns_of(meta)
    # Rows before events: a launch's segment event is written before its rows, so every row read has its
    # launch's event (and world size) in what is read next, even while the run is writing.
    rows = _read_or_note(lambda: read_rows(root, columns), "steps.f64", problems, np.empty((0, NCOLS)))
    if not (root / "steps.f64").exists():
        problems.append("steps.f64 is missing: no gathered step records (only the ranks' own files, if any)")
    no_rank_files: tuple[np.ndarray, dict[int, str], list[RankFailure]] = (np.empty((0, NCOLS)), {}, [])
    own_rows, rank_reasons, failures = _read_or_note(
        lambda: read_rank_files(root, columns, rows, problems), "ranks/", problems, no_rank_files
    )
    if own_rows.size:
        rows = np.concatenate([rows, own_rows])
    no_events: tuple[list[dict[str, Any]] | None, int] = (None, 0)  # None: events.jsonl cannot be read
    read: tuple[list[dict[str, Any]] | None, int] = _read_or_note(
        lambda: read_events(root), "events.jsonl", problems, no_events
    )
    found, bad_lines = read
    events = found or []
    for e in events:  # settings learnt during the run (e.g. measured FLOPs) arrive as "meta" events
        if e.get("type") == "meta" and isinstance(e.get("fields"), dict):
            meta.update(_with_earlier_places(meta, e["fields"]))
    if bad_lines:
        problems.append(f"{bad_lines} unreadable line(s) in events.jsonl skipped")
    for key, value in _bad_settings(meta):
        problems.append(f"run setting {key}={value!r} is not valid; its default assumed")
        del meta[key]
    # Without the events, a relaunch on more ranks than meta.json's first is not known: no rank is too high.
    rows, corrupt = sound_rows(rows, _largest_world(meta, events) if found is not None else 2**24)
    if corrupt:
        problems.append(f"{corrupt} corrupt row(s) of step records dropped")
    torn = _torn(root / "steps.f64", len(columns or COLUMNS))
    if torn:
        problems.append("a torn last row of step records dropped (the process was killed while writing it)")
    for f in sorted((root / "ranks").glob("rank*.f64")) if (root / "ranks").is_dir() else []:
        if _torn(f, len(columns or COLUMNS)):
            problems.append(f"a torn last row of ranks/{f.name} dropped (killed while writing it)")
    w = int(meta.get("warmup", 5)) if warmup is None else warmup
    arrays = RunArrays.from_rows(rows, warmup=w)
    duplicates = rows.shape[0] - int(np.isfinite(arrays.wall_ms).sum()) - arrays.replayed.shape[0]
    if duplicates > 0:  # (the same rank's step twice in one launch: one is kept)
        problems.append(f"{duplicates} duplicate row(s) of step records dropped")
    context = _context(meta, events, arrays, w, problems)
    if rank_reasons or failures:
        context = dataclasses.replace(
            context, rank_notes=tuple(sorted(rank_reasons.items())), failures=tuple(failures)
        )
    if corrupt or torn:
        context = dataclasses.replace(context, records_lost=True)
    if not (root / "summary.json").is_file():  # written last, by the end of the run
        context = dataclasses.replace(context, ended=False)
    live: list[Finding] = []
    extra: list[Finding] = []
    for e in events:
        if e.get("type") == "finding":
            try:
                finding = Finding.from_dict(e["finding"])
            except (KeyError, TypeError, ValueError, OverflowError):
                problems.append("a live finding could not be read")
                continue
            (extra if e.get("source") == "integration" else live).append(finding)
    # An integration re-checks at every launch (e.g. uneven shards): keep each finding's latest word once.
    extra = list({f.key: f for f in extra}.values())
    return Run(root, meta, arrays, context, live, extra, problems)


def _torn(f: Path, width: int) -> bool:
    """Whether the file ends in part of a row (a kill while writing it: `read_rows` leaves it out)."""
    try:
        return f.is_file() and f.stat().st_size % (width * 8) != 0
    except OSError:
        return False


def _with_earlier_places(meta: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` of a launch's meta event, its `hosts` and `local_ranks` extended by the earlier launches' for
    the ranks it did not have: a job resumed on fewer ranks still says where the others ran."""
    out = dict(fields)
    for key in ("hosts", "local_ranks"):
        new, old = fields.get(key), meta.get(key)
        if isinstance(new, list) and isinstance(old, list) and len(old) > len(new):
            out[key] = new + old[len(new) :]
    return out


RUN_FILES = (CLAIM, "meta.json", "steps.f64", "events.jsonl", "scalars.jsonl", "summary.json", "summary.txt")
RUN_FOLDERS = ("ranks", "stacks")


def is_run_file(root: Path, path: Path) -> bool:
    """Whether `path` is (or would be) one of the files of the run in `root`, where its writer or reader
    puts them."""
    try:
        root, path = root.resolve(), path.resolve()
    except (OSError, RuntimeError):  # (a link loop)
        return False
    if path.parent == root:
        return path.name in RUN_FILES + RUN_FOLDERS
    return any(path.is_relative_to(root / folder) for folder in RUN_FOLDERS)


def regular_file(f: Path) -> Path:
    """`f`, if it is a regular file (or a link to one); OSError if not: a named pipe would block the reader
    forever, a device such as /dev/zero would fill its memory."""
    if not f.is_file():
        raise OSError(errno.EINVAL, "not a regular file", str(f))
    return f


def _read_or_note(read: Callable[[], T], name: str, problems: list[str], empty: T) -> T:
    """What `read` returns, or `empty` with a note when the file cannot be read at all."""
    try:
        return read()
    except OSError as exc:  # e.g. a directory where a file should be, or no permission
        problems.append(f"{name} cannot be read ({exc.strerror or type(exc).__name__}); left out")
        return empty


_SETTINGS: dict[str, tuple[type, ...]] = {  # meta.json settings the analysis reads, and their types
    "world_size": (int,),
    "interval": (int,),
    "warmup": (int,),
    "step_origin": (int,),
    "device": (str,),
    "parallelism": (str, type(None)),
    "comm_measured": (bool,),
    "flops_per_step": (int, float, type(None)),
    "peak_flops": (int, float, type(None)),
    "precision": (str, type(None)),
    "mem_limit_bytes": (int, float, type(None)),
}


MAX_WORLD = 2**18
"""More ranks than any job runs (262,144): a meta.json that says more is damaged, not read as that many."""


def _bad_settings(meta: dict[str, Any]) -> list[tuple[str, Any]]:
    """Settings present with a value of the wrong type or range (a hand-edited or damaged meta.json)."""
    bad = []
    for key, types in _SETTINGS.items():
        if key not in meta:
            continue
        value = meta[key]
        ok = isinstance(value, types) and isinstance(value, bool) == (bool in types)  # True is an int too
        if ok and types == (int,):
            ok = value >= (1 if key in ("world_size", "interval") else 0) or key == "step_origin"
            ok = ok and (key != "world_size" or value <= MAX_WORLD)
        if not ok:
            bad.append((key, value))
    return bad


def run_world(path: Path) -> int:
    """The most ranks any launch of the run in `path` had, as the reader takes it (`sound_rows`)."""
    try:
        meta = json.loads(regular_file(path / "meta.json").read_text())
    except (OSError, ValueError, RecursionError):
        meta = {}
    return _largest_world(meta if isinstance(meta, dict) else {}, read_events(path)[0])


def run_warmup(path: Path, default: int) -> int:
    """The warm-up the run's reports leave out (`meta.json`'s: a resumed run keeps its first launch's)."""
    try:
        warmup = json.loads(regular_file(path / "meta.json").read_text()).get("warmup")
    except (OSError, ValueError, RecursionError, AttributeError):
        return default
    return warmup if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0 else default


def _largest_world(meta: dict[str, Any], events: list[dict[str, Any]]) -> int:
    """The most ranks any launch of the run had (a resume may change the world size); 2**24 when unknown."""
    sizes = [meta.get("world_size")] + [e.get("world_size") for e in events if e.get("type") == "segment"]
    known = [n for n in sizes if isinstance(n, int) and not isinstance(n, bool) and n >= 1]
    return max(known, default=2**24)


PHASE_SUM_SLACK = 0.01
"""A row's phases add up to its wall time (they are attributed from one timeline); beyond this share off, the
row is damaged, not rounded."""


def sound_rows(rows: np.ndarray, world: int = 2**24) -> tuple[np.ndarray, int]:
    """The rows whose keys and times are possible (whole rank numbers below `world`, segment and step
    numbers in range, a start time and durations that are finite and not negative, a step that took time,
    phases that add up to it), and how many were not: a damaged file's bytes."""
    if not rows.size:
        return rows, 0
    key = rows[:, [COL["rank"], COL["segment"], COL["step"]]]
    spans = rows[:, [COL["wall_ms"], *PHASE_COLS, COL["excluded_ms"]]]
    with np.errstate(invalid="ignore"):
        ok = (
            np.isfinite(key).all(axis=1)
            & (key == np.round(key)).all(axis=1)
            & (key[:, 0] >= 0)
            & (key[:, 0] < min(world, 2**24))
            & (key[:, 1] >= 0)
            & (key[:, 1] < 2**24)
            & (key[:, 2] >= 0)  # steps count from 0 or 1
            & (key[:, 2] < 2**48)
            & np.isfinite(rows[:, COL["start_s"]])
            & (np.abs(rows[:, COL["start_s"]]) < 1e11)
            & np.isfinite(spans).all(axis=1)
            & (spans >= 0).all(axis=1)
            & (spans < 1e10).all(axis=1)
            & (spans[:, 0] > 0)
            & (np.abs(spans[:, 1:-1].sum(axis=1) - spans[:, 0]) <= PHASE_SUM_SLACK * spans[:, 0] + 1e-6)
        )
    bad = int(rows.shape[0] - ok.sum())
    return (rows[ok] if bad else rows), bad


def _context(
    meta: dict[str, Any], events: list[dict[str, Any]], arrays: RunArrays, warmup: int, problems: list[str]
) -> RunContext:
    """The run's context from its settings and events; an event that cannot be read is left out, and said
    in `problems` by kind (a damaged hang report must not vanish without a word)."""
    segments, counts, replicas, hangs, errors, notes, alive, joins = [], [], [], [], [], [], [], []
    unreadable: dict[str, int] = {}
    seen_notes: set[str] = set()
    world = int(meta.get("world_size") or arrays.world_size or 1)
    largest = _largest_world(meta, events)
    for e in events:
        kind = e.get("type")
        try:
            if kind == "segment":
                segments.append(
                    Segment(
                        int(e["index"]),
                        float(e["started_s"]),
                        int(e.get("resumed_from_step", 0)),
                        int(e.get("world_size", world)),
                    )
                )
            elif kind == "counts_check":
                check = CountsCheck(
                    int(e["gather"]),
                    tuple(int(v) for v in e["steps"]),
                    tuple(int(v) for v in e["grad_syncs"]),
                    tuple(int(v) for v in e["micro_batches"]),
                    tuple(int(r) for r in e.get("joined", ())),
                )
                if not len(check.steps) == len(check.grad_syncs) == len(check.micro_batches) <= largest:
                    raise ValueError("one count per rank")
                counts.append(check)
            elif kind == "joined":
                joins.append((int(e["rank"]), int(e["step"])))
            elif kind == "replica_check":
                sums = tuple(float(c) if c is not None else math.nan for c in e["checksums"])
                if len(sums) > largest:
                    raise ValueError("one checksum per rank")
                replicas.append(ReplicaCheck(int(e["step"]), sums))
            elif kind == "hang":
                Finding.from_dict(e["finding"])  # a damaged report is left out, as any unreadable event
                hangs.append({**e["finding"], "segment": e.get("segment")})  # (the launch it came from)
                if isinstance(e.get("t"), (int, float)) and isinstance(e.get("segment"), int):
                    alive.append((e["segment"], float(e["t"])))
            elif kind == "scope_error":
                errors.append(str(e.get("message", "")))
            elif (
                kind == "scope_note" and str(e.get("message", "")) not in seen_notes
            ):  # (each launch says it)
                notes.append(str(e.get("message", "")))
                seen_notes.add(notes[-1])
        except (KeyError, TypeError, ValueError, OverflowError):
            unreadable[str(kind)] = unreadable.get(str(kind), 0) + 1
    problems.extend(f"{n} {kind} event(s) could not be read" for kind, n in unreadable.items())
    return RunContext.from_meta(
        meta,
        world_size=world,
        warmup=warmup,
        segments=tuple(segments),
        counts_checks=tuple(counts),
        joins=tuple(joins),
        replica_checks=tuple(replicas),
        hang_reports=tuple(hangs),
        alive=tuple(alive),
        scope_errors=tuple(errors),
        scope_notes=tuple(notes),
    )
