"""How fast and how lean the analysis is on big runs: synthetic arrays, and a run directory read back from disk.

Two measurements (SPEC 9 budgets):

1. **Diagnosis at scale**: a synthetic run of 1,024 ranks x 10,000 steps (float32 phases, built with
   `RunArrays.from_arrays`; one rank 10% slow, a noisy decreasing loss) is diagnosed (`diagnose`) and
   summarised (`summarize`, which analyses and diagnoses again and builds the report tree). T is the wall time
   of `summarize` (the superset; `diagnose` alone is printed too). Memory: tracemalloc's peak over the analysis
   *including the 235 MiB input arrays* (numpy reports its buffers to tracemalloc), and the process's
   ru_maxrss (lifetime peak, which also holds the interpreter, numpy and the input generation).
   Budget: < 2 s and < 1 GiB.
2. **Loading and reporting**: 100,000 steps x 8 ranks written with `RunWriter` (raw rows, as rank 0 writes
   them), then `load_run` + `summarize` + `render_summary` into a string, timed together. Budget: < 2 s.
   Also what a resumed launch's rank 0 reads of the same run once, on its ingest thread, so that its live
   diagnosis judges the whole run's loss (`live.earlier_loss_history`): time and tracemalloc's peak.

Each timing is the median of `--repeat` runs (default 3). The last line reads
`analysis: 1024 ranks x 10000 steps in T s, peak M MiB` (with the sizes actually run; `--quick` is smaller).
"""

from __future__ import annotations

import argparse
import io
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

BUDGET_S = 2.0
BUDGET_MIB = 1024.0
PHASE_MS = np.array([0.3, 3.0, 5.0, 1.5, 0.5, 0.2], dtype=np.float32)  # data, fwd, bwd, comm, opt, other
SLOW_RANK_FACTOR = 1.10


def synthetic_phases(steps: int, ranks: int, seed: int = 0) -> np.ndarray:
    """(steps, ranks, 6) float32 ms with lognormal noise, made in chunks so generation stays small."""
    rng = np.random.default_rng(seed)
    out = np.empty((steps, ranks, PHASE_MS.size), dtype=np.float32)
    chunk = max(1, 2_000_000 // (ranks * PHASE_MS.size))
    for start in range(0, steps, chunk):
        stop = min(steps, start + chunk)
        noise = rng.standard_normal((stop - start, ranks, PHASE_MS.size), dtype=np.float32)
        np.exp(noise * np.float32(0.05), out=noise)
        out[start:stop] = noise * PHASE_MS
    out[:, ranks - 1, 1:3] *= np.float32(SLOW_RANK_FACTOR)  # the last rank's forward and backward are slower
    return out


def synthetic_loss(steps: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    return (2.0 * np.exp(-t / (steps / 3)) + 0.5) * np.exp(0.05 * rng.standard_normal(steps))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def diagnose_at_scale(ranks: int, steps: int, repeat: int) -> tuple[float, float, float, int, float]:
    """(summarize s, diagnose s, tracemalloc peak MiB incl. inputs, findings, the first diagnose's s) for a
    synthetic run: the first call in the process is cold, as a `pytscope report` is."""
    from pytscope_core.analysis import diagnose
    from pytscope_core.arrays import RunArrays
    from pytscope_core.context import RunContext
    from pytscope_core.summary import summarize

    tracemalloc.start()
    arrays = RunArrays.from_arrays(synthetic_phases(steps, ranks), loss=synthetic_loss(steps), warmup=5)
    ctx = RunContext(world_size=ranks)
    t_summary, t_diag = [], []
    findings: list[Any] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        findings = diagnose(arrays, ctx)
        t_diag.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        summary = summarize(arrays, ctx)
        t_summary.append(time.perf_counter() - t0)
        del summary
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    codes = sorted({f.code for f in findings})
    straggler = [f for f in findings if f.code == "DIST.STRAGGLER"]
    print(f"  findings: {', '.join(codes) or 'none'}")
    if straggler:
        print(f"  DIST.STRAGGLER names rank(s) {list(straggler[0].ranks)} (injected: rank {ranks - 1})")
    return statistics.median(t_summary), statistics.median(t_diag), peak / 2**20, len(findings), t_diag[0]


def write_run(path: Path, steps: int, ranks: int) -> None:
    from pytscope_core.records import COL, NCOLS, PHASE_COLS
    from pytscope_core.rundir import RunWriter

    meta = {
        "created_s": time.time(),
        "world_size": ranks,
        "interval": 50,
        "warmup": 5,
        "integration": "benchmark",
        "device": "cpu",
        "mem_limit_bytes": None,
        "peak_flops": None,
        "flops_per_step": None,
    }
    writer = RunWriter(path, meta)
    phases = synthetic_phases(steps, ranks, seed=2).astype(np.float64)
    loss = synthetic_loss(steps, seed=3)
    chunk = 5000  # as rank 0 appends at every gather, in larger pieces to keep this quick
    for start in range(0, steps, chunk):
        stop = min(steps, start + chunk)
        n = stop - start
        rows = np.full((n, ranks, NCOLS), np.nan)
        rows[:, :, COL["rank"]] = np.arange(ranks)
        rows[:, :, COL["segment"]] = 0
        rows[:, :, COL["step"]] = np.arange(start + 1, stop + 1)[:, None]
        wall = phases[start:stop].sum(axis=2)
        rows[:, :, COL["start_s"]] = 1.7e9 + np.cumsum(wall.max(axis=1))[:, None] / 1e3 + start * 0.01
        rows[:, :, COL["wall_ms"]] = wall
        rows[:, :, list(PHASE_COLS)] = phases[start:stop]
        rows[:, :, COL["excluded_ms"]] = 0.0
        rows[:, :, COL["loss"]] = loss[start:stop, None]
        rows[:, :, COL["samples"]] = 32
        rows[:, :, COL["mem_bytes"]] = 1e9
        rows[:, :, COL["grad_syncs"]] = 1
        rows[:, :, COL["micro_batches"]] = 1
        writer.append_rows(rows.reshape(-1, NCOLS))
    writer.close()


def load_and_report(path: Path, repeat: int) -> tuple[float, int]:
    """(median s of load_run + summarize + render to a string, characters of the report)."""
    from rich.console import Console

    from pytscope_core.render import render_summary
    from pytscope_core.rundir import load_run
    from pytscope_core.summary import summarize

    times, chars = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        run = load_run(path)
        summary = summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings))
        buf = io.StringIO()
        Console(file=buf, width=110, color_system=None).print(render_summary(summary))
        text = buf.getvalue()
        times.append(time.perf_counter() - t0)
        chars = len(text)
    return statistics.median(times), chars


