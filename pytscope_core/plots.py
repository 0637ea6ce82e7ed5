"""PNG plots for `pytscope report --plots DIR`: what a person would rather look at than read.

Three figures: each rank's local work over steps (a straggler is the line above the others), the phase
breakdown over time as stacked shares per block of steps, and the loss with spikes and non-finite steps
marked. Long runs are reduced to block medians (at most `MAX_POINTS` points a line) and many ranks to the
median with a min-max band plus the stragglers and slowest ranks, so the files stay readable at any size.
matplotlib is imported inside the functions and drawn with the Agg canvas directly (no pyplot), so no global
backend is switched in the caller's process.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .analysis.convergence import loss_per_step
from .analysis.timing import phase_ms_per_step
from .records import PHASES
from .summary import Summary, summarize

if TYPE_CHECKING:
    from .rundir import Run

MAX_POINTS = 500
"""Points per line: more than a figure's pixel width only adds file size."""
MAX_RANK_LINES = 16
"""Above this many ranks, individual lines are drawn only for stragglers and the slowest ranks."""
PHASE_BLOCKS = 100
"""Blocks of steps in the phase breakdown: enough to see a change, few enough to read."""


def _figure(size: tuple[float, float] = (10, 4)) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def block_reduce(steps: np.ndarray, values: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """(block centre steps, per-block nan-median of `values` along axis 0); unchanged when already short."""
    n = steps.size
    if n <= max_points:
        return steps.astype(float), values
    edges = np.linspace(0, n, max_points + 1).round().astype(np.int64)
    centres = np.array([steps[a:b].mean() for a, b in zip(edges[:-1], edges[1:], strict=True)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN block stays NaN
        reduced = np.stack(
            [np.nanmedian(values[a:b], axis=0) for a, b in zip(edges[:-1], edges[1:], strict=True)]
        )
    return centres, reduced


def plot_local_work(run: Run, summary: Summary, path: Path) -> Path:
    a = run.arrays
    fig, ax = _figure()
    x, local = block_reduce(a.steps, np.asarray(a.local_ms, dtype=np.float64), MAX_POINTS)
    stragglers = set(summary.distributed.effective.stragglers)
    if a.world_size <= MAX_RANK_LINES:
        shown = list(range(a.world_size))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ax.fill_between(x, np.nanmin(local, axis=1), np.nanmax(local, axis=1), color="grey", alpha=0.3,
                            label="all ranks (min-max)")  # fmt: skip
            ax.plot(x, np.nanmedian(local, axis=1), color="black", lw=1, label="median rank")
        by_local = sorted(
            summary.distributed.per_rank, key=lambda r: -r.local_ms if math.isfinite(r.local_ms) else 0
        )
        picked = {r.rank for r in by_local[:3]} | stragglers
        shown = [j for j, r in enumerate(a.ranks) if int(r) in picked]
    for j in shown:
        rank = int(a.ranks[j])
        slow = rank in stragglers
        ax.plot(x, local[:, j], lw=2.0 if slow else 0.8, color="tab:red" if slow else None,
                label=f"rank {rank}" + (" (straggler)" if slow else ""), zorder=3 if slow else 2)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("local work per step (ms)")
    ax.set_title(
        "Per-rank local work (wall - exposed communication)"
        + (" — block medians" if a.n_steps > MAX_POINTS else "")
    )
    if a.n_steps:
        ax.legend(loc="upper right", fontsize="small", ncol=2)
    else:
        ax.text(0.5, 0.5, "no steps recorded", ha="center", transform=ax.transAxes)
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_phases(run: Run, path: Path) -> Path:
    a = run.arrays
    fig, ax = _figure()
    per_step = phase_ms_per_step(a)
    n = a.n_steps
    if n:
        blocks = min(PHASE_BLOCKS, n)
        edges = np.linspace(0, n, blocks + 1).round().astype(np.int64)
        totals = np.stack(
            [np.nansum(per_step[p:q], axis=0) for p, q in zip(edges[:-1], edges[1:], strict=True)]
        )
        wall = totals.sum(axis=1, keepdims=True)
        shares = np.divide(totals, wall, out=np.zeros_like(totals), where=wall > 0)
        x = np.array([a.steps[p:q].mean() for p, q in zip(edges[:-1], edges[1:], strict=True)])
        ax.stackplot(x, 100 * shares.T, labels=list(PHASES), alpha=0.85)
        ax.set_ylim(0, 100)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        ax.text(0.5, 0.5, "no steps recorded", ha="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("share of step wall (%)")
    ax.set_title("Phase breakdown over time (blocks of steps)")
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_loss(run: Run, summary: Summary, path: Path) -> Path:
    a = run.arrays
    fig, ax = _figure()
    loss = loss_per_step(a)
    finite = np.isfinite(loss)
    if finite.any():
        x, y = block_reduce(a.steps[finite], loss[finite], MAX_POINTS * 4)
        ax.plot(x, y, lw=0.8, label="loss (rank mean)")
    c = summary.convergence
    if c.spikes:
        ax.scatter([s.step for s in c.spikes], [s.loss for s in c.spikes], color="tab:red", marker="^", zorder=3,
                   label=f"spikes ({len(c.spikes)})")  # fmt: skip
    raw = np.asarray(a.loss)
    bad_steps = a.steps[np.isinf(raw).any(axis=1)] if raw.size else a.steps[:0]
    if c.nonfinite_step is not None:
        bad_steps = np.union1d(bad_steps, [c.nonfinite_step])
    for k, step in enumerate(bad_steps[:50]):  # the first few show where it broke; more only hides the curve
        ax.axvline(step, color="black", ls=":", lw=1, label="non-finite loss" if k == 0 else None)
    if not finite.any() and not bad_steps.size:
        ax.text(0.5, 0.5, "no loss logged", ha="center", transform=ax.transAxes)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss, with spikes and non-finite steps marked")
    fig.savefig(path, format="png", dpi=100)
    return path


def write_report_plots(
    run: Run, out_dir: str | os.PathLike[str], summary: Summary | None = None
) -> list[Path]:
    """Write local_work.png, phases.png and loss.png into `out_dir` and return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if summary is None:
        summary = summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings))
    return [
        plot_local_work(run, summary, out / "local_work.png"),
        plot_phases(run, out / "phases.png"),
        plot_loss(run, summary, out / "loss.png"),
    ]
