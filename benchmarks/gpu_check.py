"""pytscope's CUDA path, checked end to end on one GPU: one command, one table, one JSON file.

On the GPU machine, from the repository root (`PYTHONPATH=.` makes an install unnecessary; torch with CUDA,
numpy, rich and lightning must be there):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_check.py --out gpu_check.json --work gpu_check_work

(through this project's device tool: `--out $OUT/gpu_check.json --work $OUT/gpu_check_work`, timeout_s 420.)
Expected runtime on one H200: about 2.5-3 minutes, at most 5 (`--budget-s`, default 290: no check starts after
it, and the ones left say so). The JSON is first written before torch is imported (the environment alone),
then whenever a check starts (naming it as `running`) and ends, so a run cut short keeps what finished and says
what was running. `--work` keeps every run directory and worker log, in a new subfolder per run (a temporary
folder otherwise), so a check that failed can be read afterwards with `pytscope report`; at the end that
subfolder is also packed into one archive beside the JSON (`gpu_check.json` -> `gpu_check.work.tar.gz`, at most
8 MiB, large files left out and listed), the copy to take away from a machine that returns only a few files near
the top of a folder. A failed worker's last 60 log lines are in its check's numbers too.

Every check (and the setup and the step-size calibration before them) runs under a time limit of its own
(`CHECK_LIMIT_S`), cut to what is left of `--stacks-after-s` (400): at the limit the check is written as failed
("timed out after N s") and `timed_out` names it, the worker processes it started are killed (their log tails
kept), every thread's stack is printed to stderr, the archive is written and the process exits with code 3.
Rerun some checks with `--checks torch,nccl` (names below). Anywhere, as a smoke test (without CUDA the
CUDA-only checks say skipped and why; about 20 s on 2 CPU cores):

    python benchmarks/gpu_check.py --quick --out /tmp/gpu_check.json

Written before pytscope's CUDA path (phase marks as CUDA events resolved once per gather, the allocator's
peak memory, the device peak-FLOPs table, graph-done autograd callbacks next to NCCL's asynchronous
all-reduce) had ever run on a GPU. Each check is a function returning a `Check` record (name, status
pass/fail/skipped, numbers, the criteria it applied, a reason); the table and the JSON are made from those
records only. The exit code is 1 when a check that ran failed, 3 when one ran out of time, else 0.

Checks (name: what it measures):

* `torch`, `lightning` -- one process: a plain loop under `Scope`, and Lightning `Trainer(devices=1)` with
  `ScopeCallback`. meta.json names the device; each step's phases sum to its wall (1%); pytscope's median
  step matches the loop's own timing (each step bracketed by `torch.cuda.synchronize()` on CUDA); peak
  memory is the allocator's high-water mark on CUDA (`max_memory_allocated` read after each step, and the
  same steps without pytscope; the user's readings must never fall: pytscope does not reset them) or the
  process peak RSS on CPU; MFU is a number, below 100% on a GPU, with the table's
  peak for the step's precision when the GPU is in the table (`torch`: no `peak_flops=` given). CUDA runs
  under bf16 autocast, CPU in fp32; the JSON states the table's bf16/tf32/fp32 peaks for the device.
* `accelerate` -- one process: an Accelerate loop (`Accelerator(mixed_precision="bf16")` on CUDA, the
  prepared model, optimizer and loader, `accelerator.backward`) under `AccelerateScope`, judged as `torch`
  (its peak from the table for the precision Accelerate names); meta.json says the integration.
* `overhead_small`, `overhead_large` -- steps of about 5 and 50 ms on a GPU (1 and 4-10 ms on CPU):
  interleaved blocks with and without pytscope (ABBA...), ratio of median step times per pair, median
  over pairs (and of mean step times, which carry the gathers). Every step ends with a device sync (the
  loop's own timing needs it), so the GPU is idle from that sync to the next step's first kernel: pytscope's
  work at the step boundary (its loop-top mark, the memory reading, a gather) adds to the step in full, while
  its hooks inside the step run as kernels are queued and are hidden behind them when the step is GPU-bound,
  as in any loop. The `nccl` check measures steps with no sync. `flops_per_step=` is given, so pytscope's
  one-off FLOP count on a warm-up step is not charged as per-step overhead.
* `ddp_gpu_delay`, `ddp_host_delay` -- two processes sharing the one GPU, DDP over gloo with CUDA tensors
  (NCCL refuses two ranks on one device); rank 1 slowed by extra matmuls (GPU-side, invisible to host
  timestamps: only CUDA events see it) or by busy-waiting (host-side). Rank 1 must be `DIST.STRAGGLER`,
  rank 0's wait billed as sync wait (against the delay rank 1 measured: CUDA events around the extra matmuls
  in every step, or the busy-wait's length), the transfer estimate small; pytscope's own FLOP estimate (no
  `flops_per_step=` here) against a count on the bare model. Without CUDA the host-side variant runs on
  CPU tensors.
* `nccl` -- a 1-rank NCCL process group with DDP: step time with and without pytscope over unsynchronized
  blocks (a sync or serialization added by the graph-done callbacks or CUDA events would show here; each
  scope is started before its block's clock, and the blocks' means less the scope's gathers are reported
  too), and pytscope's median step against the blocks' own timing. The worker runs with `NCCL_DEBUG=WARN`, so
  NCCL's own reason for a failure is in the log tail.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import io
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

# -- thresholds (each with its reason) --------------------------------------------------------------------
PHASE_SUM_TOLERANCE = 0.01
"""The issue's bound: a step's phases must add up to its wall time (SPEC 3)."""
STEP_TOLERANCE = 0.02
"""The issue's bound on pytscope's median step against the loop's own timing. Both time the same intervals
(loop top to loop top, microseconds apart); the recorder's own bookkeeping is inside the step it closes, so
neither runs systematically low: -0.9% to +0.6% measured at 1-2 ms CPU steps (quick mode, plain loop and
Lightning, 5 runs on an idle 2-core machine)."""
STEP_SMOKE_TOLERANCE = 0.10
"""Quick runs on CPU: 1 ms steps on 2 cores shared with other multi-process test runs measured -8% once
(Lightning); only a gross error fails, such as a phase or a whole step missing from the timeline."""
MEM_TOLERANCE = 0.10
"""The same steps without pytscope allocate the same tensors: the allocator peaks should agree closely."""
OVERHEAD_BUDGET = {"small": 0.03, "large": 0.01}
"""SPEC 9's budgets for short and long steps (<= 3% at 1 ms, <= 1% at 10 ms on CPU)."""
OVERHEAD_SMOKE_LIMIT = 1.0
"""Quick runs: a few short blocks on shared cores measure mostly noise (+-15% seen on 2 cores loaded by other
test runs); only a gross regression fails, such as a device sync or a diagnosis in every step."""
NCCL_OVERHEAD_BUDGET = 0.03
"""A ~5 ms step: the short-step budget. A per-step sync would cost far more (queue drained every step)."""
ASYNC_STEP_TOLERANCE = 0.05
"""Unsynchronized steady state: the GPU timeline's median step vs the block's mean (gathers included)."""
WAIT_SHARE_OF_DELAY = 0.5
"""Rank 0's median sync wait must carry at least half the delay injected into rank 1."""
TRANSFER_SHARE_OF_WAIT = 0.5
"""The transfer estimate must stay well under rank 0's sync wait: the wait is the straggler's bill."""
PEER_GRACE_S = 20.0
"""After one rank of a 2-process job dies, its peer blocks in a collective: kill it after this long."""
NOMINAL_PEAK_FLOPS = 1e12
"""Passed as `peak_flops=` where the device is not in pytscope's table (CPU): only checks MFU is computed."""
CHECK_LIMIT_S: dict[str, float] = {
    "setup": 120.0,
    "calibration": 90.0,
    "torch": 90.0,
    "lightning": 90.0,
    "accelerate": 90.0,
    "overhead_small": 90.0,
    "overhead_large": 120.0,
    "ddp_gpu_delay": 180.0,
    "ddp_host_delay": 180.0,
    "nccl": 180.0,
}
"""Each check's own time limit: several times what it takes when it works (the setup: a first CUDA call on a
fresh machine is not timed yet), and for the two-process checks room for their workers' own limit (150 s) and
the reading of the results after it. A check missing here gets DEFAULT_CHECK_LIMIT_S."""
DEFAULT_CHECK_LIMIT_S = 120.0
PROCESS_MARGIN_S = 10.0
"""Worker processes end this long before their check's time limit, so the check itself reports them."""
BACKSTOP_S = 10.0
"""After --stacks-after-s the check's timer should have ended the process; faulthandler ends it this long later
in case the timer thread cannot run (a call that never releases the GIL)."""
TIMEOUT_EXIT = 3
"""The exit code of a run that a check's time limit ended (1: a check failed)."""
LOG_TAIL_LINES = 60
"""Lines of a failed worker's log kept in its check's numbers: a Python traceback and NCCL's warnings fit."""
ARCHIVE_LIMIT_BYTES = 8 * 2**20
"""The work folder's archive holds at most this much (tar blocks, before compression): half of the 16 MiB a
file may be to come back from the device machine."""
ARCHIVE_FILE_LIMIT_BYTES = 2 * 2**20
"""Larger files are left out of the archive (and listed): logs, JSON and step arrays are far smaller."""
LR = 0.01  # SGD with momentum 0.9 on the teacher-labelled MLP: the loss falls without diverging
WARMUP = 5  # pytscope's default warm-up: its statistics leave out these steps, so the loop's do too