def read_earlier_losses(path: Path, repeat: int) -> tuple[float, float]:
    """(median s, traced peak MiB) of reading the run's loss history as a resumed launch does."""
    from pytscope_core.live import earlier_loss_history

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        earlier_loss_history(path, segment=1, warmup=5)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    earlier_loss_history(path, segment=1, warmup=5)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--repeat", type=int, default=None, help="timed repetitions (median reported)")
    args = parser.parse_args(argv)
    ranks, steps = (64, 1000) if args.quick else (1024, 10_000)
    load_steps, load_ranks = (5000, 8) if args.quick else (100_000, 8)
    repeat = args.repeat or (1 if args.quick else 3)

    print(f"loading and reporting {load_steps} steps x {load_ranks} ranks from a run directory")
    with tempfile.TemporaryDirectory(prefix="pytscope-scale-") as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        write_run(run_dir, load_steps, load_ranks)
        size = (run_dir / "steps.f64").stat().st_size / 2**20
        print(f"  written in {time.perf_counter() - t0:.2f} s ({size:.0f} MiB of rows)")
        t_load, chars = load_and_report(run_dir, repeat)
        t_earlier, peak_earlier = read_earlier_losses(run_dir, repeat)
    verdict = "met" if t_load < BUDGET_S else "MISSED"
    print(
        f"  load_run + summarize + render: {t_load:.2f} s (report {chars} characters); < {BUDGET_S:.0f} s: {verdict}"
    )

    print(
        f"  a resumed launch's read of the run's loss (once, off the training thread): {t_earlier:.2f} s, "
        f"peak {peak_earlier:.0f} MiB traced"
    )
    print(f"diagnosing {ranks} ranks x {steps} steps (float32 phases, rank {ranks - 1} 10% slower)")
    t_sum, t_diag, peak, _, t_cold = diagnose_at_scale(ranks, steps, repeat)
    rss = _rss_mib()
    verdict_t = "met" if t_sum < BUDGET_S else "MISSED"
    verdict_m = "met" if max(peak, rss) < BUDGET_MIB else "MISSED"
    print(
        f"  diagnose {t_diag:.2f} s (the first call, cold: {t_cold:.2f} s), summarize {t_sum:.2f} s; "
        f"< {BUDGET_S:.0f} s: {verdict_t}"
    )
    print(
        f"  peak traced {peak:.0f} MiB (inputs included), process ru_maxrss {rss:.0f} MiB; < 1 GiB: {verdict_m}"
    )
    print(f"analysis: {ranks} ranks x {steps} steps in {t_sum:.2f} s, peak {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
