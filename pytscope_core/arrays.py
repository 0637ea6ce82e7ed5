"""Dense (steps x ranks) arrays of a run, built from the record rows of every rank: what analysis consumes.

Rows may come in any order, from any number of segments (launches). When a step was recorded twice for a
rank (a resume replayed steps done after the last checkpoint), the row of the later segment counts and the
earlier one is kept apart as *replayed* work, which goodput charges as lost time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .records import COL, NCOLS, PHASE_COLS


@dataclass(frozen=True)
class RunArrays:
    steps: np.ndarray  # (S,) int64, sorted step indices present on any rank
    ranks: np.ndarray  # (R,) int64 rank ids, sorted
    phases: np.ndarray  # (S, R, P) float64 ms in PHASES order; NaN where a rank has no record
    wall_ms: np.ndarray  # (S, R)
    start_s: np.ndarray  # (S, R)
    excluded_ms: np.ndarray  # (S, R)
    loss: np.ndarray  # (S, R)
    samples: np.ndarray  # (S, R)
    mem_bytes: np.ndarray  # (S, R)
    grad_syncs: np.ndarray  # (S, R)
    micro_batches: np.ndarray  # (S, R)
    batch_fp: np.ndarray  # (S, R) hash of the step's first batch on that rank (every 8th step), else NaN
    optimizer_steps: np.ndarray  # (S, R) optimizer.step() calls in the step; NaN in runs before the column
    loop_comm_ms: np.ndarray  # (S, R) the part of comm in the loop's own collectives; NaN in runs before it
    segment: np.ndarray  # (S, R) float64, NaN where missing
    counted: np.ndarray  # (S,) bool: step is past the warm-up of its segment (statistics use these)
    replayed: np.ndarray = field(default_factory=lambda: np.empty((0, NCOLS)))  # rows superseded by a resume

    @property
    def n_steps(self) -> int:
        return int(self.steps.size)

    @property
    def world_size(self) -> int:
        return int(self.ranks.size)

    @property
    def comm_ms(self) -> np.ndarray:
        return self.phases[:, :, PHASE_COLS.index(COL["comm_ms"])]

    @property
    def local_ms(self) -> np.ndarray:
        """A rank's own work in a step: its wall time less the time it was blocked in gradient communication."""
        return self.wall_ms - self.comm_ms

    def select_steps(self, keep: np.ndarray) -> RunArrays:
        """The steps where `keep` (S,) is True, over the ranks that recorded any of them; the replayed rows of
        the segments those steps belong to."""
        keep = np.asarray(keep, dtype=bool)
        recorded = np.isfinite(self.wall_ms[keep]).any(axis=0)
        segments = np.unique(self.segment[keep][np.isfinite(self.segment[keep])])
        ranks = self.ranks[recorded]
        out: dict[str, np.ndarray] = {"ranks": ranks}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "replayed":
                out[f.name] = value[
                    np.isin(value[:, COL["segment"]], segments) & np.isin(value[:, COL["rank"]], ranks)
                ]
            elif f.name != "ranks":
                out[f.name] = value[keep][:, recorded] if value.ndim > 1 else value[keep]
        return RunArrays(**out)

    @classmethod
    def from_rows(cls, rows: np.ndarray, warmup: int = 5) -> RunArrays:
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, NCOLS)
        valid = np.isfinite(rows[:, COL["step"]]) & np.isfinite(rows[:, COL["rank"]])
        if not valid.all():
            rows = rows[valid]
        grid = _rank_grid(rows)
        if grid is not None:  # whole ranks in order, as a gather delivers them: transpose, nothing to sort
            steps, ranks = grid[0, :, COL["step"]].astype(np.int64), grid[:, 0, COL["rank"]].astype(np.int64)
            replayed = rows[:0]

            def column(name: str) -> np.ndarray:
                return np.ascontiguousarray(grid[:, :, COL[name]].T)

            phases = np.ascontiguousarray(grid[:, :, _PHASE_SLICE].transpose(1, 0, 2))
        else:
            rows, replayed = _latest_per_rank_step(rows)
            steps, step_index = _dense_index(rows[:, COL["step"]].astype(np.int64))
            ranks, rank_index = _dense_index(rows[:, COL["rank"]].astype(np.int64))
            # One flat (step, rank) cell index, then one scatter per column: no (S, R, 17) temporary.
            cell = step_index * ranks.size + rank_index
            shape = (steps.size, ranks.size)
            # Cells are unique (one row per rank and step); when every cell has one, no NaN fill is needed.
            complete = cell.size == steps.size * ranks.size

            def empty(*size: int) -> np.ndarray:
                return np.empty(size) if complete else np.full(size, np.nan)

            def column(name: str) -> np.ndarray:
                out = empty(steps.size * ranks.size)
                out[cell] = rows[:, COL[name]]
                return out.reshape(shape)

            flat = empty(steps.size * ranks.size, len(PHASE_COLS))
            flat[cell] = rows[:, list(PHASE_COLS)]
            phases = flat.reshape(*shape, len(PHASE_COLS))
        wall, excluded = column("wall_ms"), column("excluded_ms")
        discount_peer_pauses(phases, wall, excluded)
        segment = column("segment")
        return cls(
            steps=steps,
            ranks=ranks,
            phases=phases,
            wall_ms=wall,
            start_s=column("start_s"),
            excluded_ms=excluded,
            loss=column("loss"),
            samples=column("samples"),
            mem_bytes=column("mem_bytes"),
            grad_syncs=column("grad_syncs"),
            micro_batches=column("micro_batches"),
            batch_fp=column("batch_fp"),
            optimizer_steps=column("optimizer_steps"),
            loop_comm_ms=column("loop_comm_ms"),
            segment=segment,
            counted=_past_warmup(steps, segment, warmup),
            replayed=replayed,
        )

    @classmethod
    def from_arrays(
        cls,
        phases: np.ndarray,
        *,
        loss: np.ndarray | None = None,
        samples: np.ndarray | None = None,
        mem_bytes: np.ndarray | None = None,
        first_step: int = 1,
        warmup: int = 0,
        **extra: Any,
    ) -> RunArrays:
        """Build from synthetic arrays (tests, simulations): `phases` is (steps, ranks, 6) in ms.

        Wall time is the sum of the phases; `loss`, `samples`, `mem_bytes` are (steps,) or (steps, ranks).
        float32 input stays float32 (large simulations); the arrays returned may be read-only views.
        """
        phases = np.asarray(phases)
        if phases.dtype not in (np.float32, np.float64):
            phases = phases.astype(np.float64)
        dtype = phases.dtype
        s, r, _ = phases.shape

        def per_rank(a: np.ndarray | None, fill: float) -> np.ndarray:
            # Constant fills are read-only broadcast views: no memory for 1,024 ranks x 10,000 steps.
            if a is None:
                return np.broadcast_to(np.asarray(fill, dtype=dtype), (s, r))
            a = np.asarray(a, dtype=dtype)
            return np.broadcast_to(a[:, None], (s, r)) if a.ndim == 1 else a

        wall = phases.sum(axis=2)
        steps = np.arange(first_step, first_step + s, dtype=np.int64)
        start = np.cumsum(np.nanmax(wall, axis=1), dtype=np.float64) / 1e3
        fields: dict[str, Any] = dict(
            steps=steps,
            ranks=np.arange(r, dtype=np.int64),
            phases=phases,
            wall_ms=wall,
            start_s=np.broadcast_to(start[:, None], (s, r)),
            excluded_ms=per_rank(None, 0.0),
            loss=per_rank(loss, np.nan),
            samples=per_rank(samples, np.nan),
            mem_bytes=per_rank(mem_bytes, np.nan),
            grad_syncs=per_rank(None, 1.0),
            micro_batches=per_rank(None, 1.0),
            batch_fp=per_rank(None, np.nan),
            optimizer_steps=per_rank(None, 1.0),
            loop_comm_ms=per_rank(None, 0.0),
            segment=per_rank(None, 0.0),
            counted=np.arange(s) >= warmup,
        )
        fields.update(extra)
        return cls(**fields)


