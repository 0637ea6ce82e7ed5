"""Scaling analysis over runs of one job at 1, 2, 4 ... workers: throughput, speedup, efficiency, cost to target.

Throughput T is counted work over counted wall time: samples per second when every run records its batch
size (the samples column), else optimizer steps per second, the same unit for every point. Speedup is
T_W / T_1 and efficiency T_W / (W x T_1); without a 1-worker run the smallest run is the base and both are
relative to it (speedup T_W / T_base, efficiency T_W / ((W / W_base) x T_base)), and the result says so.
Throughput alone hides the quality side: with `target_loss`, each point also says how long the run took to
get there (the sum of step walls up to the first step whose rank-mean loss is at or below the target, so
validation pauses and restart downtime do not count) and what that cost in worker-seconds. Those numbers
only compare like with like when every run trains with the same global batch (per-rank samples x W), so a
difference there is a warning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .analysis.convergence import loss_per_step
from .analysis.timing import launch_sequence, launch_sizes, statistics_steps, step_wall_ms
from .arrays import step_segments
from .summary import Summary, _plain, summarize

if TYPE_CHECKING:
    from rich.console import RenderableType

    from .rundir import Run

BATCH_MISMATCH_TOLERANCE = 0.01
"""Global batches within 1% are the same contract (a last partial batch moves the median by less)."""


@dataclass(frozen=True)
class ScalingPoint:
    run: str
    world_size: int
    steps_counted: int
    median_step_ms: float
    global_batch: float | None  # median per-rank samples per step x W; None when not recorded
    throughput: float  # in Scaling.unit
    speedup: float
    efficiency: float
    phase_shares: dict[str, float]  # share of step wall per phase (counted steps)
    comm_share: float  # exposed communication (transfer + sync wait)
    transfer_share: float
    sync_wait_share: float  # waiting for slower peers inside the all-reduce
    data_share: float
    seconds_to_target: float | None = None
    worker_seconds_to_target: float | None = None
    step_at_target: int | None = None
    segments: tuple[int, ...] = ()  # the segments this point covers, when its run ran on several sizes

    @property
    def label(self) -> str:
        run = Path(self.run).name or self.run
        if not self.segments:
            return run
        return f"{run} (segment{'s' if len(self.segments) > 1 else ''} {', '.join(map(str, self.segments))})"


@dataclass(frozen=True)
class Scaling:
    points: tuple[ScalingPoint, ...]
    unit: str  # "samples/s" or "steps/s"
    base_world_size: int
    base_is_single_worker: bool
    target_loss: float | None
    warnings: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        points = []
        for p in self.points:
            d: dict[str, Any] = {
                "run": p.run,
                "segments": list(p.segments) or None,
                "world_size": p.world_size,
                "steps_counted": p.steps_counted,
                "median_step_ms": p.median_step_ms,
                "global_batch": p.global_batch,
                "throughput": p.throughput,
                "speedup": p.speedup,
                "efficiency": p.efficiency,
                "phases": dict(p.phase_shares),
                "comm_share": p.comm_share,
                "transfer_share": p.transfer_share,
                "sync_wait_share": p.sync_wait_share,
                "data_share": p.data_share,
            }
            if self.target_loss is not None:
                d["seconds_to_target"] = p.seconds_to_target
                d["worker_seconds_to_target"] = p.worker_seconds_to_target
                d["step_at_target"] = p.step_at_target
            points.append(d)
        out = {
            "unit": self.unit,
            "base_world_size": self.base_world_size,
            "base_is_single_worker": self.base_is_single_worker,
            "target_loss": self.target_loss,
            "points": points,
            "warnings": list(self.warnings),
        }
        return dict(_plain(out))


@dataclass(frozen=True)
class CountedWork:
    """A run's work over its counted steps that every rank of their launch recorded (`incomplete_steps`)."""

    seconds: float
    steps: float
    samples: float
    """NaN where some rank did not record its batch size."""
    per_rank_samples: float | None
    """Median samples per rank and step; None where not known."""
    incomplete: int
    """Counted steps left out because some rank's records are missing (a rank killed or ended early)."""


def counted_work(run: Run) -> CountedWork:
    a = run.arrays
    sel = statistics_steps(a)
    wall = step_wall_ms(a)[sel]
    incomplete = incomplete_steps(run)[sel]
    ok = np.isfinite(wall) & ~incomplete
    seconds = float(wall[ok].sum()) / 1e3
    samples = np.asarray(a.samples)[sel][ok]
    recorded = np.isfinite(np.asarray(a.wall_ms)[sel][ok])
    # Samples are "known" only when every rank that recorded a step also recorded its batch size.
    known = samples.size > 0 and bool(np.all(np.isfinite(samples[recorded])))
    total = float(np.nansum(samples)) if known else math.nan
    per_rank = float(np.nanmedian(samples[recorded])) if known else None
    return CountedWork(seconds, float(ok.sum()), total, per_rank, int(incomplete.sum()))