# -- records ----------------------------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    what: str
    status: str = "pass"  # "pass" | "fail" | "skipped"
    reason: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    criteria: list[dict[str, Any]] = field(default_factory=list)
    headline: str = ""  # the measured numbers in one line, for the table
    seconds: float = 0.0

    def expect(self, what: str, ok: bool, detail: str) -> bool:
        """One criterion; the check fails when any criterion fails, and says which."""
        self.criteria.append({"what": what, "ok": bool(ok), "detail": detail})
        if not ok:
            self.status = "fail"
            self.reason = "; ".join(filter(None, [self.reason, f"{what}: {detail}"]))
        return bool(ok)

    def skip(self, reason: str) -> Check:
        self.status, self.reason = "skipped", reason
        return self

    def note(self, text: str) -> None:
        self.numbers.setdefault("notes", []).append(text)


@dataclass(frozen=True)
class Size:
    """An MLP training job: `depth` hidden layers of `width`, cross-entropy over `out_dim` classes."""

    name: str
    batch: int
    in_dim: int
    width: int
    depth: int
    out_dim: int
    target_ms: float = 0.0
    measured_ms: float = 0.0


@dataclass
class Ctx:
    device: str  # "cuda" or "cpu"
    device_name: str  # torch.cuda.get_device_name() or "cpu"
    quick: bool
    tmp: Path
    bf16: bool  # CUDA runs under bf16 autocast
    deadline: float  # time.monotonic() after which no check starts
    check_deadline: float = math.inf  # time.monotonic() at which the running check's time limit ends it
    no_cuda: str = ""  # why the CUDA-only checks are skipped
    sizes: dict[str, Size] = field(default_factory=dict)
    sizes_error: str = ""  # why calibration failed: the checks that need a size fail with it

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def steps(self, full: int, quick: int) -> int:
        return quick if self.quick else full