_PHASE_SLICE = slice(PHASE_COLS[0], PHASE_COLS[-1] + 1)
assert PHASE_COLS == tuple(range(_PHASE_SLICE.start, _PHASE_SLICE.stop)), "phase columns are adjacent"


def _rank_grid(rows: np.ndarray) -> np.ndarray | None:
    """`rows` as a (ranks, steps, columns) view when they are whole ranks one after another, ranks increasing,
    every rank with the same increasing steps (what a gather delivers); else None. Such rows need no
    deduplication and no scatter: O(n) checks on two columns decide."""
    n = rows.shape[0]
    if n == 0:
        return None
    rank = rows[:, COL["rank"]]
    per_rank = int(np.argmax(rank != rank[0])) or n
    if n % per_rank:
        return None
    grid = rows.reshape(n // per_rank, per_rank, NCOLS)
    r, s = grid[:, :, COL["rank"]], grid[:, :, COL["step"]]
    if not ((r == r[:, :1]).all() and (s == s[:1]).all()):
        return None
    if not ((np.diff(r[:, 0]) > 0).all() and (np.diff(s[0]) > 0).all()):
        return None
    return grid


def _dense_index(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, each value's position among them); O(n) for compact integer ranges."""
    if values.size == 0:
        return values, values
    low = int(values.min())
    span = int(values.max()) - low + 1
    if span > 4 * values.size + 1_000_000:
        distinct, index = np.unique(values, return_inverse=True)
        return distinct, index.reshape(-1)
    present = np.zeros(span, dtype=bool)
    present[values - low] = True
    position = np.cumsum(present) - 1
    return np.flatnonzero(present) + low, position[values - low]


_COMM = PHASE_COLS.index(COL["comm_ms"])


def discount_peer_pauses(phases: np.ndarray, wall: np.ndarray, excluded: np.ndarray) -> None:
    """Time a rank spent waiting in the all-reduce for a peer that was paused (evaluation or a checkpoint on
    rank 0 only) is no more a training phase than the pause itself: move it from `comm` to excluded, in
    place. The wait falls in the pausing rank's step or the next one, so a rank may discount up to the
    largest pause another rank took in those two steps, less the time it was paused itself in them: ranks
    that pause together wait for no one, and a rank's own pause never made it wait."""
    with np.errstate(invalid="ignore"):
        paused = np.nan_to_num(excluded, nan=0.0)
    if paused.ndim != 2 or paused.shape[1] < 2 or not (paused > 0).any():
        return
    largest, own = paused.copy(), paused.copy()  # each rank's largest pause, and its time paused, in the
    largest[1:] = np.maximum(paused[1:], paused[:-1])  # step and the one before
    own[1:] += paused[:-1]
    ranked = np.sort(largest, axis=1)  # another rank's largest: the largest, or, for the rank that took
    others = np.where(largest >= ranked[:, -1:], ranked[:, -2:-1], ranked[:, -1:])  # it, the next one
    comm = phases[:, :, _COMM]
    with np.errstate(invalid="ignore"):
        shift = np.clip(np.minimum(comm, others - own), 0.0, None)
    shift = np.nan_to_num(shift, nan=0.0)
    phases[:, :, _COMM] -= shift
    wall -= shift
    excluded += shift


def _latest_per_rank_step(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep, for each step, the rows of the latest segment that recorded it, one per rank; return (kept,
    superseded). A resume replays the steps done after the checkpoint: every earlier record of such a step is
    superseded, a rank's that the resumed job no longer has included. A record written twice in one segment (a
    rank's own file and a gather, a file appended twice) is one record, not a replay."""
    if rows.shape[0] == 0:
        return rows, rows
    rank = rows[:, COL["rank"]].astype(np.int64)
    step = rows[:, COL["step"]].astype(np.int64)
    key = (rank - rank.min()) * (int(step.max() - step.min()) + 1) + (step - step.min())
    _, index = _dense_index(key)
    if index.size == 0 or int(index.max()) + 1 == key.size:  # the usual case: nothing was replayed
        return rows, rows[:0]
    order = np.lexsort((rows[:, COL["segment"]], step))  # by step, then segment
    rows, step = rows[order], step[order]
    segment = rows[:, COL["segment"]]
    ends = np.flatnonzero(np.r_[step[1:] != step[:-1], True])  # each step's last row: its latest segment
    latest = np.repeat(segment[ends], np.diff(np.r_[-1, ends]))
    current = segment == latest
    kept, superseded = rows[current], rows[~current]
    key = key[order][current]  # one row per (rank, step) of the latest segment: the last one written
    once = np.ones(key.size, dtype=bool)
    by_key = np.argsort(key, kind="stable")
    once[by_key[:-1]] = key[by_key[1:]] != key[by_key[:-1]]
    return kept[once], superseded


def step_segments(segment: np.ndarray) -> np.ndarray:
    """(S,) the segment of each step from the (S, R) segment of every record, NaN where no rank recorded it
    (one pass over the grid, no warning)."""
    return np.fmax.reduce(segment, axis=1) if segment.shape[1] else np.full(segment.shape[0], np.nan)


def _past_warmup(steps: np.ndarray, segment: np.ndarray, warmup: int) -> np.ndarray:
    """True for steps that are not among the first `warmup` steps of their segment."""
    if steps.size == 0 or warmup <= 0:
        return np.ones(steps.size, dtype=bool)
    seg = step_segments(segment)
    seg[np.isnan(seg)] = -1
    counted = np.ones(steps.size, dtype=bool)
    for value in np.unique(seg):
        idx = np.flatnonzero(seg == value)
        counted[idx[:warmup]] = False
    return counted