def incomplete_steps(run: Run) -> np.ndarray:
    """(S,) bool: steps that fewer ranks recorded than their launch had (its world size, or the most ranks
    that recorded one of its steps): a rank killed, or ended without the others, whose records since its last
    gather are lost. Their samples, summed over the ranks that are there, would read as that much less
    throughput. A rank out of batches inside a join trained none in the steps it has no record of: it is not
    counted as missing."""
    a, ctx = run.arrays, run.context
    joined = np.isin(a.ranks, [rank for rank, _ in ctx.joins])
    ranks = np.isfinite(a.wall_ms[:, ~joined]).sum(axis=1)
    launched = {seg.index: seg.world_size for seg in ctx.segments}
    segment = step_segments(a.segment)
    out = np.zeros(a.n_steps, dtype=bool)
    for seg in np.unique(segment[np.isfinite(segment)]):
        mine = segment == seg
        world = launched.get(int(seg), 0) - int(joined.sum())
        out[mine] = ranks[mine] < max(world, int(ranks[mine].max()))
    return out


def time_to_target(run: Run, target_loss: float) -> tuple[float | None, int | None]:
    """Sum of step walls (rank mean, warm-up included) through the first step with loss <= target, and that step.
    Time outside the steps (validation, checkpoints, the scope's own start and gathers) is not training: left out."""
    a = run.arrays
    loss = loss_per_step(a)
    with np.errstate(invalid="ignore"):
        hit = np.flatnonzero(loss <= target_loss)
    if hit.size == 0:
        return None, None
    i = int(hit[0])
    wall = step_wall_ms(a)[: i + 1]
    return float(np.nansum(wall)) / 1e3, int(a.steps[i])


def by_world_size(run: Run) -> list[Run]:
    """`run` as one run per number of ranks it ran on: a job resumed on other numbers of ranks (an elastic
    restart) is a measurement at each size, and mixing them would credit one size with the other's speed."""
    sizes = {s.index: s.world_size for s in run.context.segments}
    if len(set(sizes.values())) < 2:
        return [run]
    step_world = launch_sizes(run.arrays.segment, sizes)
    pieces = []
    for w in sorted(set(step_world[step_world > 0].tolist())):
        context = replace(
            run.context, world_size=w, segments=tuple(s for s in run.context.segments if s.world_size == w)
        )
        pieces.append(replace(run, arrays=run.arrays.select_steps(step_world == w), context=context))
    return pieces


def _launches(run: Run) -> tuple[int, ...]:
    return launch_sequence([s.world_size for s in run.context.segments])


class NothingToScale(ValueError):
    """No run given has a counted step."""