# -- device helpers ---------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def autocast(device: str, bf16: bool) -> Any:
    if device == "cuda" and bf16:
        import torch

        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_model(size: Size, device: str) -> Any:
    import torch

    layers: list[Any] = [torch.nn.Linear(size.in_dim, size.width), torch.nn.ReLU()]
    for _ in range(size.depth - 1):
        layers += [torch.nn.Linear(size.width, size.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(size.width, size.out_dim))
    return torch.nn.Sequential(*layers).to(device)


def make_job(size: Size, device: str, seed: int = 0) -> tuple[Any, Any, list[Any], list[Any]]:
    """Model, SGD optimizer and a few ready batches on the device (no input cost: this measures the step).
    Labels come from a fixed random linear map, so the loss really goes down (no convergence findings)."""
    import torch

    torch.manual_seed(0)  # the same initial weights on every rank
    model = make_model(size, device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    gen = torch.Generator(device=device).manual_seed(1 + seed)
    teacher = torch.randn(
        size.in_dim, size.out_dim, device=device, generator=torch.Generator(device=device).manual_seed(0)
    )
    xs = [torch.randn(size.batch, size.in_dim, device=device, generator=gen) for _ in range(2)]
    ys = [(x @ teacher).argmax(dim=1) for x in xs]
    return model, opt, xs, ys


def batch_loader(xs: list[Any], ys: list[Any], steps: int) -> Any:
    """A torch DataLoader of `steps` batches cycled from a few ready ones (what the integrations prepare)."""
    from torch.utils.data import DataLoader, Dataset

    class BatchSet(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return steps

        def __getitem__(self, i: int) -> Any:
            return xs[i % len(xs)], ys[i % len(ys)]

    return DataLoader(BatchSet(), batch_size=None)


class Batches:
    """`steps` batches cycled from a few ready ones. A class of its own: `scope.watch` wraps this loader
    instance by swapping its class, which a builtin list does not allow."""

    def __init__(self, xs: list[Any], ys: list[Any], steps: int) -> None:
        self.xs, self.ys, self.steps = xs, ys, steps

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for i in range(self.steps):
            yield self.xs[i % len(self.xs)], self.ys[i % len(self.ys)]

    def __len__(self) -> int:
        return self.steps


def run_steps(
    model: Any,
    opt: Any,
    loader: Any,
    device: str,
    bf16: bool,
    scope: Any = None,
    sync_each: bool = True,
    before_forward: Callable[[], None] | None = None,
    after_step: Callable[[], None] | None = None,
    backward: Callable[[Any], None] | None = None,
) -> list[float]:
    """Per-step wall times in ms, loop top to loop top; with `sync_each` every step ends with a device sync
    (the loop's own ground truth for pytscope's CUDA-event timing). `after_step` runs after that sync;
    `backward` replaces `loss.backward()` (e.g. `accelerator.backward`)."""
    import torch.nn.functional as F

    times: list[float] = []
    sync(device)
    last = time.perf_counter()
    for x, y in loader:
        if before_forward is not None:
            before_forward()
        with autocast(device, bf16):
            loss = F.cross_entropy(model(x), y)
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scope is not None:
            scope.log(loss=loss)
        if sync_each:
            sync(device)
        if after_step is not None:
            after_step()
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    sync(device)
    return times


def count_flops(model: Any, x: Any, y: Any, device: str, bf16: bool) -> float:
    """FLOPs of one forward + backward, counted by torch's FlopCounterMode (gradients are cleared after)."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        with autocast(device, bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def calibrate(ctx: Ctx, base: Size, name: str, target_ms: float) -> Size:
    """The batch size at which one plain step (synchronized) takes about `target_ms`."""
    import torch

    batch, measured, ms = base.batch, base.batch, math.nan
    for _ in range(4):
        size = dataclasses.replace(base, batch=batch)
        model, opt, xs, ys = make_job(size, ctx.device)
        times = run_steps(model, opt, Batches(xs, ys, 3 + (5 if ctx.quick else 8)), ctx.device, ctx.bf16)
        measured, ms = batch, statistics.median(times[3:])
        del model, opt, xs, ys
        if ctx.cuda:
            torch.cuda.empty_cache()
        if abs(ms / target_ms - 1) < 0.1:
            break
        batch = int(min(max(batch * target_ms / ms, 16), 1 << 18))
    # The last size measured, not the next try's (the step time printed and used is that size's).
    return dataclasses.replace(base, name=name, batch=measured, target_ms=target_ms, measured_ms=ms)


def host_peak_rss() -> float:
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


def table_peaks(device_name: str) -> dict[str, float | None]:
    """The device's peaks as pytscope's table gives them, per precision where the table has precisions."""
    from pytscope_core import flops

    out: dict[str, float | None] = {"default": flops.peak_flops_for(device_name)}
    for precision in getattr(flops, "PRECISIONS", ()):
        try:
            out[precision] = flops.peak_flops_for(device_name, precision)  # type: ignore[call-arg]
        except TypeError:
            break
    return out


def report_of(run_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The run as `pytscope report --json` sees it: (Run, summary dict)."""
    from pytscope_core.rundir import load_run
    from pytscope_core.summary import summarize

    run = load_run(run_dir)
    summary = summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings)).to_dict()
    return run, summary


def scope_errors(scope: Any, run_dir: Path) -> list[str]:
    """Internal errors that disabled the scope: the scope's own list and those written to its run."""
    errors = list(getattr(scope, "errors", []))
    return errors + [e for e in report_of(run_dir)[1]["scope"]["errors"] if e not in errors]


def rel(a: float, b: float) -> float:
    return a / b - 1.0 if b else math.inf


def num(x: Any) -> float:
    """A summary number as a float: NaN where the summary has none (null in its JSON)."""
    return float(x) if isinstance(x, (int, float)) else math.nan


def fmt_bytes(n: float | None) -> str:
    return f"{n / 2**20:.0f} MiB" if n is not None and math.isfinite(n) else "n/a"


def free_port() -> int:
    from pytscope_core.demo import free_port as pick

    while True:
        port = pick()  # bound to port 0: the OS's choice, free now
        if port != 29500:  # torch's default port: another job on the machine may take it any moment
            return port


# -- check 1: one process ---------------------------------------------------------------------------------
def single_process_criteria(
    c: Check,
    ctx: Ctx,
    run_dir: Path,
    loop_ms: list[float],
    flops_per_step: float,
    mem_bounds: tuple[float, float, str],
    peak_given: bool,
) -> None:
    """What both single-process checks demand of the run directory and the summary."""
    import torch

    run, s = report_of(run_dir)
    expected_device = torch.cuda.get_device_name(0) if ctx.cuda else "cpu"
    c.expect(
        "meta.json device",
        run.meta.get("device") == expected_device,
        f"{run.meta.get('device')!r}, expected {expected_device!r}",
    )
    c.expect("no scope errors", not s["scope"]["errors"], "; ".join(s["scope"]["errors"]) or "none")

    a = run.arrays
    if not c.expect("steps recorded", a.n_steps > 0, f"{a.n_steps} rows"):
        return
    wall = np.asarray(a.wall_ms[:, 0], dtype=np.float64)
    phases = np.asarray(a.phases[:, 0, :], dtype=np.float64)
    c.expect("every step recorded", a.n_steps == len(loop_ms), f"{a.n_steps} rows for {len(loop_ms)} steps")
    dev = np.abs(phases.sum(axis=1) - wall) / np.where(wall > 0, wall, np.nan)
    worst = float(np.nanmax(dev)) if dev.size else math.nan
    c.numbers["phase_sum_max_rel_dev"] = worst
    c.expect(
        "phases sum to wall",
        dev.size > 0 and bool(np.all(dev <= PHASE_SUM_TOLERANCE)),
        f"worst step off by {100 * worst:.4f}% (limit {100 * PHASE_SUM_TOLERANCE:.0f}%)",
    )
    c.expect("no negative phase", bool(np.all(phases >= -1e-6)), f"min {float(np.min(phases)):.4f} ms")
    c.numbers["phase_median_ms"] = {
        name: float(np.median(phases[WARMUP:, i])) for i, name in enumerate(s["timing"]["phases"])
    }

    loop_median = statistics.median(loop_ms[WARMUP:])
    scope_median = num(s["timing"]["median_ms"])
    tol = STEP_SMOKE_TOLERANCE if ctx.quick and not ctx.cuda else STEP_TOLERANCE
    diff = rel(scope_median, loop_median)
    c.numbers.update(loop_median_ms=loop_median, pytscope_median_ms=scope_median, median_rel_diff=diff)
    n = min(len(wall), len(loop_ms))
    per_step = np.abs(wall[WARMUP:n] / np.asarray(loop_ms[WARMUP:n]) - 1)
    c.numbers["per_step_rel_diff_median"] = float(np.median(per_step)) if per_step.size else math.nan
    c.expect(
        "median step vs the loop's own timing",
        abs(diff) <= tol,
        f"pytscope {scope_median:.3f} ms, loop {loop_median:.3f} ms ({100 * diff:+.2f}%, limit {100 * tol:.0f}%)",
    )

    peak = num(s["memory"]["peak_bytes"])
    low, high, source = mem_bounds
    c.numbers.update(peak_bytes=peak, peak_low_bytes=low, peak_high_bytes=high, peak_reference=source)
    mem = np.asarray(a.mem_bytes[:, 0], dtype=np.float64)
    c.numbers["first_step_mem_bytes"] = float(mem[0]) if mem.size else math.nan
    c.expect(
        "peak memory recorded every step", bool(np.isfinite(mem).all()), f"{int(np.isnan(mem).sum())} NaN"
    )
    c.expect(
        "peak memory is a high-water mark",
        bool(np.all(np.diff(mem) >= 0)),
        f"{int(np.count_nonzero(np.diff(mem) < 0))} falls between steps",
    )
    c.expect(
        "peak memory",
        low <= peak <= high,
        f"{fmt_bytes(peak)}, expected {fmt_bytes(low)}..{fmt_bytes(high)} ({source})",
    )

    mfu = s["efficiency"]["mfu"]
    used_peak = run.context.peak_flops
    c.numbers.update(
        mfu=mfu,
        flops_per_step=flops_per_step,
        peak_flops_used=used_peak,
        table_peaks=table_peaks(ctx.device_name),
    )
    c.numbers["meta_flops_per_step"] = run.meta.get("flops_per_step")
    c.numbers["meta_peak_precision"] = run.meta.get("peak_precision")
    peaks = table_peaks(ctx.device_name)
    which = [k for k, v in peaks.items() if k != "default" and v is not None and v == used_peak]
    c.numbers["peak_flops_used_is"] = which or ("given" if used_peak else None)
    peak_text = (
        f"peak {used_peak:.4g} FLOP/s ({', '.join(which) or 'not from the table'})"
        if used_peak
        else "no peak"
    )
    ok = isinstance(mfu, float) and math.isfinite(mfu) and mfu > 0
    c.expect("MFU is a number", ok, f"{mfu!r} (flops/step {flops_per_step:.3g}, {peak_text})")
    if ok and used_peak:
        # FLOPs per step over the step time (mean or median, whichever the summary uses) over the peak.
        expected = [
            flops_per_step / (num(s["timing"][k]) / 1e3) / used_peak for k in ("mean_ms", "median_ms")
        ]
        c.expect(
            "MFU formula",
            any(abs(rel(mfu, e)) < 0.01 for e in expected),
            f"{mfu:.4g} vs {expected[0]:.4g} (mean step) / {expected[1]:.4g} (median step) recomputed",
        )
    if ctx.cuda and not peak_given and peaks["default"] is not None:
        # The step's matmuls run in bf16 (autocast): the table's bf16 peak is the one that applies.
        want = peaks.get("bf16", peaks["default"]) if ctx.bf16 else used_peak
        c.expect(
            "peak from the table for the step's precision",
            used_peak == want,
            f"{peak_text}, precision {run.meta.get('peak_precision')!r} in meta.json; the step runs under "
            f"{'bf16 autocast: bf16 peak ' + format(want, '.4g') if ctx.bf16 else 'fp32'}",
        )
    if ok and ctx.cuda:
        mfu_ceiling(c, mfu, used_peak, peaks, peak_text)
    c.headline = (
        f"step {scope_median:.3f} vs loop {loop_median:.3f} ms ({100 * diff:+.2f}%); phases sum to wall within "
        f"{100 * worst:.3f}%; peak {fmt_bytes(peak)}; MFU {f'{100 * mfu:.1f}%' if ok else 'n/a'}"
    )


def mfu_ceiling(
    c: Check, mfu: float, used_peak: float | None, peaks: dict[str, float | None], peak_text: str
) -> None:
    """MFU above 100% means the step time is too short (events not measuring execution) or the peak too low for
    the precision the step ran at; only a peak from pytscope's table says so. A nominal peak (a GPU not in the
    table) bounds nothing: the MFU is then noted, not judged."""
    if used_peak is not None and used_peak in {v for v in peaks.values() if v is not None}:
        c.expect("MFU <= 100%", mfu <= 1.0, f"{100 * mfu:.1f}% with {peak_text}")
    else:
        c.note(f"MFU {100 * mfu:.1f}% against {peak_text}: a nominal peak, not judged against 100%")


def check_torch(ctx: Ctx) -> Check:
    c = Check("torch", "1 process, plain loop under Scope: device, phases, median step, peak memory, MFU")
    import torch

    from pytscope_core import Scope

    size = ctx.sizes["small"]
    model, opt, xs, ys = make_job(size, ctx.device)
    flops_per_step = count_flops(model, xs[0], ys[0], ctx.device, ctx.bf16)
    # The same steps without pytscope: the allocator's peak for them (CUDA), and a warm model.
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    run_steps(model, opt, Batches(xs, ys, 5), ctx.device, ctx.bf16)
    plain_peak = float(torch.cuda.max_memory_allocated()) if ctx.cuda else math.nan
    rss_before = host_peak_rss()
    seen, after_step = allocator_readings(ctx)

    in_table = ctx.cuda and table_peaks(ctx.device_name)["default"] is not None
    peak_flops = None if in_table else NOMINAL_PEAK_FLOPS
    c.numbers.update(size=dataclasses.asdict(size), peak_flops_given=peak_flops)
    if not in_table:
        c.note(f"{ctx.device_name} is not in pytscope's peak table: peak_flops={NOMINAL_PEAK_FLOPS:g} given")
    steps = ctx.steps(300, 120)
    run_dir = ctx.tmp / "torch"
    scope = Scope(run_dir, interval=50, console=False, flops_per_step=flops_per_step, peak_flops=peak_flops)
    loader = Batches(xs, ys, steps)
    scope.watch(model, opt, loader)
    loop_ms = run_steps(model, opt, loader, ctx.device, ctx.bf16, scope, after_step=after_step)
    scope.finish()
    bounds = memory_bounds(ctx, seen, rss_before, "loop")
    single_process_criteria(
        c, ctx, run_dir, loop_ms, flops_per_step, bounds, peak_given=peak_flops is not None
    )
    if ctx.cuda:
        falls = int(np.count_nonzero(np.diff(seen) < 0))
        c.expect(
            "the user's max_memory_allocated() readings are left alone (never reset)",
            falls == 0,
            f"{falls} falls in {len(seen)} readings after steps",
        )
        peak = num(c.numbers.get("peak_bytes"))
        c.numbers["plain_steps_peak_bytes"] = plain_peak
        c.expect(
            "peak memory vs the same steps without pytscope",
            abs(rel(peak, plain_peak)) <= MEM_TOLERANCE,
            f"{fmt_bytes(peak)} vs {fmt_bytes(plain_peak)} (max_memory_allocated of 5 plain steps)",
        )
    return c


def allocator_readings(ctx: Ctx) -> tuple[list[float], Callable[[], None] | None]:
    """On CUDA, a list filled with `torch.cuda.max_memory_allocated()` at the end of every step (after its
    sync, before the next loop top where pytscope reads its own), and the callable that fills it. The
    allocator's peak statistic is reset first: it would otherwise carry peaks from before the run."""
    if not ctx.cuda:
        return [], None
    import torch

    torch.cuda.reset_peak_memory_stats()
    seen: list[float] = []
    return seen, lambda: seen.append(float(torch.cuda.max_memory_allocated()))


def memory_bounds(ctx: Ctx, seen: list[float], rss_before: float, what: str) -> tuple[float, float, str]:
    """Where pytscope's peak must lie: around the allocator's own readings (CUDA), or between the process
    peak RSS before and after (CPU: ru_maxrss only grows, and pytscope reads it during the run)."""
    if ctx.cuda:
        ref = max(seen) if seen else math.nan
        return (
            ref * (1 - MEM_TOLERANCE),
            ref * (1 + MEM_TOLERANCE),
            f"max of torch.cuda.max_memory_allocated() read after each step's sync: {fmt_bytes(ref)}",
        )
    return rss_before, host_peak_rss(), f"process peak RSS before and after the {what}"


def check_lightning(ctx: Ctx) -> Check:
    c = Check("lightning", "1 process, Lightning Trainer(devices=1) + ScopeCallback: same criteria as torch")
    try:
        import lightning.pytorch as pl
        import torch

        from pytscope_lightning import ScopeCallback
    except ImportError as exc:
        return c.skip(f"Lightning is not installed ({exc}): pip install -e '.[lightning]'")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    size = ctx.sizes["small"]
    model, _, xs, ys = make_job(size, ctx.device)
    flops_per_step = count_flops(model, xs[0], ys[0], ctx.device, ctx.bf16)
    steps = ctx.steps(300, 120)
    device = ctx.device

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    loop_ms: list[float] = []
    seen, read_allocator = allocator_readings(ctx)

    class StepTimer(pl.Callback):
        """Listed before ScopeCallback: syncs, then times, right before pytscope's loop-top mark."""

        last = 0.0

        def on_train_batch_end(self, *args: Any) -> None:
            sync(device)
            if read_allocator is not None:
                read_allocator()
            now = time.perf_counter()
            if self.last:
                loop_ms.append((now - self.last) * 1e3)
            self.last = now

    in_table = ctx.cuda and table_peaks(ctx.device_name)["default"] is not None
    peak_flops = table_peaks(ctx.device_name)["default"] if in_table else NOMINAL_PEAK_FLOPS
    run_dir = ctx.tmp / "lightning"
    try:
        callback = ScopeCallback(
            run_dir=str(run_dir),
            interval=50,
            console=False,
            flops_per_step=flops_per_step,
            peak_flops=peak_flops,
        )
    except TypeError as exc:
        c.expect("ScopeCallback(flops_per_step=, peak_flops=)", False, f"not accepted yet: {exc}")
        return c
    rss_before = host_peak_rss()
    trainer = pl.Trainer(
        accelerator="gpu" if ctx.cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if ctx.cuda and ctx.bf16 else "32-true",
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[StepTimer(), callback],
    )
    trainer.fit(Module(), train_dataloaders=batch_loader(xs, ys, steps + 1))
    c.numbers["size"] = dataclasses.asdict(size)
    bounds = memory_bounds(ctx, seen, rss_before, "fit")
    # The timer sees one boundary fewer than there are steps (it starts at the first step's end).
    single_process_criteria(c, ctx, run_dir, [math.nan] + loop_ms, flops_per_step, bounds, peak_given=True)
    return c


def check_accelerate(ctx: Ctx) -> Check:
    c = Check(
        "accelerate",
        "1 process, an Accelerate loop (prepared model, optimizer, loader; accelerator.backward) + "
        "AccelerateScope: same criteria as torch",
    )
    try:
        import torch
        from accelerate import Accelerator

        from pytscope_accelerate import AccelerateScope
    except ImportError as exc:
        return c.skip(f"Accelerate is not installed ({exc}): pip install -e '.[accelerate]'")

    size = ctx.sizes["small"]
    model, opt, xs, ys = make_job(size, ctx.device)
    flops_per_step = count_flops(model, xs[0], ys[0], ctx.device, ctx.bf16)
    steps = ctx.steps(300, 120)
    # Accelerate may set process-wide matmul precision flags: the checks after this one must not inherit them.
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    accelerator = Accelerator(cpu=not ctx.cuda, mixed_precision="bf16" if ctx.cuda and ctx.bf16 else "no")
    try:
        model, opt, loader = accelerator.prepare(model, opt, batch_loader(xs, ys, steps))
        in_table = ctx.cuda and table_peaks(ctx.device_name)["default"] is not None
        peak_flops = None if in_table else NOMINAL_PEAK_FLOPS
        c.numbers.update(
            size=dataclasses.asdict(size),
            peak_flops_given=peak_flops,
            mixed_precision=str(accelerator.mixed_precision),
            loader=type(loader).__name__,
        )
        run_dir = ctx.tmp / "accelerate"
        run_steps(model, opt, Batches(xs, ys, 5), ctx.device, ctx.bf16, backward=accelerator.backward)  # warm
        rss_before = host_peak_rss()
        seen, after_step = allocator_readings(ctx)
        scope = AccelerateScope(
            accelerator,
            run_dir=run_dir,
            interval=50,
            console=False,
            flops_per_step=flops_per_step,
            peak_flops=peak_flops,
        )
        scope.watch(model, opt, loader)
        loop_ms = run_steps(
            model,
            opt,
            loader,
            ctx.device,
            ctx.bf16,
            scope,
            after_step=after_step,
            backward=accelerator.backward,
        )
        scope.finish()
    finally:
        accelerator.free_memory()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    run, _ = report_of(run_dir)
    c.expect(
        "meta.json integration",
        run.meta.get("integration") == "accelerate",
        f"{run.meta.get('integration')!r}, expected 'accelerate'",
    )
    bounds = memory_bounds(ctx, seen, rss_before, "loop")
    single_process_criteria(
        c, ctx, run_dir, loop_ms, flops_per_step, bounds, peak_given=peak_flops is not None
    )
    return c


# -- check 2: overhead ------------------------------------------------------------------------------------
def overhead(ctx: Ctx, which: str) -> Check:
    size = ctx.sizes[which]
    c = Check(
        f"overhead_{which}",
        f"step overhead at ~{size.target_ms:g} ms: interleaved blocks with/without Scope, ratio of medians",
    )
    from pytscope_core import Scope

    pairs = 4
    steps = max(30, min(ctx.steps(200, 100), int(ctx.steps(5000, 400) / max(size.measured_ms, 0.1))))
    skip = 10 if steps >= 60 else 5
    model, opt, xs, ys = make_job(size, ctx.device)
    # Given, so that pytscope's one-off FLOP count on a warm-up step is not charged as per-step overhead.
    flops = count_flops(model, xs[0], ys[0], ctx.device, ctx.bf16)
    run_steps(model, opt, Batches(xs, ys, 10), ctx.device, ctx.bf16)  # warm-up outside the measurement
    med_ratios, mean_ratios, base = [], [], []
    errors: list[str] = []
    for i in range(pairs):
        res: dict[bool, np.ndarray] = {}
        for with_scope in (False, True) if i % 2 == 0 else (True, False):
            loader = Batches(xs, ys, steps)
            scope = None
            run_dir = ctx.tmp / f"overhead-{which}-{i}"
            if with_scope:
                scope = Scope(run_dir, interval=50, console=False, flops_per_step=flops)
                scope.watch(model, opt, loader)
            times = run_steps(model, opt, loader, ctx.device, ctx.bf16, scope)
            if scope is not None:
                scope.finish()
                errors += scope_errors(scope, run_dir)
            res[with_scope] = np.asarray(times[skip:])
        med_ratios.append(float(np.median(res[True]) / np.median(res[False])))
        mean_ratios.append(float(res[True].mean() / res[False].mean()))
        base.append(float(np.median(res[False])))
    pct = 100 * (statistics.median(med_ratios) - 1)
    c.numbers.update(
        size=dataclasses.asdict(size),
        pairs=pairs,
        steps_per_block=steps,
        base_step_ms=statistics.median(base),
        overhead_pct=pct,
        overhead_pct_per_pair=[100 * (r - 1) for r in med_ratios],
        overhead_pct_incl_gathers=100 * (statistics.median(mean_ratios) - 1),
    )
    c.headline = (
        f"{pct:+.2f}% at {statistics.median(base):.2f} ms steps ({pairs} pairs x {steps} steps; "
        f"mean incl. gathers {c.numbers['overhead_pct_incl_gathers']:+.2f}%)"
    )
    c.expect("no scope errors", not errors, "; ".join(errors) or "none")
    limit = OVERHEAD_SMOKE_LIMIT if ctx.quick else OVERHEAD_BUDGET[which]
    c.expect(
        "overhead",
        pct <= 100 * limit,
        f"{pct:+.2f}% at {statistics.median(base):.2f} ms steps (limit {100 * limit:.0f}%"
        f"{', quick: smoke only' if ctx.quick else ''})",
    )
    return c


# -- checks 3 and 4: separate processes -------------------------------------------------------------------
@dataclass
class ProcResult:
    codes: list[int | None]
    timed_out: bool
    logs: list[str]

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.codes)

    def error(self) -> str:
        parts = []
        for i, code in enumerate(self.codes):
            if code != 0:
                lines = self.logs[i].strip().splitlines()[-6:]
                parts.append(f"[process {i}, exit {code}] " + (" | ".join(lines) or "(no output)"))
        return ("timed out, killed: " if self.timed_out else "") + " ".join(parts)

    def tails(self, lines: int = LOG_TAIL_LINES) -> dict[str, list[str]]:
        """The last `lines` lines of the log of each process that did not exit 0."""
        return {
            f"process{i}": log_tail(log, lines)
            for i, (code, log) in enumerate(zip(self.codes, self.logs, strict=True))
            if code != 0
        }


