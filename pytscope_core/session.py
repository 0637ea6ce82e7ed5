"""One segment of a run on this rank, from the moment the ranks first meet until finish.

`Scope.start()` creates it (collectively): the `Coordinator` agrees on the run directory and tells rank 0
where every rank runs; on rank 0 the `RunReporter` opens it and `LiveDiagnosis` starts on its own ingest
thread (`BackgroundIngest`); every rank starts its hang `Watchdog`, chains SIGTERM, keeps word of the ends
no Python of its own would tell (`ProcessEnds`) and times the loop's torch.distributed collectives.
From then on the session gathers every `interval` steps, and at the end either meets the other ranks for a
final gather (`finish`) or, when they may be gone, leaves its own rows behind (`stop`); rank 0 drains its
ingest thread before the summary reads the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .clocks import CudaEventClock
from .collectives import TorchCollectives
from .context import FINISH_AFTER_TEARDOWN, FINISH_WITHOUT_ALL, LEFT, STOPPED, Segment
from .coordinator import default_store, dist_alive
from .findings import Finding
from .records import COL
from .rundir import run_warmup
from .shards import uneven_shards_finding
from .signals import ProcessEnds, SignalChain
from .untrained import UntrainedAlert

# (imported now: it binds the clocks early)
from .watchdog import AUTO_MIN_S, AUTO_STEP_FACTOR, AUTO_WARMUP_S, Watchdog, left_waiting, position

if TYPE_CHECKING:
    from .scope import Scope

HANG_DRAIN_S = 5.0  # on a hang or SIGTERM, how long rank 0 waits for its ingest thread to write what it holds


NO_OPTIMIZER = (
    "no optimizer watched: each iteration of the loop is a step (gradient accumulation is not seen) and the "
    "optimizer's time is counted as other; pass the optimizer to watch()"
)


RUN_NOT_OPENED = (
    "rank 0 could not set up the run directory (its console says why): the scope is off on every rank, and "
    "training goes on"
)


class RunSession:
    """Gathers, the final gather and report, this rank's own rows, the watchdog and SIGTERM, for one scope."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.run_dir: Path
        self.run_dir, scope.segment = scope.coordinator.start(scope.run_dir, scope.segment)  # learns the rank
        self.rank = scope.coordinator.rank
        self.reporter: Any = None
        self.live: Any = None
        self.untrained: UntrainedAlert | None = None  # rank 0: batches that run on without an optimizer step
        self.ingest: Any = None  # rank 0: ingest.BackgroundIngest
        self.gather_ms: list[float] = []  # each gather: resolving the window and the exchange, every rank
        self.traffic: list[tuple[int, int]] = []  # each gather: payload bytes (sent, received) on this rank
        self._epoch_offset = time.time() - time.perf_counter()  # host perf_counter -> seconds since epoch
        unopened: Exception | None = None  # rank 0: the run directory could not be set up (said to all below)
        if self.rank == 0:
            try:
                self._open_run()
            except Exception as exc:
                unopened = exc
        if scope.recorder.iteration_steps:
            scope.note(NO_OPTIMIZER)
        self._watchdog: Any = None
        self.own_rows = OwnRows(scope, self.run_dir, self._epoch_offset)
        self._sigterm = SignalChain(self._on_sigterm)
        self._sigterm.install()
        self.ends = ProcessEnds(self.run_dir, self.rank, scope.segment)  # (Ctrl-C, fatal signals)
        self.ends.install()
        self._collectives = TorchCollectives(scope.hooks, scope.fail)  # the loop's `dist.barrier()`, ...
        if scope.options.hang_timeout is not None:
            self._start_watchdog()
        try:
            self._meet_at_start(unopened)
        except Exception:
            self.release()  # (the scope disables itself: what this session opened is closed first)
            raise
        self._collectives.install()

    def _meet_at_start(self, unopened: Exception | None) -> None:
        """Every rank learns whether rank 0 set the run up (a rank-0 failure, e.g. a `run_dir` it cannot create,
        disabled rank 0 alone: the others then waited `gather_timeout` for it at their next collective), and
        rank 0 every rank's watched loader's batches per epoch, for DATA.UNEVEN_SHARDS (-1 where unknown or none
        is watched; under Lightning the callback checks its own). Collective when distributed."""
        batches, coordinator = self.scope.hooks.loader_batches, self.scope.coordinator
        mine = [-1 if batches is None else batches, unopened is None]
        every_rank = coordinator.all_gather_ints(mine) or [mine]
        if unopened is not None:
            raise unopened
        if not all(opened for _, opened in every_rank):
            raise RuntimeError(RUN_NOT_OPENED)
        finding = uneven_shards_finding([b for b, _ in every_rank]) if batches is not None else None
        if finding is not None and self.live is not None:
            self.live.add(finding, self.scope.step_label())

    def _open_run(self) -> None:
        from . import analysis, render, summary  # noqa: F401  (imported now, not in the middle of a step)
        from .ingest import BackgroundIngest
        from .live import LiveDiagnosis
        from .reporter import RunReporter

        scope = self.scope
        self.reporter = RunReporter(self.run_dir, run_meta(scope), scope.options.console)
        host_start = scope.recorder.host_start_ns
        segment = Segment(
            index=scope.segment,
            started_s=host_start / 1e9 + self._epoch_offset if host_start else time.time(),
            resumed_from_step=scope.resumed_from_step,
            world_size=scope.coordinator.world_size,
        )
        self.reporter.segment(**dataclasses.asdict(segment))
        warmup = run_warmup(self.run_dir, scope.options.warmup)  # (as its reports read it: meta.json's)
        self.live = LiveDiagnosis(self.reporter, segment, warmup, scope.errors, scope.metrics_sink)
        placement = scope.coordinator.placement
        if placement.known:  # every launch: a resumed run may land on other hosts
            self.reporter.learnt(**placement.to_meta())
        self.ingest = BackgroundIngest(self.live, threaded=scope.coordinator.world_size > 1)
        self.untrained = UntrainedAlert(scope.recorder, self.live.add)
        self.reporter.messages(scope.errors, scope.notes)  # those from before the run existed (in watch())
        if scope.flops.learnt:
            self.reporter.learnt(**scope.flops.take_learnt())

    # -- hangs ----------------------------------------------------------------------------------------
    def _start_watchdog(self) -> None:

        coordinator = self.scope.coordinator
        self._watchdog = Watchdog(
            self.scope.recorder,
            default_store() if coordinator.world_size > 1 else None,
            self.rank,
            coordinator.world_size,
            self.run_dir,
            self._hang_timeout_s,
            self.scope.options.on_hang,
            self._report_hang,
            prefix=coordinator.store_prefix,
            disabled_key=coordinator.disabled_key,
            flush=self.own_rows.flush,
            placement=coordinator.placement if self.rank == 0 else None,
            warmup_timeout_s=self._warmup_hang_timeout_s,
        )
        self._watchdog.start()

    def _hang_timeout_s(self) -> float | None:
        """The fixed timeout, or "auto": after warm-up, 2 minutes or 20x the slowest step (`step_walls`)."""
        scope = self.scope
        timeout = scope.options.hang_timeout
        if timeout != "auto":
            return float(timeout)  # type: ignore[arg-type]
        if self._in_warmup():
            return None
        return max(AUTO_MIN_S, AUTO_STEP_FACTOR * self._watchdog.slowest_step_s)

    def _warmup_hang_timeout_s(self) -> float | None:
        """Under "auto", during warm-up: a wait of AUTO_WARMUP_S inside a collective (see the watchdog)."""
        return AUTO_WARMUP_S if self.scope.options.hang_timeout == "auto" and self._in_warmup() else None

    def _in_warmup(self) -> bool:
        return self._past_warmup() <= 0

    def _past_warmup(self) -> int:
        scope = self.scope
        return scope.recorder.steps_done - scope.resumed_from_step - scope.options.warmup

    def waiting_in(self, status: str) -> str:
        """Say `status` ("gather", `watchdog.JOINED` ...) with this rank's heartbeats instead of the phase of its
        last mark, until the next call; return the one it replaces."""
        if self._watchdog is None:
            return ""
        previous, self._watchdog.status = self._watchdog.status, status
        return previous

    def _report_hang(self, finding: Finding) -> None:
        """Called from rank 0's watchdog thread while the main thread is blocked: the gathers already handed to
        the ingest thread are written before the process may end."""
        if self.live is not None:
            self.live.hang(finding, self.scope.step_label())
            self.ingest.drain(HANG_DRAIN_S)

    def stop_watching(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    def disabled(self) -> None:
        """The scope disabled itself: no more watching for progress (without marks that would call a hang),
        and the run says why (the errors and notes not written yet)."""
        self.stop_watching()
        if self.reporter is not None:
            with contextlib.suppress(OSError, ValueError):
                self.reporter.messages(self.scope.errors, self.scope.notes)

    def _on_sigterm(self) -> None:
        if self.ingest is not None:  # rank 0: what the other ranks sent is written before the process ends
            self.ingest.drain(HANG_DRAIN_S)
        where = self._watchdog.whereabouts() if self._watchdog is not None else position(self.scope.recorder)
        self.own_rows.flush("SIGTERM" + (f" while {where}" if where else ""))

    # -- gathers --------------------------------------------------------------------------------------
    def gather(self, final: bool = False) -> None:
        t0 = time.perf_counter()
        scope = self.scope
        rec = scope.recorder
        rows = rec.drain(self.rank, scope.segment, self._epoch_offset)
        joined_at = math.nan if scope.joins.joined_at is None else float(scope.joins.joined_at)
        checksum = replica_checksum(scope.replicated_model) if math.isnan(joined_at) else math.nan  # (behind)
        counts = (float(rec.steps_done), float(rec.grad_syncs), float(rec.micro_batches))
        counters = (*counts, checksum, joined_at)
        status = self.waiting_in("gather")
        if self._watchdog is not None:
            self._watchdog.step_walls(rows[max(0, rows.shape[0] - self._past_warmup()) :, COL["wall_ms"]])
        self.own_rows.in_flight = rows
        threaded = self.ingest is not None and self.ingest.threaded
        if self.live is not None and threaded:  # a slow tracker: the others wait in the exchange, not a step
            self.live.publish_metrics(scope.step_label())  # the diagnosis done on the ingest thread since
        try:
            ex = scope.coordinator.exchange(counters, rows)
            self.own_rows.in_flight = None
        finally:
            if self._watchdog is not None:
                self._watchdog.status = "finished" if final else status
        self.gather_ms.append((time.perf_counter() - t0) * 1e3)
        gatherer = scope.coordinator.gatherer
        if gatherer is not None:
            self.traffic.append((gatherer.traffic.sent, gatherer.traffic.received))
        if self.live is not None and ex is not None:
            from .ingest import Gathered

            self.reporter.messages(scope.errors, scope.notes)  # (a run killed later still says them)
            # What rank 0 learnt since the last gather (e.g. FLOPs counted in warm-up) goes with the rows.
            learnt = scope.flops.take_learnt() if scope.flops.learnt else None
            gathers, step = scope.coordinator.gathers, scope.step_label()
            scalars = scope.scalars.take(scope.segment)
            self.ingest.submit(Gathered(ex.headers, ex.rows, gathers, step, final, scalars, learnt))
            if not threaded:  # diagnosed in place (one process): this gather's, on the training thread
                self.live.publish_metrics(step)
            if self.untrained is not None:
                self.untrained.ended()

    # -- the end --------------------------------------------------------------------------------------
    def finish(self, forgotten: bool = False) -> Any:
        """Meet every rank that arrives in time for a last gather; rank 0 then writes the summary. `forgotten`:
        at interpreter exit, finish() never having been called."""
        scope, coordinator = self.scope, self.scope.coordinator
        if self._watchdog is not None:
            self._watchdog.status = "finished"
        if scope.enabled:
            if self.untrained is not None:
                self.untrained.ended(run_ends=True)
            # The open step, unstepped, with a non-finite loss on this rank is kept before the meeting (a
            # SIGTERM while waiting writes it); with one on any rank, it is kept on every rank after it.
            recorder, absent = scope.recorder, None
            skipped = recorder.skipped_at_end()
            if skipped:
                recorder.close(keep_skipped=True)
            if coordinator.distributed and dist_alive():
                give_up = functools.partial(left_mid_training, scope) if forgotten else None
                absent = coordinator.all_ranks_arrive(give_up, skipped)
            recorder.close(keep_skipped=absent is None and coordinator.skipped_at_finish)
            if coordinator.distributed and not dist_alive():
                scope.note(
                    ("finish() was not called; at exit" if forgotten else "finish() ran after")
                    + " the process group was destroyed: the other ranks' last steps go to their own files "
                    "(ranks/), which this summary holds only if they came first (`pytscope report` reads them); "
                    "call finish() before destroy_process_group() / accelerator.end_training()",
                    error=True,
                    warn=self.rank == 0,  # (every rank would say the same, from rank 0's side)
                )
                coordinator.gatherer = None
                if self.rank != 0:  # rank 0 writes its own below, as a process of its own
                    self.own_rows.flush(FINISH_AFTER_TEARDOWN)
            elif absent is not None:
                scope.note(absent, error=True)
                self.own_rows.flush(absent if LEFT in absent else FINISH_WITHOUT_ALL)
                coordinator.gatherer = None
            if coordinator.distributed or self.rank == 0:
                self.gather(final=True)
                coordinator.met_at_finish = coordinator.distributed  # every rank took part in that gather
        return self.report()

    def stop(self, reason: str) -> Any:
        """End without meeting the other ranks: this rank's rows go to its own file; rank 0 reports."""
        if self.untrained is not None:
            self.untrained.ended(run_ends=True)
        self.scope.recorder.close(keep_skipped=self.scope.recorder.skipped_at_end())
        self.stop_watching()
        self.own_rows.flush(reason)
        # (Not an error of the scope's: the training ended it, e.g. an exception or Ctrl-C in fit().)
        self.scope.note(f"{STOPPED}{reason}", warn=False)
        return self.report()

    def report(self) -> Any:
        if self.reporter is None:
            return None
        self._close_ingest()
        if self.scope.flops.learnt:
            self.reporter.learnt(**self.scope.flops.take_learnt())
        self.reporter.messages(self.scope.errors, self.scope.notes)
        gatherer = self.scope.coordinator.gatherer
        self.reporter.cost(
            gathers=self.scope.coordinator.gathers,
            gather_ms=_quantiles(self.gather_ms),
            ingest_ms=_quantiles(self.ingest.ingest_ms),  # on rank 0's ingest thread
            handoff_ms=_quantiles(self.ingest.handoff_ms),  # on rank 0's training thread
            diagnoses=self.live.diagnoses,
            diagnoses_skipped=self.ingest.skipped,
            group_create_ms=gatherer.create_ms if gatherer is not None else None,
            bytes_received=_quantiles([float(r) for _, r in self.traffic]),  # rank 0's, per gather
        )
        summary = self.reporter.summary(self.live.standing())
        sink = self.scope.metrics_sink
        if sink is not None:  # the end-of-run numbers too; a logger failing at the end must not cost them
            from .live import metrics

            with contextlib.suppress(Exception):
                sink(metrics(summary, list(summary.findings)), self.scope.step_label())
        return summary

    def _close_ingest(self) -> None:
        """Every gather handed over is written before the summary reads the run (whose metrics replace the last
        diagnosis's)."""
        if not self.ingest.close():
            self.scope.note(
                "the live diagnosis did not finish in time; the summary may miss a gather", error=True
            )
        try:
            self.ingest.raise_error()
        except RuntimeError as exc:
            self.scope.note(str(exc), error=True)

    def release(self) -> None:
        if self.untrained is not None:
            self.untrained.remove()
        self.stop_watching()
        self._sigterm.restore()
        self.ends.restore()
        self._collectives.remove()
        if self.ingest is not None:
            self.ingest.close(timeout_s=HANG_DRAIN_S)
        if self.reporter is not None:
            self.reporter.close()


def run_meta(scope: Scope) -> dict[str, Any]:
    """The run's settings, device and limits, as `meta.json` keeps them."""
    import torch

    from . import __version__
    from .flops import peak_flops_for

    options = scope.options
    device = "cpu"
    mem_limit: float | None = _host_memory()
    if isinstance(scope.recorder.clock, CudaEventClock):
        props = torch.cuda.get_device_properties(scope.recorder.clock.device)
        device, mem_limit = props.name, float(props.total_memory)
    precision = scope.flops.precision or "bf16"
    scope.flops.device = device  # (a precision learnt later, under autocast, corrects the peak: `learnt`)
    return {
        "created_s": time.time(),
        "world_size": scope.coordinator.world_size,
        "interval": options.interval,
        "warmup": options.warmup,
        "integration": scope.integration,
        "step_origin": scope.recorder.step_origin,
        "device": device,
        "mem_limit_bytes": mem_limit,
        "peak_flops": options.peak_flops or peak_flops_for(device, precision),
        "peak_precision": None if options.peak_flops else precision,
        "precision": scope.flops.precision,  # None until the model is seen; autocast's is learnt later
        "flops_per_step": options.flops_per_step,
        "flops_estimated": False,
        "parallelism": scope.parallelism.name,
        "comm_measured": scope.parallelism.comm_measured,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "pytscope": __version__,
        "argv": sys.argv,
    }


def left_mid_training(scope: Scope) -> str | None:
    """At interpreter exit without finish(): why this rank is leaving the job mid-training, where another rank
    waits for it in a collective of training (that rank never comes to finish()); else None."""
    store, coordinator = default_store(), scope.coordinator
    waiting = (
        left_waiting(store, coordinator.store_prefix, coordinator.rank, coordinator.world_size)
        if store
        else None
    )
    if waiting is None:
        return None
    return (
        f"the process{LEFT}without finish() while rank {waiting[0]} waited for it in `{waiting[1]}` "
        "(sys.exit(), or the end of the script, on this rank only)"
    )


def replica_checksum(model: Any) -> float:
    """A cheap fingerprint of the replicated parameters (NaN without a model); DDP replicas must agree bit
    for bit."""
    if model is None:
        return math.nan
    import torch

    with torch.no_grad():
        sums = [p.detach().sum(dtype=torch.float64) for p in model.parameters()]
        return float(torch.stack(sums).sum().item()) if sums else math.nan


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    return {
        "median": float(np.median(a)),
        "p95": float(np.percentile(a, 95)),
        "total": float(a.sum()),
        "n": len(values),
    }


def _host_memory() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


class OwnRows:
    """This rank's closed steps that no gather took yet, written into its own file in the run directory, so
    the report covers every rank up to a hang, a SIGTERM or an exception. `flush` reads the recorder without
    changing it (the caller may be another thread, or a signal handler). A flush that an exception cut short
    (e.g. a second SIGTERM whose handler raised in the middle of it) is done again by the next caller; a later
    one writes again only where steps were done since, under a SIGTERM's reason where that came first (the
    cause: Lightning finishes the batch in flight after it, then raises), else under its own (a hang that
    cleared, then an exception)."""

    def __init__(self, scope: Scope, run_dir: Path, epoch_offset: float) -> None:
        self.scope = scope
        self.run_dir = run_dir
        self.epoch_offset = epoch_offset
        # Rows handed to a gather that has not returned (a peer hung): a flush writes them too.
        self.in_flight: np.ndarray | None = None
        self._flushed: tuple[str, int] | None = None  # (the reason, the steps done when written)
        self._lock = threading.Lock()  # one caller at a time (a signal may arrive during a flush)

    def flush(self, reason: str) -> None:
        scope = self.scope
        if isinstance(scope.recorder.clock, CudaEventClock):
            return  # CUDA events behind a hung kernel never resolve
        if self._flushed is not None and scope.recorder.completed[0] <= self._flushed[1]:
            return  # nothing new since (a hang, then the launcher's SIGTERM)
        if self._flushed is not None and self._flushed[0].startswith("SIGTERM"):
            reason = self._flushed[0]  # the cause: Lightning finishes the batch in flight, then raises
        if not self._lock.acquire(blocking=False):
            return  # a flush is under way: this call interrupted it (a signal) or raced it (the watchdog)
        try:
            from .rundir import append_rank_rows

            rec, rank = scope.recorder, scope.coordinator.rank
            rows = rec.pending_rows(rank, scope.segment, self.epoch_offset)
            in_flight = self.in_flight  # (read once: the main thread clears it when its gather returns)
            if in_flight is not None:  # drained for a gather the main thread is still blocked in
                rows = np.concatenate([in_flight, rows])
            last = rec.current_label() if rec.steps_done else None
            append_rank_rows(self.run_dir, rank, rows, reason, last, scope.segment)  # (rows again: read once)
            self._flushed = (reason, rec.completed[0])
        finally:
            self._lock.release()
