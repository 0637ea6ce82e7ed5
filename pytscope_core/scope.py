"""`Scope`: one rank's view of a training run, and the engine both integrations drive.

It owns the recorder and hooks (the hot path), the cross-rank gather every `interval` gradient syncs,
rank 0's run directory, the live diagnosis and the end-of-run summary. Used directly it is the torch-level
recorder for a plain DDP loop:

    scope = Scope(run_dir="runs/exp1")
    scope.watch(ddp_model, optimizer, loader)
    for batch in loader:
        ...; loss.backward(); optimizer.step(); optimizer.zero_grad()
        scope.log(loss=loss)
    scope.finish()

Gathers are triggered by the count of completed gradient all-reduces, which DDP keeps equal on every rank,
so a rank that took an extra or a missing optimizer step still meets the others at the same collective;
its differing step count is then reported (`DIST.DESYNC`) instead of deadlocking the job. Any internal
error disables the scope with one message; the training goes on.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .arrays import RunArrays
from .clocks import Clock, CudaEventClock
from .context import CountsCheck, ReplicaCheck, RunContext
from .findings import Finding, Severity
from .hooks import TorchHooks
from .recorder import StepRecorder
from .timeline import Mark

STORE_PREFIX = "pytscope"
LIVE_STEPS = 1000  # steps kept in memory on rank 0 for live diagnosis: bounds its cost on long runs
LIVE_BUDGET = 0.005  # live diagnosis may take at most this share of wall time; other gathers only store rows
FINISH_WAIT_S = 30.0  # how long finish() waits for every rank to arrive before reporting without them


class Scope:
    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        interval: int = 50,
        warmup: int = 5,
        hang_timeout: float | None | str = "auto",
        on_hang: str = "abort",
        console: bool = True,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        gather_timeout: float = 300.0,
        integration: str = "torch",
        clock: Clock | None = None,
    ) -> None:
        if interval < 1:
            raise ValueError("interval must be >= 1")
        if not (
            hang_timeout is None
            or hang_timeout == "auto"
            or (isinstance(hang_timeout, (int, float)) and hang_timeout > 0)
        ):
            raise ValueError('hang_timeout must be a number of seconds > 0, "auto" or None')
        if on_hang not in ("abort", "report"):
            raise ValueError('on_hang must be "abort" or "report"')
        self.run_dir: Path | None = Path(run_dir) if run_dir is not None else None
        self._explicit_run_dir = run_dir is not None
        self.interval = interval
        self.warmup = warmup
        self.hang_timeout = hang_timeout
        self.on_hang = on_hang
        self.console = console
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.gather_timeout = gather_timeout
        self.integration = integration
        self._clock = clock
        self.recorder = StepRecorder(clock=clock)
        self.recorder.on_step_closed = self._after_step
        self.hooks = TorchHooks(self.recorder, self.fail)
        self.metrics_sink: Callable[[dict[str, float], int], None] | None = None
        self.enabled = True
        self.errors: list[str] = []
        self.segment = 0
        self.resumed_from_step = 0
        self.rank = 0
        self.world_size = 1
        self.gather_ms: list[float] = []  # each gather: resolving the window and the exchange, every rank
        self.ingest_ms: list[float] = []  # rank 0 after each gather: writing the run, live diagnosis
        self.findings: list[Finding] = []  # latest live diagnosis (rank 0)
        self.summary: Any = None  # end-of-run Summary (rank 0)
        self._started = False
        self._finished = False
        self._gatherer: Any = None
        self._writer: Any = None
        self._model: Any = None
        self._next_gather = interval
        self._gathers = 0
        self._recent: collections.deque[np.ndarray] = collections.deque()
        self._recent_steps = 0
        self._counts_checks: list[CountsCheck] = []
        self._replica_checks: list[ReplicaCheck] = []
        self._extra_findings: list[Finding] = []
        self._reported: dict[tuple[str, tuple[int, ...]], Severity] = {}
        self._scalars: list[dict[str, Any]] = []
        self._epoch_offset = time.time() - time.perf_counter()
        self._console: Any = None
        self._atexit_registered = False
        self._watchdog: Any = None
        self._live_cost_s = 0.0
        self._live_at = time.perf_counter()

    # -- user API -------------------------------------------------------------------------------------
    def watch(
        self,
        model: Any = None,
        optimizer: Any | list[Any] | tuple[Any, ...] = None,
        loader: Any = None,
        *,
        optimizer_pre_hook: bool = True,
        manual_data: bool = False,
    ) -> Scope:
        """Install the hooks: forward and graph-done on `model`, step hooks on each optimizer, batch waits on
        `loader`. Integrations that see the loop themselves pass `manual_data=True` and call `data_begin()` /
        `data_end()` (and may leave `model` out and call `forward_begin()` / `forward_end()`)."""
        try:
            if model is not None:
                if self._clock is None and _on_cuda(model):
                    self.use_cuda_clock()
                self._model = model
                self.hooks.watch_model(model)
            if optimizer is not None:
                for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
                    self.hooks.watch_optimizer(opt, pre_hook=optimizer_pre_hook)
            if loader is not None:
                self.hooks.watch_loader(loader)
            if manual_data:
                self.hooks.loader_watched = True
        except Exception as exc:
            self.fail(exc)
        if not self._atexit_registered:
            atexit.register(self.finish)  # the summary still appears if the user forgets finish()
            self._atexit_registered = True
        return self

    def use_cuda_clock(self) -> None:
        """Time phases with CUDA events (execution, not launch), resolved lazily at each gather."""
        self.recorder.clock = CudaEventClock()
        self.recorder._now = self.recorder.clock.now
        self.recorder._memory = _cuda_peak_memory
        self.recorder._memory_every = 1  # the allocator peak is reset every step

    def watch_backward(self, model: Any) -> None:
        """Time backward and exposed gradient communication from `model`'s parameters (integrations that mark
        forward themselves)."""
        try:
            self.hooks.watch_backward(model)
        except Exception as exc:
            self.fail(exc)

    def watch_replicas(self, model: Any) -> None:
        """Compare this data-parallel model's parameters across ranks at every gather."""
        self._model = model
        self.hooks.is_ddp = True

    # -- marks for integrations that see the training loop themselves -------------------------------------
    def data_begin(self) -> None:
        if self.enabled:
            self.hooks.data_begin()

    def data_end(self, batch: Any = None) -> None:
        if self.enabled:
            self.hooks.data_end(batch)

    def forward_begin(self) -> None:
        if self.enabled:
            self.recorder.mark(Mark.FORWARD_BEGIN)

    def forward_end(self, output: Any = None, grad_sync: bool = False) -> None:
        """End of a micro-batch's forward; `grad_sync`: this backward all-reduces. Without `watch_backward`,
        `output` (e.g. the loss) is hooked so that its backward is timed."""
        if self.enabled:
            try:
                self.hooks.forward_done(output, grad_sync)
            except Exception as exc:
                self.fail(exc)

    def optimizer_begin(self) -> None:
        if self.enabled:
            self.recorder.mark(Mark.OPTIMIZER_BEGIN)

    def pause(self) -> None:
        """Time until `resume()` is not charged to the step (validation, checkpoint saving); forwards in
        it are not training forwards."""
        self.hooks.paused = True
        self.recorder.mark(Mark.PAUSE_BEGIN)

    def resume(self) -> None:
        self.hooks.paused = False
        self.recorder.mark(Mark.PAUSE_END)

    def log(self, **scalars: Any) -> None:
        """Record scalars for the current step. `loss` drives convergence analysis; tensors are never synced here."""
        if not self.enabled:
            return
        loss = scalars.pop("loss", None)
        if loss is not None:
            self.recorder.set_loss(loss.detach() if hasattr(loss, "detach") else loss)
        if scalars and self.rank == 0:
            self._scalars.append({"step": self.recorder.steps_done + 1, **scalars})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside is not charged to the step (validation, checkpoint saving)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def add_finding(self, finding: Finding) -> None:
        """A finding an integration made itself (e.g. DATA.UNEVEN_SHARDS); rank 0 keeps, prints and stores it."""
        if self.rank != 0 or not self.enabled:
            return
        self._extra_findings.append(finding)
        self._publish([finding], source="integration")

    def all_gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's `values` on the scope's own group (None if not distributed). Collective."""
        return self._gatherer.all_gather_ints(values) if self._gatherer is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Small, plain, rank-agnostic: the same on every rank of a healthy job."""
        steps, syncs, micro = self.recorder.completed
        return {
            "version": 1,
            "run_dir": str(self.run_dir) if self.run_dir is not None else None,
            "step": steps,
            "grad_syncs": syncs,
            "micro_batches": micro,
            "segment": self.segment,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run the state came from, as a new segment; steps done before it are not recounted."""
        self.recorder.steps_done = int(state.get("step", 0))
        self.recorder.grad_syncs = int(state.get("grad_syncs", 0))
        self.recorder.micro_batches = int(state.get("micro_batches", 0))
        self.recorder.window.clear()  # steps recorded before the restore are replayed after it
        self.segment = int(state.get("segment", 0)) + 1
        self.resumed_from_step = self.recorder.steps_done
        if not self._explicit_run_dir and state.get("run_dir"):
            self.run_dir = Path(state["run_dir"])
        self.recorder.notify_at = 0  # the next step boundary re-decides when to gather

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Set up the run (collective when distributed): call at a point every rank reaches, or let the
        first step boundary do it."""
        if self._started or not self.enabled:
            return
        self._started = True
        try:
            self._start()
        except Exception as exc:
            self.fail(exc)

    def _start(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
        if self.world_size > 1:
            from .gather import Gatherer

            self._gatherer = Gatherer(self.gather_timeout)
            chosen = str(self.run_dir or _default_run_dir()) if self.rank == 0 else None
            self.run_dir = Path(self._gatherer.broadcast_object(chosen))
        elif self.run_dir is None:
            self.run_dir = _default_run_dir()
        if self.rank == 0:
            from rich.console import Console

            from . import analysis, render, summary  # noqa: F401  (imported now, not in the middle of a step)
            from .rundir import RunWriter

            self._console = Console(stderr=False) if self.console else None
            self._writer = RunWriter(self.run_dir, self._meta())
            self._writer.event(
                "segment",
                index=self.segment,
                started_s=(self.recorder._host_start / 1e9 + self._epoch_offset)
                if self.recorder._host_start
                else time.time(),
                resumed_from_step=self.resumed_from_step,
                world_size=self.world_size,
            )
        if self.hang_timeout is not None:
            self._start_watchdog()

    def _start_watchdog(self) -> None:
        from .watchdog import Watchdog

        assert self.run_dir is not None
        self._watchdog = Watchdog(
            self.recorder,
            _default_store() if self.world_size > 1 else None,
            self.rank,
            self.world_size,
            self.run_dir,
            self._hang_timeout_s,
            self.on_hang,
            self._report_hang,
            prefix=f"{STORE_PREFIX}/{self.segment}",
            disabled_key=f"{STORE_PREFIX}/disabled",
        )
        self._watchdog.start()

    def _hang_timeout_s(self) -> float | None:
        """The fixed timeout, or "auto": after warm-up, the larger of 2 minutes and 20x the slowest step seen."""
        from .watchdog import AUTO_MIN_S, AUTO_STEP_FACTOR

        if self.hang_timeout != "auto":
            return float(self.hang_timeout)  # type: ignore[arg-type]
        if self.recorder.steps_done - self.resumed_from_step <= self.warmup:
            return None
        return max(AUTO_MIN_S, AUTO_STEP_FACTOR * self._watchdog.slowest_step_s)

    def _report_hang(self, finding: Finding) -> None:
        """Called from rank 0's watchdog thread while the main thread is blocked."""
        if self._writer is not None:
            if not isinstance(
                self.recorder.clock, CudaEventClock
            ):  # events behind a hung kernel never resolve
                self._writer.append_rows(self.recorder.drain(self.rank, self.segment, self._epoch_offset))
            self._writer.event("hang", step=self.recorder.steps_done, finding=finding.to_dict())
        if self._console is not None:
            from .render import render_findings

            self._console.print("[bold red]pytscope: hang detected[/]")
            self._console.print(render_findings([finding]))

    def _meta(self) -> dict[str, Any]:
        import torch

        from . import __version__
        from .flops import peak_flops_for

        device = "cpu"
        mem_limit: float | None = _host_memory()
        if isinstance(self.recorder.clock, CudaEventClock):
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            device, mem_limit = props.name, float(props.total_memory)
        return {
            "created_s": time.time(),
            "world_size": self.world_size,
            "interval": self.interval,
            "warmup": self.warmup,
            "integration": self.integration,
            "device": device,
            "mem_limit_bytes": mem_limit,
            "peak_flops": self.peak_flops if self.peak_flops is not None else peak_flops_for(device),
            "flops_per_step": self.flops_per_step,
            "host": socket.gethostname(),
            "torch": torch.__version__,
            "pytscope": __version__,
            "argv": sys.argv,
        }

    # -- per step -------------------------------------------------------------------------------------
    def _gather_key(self) -> int:
        rec = self.recorder
        return rec.grad_syncs if rec.notify_on_syncs else rec.steps_done

    def _after_step(self) -> None:
        """Called by the recorder when a step closes with the gather key at or past `recorder.notify_at`."""
        if not self.enabled:
            return
        try:
            rec = self.recorder
            if not self._started:
                self.start()
                # DDP keeps the count of completed all-reduces equal on all ranks: a safe place to meet,
                # even for a rank that took one optimizer step more or less. Without DDP (or if syncs are
                # not seen), optimizer steps.
                rec.notify_on_syncs = self.hooks.is_ddp and rec.grad_syncs > 0
                self._next_gather = (self._gather_key() // self.interval + 1) * self.interval
            elif self._gather_key() >= self._next_gather:
                self._next_gather = (self._gather_key() // self.interval + 1) * self.interval
                self._gather()
            rec.notify_at = self._next_gather
        except Exception as exc:
            self.fail(exc)

    def _gather(self, final: bool = False) -> None:
        t0 = time.perf_counter()
        rec = self.recorder
        rows = rec.drain(self.rank, self.segment, self._epoch_offset)
        counters = (float(rec.steps_done), float(rec.grad_syncs), float(rec.micro_batches), self._checksum())
        if self._gatherer is not None:
            self._check_peers_enabled()
            if self._watchdog is not None:
                self._watchdog.status = "gather"
            try:
                ex = self._gatherer.exchange(counters, rows)
            finally:
                if self._watchdog is not None:
                    self._watchdog.status = "finished" if final else ""
            headers, rows = ex.headers, ex.rows
        else:
            headers = np.array([[*counters[:3], rows.shape[0], counters[3]]])
        self._gathers += 1
        t1 = time.perf_counter()
        self.gather_ms.append((t1 - t0) * 1e3)
        if self.rank == 0:
            self._ingest(headers, rows, final)
            self.ingest_ms.append((time.perf_counter() - t1) * 1e3)

    def _checksum(self) -> float:
        """A cheap fingerprint of the replicated parameters; DDP replicas must agree bit for bit."""
        if self._model is None or not self.hooks.is_ddp:
            return math.nan
        import torch

        with torch.no_grad():
            sums = [p.detach().sum(dtype=torch.float64) for p in self._model.parameters()]
            return float(torch.stack(sums).sum().item()) if sums else math.nan

    def _ingest(self, headers: np.ndarray, rows: np.ndarray, final: bool) -> None:
        w = self._writer
        w.append_rows(rows)
        w.scalars(self._scalars)
        self._scalars = []
        steps, syncs, micro = (tuple(int(v) for v in headers[:, i]) for i in range(3))
        if len(set(steps)) > 1 or len(set(syncs)) > 1 or len(set(micro)) > 1:
            check = CountsCheck(self._gathers, steps, syncs, micro)
            self._counts_checks.append(check)
            w.event("counts_check", gather=check.gather, steps=steps, grad_syncs=syncs, micro_batches=micro)
        sums = headers[:, 4]
        if (
            np.isfinite(sums).all()
            and len(sums) > 1
            and np.ptp(sums) > 1e-9 * max(1.0, float(np.abs(sums).max()))
        ):
            check_r = ReplicaCheck(int(max(steps)), tuple(float(s) for s in sums))
            self._replica_checks.append(check_r)
            w.event("replica_check", step=check_r.step, checksums=list(check_r.checksums))
        if final:
            return
        self._recent.append(rows)
        self._recent_steps += rows.shape[0] // max(1, self.world_size)
        while (
            len(self._recent) > 1
            and self._recent_steps - self._recent[0].shape[0] // max(1, self.world_size) >= LIVE_STEPS
        ):
            self._recent_steps -= self._recent.popleft().shape[0] // max(1, self.world_size)
        self._diagnose_live()

    def _context(self) -> RunContext:
        return RunContext(
            world_size=self.world_size,
            interval=self.interval,
            warmup=self.warmup,
            flops_per_step=self.flops_per_step,
            peak_flops=self.peak_flops,
            counts_checks=tuple(self._counts_checks),
            replica_checks=tuple(self._replica_checks),
            scope_errors=tuple(self.errors),
        )

    def _diagnose_live(self) -> None:
        # Rank 0 is on every rank's critical path while it diagnoses (they wait for it in the next
        # all-reduce), so diagnosis runs only as often as keeps it under LIVE_BUDGET of wall time.
        now = time.perf_counter()
        if self._live_cost_s > LIVE_BUDGET * (now - self._live_at):
            return
        self._live_at = now
        try:
            self._diagnose_recent()
        finally:
            self._live_cost_s = time.perf_counter() - now

    def _diagnose_recent(self) -> None:
        from .analysis import diagnose
        from .summary import summarize

        arrays = RunArrays.from_rows(
            np.concatenate(list(self._recent)), warmup=0 if self.segment else self.warmup
        )
        if arrays.n_steps == 0:
            return
        ctx = self._context()
        self.findings = diagnose(arrays, ctx) + self._extra_findings
        fresh = [f for f in self.findings if self._reported.get(f.key, Severity.LOW - 1) < f.severity]
        if fresh:
            self._publish(fresh)
        if self.metrics_sink is not None:
            summary = summarize(arrays, ctx)
            self.metrics_sink(_metrics(summary.to_dict(), self.findings), int(arrays.steps[-1]))

    def _publish(self, findings: list[Finding], source: str = "diagnosis") -> None:
        for f in findings:
            self._reported[f.key] = f.severity
            if self._writer is not None:
                self._writer.event(
                    "finding", step=self.recorder.steps_done, source=source, finding=f.to_dict()
                )
        if self._console is not None:
            from .render import render_findings

            self._console.print(f"[bold]pytscope[/] step {self.recorder.steps_done}:")
            self._console.print(render_findings(findings))

    # -- end ------------------------------------------------------------------------------------------
    def finish(self) -> Any:
        """Final gather and, on rank 0, the end-of-run summary (printed and written to the run). Idempotent.

        Call it on every rank, before the process group is destroyed.
        """
        if self._finished:
            return self.summary
        self._finished = True
        if self._atexit_registered:
            atexit.unregister(self.finish)
        if self._watchdog is not None:
            self._watchdog.status = "finished"
        try:
            self.recorder.close()
            if self.enabled and self.recorder.window and not self._started:
                self.start()
            if self.enabled and self._started:
                self._final_gather()
            if self.rank == 0 and self._writer is not None:
                self._final_report()
        except Exception as exc:
            self.fail(exc)
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
            self.hooks.remove()
            if self._writer is not None:
                self._writer.close()
            if self._gatherer is not None:
                self._gatherer.destroy(self._dist_alive())
                self._gatherer = None
        return self.summary

    def _dist_alive(self) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def _final_gather(self) -> None:
        if self._gatherer is not None and not self._dist_alive():
            self.errors.append(
                "finish() ran after the process group was destroyed: only rank 0's last steps are in the run; "
                "call finish() before destroy_process_group() / accelerator.end_training()"
            )
            _warn(self.rank, self.errors[-1])
            self._gatherer = None
            if self.rank != 0:
                return
        if self._gatherer is not None and not self._all_ranks_arrive():
            self._gatherer = None
            if self.rank != 0:
                return
        self._gather(final=True)

    def _all_ranks_arrive(self) -> bool:
        """Meet at the store first, so a rank that died or never finishes cannot hang the final gather."""
        store = _default_store()
        if store is None:
            return True
        key = f"{STORE_PREFIX}/finish/{self.segment}"
        store.set(f"{key}/{self.rank}", "1")
        try:
            store.wait(
                [f"{key}/{r}" for r in range(self.world_size)], datetime.timedelta(seconds=FINISH_WAIT_S)
            )
            return True
        except Exception:
            missing = [r for r in range(self.world_size) if not store.check([f"{key}/{r}"])]
            self.errors.append(f"ranks {missing} never reached finish(); their last steps are missing")
            _warn(self.rank, self.errors[-1])
            return False

    def _final_report(self) -> None:
        from rich.console import Console

        from .render import render_summary
        from .rundir import load_run
        from .summary import summarize

        assert self.run_dir is not None
        for message in self.errors:
            self._writer.event("scope_error", message=message)
        self._writer.event(
            "scope_cost",
            gathers=self._gathers,
            gather_ms=_quantiles(self.gather_ms),
            ingest_ms=_quantiles(self.ingest_ms),
        )
        run = load_run(self.run_dir)
        self.summary = summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings))
        text_console = Console(record=True, width=110, file=open(os.devnull, "w"), color_system=None)
        text_console.print(render_summary(self.summary))
        self._writer.write_summary(self.summary.to_dict(), text_console.export_text())
        if self._console is not None:
            self._console.print(render_summary(self.summary))
            self._console.print(f"[dim]run directory: {self.run_dir}  (pytscope report {self.run_dir})[/]")

    # -- failure --------------------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Disable the scope after an internal error (one message, every rank told); training goes on."""
        if not self.enabled:
            return
        self.enabled = False
        self.hooks.active = False
        if self._watchdog is not None:  # no marks come any more: watching for progress would call a hang
            self._watchdog.stop()
        message = f"internal error, scope disabled, training continues: {type(exc).__name__}: {exc}"
        self.errors.append(message)
        _warn(self.rank, message)
        store = _default_store() if self.world_size > 1 else None
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"{STORE_PREFIX}/disabled", str(self.rank))
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.event("scope_error", message=message)

    def _check_peers_enabled(self) -> None:
        store = _default_store()
        if store is not None and store.check([f"{STORE_PREFIX}/disabled"]):
            raise RuntimeError(f"rank {store.get(f'{STORE_PREFIX}/disabled').decode()} disabled its scope")


def _metrics(summary: dict[str, Any], findings: list[Finding]) -> dict[str, float]:
    timing = summary.get("timing", {})
    phases = timing.get("phases", {})
    dist_ = summary.get("distributed", {})
    out = {
        "pytscope/step_ms": timing.get("median_ms"),
        "pytscope/comm_share": phases.get("comm", {}).get("share"),
        "pytscope/data_share": phases.get("data", {}).get("share"),
        "pytscope/lost_to_imbalance": dist_.get("lost_to_imbalance"),
        "pytscope/findings_high": sum(f.severity == Severity.HIGH for f in findings),
        "pytscope/findings_med": sum(f.severity == Severity.MED for f in findings),
    }
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and math.isfinite(v)}


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


def _default_run_dir() -> Path:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _default_store() -> Any:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    return None


def _on_cuda(model: Any) -> bool:
    try:
        return next(model.parameters()).is_cuda
    except (StopIteration, AttributeError):
        return False


def _cuda_peak_memory() -> float:
    import torch

    peak = float(torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    return peak


def _host_memory() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _warn(rank: int, message: str) -> None:
    print(f"pytscope[rank {rank}]: {message}", file=sys.stderr, flush=True)