def log_tail(text: str, lines: int = LOG_TAIL_LINES) -> list[str]:
    return text.rstrip().splitlines()[-lines:]


LIVE_PROCESSES: dict[subprocess.Popen[bytes], Path] = {}
"""Worker processes running now, with their logs: a check's time limit kills them before the run ends."""


def stop_processes() -> dict[str, list[str]]:
    """Kill the worker processes still running and return their logs' tails (called at a time limit)."""
    tails: dict[str, list[str]] = {}
    for proc, log in list(LIVE_PROCESSES.items()):
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            tails[f"{log.parent.parent.name}/{log.name}"] = log_tail(log.read_text(errors="replace"))
    return tails


def run_processes(
    commands: list[list[str]], env: dict[str, str], timeout_s: float, log_dir: Path
) -> ProcResult:
    """Run the commands together; a dead rank's peers are killed after PEER_GRACE_S, all of them at the
    timeout. Never hangs."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i, cmd in enumerate(commands):
        f = open(log_dir / f"process{i}.log", "w")
        files.append(f)
        procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
        LIVE_PROCESSES[procs[-1]] = log_dir / f"process{i}.log"
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    timed_out = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > PEER_GRACE_S):
            timed_out = now > deadline
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p, f in zip(procs, files, strict=True):
        p.wait()
        f.close()
        LIVE_PROCESSES.pop(p, None)
    logs = [(log_dir / f"process{i}.log").read_text(errors="replace") for i in range(len(procs))]
    return ProcResult([p.returncode for p in procs], timed_out, logs)


def process_timeout(ctx: Ctx) -> float:
    """How long a check's worker processes may run: their own limit, the run's budget plus a minute (a check
    that started in time may finish), and never past the check's own time limit."""
    now = time.monotonic()
    return min(
        ctx.steps(150, 90),
        max(30.0, ctx.deadline - now + 60),
        max(1.0, ctx.check_deadline - now - PROCESS_MARGIN_S),
    )