def scaling_points(runs: Sequence[Run], target_loss: float | None = None, weak: bool = False) -> Scaling:
    """One point per run and number of ranks it ran on (`by_world_size`), sorted by world size; `weak` states
    that the per-rank batch is held on purpose."""
    if not runs:
        raise ValueError("scaling needs at least one run")
    split = [(run, by_world_size(run)) for run in runs]
    # Each point with the segments it takes from its run (empty for a whole run); a point without counted
    # steps (a run killed before its first gather) has no throughput: left out, said, and no base.
    pieced = [
        (p, tuple(s.index for s in p.context.segments) if len(ps) > 1 else ()) for _, ps in split for p in ps
    ]
    # Steps past the warm-up with a wall time give a throughput (warm-up steps alone would give a false one).
    counted = [counted_work(p) if np.asarray(p.arrays.counted, dtype=bool).any() else None for p, _ in pieced]
    empty = [piece for piece, c in zip(pieced, counted, strict=True) if c is None or c.steps == 0]
    kept = [(piece, c) for piece, c in zip(pieced, counted, strict=True) if c is not None and c.steps > 0]
    if not kept:
        raise NothingToScale("no run has counted steps")
    runs, parts = [p for (p, _), _ in kept], [part for (_, part), _ in kept]
    summaries: list[Summary] = [
        summarize(r.arrays, r.context, extra_findings=tuple(r.extra_findings)) for r in runs
    ]
    order = sorted(range(len(runs)), key=lambda i: (summaries[i].run.world_size, str(runs[i].path)))
    work = [kept[i][1] for i in order]
    use_samples = all(math.isfinite(w.samples) for w in work)
    unit = "samples/s" if use_samples else "steps/s"
    throughputs = [
        (w.samples if use_samples else w.steps) / w.seconds if w.seconds > 0 else math.nan for w in work
    ]
    worlds = [max(summaries[i].run.world_size, 1) for i in order]
    base_w, base_t = worlds[0], throughputs[0]
    notes: list[str] = [
        f"{run.path} ran on {' and then '.join(map(str, _launches(run)))} ranks: a point for each number of ranks"
        for run, pieces in split
        if len(pieces) > 1
    ]
    notes.extend(
        f"{p.path} has no counted steps "
        + (
            "that every rank recorded (a rank killed, or ended early, before its records were gathered): left out"
            if np.asarray(p.arrays.counted, dtype=bool).any()
            else "(no step records, or warm-up only): left out"
        )
        for p, _ in empty
    )
    notes.extend(
        f"{runs[i].path}: {n} counted step(s) with some ranks' records missing (a rank killed or ended early) "
        "left out of its throughput"
        for i, w in zip(order, work, strict=True)
        if (n := w.incomplete)
    )
    if base_w != 1:
        notes.append(
            f"no 1-worker run: speedup and efficiency are relative to the {base_w}-worker run "
            f"(efficiency = T_W / ((W / {base_w}) x T_{base_w}))"
        )
    if len(set(worlds)) < len(worlds):
        notes.append("several runs share a worker count; the first one (by path) is the base for its count")
    if not use_samples:
        missing = [
            str(runs[i].path) for i, w in zip(order, work, strict=True) if not math.isfinite(w.samples)
        ]
        notes.append(
            f"batch size not recorded in {', '.join(missing)}: throughput is in steps/s, which assumes every "
            "run does the same work per step; the global-batch contract cannot be checked"
        )
    else:
        notes.extend(_batch_contract(worlds, [w.per_rank_samples for w in work], weak))

    points = []
    for k, i in enumerate(order):
        s, w = summaries[i], worlds[k]
        speedup = throughputs[k] / base_t if base_t > 0 else math.nan
        efficiency = speedup / (w / base_w)
        shares = {p.name: p.share for p in s.timing.phases}
        if not s.run.comm_measured:
            shares["comm"] = math.nan
        seconds, step = time_to_target(runs[i], target_loss) if target_loss is not None else (None, None)
        per_rank = work[k].per_rank_samples
        points.append(
            ScalingPoint(
                run=str(runs[i].path),
                segments=parts[i],
                world_size=w,
                steps_counted=s.timing.steps_counted,
                median_step_ms=s.timing.median_ms,
                global_batch=per_rank * w if per_rank is not None else None,
                throughput=throughputs[k],
                speedup=speedup,
                efficiency=efficiency,
                phase_shares=shares,
                comm_share=shares.get("comm", math.nan),
                transfer_share=s.distributed.transfer_share,
                sync_wait_share=s.distributed.sync_wait_share,
                data_share=shares.get("data", math.nan),
                seconds_to_target=seconds,
                worker_seconds_to_target=seconds * w if seconds is not None else None,
                step_at_target=step,
            )
        )
    blind = [
        (str(runs[i].path), summaries[i].run.comm_note) for i in order if not summaries[i].run.comm_measured
    ]
    notes.extend(f"{path}: {note} (its comm and wait: n/a)" for path, note in blind)
    if target_loss is not None:
        never = [p.run for p in points if p.seconds_to_target is None]
        if never:
            notes.append(f"never reached loss {target_loss:g}: {', '.join(never)}")
    return Scaling(tuple(points), unit, base_w, base_w == 1, target_loss, tuple(notes))


def _batch_contract(worlds: list[int], per_rank: list[float | None], weak: bool) -> list[str]:
    sizes = [
        (b if weak else b * w) if b is not None else math.nan for w, b in zip(worlds, per_rank, strict=True)
    ]
    finite = [x for x in sizes if math.isfinite(x)]
    if len(finite) < 2 or (max(finite) - min(finite)) <= BATCH_MISMATCH_TOLERANCE * max(finite):
        return []
    listed = ", ".join(f"{w} worker{'s' if w > 1 else ''}: {x:g}" for w, x in zip(worlds, sizes, strict=True))
    if weak:
        return [f"per-rank batch differs between runs ({listed}); weak scaling needs the same per-rank batch"]
    return [
        f"runs do not share a global batch ({listed}): samples/s compares, but loss per step and time to a "
        "target loss do not unless the learning rate and schedule were adjusted (pass --weak if the per-rank "
        "batch is held on purpose)"
    ]


