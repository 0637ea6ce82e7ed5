"""Recorded runs for tests: synthetic per-step arrays written through `RunWriter`, read back with `load_run`.

Writing real run directories (instead of building `RunArrays` in memory) exercises the same reader the
commands use, without spawning a training job.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pytscope_core.findings import Finding
from pytscope_core.records import COL, NCOLS, PHASES
from pytscope_core.rundir import RunWriter

T0 = 1_700_000_000.0  # an arbitrary epoch second for the first loop top


def phases_of(steps: int, ranks: int, ms: dict[str, float], seed: int = 0, noise: float = 0.0) -> np.ndarray:
    """(steps, ranks, 6) phase times: `ms` per phase name (missing ones 0), with optional relative noise."""
    base = np.array([ms.get(p, 0.0) for p in PHASES])
    out = np.broadcast_to(base, (steps, ranks, len(PHASES))).copy()
    if noise:
        out *= 1 + noise * np.random.default_rng(seed).standard_normal(out.shape).clip(-3, 3)
    return out


def write_run(
    path: Path,
    phases: np.ndarray,
    *,
    loss: np.ndarray | None = None,
    samples: float | np.ndarray | None = None,
    segment: np.ndarray | None = None,
    warmup: int = 0,
    findings: tuple[Finding, ...] = (),
    t0: float = T0,
    meta: dict | None = None,
) -> Path:
    """Write `phases` (S, R, 6 ms) as a run: steps back to back from `t0`, every rank starting together.

    `loss` is (S,) or (S, R); `samples` a per-rank batch size (scalar or (S, R)); `segment` (S,) restarts.
    `findings` are stored as integration findings, so every command sees them; `meta` adds to meta.json.
    """
    s, r, _ = phases.shape
    wall = phases.sum(axis=2)
    step_wall = wall.max(axis=1)  # under DDP the next step starts when the slowest rank is done
    starts = t0 + np.concatenate(([0.0], np.cumsum(step_wall)[:-1])) / 1e3
    rows = np.full((s, r, NCOLS), np.nan)
    rows[:, :, COL["rank"]] = np.arange(r)[None, :]
    rows[:, :, COL["segment"]] = (segment if segment is not None else np.zeros(s))[:, None]
    rows[:, :, COL["step"]] = np.arange(1, s + 1)[:, None]
    rows[:, :, COL["start_s"]] = starts[:, None]
    rows[:, :, COL["wall_ms"]] = wall
    for i, p in enumerate(PHASES):
        rows[:, :, COL[f"{p}_ms"]] = phases[:, :, i]
    rows[:, :, COL["excluded_ms"]] = 0.0
    if loss is not None:
        rows[:, :, COL["loss"]] = loss[:, None] if loss.ndim == 1 else loss
    if samples is not None:
        rows[:, :, COL["samples"]] = samples
    rows[:, :, COL["grad_syncs"]] = 1.0
    rows[:, :, COL["micro_batches"]] = 1.0
    writer = RunWriter(
        path, {"world_size": r, "warmup": warmup, "interval": 50, "device": "cpu", **(meta or {})}
    )
    writer.append_rows(rows.reshape(-1, NCOLS))
    for f in findings:
        writer.event("finding", step=s, source="integration", finding=f.to_dict())
    writer.close()
    return path


def write_launches(
    path: Path, launches: list[tuple[float, ...]], batch: float = 16.0, warmup: int = 0
) -> Path:
    """A job launched several times on different numbers of ranks: `launches` is (ranks, steps, step ms) per
    launch, each resuming where the last one ended, or (ranks, steps, step ms, first step) for one resumed
    from an earlier checkpoint (it replays the steps after it); every launch writes its segment and its
    ranks' hosts."""
    writer = RunWriter(
        path, {"world_size": launches[0][0], "warmup": warmup, "interval": 50, "device": "cpu"}
    )
    first, t0 = 1, T0
    for index, (ranks_, steps_, step_ms, *resumed) in enumerate(launches):
        ranks, steps = int(ranks_), int(steps_)
        first = int(resumed[0]) if resumed else first
        writer.event("segment", index=index, started_s=t0, resumed_from_step=first - 1, world_size=ranks)
        writer.event("meta", fields={"hosts": [f"h{index}"] * ranks, "local_ranks": list(range(ranks))})
        rows = np.zeros((steps, ranks, NCOLS))
        rows[:, :, COL["rank"]] = np.arange(ranks)[None, :]
        rows[:, :, COL["segment"]] = index
        rows[:, :, COL["step"]] = np.arange(first, first + steps)[:, None]
        rows[:, :, COL["start_s"]] = (t0 + np.arange(steps) * step_ms / 1e3)[:, None]
        rows[:, :, COL["wall_ms"]] = step_ms
        rows[:, :, COL["forward_ms"]] = rows[:, :, COL["backward_ms"]] = step_ms / 2
        rows[:, :, COL["samples"]] = batch
        rows[:, :, COL["loss"]] = 1.0
        rows[:, :, COL["grad_syncs"]] = rows[:, :, COL["micro_batches"]] = 1.0
        writer.append_rows(rows.reshape(-1, NCOLS))
        first, t0 = first + steps, t0 + steps * step_ms / 1e3 + 5.0
    writer.close()
    return path