def rank_results(c: Check, what: str, res: ProcResult, paths: list[Path]) -> list[dict[str, Any]] | None:
    """Each rank's result file, or None (and `what` failed) when one is missing or unreadable. A process that
    wrote its result and then did not exit 0 (torch.distributed's teardown has aborted after a finished run)
    is a note: its numbers stand. The log tails of processes that did not exit 0 are kept either way."""
    if not res.ok:
        c.numbers["log_tail"] = res.tails()
    results: list[dict[str, Any]] = []
    for path in paths:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            c.expect(what, False, res.error() if not res.ok else f"exit 0 but {path.name} unreadable: {exc}")
            return None
    c.expect(what, True, "exit 0" if res.ok else "results written")
    if not res.ok:
        c.note(f"after writing their results: {res.error()[:400]}")
    return results


def worker_command(kind: str, rank: int, world: int, port: int, spec_path: Path) -> list[str]:
    script = str(Path(__file__).resolve())
    args = dict(worker=kind, rank=rank, world=world, port=port, spec=spec_path)
    return [sys.executable, script, *(f"--{k}={v}" for k, v in args.items())]


def child_env(ctx: Ctx, port: int) -> dict[str, str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    # One host: loopback, whatever the hostname resolves to (an isolated machine may have no other route).
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if not ctx.cuda:
        env["OMP_NUM_THREADS"] = "1"
    return env


def check_ddp(ctx: Ctx, delay: str) -> Check:
    gpu = delay == "gpu"
    c = Check(
        f"ddp_{delay}_delay",
        f"2 processes, DDP over gloo ({'CUDA' if ctx.cuda else 'CPU'} tensors), rank 1 slowed "
        f"{'on the GPU (extra matmuls)' if gpu else 'on the host (busy-wait)'}: straggler and sync wait",
    )
    import torch.distributed as dist

    if gpu and not ctx.cuda:
        return c.skip(f"needs CUDA ({ctx.no_cuda}): a GPU-side delay needs a GPU")
    if not dist.is_available() or not dist.is_gloo_available():
        return c.skip("torch.distributed with gloo is not available in this torch build")
    size = Size(
        "ddp", batch=4096 if ctx.cuda else 256, in_dim=256 if ctx.cuda else 64, width=256, depth=2, out_dim=10
    )
    # Small models (gradients well under 1 MB: a short transfer) and a delay that dominates the step. On 2
    # shared CPU cores other processes inflate rank 0's own work by several ms: a 5 ms spin was missed once.
    # On one shared GPU the two ranks' kernels take turns in time slices: rank 0's may wait behind rank 1's
    # delay for up to a slice, so the delay is several slices long.
    delay_ms = 20.0 if ctx.cuda else 12.0
    out = ctx.tmp / f"ddp-{delay}"
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(
        device=ctx.device,
        bf16=ctx.bf16,
        size=dataclasses.asdict(size),
        steps=ctx.steps(300, 150),
        interval=50,
        delay=delay,
        delay_ms=delay_ms,
        out=str(out),
    )
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    res = run_processes(
        [worker_command("ddp", r, 2, port, spec_path) for r in range(2)],
        child_env(ctx, port),
        process_timeout(ctx),
        out / "logs",
    )
    c.numbers.update(size=dataclasses.asdict(size), steps=spec["steps"], port=port)
    ranks = rank_results(c, "both ranks finished", res, [out / f"rank{r}.json" for r in range(2)])
    if ranks is None:
        return c
    injected = float(ranks[1].get("delay_ms", delay_ms))
    c.numbers["injected_delay_ms"] = injected
    if gpu:
        c.numbers.update(
            matmuls_per_step=ranks[1].get("matmuls"),
            delay_calibrated_ms=ranks[1].get("delay_calibrated_ms"),
            delay_measured_ms=ranks[1].get("delay_measured_ms"),
        )
    run, s = report_of(out / "run")
    errors = [e for r in ranks for e in r.get("errors", [])] + list(s["scope"]["errors"])
    c.expect("no scope errors", not errors, "; ".join(dict.fromkeys(errors)) or "none")
    d = s["distributed"]
    per_rank = {r["rank"]: r for r in d["per_rank"]}
    c.numbers.update(
        device=run.meta.get("device"),
        step_median_ms=s["timing"]["median_ms"],
        stragglers=d["stragglers"],
        transfer_ms=d["transfer_ms"],
        lost_to_imbalance=d["lost_to_imbalance"],
        per_rank={
            str(r): {k: per_rank[r][k] for k in ("local_ms", "comm_ms", "sync_wait_ms", "critical_share")}
            for r in per_rank
        },
        findings=[f"{f['severity']} {f['code']} {f['ranks']}" for f in s["findings"]],
    )
    local = [num(per_rank.get(r, {}).get("local_ms")) for r in (0, 1)]
    c.expect(
        "meta.json device",
        run.meta.get("device") == ctx.device_name,
        f"{run.meta.get('device')!r}, expected {ctx.device_name!r}",
    )
    estimated, counted = num(run.meta.get("flops_per_step")), num(ranks[0].get("flops_per_step"))
    c.numbers.update(flops_estimated_by_pytscope=estimated, flops_counted_here=counted)
    if math.isfinite(estimated):
        c.expect(
            "pytscope's FLOP estimate",
            abs(rel(estimated, counted)) <= 0.05,
            f"{estimated:.4g} estimated on a warm-up step vs {counted:.4g} counted on the bare model",
        )
    else:
        c.note("pytscope recorded no FLOPs per step (its estimate on a warm-up step did not run or failed)")
    straggler = [f for f in s["findings"] if f["code"] == "DIST.STRAGGLER"]
    c.expect(
        "rank 1 is DIST.STRAGGLER",
        d["stragglers"] == [1] and bool(straggler) and straggler[0]["ranks"] == [1],
        f"stragglers {d['stragglers']}, findings {c.numbers['findings']}",
    )
    wait0 = per_rank.get(0, {}).get("sync_wait_ms") or 0.0
    c.expect(
        "rank 0's wait is sync wait",
        wait0 >= WAIT_SHARE_OF_DELAY * injected,
        f"rank 0 sync wait {wait0:.2f} ms for {injected:.2f} ms injected (needs >= {WAIT_SHARE_OF_DELAY:.0%})",
    )
    transfer = d["transfer_ms"] if d["transfer_ms"] is not None else math.inf
    c.headline = (
        f"stragglers {d['stragglers']}; local work {local[0]:.2f} / {local[1]:.2f} ms; rank 0 sync wait "
        f"{wait0:.2f} ms for {injected:.1f} ms injected{' (measured)' if gpu else ''}; transfer {transfer:.2f} ms"
    )
    c.expect(
        "transfer estimate small",
        transfer <= TRANSFER_SHARE_OF_WAIT * wait0,
        f"transfer {transfer:.2f} ms vs rank 0 sync wait {wait0:.2f} ms",
    )
    return c


def check_nccl(ctx: Ctx) -> Check:
    c = Check("nccl", "1-rank NCCL group + DDP: step time with/without Scope, unsynchronized blocks")
    import torch.distributed as dist

    if not ctx.cuda:
        return c.skip(f"needs CUDA ({ctx.no_cuda}) for an NCCL process group")
    if not dist.is_available() or not dist.is_nccl_available():
        return c.skip("torch.distributed.is_nccl_available() is False in this torch build")
    size = ctx.sizes["small"]
    out = ctx.tmp / "nccl"
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(
        device="cuda",
        bf16=ctx.bf16,
        size=dataclasses.asdict(size),
        steps=ctx.steps(500, 60),  # long blocks: the first live diagnosis (~15 ms) is a one-off per run
        pairs=ctx.steps(3, 2),
        interval=50,
        out=str(out),
    )
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    env = child_env(ctx, port)
    env.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reason for a failure, in the log tail
    res = run_processes(
        [worker_command("nccl", 0, 1, port, spec_path)], env, process_timeout(ctx), out / "logs"
    )
    c.numbers.update(size=dataclasses.asdict(size), steps_per_block=spec["steps"], pairs=spec["pairs"])
    results = rank_results(c, "the NCCL process finished", res, [out / "rank0.json"])
    if results is None:
        return c
    r = results[0]
    c.numbers.update({k: r[k] for k in ("nccl_version", "block_mean_ms", "gather_ms_per_block", "pytscope")})
    c.expect("no scope errors", not r["errors"], "; ".join(r["errors"]) or "none")
    ratios = [b / a for a, b in r["pairs_mean_ms"]]
    pct = 100 * (statistics.median(ratios) - 1)
    blocks = r["block_mean_ms"]
    # Informational: what is left once the gathers (every `interval` steps, counted in the mean) are taken out.
    less = [b / a for a, b in zip(blocks["without"], blocks["with_less_gathers"], strict=True)]
    c.numbers.update(
        overhead_pct=pct,
        overhead_pct_per_pair=[100 * (x - 1) for x in ratios],
        overhead_pct_less_gathers=100 * (statistics.median(less) - 1),
    )
    limit = OVERHEAD_SMOKE_LIMIT if ctx.quick else NCCL_OVERHEAD_BUDGET
    c.expect("overhead", pct <= 100 * limit, f"{pct:+.2f}% (limit {100 * limit:.0f}%)")
    p = r["pytscope"]
    diff = rel(num(p["median_ms"]), p["block_mean_ms"])
    c.headline = (
        f"{pct:+.2f}% at {statistics.median(r['block_mean_ms']['without']):.2f} ms steps; pytscope step "
        f"{num(p['median_ms']):.3f} vs block {p['block_mean_ms']:.3f} ms; comm {num(p['comm_median_ms']):.3f} ms"
    )
    c.expect(
        "pytscope median step vs the block's timing",
        abs(diff) <= ASYNC_STEP_TOLERANCE,
        f"{num(p['median_ms']):.3f} ms vs {p['block_mean_ms']:.3f} ms ({100 * diff:+.2f}%)",
    )
    c.expect(
        "gradient syncs counted", p["grad_syncs"] == p["steps"], f"{p['grad_syncs']} for {p['steps']} steps"
    )
    c.expect(
        "meta.json device", p["device"] == ctx.device_name, f"{p['device']!r}, expected {ctx.device_name!r}"
    )
    return c


# -- workers (separate processes) -------------------------------------------------------------------------
def worker_ddp(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from pytscope_core import Scope
    from pytscope_core.demo import spin

    device, bf16 = spec["device"], spec["bf16"]
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one GPU
    else:
        torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    out = Path(spec["out"])
    info: dict[str, Any] = {"rank": rank}
    try:
        size = Size(**spec["size"])
        model, opt, xs, ys = make_job(size, device, seed=rank)
        if rank == 0:  # what pytscope's own FLOP estimate (on a warm-up step) should find
            info["flops_per_step"] = count_flops(model, xs[0], ys[0], device, bf16)
        slow = rank == world - 1
        delay: Callable[[], None] | None = None
        measured: Callable[[], list[float]] | None = None
        if slow and spec["delay"] == "gpu":
            # Calibrated before DDP's constructor (a collective) while rank 0 may still be setting up on the
            # same GPU: the length it ran for in each step is measured as well, and that is what is reported.
            delay, info["matmuls"], info["delay_calibrated_ms"], measured = _gpu_delay(spec["delay_ms"])
        elif slow:
            delay, info["delay_ms"] = (lambda: spin(spec["delay_ms"])), spec["delay_ms"]
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)
        scope = Scope(out / "run", interval=spec["interval"], console=False)
        loader = Batches(xs, ys, spec["steps"])
        scope.watch(ddp, opt, loader)
        run_steps(ddp, opt, loader, device, bf16, scope, sync_each=False, before_forward=delay)
        scope.finish()
        if measured is not None:
            # The delay as it ran, next to rank 0's steps on the same GPU, not as calibrated before them.
            times = measured()
            steady = times[WARMUP:] or times
            info["delay_ms"] = statistics.median(steady)
            info["delay_measured_ms"] = {"min": min(steady), "median": info["delay_ms"], "max": max(steady)}
        info["errors"] = list(getattr(scope, "errors", []))
        (out / f"rank{rank}.json").write_text(json.dumps(info))
    finally:
        dist.destroy_process_group()


def _gpu_delay(target_ms: float) -> tuple[Callable[[], None], int, float, Callable[[], list[float]]]:
    """Extra GPU work of about `target_ms` queued without blocking the host: square fp32 matmuls. Returns the
    delay, its matmul count, its calibrated length in ms, and a reader of its length in each step as CUDA
    events around it measured (all of them complete once the loop's last sync has returned)."""
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    buf = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, a, out=buf)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.mm(a, a, out=buf)
    end.record()
    end.synchronize()
    per = start.elapsed_time(end) / 20
    n = max(1, round(target_ms / per))
    stamps: list[tuple[Any, Any]] = []

    def delay() -> None:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        for _ in range(n):
            torch.mm(a, a, out=buf)
        last.record()
        stamps.append((first, last))

    def measured() -> list[float]:
        if stamps:
            stamps[-1][1].synchronize()
        return [first.elapsed_time(last) for first, last in stamps]

    return delay, n, n * per, measured