def _fmt(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return f"{x:{fmt}}{unit}" if x is not None and math.isfinite(x) else "n/a"


def render_scaling(s: Scaling) -> RenderableType:
    """The scaling table, where the step's time goes per worker count (a table of its own: together they are
    too wide for an 80-column terminal), and the warnings."""
    from rich.console import Group
    from rich.text import Text

    scaling: list[tuple[str, list[str]]] = [
        ("workers", [str(p.world_size) for p in s.points]),
        (s.unit, [_fmt(p.throughput, ".1f") for p in s.points]),
        ("speedup", [_fmt(p.speedup, ".2f", "x") for p in s.points]),
        ("efficiency", [_fmt(100 * p.efficiency, ".0f", "%") for p in s.points]),
        ("step ms", [_fmt(p.median_step_ms) for p in s.points]),
    ]
    if s.target_loss is not None:
        scaling.append(("to target s", [_fmt(p.seconds_to_target, ".1f") for p in s.points]))
        scaling.append(("worker-s", [_fmt(p.worker_seconds_to_target, ".1f") for p in s.points]))
    compute = [
        p.phase_shares.get("forward", math.nan) + p.phase_shares.get("backward", math.nan) for p in s.points
    ]
    shares = [
        ("workers", [str(p.world_size) for p in s.points]),
        ("compute", [_fmt(100 * c, ".1f", "%") for c in compute]),
        ("comm", [_fmt(100 * p.comm_share, ".1f", "%") for p in s.points]),
        ("wait", [_fmt(100 * p.sync_wait_share, ".1f", "%") for p in s.points]),
        ("data", [_fmt(100 * p.data_share, ".1f", "%") for p in s.points]),
    ]
    labels = [p.label for p in s.points]
    base = (
        "the 1-worker run"
        if s.base_is_single_worker
        else f"the {s.base_world_size}-worker run (no 1-worker run)"
    )
    parts: list[RenderableType] = [
        Text("Scaling", style="bold underline"),
        _table(scaling, labels),
        Text(
            f"throughput in {s.unit}; speedup = T_W / T_base, efficiency = T_W / ((W / W_base) x T_base), base: "
            f"{base}",
            style="dim",
        ),
    ]
    if s.target_loss is not None:
        parts.append(
            Text(
                f"target loss {s.target_loss:g}: seconds are the sum of step walls up to the first step at or "
                "below it; worker-s = seconds x workers",
                style="dim",
            )
        )
    parts += [
        Text(""),
        Text("Where the step goes", style="bold underline"),
        _table(shares, labels),
        Text(
            "shares of step wall: compute (forward + backward), comm (exposed), wait (sync wait inside comm), data",
            style="dim",
        ),
    ]
    parts.extend(Text(f"warning: {w}", style="yellow") for w in s.warnings)
    return Group(*parts)


def _table(columns: list[tuple[str, list[str]]], labels: list[str]) -> Any:
    """Right-aligned number columns, then the runs' names. Numbers never shrink below their width (an
    ellipsis would hide them); a run's name may wrap, and is not markup."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, padding=(0, 0, 0, 2))  # (two spaces: headers have several words)
    for name, cells in columns:
        table.add_column(name, justify="right", min_width=max((len(c) for c in cells), default=1))
    table.add_column("run", justify="left")
    for i, label in enumerate(labels):
        table.add_row(*(cells[i] for _, cells in columns), Text(label))
    return table


def write_scaling_plot(s: Scaling, path: str | Path) -> Path:
    """PNG: throughput and efficiency against workers, each with the ideal (linear) line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    workers = np.array([p.world_size for p in s.points], dtype=float)
    throughput = np.array([p.throughput for p in s.points], dtype=float)
    efficiency = np.array([p.efficiency for p in s.points], dtype=float)
    base_t = throughput[0] if throughput.size else math.nan
    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch, safe inside a user's process
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(workers, throughput, "o-", label="measured")
    ax1.plot(workers, base_t * workers / s.base_world_size, "--", color="grey", label="ideal (linear)")
    ax1.set_xlabel("workers")
    ax1.set_ylabel(f"throughput ({s.unit})")
    ax1.set_title("Throughput")
    ax1.legend()
    ax2.plot(workers, 100 * efficiency, "o-", color="tab:orange", label="measured")
    ax2.axhline(100, linestyle="--", color="grey", label="ideal")
    ax2.set_xlabel("workers")
    ax2.set_ylabel("scaling efficiency (%)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("Efficiency")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(workers)
        ax.grid(alpha=0.3)
    fig.savefig(out, format="png", dpi=100)
    return out