def worker_nccl(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from pytscope_core import Scope

    torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=90))
    out = Path(spec["out"])
    try:
        size, bf16, steps = Size(**spec["size"]), spec["bf16"], spec["steps"]
        model, opt, xs, ys = make_job(size, "cuda")
        # Given, so that pytscope's one-off FLOP count on a warm-up step stays out of the timed blocks.
        flops = count_flops(model, xs[0], ys[0], "cuda", bf16)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        run_steps(ddp, opt, Batches(xs, ys, 20), "cuda", bf16, sync_each=False)  # NCCL and allocator warm-up
        # pytscope's own one-offs (its imports, the first gather and diagnosis) outside the timed blocks.
        warm = Batches(xs, ys, 2 * spec["interval"])
        warm_scope = Scope(out / "warm-up", interval=spec["interval"], console=False, flops_per_step=flops)
        warm_scope.watch(ddp, opt, warm)
        run_steps(ddp, opt, warm, "cuda", bf16, warm_scope, sync_each=False)
        warm_scope.finish()
        pairs: list[tuple[float, float]] = []
        less_gathers: list[float] = []  # the block's mean step less the scope's gathers in it
        gathers: list[float] = []  # ms of gathers in each block
        errors: list[str] = []
        last_run: Path | None = None
        for i in range(spec["pairs"]):
            mean: dict[bool, float] = {}
            for with_scope in (False, True) if i % 2 == 0 else (True, False):
                loader = Batches(xs, ys, steps)
                scope = None
                if with_scope:
                    last_run = out / f"run{i}"
                    scope = Scope(last_run, interval=spec["interval"], console=False, flops_per_step=flops)
                    scope.watch(ddp, opt, loader)
                    scope.start()  # its run directory, threads and own group, before the block's clock starts
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run_steps(ddp, opt, loader, "cuda", bf16, scope, sync_each=False)  # ends with one sync
                elapsed_ms = (time.perf_counter() - t0) * 1e3
                mean[with_scope] = elapsed_ms / steps
                if scope is not None and last_run is not None:
                    # Read before finish(): its final gather comes after the block.
                    gathers.append(sum(scope.gather_ms))
                    less_gathers.append((elapsed_ms - gathers[-1]) / steps)
                    scope.finish()
                    errors += scope_errors(scope, last_run)
            pairs.append((mean[False], mean[True]))
        assert last_run is not None
        run, s = report_of(last_run)
        info = {
            "nccl_version": _nccl_version(),
            "pairs_mean_ms": pairs,
            "block_mean_ms": {
                "without": [a for a, _ in pairs],
                "with": [b for _, b in pairs],
                "with_less_gathers": less_gathers,
            },
            "gather_ms_per_block": gathers,
            "errors": errors,
            "pytscope": {
                "median_ms": s["timing"]["median_ms"],
                "block_mean_ms": pairs[-1][1],
                "comm_median_ms": s["timing"]["phases"]["comm"]["median_ms"],
                "backward_median_ms": s["timing"]["phases"]["backward"]["median_ms"],
                "steps": int(run.arrays.n_steps),
                "grad_syncs": int(np.nansum(run.arrays.grad_syncs)),
                "device": run.meta.get("device"),
            },
        }
        (out / "rank0.json").write_text(json.dumps(info))
    finally:
        dist.destroy_process_group()


def _nccl_version() -> str:
    import torch

    try:
        v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
    except Exception as exc:  # informational only
        return f"unknown ({type(exc).__name__})"
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


WORKERS: dict[str, Callable[[int, int, int, dict[str, Any]], None]] = {"ddp": worker_ddp, "nccl": worker_nccl}


def run_worker(args: argparse.Namespace) -> NoReturn:
    """A worker process from start to end: its exit code is the worker's own outcome. Output is flushed and
    the process ends at once, without the interpreter's shutdown, where torch.distributed's teardown has
    aborted a gloo job that had finished."""
    code = 0
    try:
        WORKERS[args.worker](args.rank, args.world, args.port, json.loads(Path(args.spec).read_text()))
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# -- driver -----------------------------------------------------------------------------------------------
CHECKS: dict[str, Callable[[Ctx], Check]] = {
    "torch": check_torch,
    "lightning": check_lightning,
    "accelerate": check_accelerate,
    "overhead_small": lambda ctx: overhead(ctx, "small"),
    "overhead_large": lambda ctx: overhead(ctx, "large"),
    "ddp_gpu_delay": lambda ctx: check_ddp(ctx, "gpu"),
    "ddp_host_delay": lambda ctx: check_ddp(ctx, "host"),
    "nccl": check_nccl,
}
SIZES_NEEDED = {
    "torch": "small",
    "lightning": "small",
    "accelerate": "small",
    "overhead_small": "small",
    "nccl": "small",
}


def make_sizes(ctx: Ctx, wanted: set[str]) -> None:
    if ctx.cuda:
        base = Size("", batch=2048, in_dim=1024, width=4096, depth=4, out_dim=1000)
        targets = {"small": 5.0, "large": 50.0}
    else:
        base = Size("", batch=128, in_dim=64, width=256, depth=2, out_dim=10)
        targets = {"small": 1.0, "large": 4.0 if ctx.quick else 10.0}
    if "small" in wanted or "large" in wanted:
        ctx.sizes["small"] = calibrate(ctx, base, "small", targets["small"])
    if "large" in wanted:
        start = dataclasses.replace(
            base, batch=max(16, int(ctx.sizes["small"].batch * targets["large"] / targets["small"]))
        )
        ctx.sizes["large"] = calibrate(ctx, start, "large", targets["large"])


def run_check(name: str, ctx: Ctx) -> Check:
    t0 = time.monotonic()
    size = "large" if name == "overhead_large" else SIZES_NEEDED.get(name)
    if t0 > ctx.deadline:
        c = Check(name, "").skip("time budget (--budget-s) spent before this check could start")
    elif size is not None and size not in ctx.sizes:
        c = Check(name, "", status="fail", reason=ctx.sizes_error or f"no {size} step size")
    else:
        try:
            c = CHECKS[name](ctx)
        except Exception as exc:
            c = Check(name, "", status="fail")
            tail = " | ".join(traceback.format_exc().strip().splitlines()[-4:])
            c.reason = f"raised {type(exc).__name__}: {exc} ({tail})"
    c.seconds = time.monotonic() - t0
    return c


def render(checks: list[Check], header: str) -> None:
    from rich.console import Console
    from rich.table import Table

    colour = {"pass": "green", "fail": "bold red", "skipped": "yellow"}
    table = Table(title=f"pytscope GPU check: {header}", show_lines=True)
    for col in ("check", "status", "measured", "reason / notes"):
        table.add_column(col, overflow="fold")
    for c in checks:
        notes = "; ".join([c.reason, *c.numbers.get("notes", [])]).strip("; ")
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.headline, notes)
    Console(width=max(120, Console().width)).print(table)


def plain(x: Any) -> Any:
    """JSON-safe: non-finite floats become null."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (np.floating, np.integer)):
        return plain(x.item())
    if isinstance(x, np.ndarray):
        return plain(x.tolist())
    return x


def write_json(path: Path, data: Any) -> str:
    """Write `data` as JSON through a temporary file beside it, so a reader never sees half a file; values JSON
    cannot hold are written as their `str()`, non-finite floats as null. Returns why it failed, or "": the run
    goes on either way."""
    try:
        text = json.dumps(plain(data), indent=1, allow_nan=False, default=str)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        os.replace(partial, path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def archive_path(out: Path) -> Path:
    """Where the work folder's archive goes: beside the JSON, `gpu_check.json` -> `gpu_check.work.tar.gz`."""
    return out.with_name(f"{out.stem}.work.tar.gz")


def pack(
    folder: Path, dest: Path, limit: int = ARCHIVE_LIMIT_BYTES, file_limit: int = ARCHIVE_FILE_LIMIT_BYTES
) -> dict[str, Any]:
    """`folder` as one .tar.gz at `dest`, at most `limit` bytes of tar blocks (so the compressed file is
    smaller). Logs and JSON go in first, then the other files smallest first; files over `file_limit`, and those
    that would pass `limit`, are left out and listed. Each file is read whole before it goes in, so one that a
    killed worker left half-written cannot break the archive."""

    def size(f: Path) -> int:
        try:
            return f.stat().st_size
        except OSError:  # gone since it was listed
            return -1

    order = {".log": 0, ".json": 1}
    sized = [(f, size(f)) for f in folder.rglob("*") if f.is_file() and not f.is_symlink() and f != dest]
    sized.sort(key=lambda fs: (order.get(fs[0].suffix, 2), fs[1], str(fs[0])))
    used, added, skipped = 2 * 512, 0, []  # the archive's two closing blocks
    partial = dest.with_name(dest.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for f, n in sized:
            name = f.relative_to(folder).as_posix()
            try:
                data = f.read_bytes() if 0 <= n <= file_limit else None
            except OSError as exc:
                skipped.append(f"{name} ({type(exc).__name__})")
                continue
            cost = 512 + -(-len(data) // 512) * 512 if data is not None else 0
            if data is None or used + cost > limit:
                skipped.append(f"{name} ({n} bytes)")
                continue
            info = tarfile.TarInfo(f"{folder.name}/{name}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
            used, added = used + cost, added + 1
    os.replace(partial, dest)
    return {
        "path": str(dest),
        "bytes": dest.stat().st_size,
        "files": added,
        "skipped": skipped[:50],
        "skipped_count": len(skipped),
    }


class Progress:
    """The JSON file of results, kept current, and the running check's time limit.

    The JSON is rewritten as each check starts (naming it as `running`) and ends. A check runs under a timer
    of its own: when the timer fires first, the timer thread writes the check as failed, kills the worker
    processes still running (keeping their logs' tails), prints every thread's stack to stderr, packs the work
    folder and ends the process with TIMEOUT_EXIT, as the check that hung cannot be interrupted from Python.
    """

    def __init__(self, out: Path, t_start: float, hard_deadline: float) -> None:
        self.out = out
        self.t_start, self.hard_deadline = t_start, hard_deadline
        self.env: dict[str, Any] = {}
        self.checks: list[Check] = []
        self.work: Path | None = None  # the folder packed beside the JSON
        self.archive: dict[str, Any] | None = None
        self.running = ""  # the check (or "setup", "calibration") under way
        self.timed_out = ""
        self._since = 0.0
        self._timer: threading.Timer | None = None
        self._state = threading.Lock()  # between the main thread and a timer that fires as its check ends
        self._writing = threading.Lock()

    def write(self, done: bool = False) -> dict[str, Any]:
        result = {
            "environment": self.env,
            "seconds": time.monotonic() - self.t_start,
            "complete": done,
            "running": self.running,
            "timed_out": self.timed_out,
            "failed": [c.name for c in self.checks if c.status == "fail"],
            # Shallow: dataclasses.asdict deep-copies, which a value that cannot be copied would end here.
            "checks": [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in self.checks],
            "archive": self.archive,
        }
        # Bounded: a timer that fires during the main thread's write must still get its own written.
        locked = self._writing.acquire(timeout=10)
        try:
            error = write_json(self.out, result)
            if error:
                print(f"writing {self.out} failed: {error}", file=sys.stderr, flush=True)
                brief = {k: result[k] for k in ("seconds", "complete", "running", "timed_out", "failed")}
                write_json(self.out, {**brief, "write_error": error})
        finally:
            if locked:
                self._writing.release()
        return result

    def begin(self, name: str, limit_s: float, ctx: Ctx | None = None) -> None:
        """Arm `name`'s timer (its limit, or what is left before the run's hard deadline) and say it runs."""
        now = time.monotonic()
        seconds = max(0.0, min(limit_s, self.hard_deadline - now))
        timer = threading.Timer(seconds, self._expired, args=(name, seconds))
        timer.daemon = True
        with self._state:
            self.running, self._since, self._timer = name, now, timer
        if ctx is not None:
            ctx.check_deadline = now + seconds
        timer.start()
        self.write()

    def end(self, check: Check | None = None) -> None:
        """The running check ended in time: disarm its timer, record it (setup and calibration record none)."""
        with self._state:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.running = ""
            if check is not None:
                self.checks.append(check)
        self.write()

    def pack(self) -> None:
        if self.work is None:
            return
        try:
            self.archive = pack(self.work, archive_path(self.out))
        except Exception as exc:
            self.archive = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"packing {self.work} failed: {self.archive['error']}", file=sys.stderr, flush=True)

    def _expired(self, name: str, seconds: float) -> None:
        # The lock is held until the process ends: the main thread, should its check return now, waits.
        self._state.acquire()
        if self.running != name:  # it ended as the timer fired
            self._state.release()
            return
        c = Check(
            name, "", status="fail", reason=f"timed out after {seconds:.0f} s (thread stacks on stderr)"
        )
        c.seconds = time.monotonic() - self._since
        # The stacks first: once its workers are stopped, a check waiting on them returns, and its thread
        # would be found past the check, in `end`, instead of where it hung.
        print(
            f"\n{name}: timed out after {seconds:.0f} s; every thread's stack:", file=sys.stderr, flush=True
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        tails = stop_processes()
        if tails:
            c.numbers["log_tail"] = tails
        self.checks.append(c)
        self.running, self.timed_out = "", name
        self.write()
        self.pack()
        self.write()
        print(f"results: {self.out} (ended: {name} timed out)", flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(TIMEOUT_EXIT)


def environment(ctx: Ctx) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import pytscope_core

    env: dict[str, Any] = {
        "device": ctx.device,
        "device_name": ctx.device_name,
        "compute": "bf16 autocast" if ctx.cuda and ctx.bf16 else "fp32",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pytscope": pytscope_core.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "quick": ctx.quick,
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "table_peaks": table_peaks(ctx.device_name),
        "sizes": {k: dataclasses.asdict(v) for k, v in ctx.sizes.items()},
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(device_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default="gpu_check.json", help="JSON file of results (default gpu_check.json)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes for CI (under a minute on 2 CPU cores)"
    )
    parser.add_argument(
        "--checks", default=",".join(CHECKS), help=f"comma list of checks ({', '.join(CHECKS)})"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="no check starts after this (290; quick 150)"
    )
    parser.add_argument("--cpu", action="store_true", help="run as if there were no GPU")
    parser.add_argument(
        "--work", default=None, help="keep run directories and worker logs here (default: a temporary folder)"
    )
    parser.add_argument(
        "--stacks-after-s",
        type=float,
        default=400.0,
        help="no check runs past this: the one running is written as timed out, every thread's stack printed, "
        f"and the process exits {TIMEOUT_EXIT} (a hang shows where)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)

    wanted = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    t_start = time.monotonic()
    progress = Progress(Path(args.out), t_start, t_start + args.stacks_after_s)
    progress.env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "argv": sys.argv if argv is None else argv,
        "checks": wanted,
    }
    progress.write()  # before anything that can hang or fail: importing torch, the first CUDA call
    faulthandler.dump_traceback_later(args.stacks_after_s + BACKSTOP_S, exit=True)
    warnings.filterwarnings("ignore")
    workdir: contextlib.AbstractContextManager[str]
    if args.work:  # a subfolder of this run's own: a rerun must not read an earlier run's directories
        Path(args.work).mkdir(parents=True, exist_ok=True)
        workdir = contextlib.nullcontext(
            tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=args.work)
        )
    else:
        workdir = tempfile.TemporaryDirectory(prefix="pytscope-gpu-check-")
    with workdir as tmp:
        progress.work = Path(tmp)
        try:
            ctx = setup(args, progress, Path(tmp), t_start)
            for name in wanted:
                print(f"  {name} ...", end=" ", flush=True)
                progress.begin(name, CHECK_LIMIT_S.get(name, DEFAULT_CHECK_LIMIT_S), ctx)
                c = run_check(name, ctx)
                progress.end(c)
                why = f": {c.reason[:300]}" if c.status == "fail" else ""  # the output's tail alone says why
                print(f"{c.status} ({c.seconds:.1f} s){why}", flush=True)
        finally:  # an error of this script's own too: the JSON says what was running, the archive is there
            progress.pack()
            progress.write(done=not progress.running)
    faulthandler.cancel_dump_traceback_later()
    checks = progress.checks
    render(checks, f"{ctx.device_name}{', quick' if ctx.quick else ''}, {time.monotonic() - t_start:.0f} s")
    print(f"results: {args.out}; work folder packed into {archive_path(Path(args.out))}")
    return 1 if any(c.status == "fail" for c in checks) else 0


def setup(args: argparse.Namespace, progress: Progress, tmp: Path, t_start: float) -> Ctx:
    """The device, the environment (written to the JSON) and the step sizes, each under a time limit."""
    progress.begin("setup", CHECK_LIMIT_S["setup"])
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        torch.set_num_threads(1)  # as the overhead benchmark: steadier timing on shared cores
    budget = args.budget_s if args.budget_s is not None else (150.0 if args.quick else 290.0)
    ctx = Ctx(
        device="cuda" if cuda else "cpu",
        device_name=torch.cuda.get_device_name(0) if cuda else "cpu",
        quick=args.quick,
        tmp=tmp,
        bf16=cuda and torch.cuda.is_bf16_supported(),
        deadline=t_start + budget,
        no_cuda="" if cuda else ("--cpu given" if args.cpu else "torch.cuda.is_available() is False"),
    )
    try:
        progress.env.update(environment(ctx))
    except Exception as exc:  # informational: the checks say what they need
        progress.env["environment_error"] = f"{type(exc).__name__}: {exc}"
    progress.end()
    print(f"pytscope GPU check on {ctx.device_name} ({ctx.device}), torch {torch.__version__}", flush=True)

    wanted = progress.env["checks"]
    needs = {SIZES_NEEDED[n] for n in wanted if n in SIZES_NEEDED} | (
        {"large"} if "overhead_large" in wanted else set()
    )
    progress.begin("calibration", CHECK_LIMIT_S["calibration"], ctx)
    try:
        make_sizes(ctx, needs)
    except Exception as exc:
        ctx.sizes_error = f"calibrating the step sizes raised {type(exc).__name__}: {exc}"
        print(ctx.sizes_error, flush=True)
    for s in ctx.sizes.values():
        print(f"  size {s.name}: batch {s.batch}, MLP {s.in_dim}-{s.width}x{s.depth}-{s.out_dim}, "
              f"{s.measured_ms:.2f} ms/step (target {s.target_ms:g})", flush=True)  # fmt: skip
    progress.env["sizes"] = {k: dataclasses.asdict(v) for k, v in ctx.sizes.items()}
    progress.end()
    return ctx


if __name__ == "__main__":
    sys.exit(main())
