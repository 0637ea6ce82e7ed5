"""`Scope`: one rank's view of a training run, and the façade both integrations drive.

Used directly it is the torch-level recorder for a plain DDP loop:

    scope = Scope(run_dir="runs/exp1")
    scope.watch(ddp_model, optimizer, loader)
    for batch in loader:
        ...; loss.backward(); optimizer.step(); optimizer.zero_grad()
        scope.log(loss=loss)
    scope.finish()

It wires parts that each do one job: `StepRecorder` and `TorchHooks` (the hot path), the `Coordinator`
(rank, the scope's own group, when to gather, the meeting at finish) and, once the ranks have met, the
`RunSession` (gathers, rank 0's `RunReporter` and `LiveDiagnosis`, the hang `Watchdog`, SIGTERM). Any
internal error disables the scope with one message; the training goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .clocks import Clock, CudaEventClock
from .collectives import collective_wait
from .context import SCOPE_DISABLED, lost_a_peer
from .coordinator import Coordinator, RanksNotMet
from .findings import Finding
from .flops import StepFlops
from .hooks import TorchHooks
from .joins import JoinFollower
from .options import ScopeOptions
from .output import say
from .parallelism import UNWATCHED, current_rank, current_world_size, detect, inside_fabric
from .recorder import StepRecorder
from .session import RunSession
from .values import ScalarLog


class Scope:
    """Records this rank's steps, meets the other ranks every `interval` steps, and (rank 0) diagnoses.

    Keyword options are `ScopeOptions` fields (run_dir, interval, warmup, hang_timeout, on_hang, console,
    flops_per_step, peak_flops, gather_timeout); `options=` passes a ready `ScopeOptions` instead.
    `integration`, `step_origin` (the number the framework gives its first step) and `precision` (the peak
    table's: "bf16", "tf32", "fp32") are set by integrations.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        options: ScopeOptions | None = None,
        integration: str = "torch",
        step_origin: int = 1,
        precision: str | None = None,
        clock: Clock | None = None,
        **option_values: Any,
    ) -> None:
        self.options = options = ScopeOptions.resolve(options, run_dir, **option_values)
        self.run_dir: Path | None = options.run_path
        self.integration = integration
        self.flops = StepFlops(options.flops_per_step, options.warmup, precision, options.peak_flops)
        self.recorder = StepRecorder(clock=clock, step_origin=step_origin)
        self.recorder.iteration_steps = True  # until an optimizer is watched
        self.recorder.on_step_closed = self._after_step
        self.recorder.on_first_step = self.start  # (so the watchdog watches step 1: a hang in it is common)
        self.hooks = TorchHooks(self.recorder, self.fail, self.note)
        self.coordinator = Coordinator(self.recorder, options.interval, options.gather_timeout)
        self.session: RunSession | None = None  # from start() to the end
        self.metrics_sink: Callable[[dict[str, float], int], None] | None = None
        self.enabled = True
        self.errors: list[str] = []  # the scope's own failures (`fail`), in the run as "scope errors"
        self.notes: list[str] = []  # what it could not measure (e.g. a loader never iterated), in the run too
        self.segment = 0
        self.resumed_from_step = 0
        self.summary: Any = None  # end-of-run Summary (rank 0)
        self.replicated_model: Any = None  # the data-parallel model whose replicas are compared at gathers
        self.joins = JoinFollower(self)  # a rank out of batches inside torch's Join still meets the gathers
        self.joins.install()  # (now: a `with` statement reads `__exit__` as it enters, maybe before watch())
        self.parallelism = UNWATCHED  # what the watched model is wrapped in (note_parallelism)
        self._clock = clock
        self._started = False
        self._finished = False
        self._watched: list[Any] = []  # the models and optimizers watched
        self._at_exit: Callable[[], Any] | None = None  # ends the run at interpreter exit if nothing else did
        self.scalars = ScalarLog()  # rank 0's extra scalars, written at the next gather
        self.hooks.flop_estimate = self.flops.estimate
        self.hooks.first_forward = self.flops.note_forward

    @property
    def rank(self) -> int:
        return self.coordinator.rank if self._started else current_rank()  # the coordinator's: from start

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def findings(self) -> list[Finding]:
        """The latest live diagnosis (rank 0; empty elsewhere)."""
        live = getattr(self.session, "live", None)  # (no session yet: None)
        return live.findings if live is not None else []

    @property
    def gather_ms(self) -> list[float]:
        return self.session.gather_ms if self.session is not None else []

    # -- installing the hooks -------------------------------------------------------------------------
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
        `loader`. Integrations that see the loop themselves pass `manual_data=True` and mark the loop through
        `scope.hooks` (`data_begin`, `data_end`, `forward_begin`, `forward_done`, `optimizer_begin`); after an
        internal error those marks record nothing."""
        if self._finished:
            self.say("watch() after finish(): this scope has ended and records nothing; make a new Scope")
            return self
        try:
            model = inside_fabric(model)
            if model is not None and all(m is not model for m in self._watched):  # twice would count twice
                self._watched.append(model)
                device = _cuda_device_of(model) if self._clock is None else None
                if device is not None:
                    self.use_cuda_clock(device)
                self.flops.note_model(model)
                self.note_parallelism(model)
                self.hooks.watch_model(model)
                if self.hooks.is_ddp:
                    self.replicated_model = model
            for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
                if opt is not None and all(o is not opt for o in self._watched):  # (as a model)
                    self._watched.append(opt)
                    self.hooks.watch_optimizer(opt, pre_hook=optimizer_pre_hook)
            if loader is not None:
                self.hooks.watch_loader(loader)
            if manual_data:
                self.hooks.loader_watched = True
        except Exception as exc:
            self.fail(exc)
        if self._at_exit is None:  # the summary still appears if the user forgets finish()
            self._at_exit = functools.partial(_end_at_exit, self, getattr(sys, "last_value", None))
            atexit.register(self._at_exit)
        return self

    def note_parallelism(self, model: Any) -> None:
        """Record what `model` is wrapped in (`parallelism.py`); integrations pass the framework's wrapper."""
        self.parallelism = detect(model, current_world_size())

    def use_cuda_clock(self, device: Any = None) -> None:
        """Time with CUDA events on `device` (default: current), resolved at gathers; memory: its allocator's peak."""
        clock = CudaEventClock(device)
        self.recorder.use_clock(clock, clock.peak_memory)

    def watch_backward(self, model: Any) -> None:
        """Time backward and exposed gradient communication from `model`'s parameters (integrations)."""
        try:
            self.flops.note_model(model)
            self.hooks.watch_backward(model)
        except Exception as exc:
            self.fail(exc)

    def watch_replicas(self, model: Any) -> None:
        """Compare this data-parallel model's parameters across ranks at every gather."""
        self.replicated_model, self.hooks.is_ddp = model, True

    # -- time that is not training ------------------------------------------------------------------
    def pause(self) -> None:
        """Time until `resume()` is not charged to the step (validation, checkpoint saving), nor forwards."""
        if self.enabled:
            self.hooks.pause()

    def resume(self) -> None:
        if self.enabled:
            self.hooks.resume()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Time inside is not charged to the step (validation, checkpoint saving)."""
        return _between(self.pause, self.resume)

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """Time inside is a wait of the loop's that nothing else times (an asynchronous collective's `wait()`,
        another library's collective): comm, not this rank's own work, so the rank waited for is named."""
        return collective_wait(self.hooks, self.fail)

    # -- what the user and integrations tell the scope ------------------------------------------------
    def log(self, loss: Any = None, **scalars: Any) -> None:
        """Record scalars for the current step. `loss` drives convergence analysis; tensors are never synced here."""
        if not self.enabled:
            return
        if loss is not None:
            detach = getattr(type(loss), "detach", None)  # (the type's: a user's __getattr__ may raise)
            self.recorder.set_loss(loss if detach is None else detach(loss))  # a tensor's graph is not kept
        if scalars and self.rank == 0:
            self.scalars.add(self.step_label(open_step=True), scalars)

    def set_metrics_sink(self, sink: Callable[[dict[str, float], int], None]) -> None:
        """Where each live diagnosis's metrics go (Lightning's loggers, `accelerator.log`); rank 0 only."""
        self.metrics_sink = sink
        if self.session is not None and self.session.live is not None:
            self.session.live.metrics_sink = sink

    def set_flops_per_step(self, flops: float) -> None:
        """FLOPs of one optimizer step, learnt by an integration (e.g. Lightning's `flops_per_batch`)."""
        self.flops.given(flops)
        self.hooks.flop_estimate = None

    def add_finding(self, finding: Finding) -> None:
        """A finding an integration made itself (e.g. DATA.UNEVEN_SHARDS); rank 0 keeps, prints and stores it."""
        if self.enabled and self.session is not None and self.session.live is not None:
            self.session.live.add(finding, self.step_label())

    def all_gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's `values` on the scope's own group (None if not distributed). Collective."""
        return self.coordinator.all_gather_ints(values)

    def step_label(self, open_step: bool = False) -> int:
        """The framework's number of the last closed step (or of the open one)."""
        return self.recorder.current_label(open_step)

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Small, plain, rank-agnostic: the same on every rank of a healthy job."""
        run_dir = str(self.run_dir) if self.run_dir is not None else None
        return {"version": 1, "run_dir": run_dir, **self.recorder.counters(), "segment": self.segment}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run the state came from, as a new segment; steps done before it are not recounted. A
        state that cannot be read (damaged, or not this scope's) disables the scope: training goes on."""
        try:
            counters, segment, run_dir = _read_state(state)
        except ValueError as exc:
            return self.fail(exc)
        self.recorder.restore(counters)
        self.segment, self.resumed_from_step = segment + 1, self.recorder.steps_done
        if self.options.run_dir is None and run_dir:
            self.run_dir = Path(run_dir)
        self.coordinator.restart_schedule()
        self.flops.resumed(self.resumed_from_step)

    # -- start, per step, end -------------------------------------------------------------------------
    def start(self) -> None:
        """Set up the run (collective when distributed): call at a point every rank reaches, or let the
        first step's loop top do it (every rank reaches it, even one that then blocks in its first batch)."""
        if self._started or not self.enabled:
            return
        self._started = True
        try:
            if self.parallelism is UNWATCHED:  # measured only if there is no other rank
                self.parallelism = detect(None, current_world_size())
            self.session = RunSession(self)
            self.run_dir = self.session.run_dir
        except Exception as exc:
            self.fail(exc)

    def _after_step(self) -> None:
        """Called by the recorder when a step closes with the gather key at or past `recorder.notify_at`."""
        if not self.enabled:
            return
        try:
            if not self.coordinator.scheduled:  # the first step boundary (the run started at its loop top)
                self.start()
                self.coordinator.schedule(syncs_seen=self.hooks.is_ddp or self.hooks.sharded is not None)
            elif self.coordinator.due() and self.session is not None:
                self.session.gather()
        except Exception as exc:
            self.fail(exc)

    def finish(self, *, forgotten: bool = False) -> Any:
        """Final gather and, on rank 0, the end-of-run summary (printed and written to the run). Idempotent. Call
        it on every rank, before the process group is destroyed. (`forgotten`: called at interpreter exit because
        the training code did not.)"""
        self.hooks.end_flop_count()  # (from training code: never inside compiled code)
        return self._end(lambda session: session.finish(forgotten))

    def stop(self, reason: str) -> Any:
        """End without meeting the other ranks (after an exception, or when they may be gone): this rank's
        ungathered steps go to its own file, rank 0 reports what the run holds; all is released. Idempotent."""
        return self._end(lambda session: session.stop(reason))

    def _end(self, end: Callable[[RunSession], Any]) -> Any:
        if self._finished:
            return self.summary
        self._finished = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        try:
            if self.enabled and self.recorder.window and not self._started:
                self.start()
            if self.session is not None:  # (it closes the open step: with more ranks, as they decide)
                self.summary = end(self.session)
        except Exception as exc:
            self.fail(exc)
        finally:
            if self.session is not None:
                self.session.release()
            self.hooks.remove()
            self.joins.remove()
            self._watched.clear()  # (the user's models are not kept alive by an ended scope)
            self.recorder.stop()
            self.coordinator.destroy()
        return self.summary

    # -- failure --------------------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Disable the scope after an internal error (one message, every rank told); training goes on.

        From here on nothing is recorded (memory stays constant) and the watchdog stops: without marks,
        watching for progress would call a hang."""
        if not self.enabled:
            return
        self.enabled = False
        self.hooks.active = False
        self.recorder.stop()
        self.flops.cancel()
        self.hooks.flop_estimate = None
        message = disabled_message(exc)
        self.errors.append(message)
        if self.session is not None:
            self.session.disabled()  # the watchdog stops first, as before anything else can block
        self.say(message)
        self.coordinator.announce_disabled()

    def note(self, message: str, *, error: bool = False, warn: bool = True) -> None:
        """Keep `message` for the run: an `error` of the scope's own, or a limit of what it measures; `warn`: say
        it (a limit, on rank 0 only: every rank runs the same loop, and would say the same)."""
        (self.errors if error else self.notes).append(message)
        if warn and (error or self.rank == 0):
            self.say(message)

    def say(self, message: str) -> None:
        say(self.rank, message)


def disabled_message(exc: BaseException) -> str:
    """Why the scope disabled itself: its internal error, or another rank gone (its process ended, e.g. by an
    exception of its own, while this one waited for it in a collective of the scope's, or in a hook): not the
    scope's fault, said so."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, RanksNotMet):
        return f"{SCOPE_DISABLED}, training continues: {exc}"
    if lost_a_peer(str(exc)):
        return f"another rank left the job while this one waited for it, {SCOPE_DISABLED}, training continues: {text}"
    return f"internal error, {SCOPE_DISABLED}, training continues: {text}"


def raised(exc: BaseException) -> str:
    """How a rank's end by an exception reads in the run: "raised RuntimeError: the first line of its text"."""
    text = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {text[0][:160]}" if text else "")


@contextlib.contextmanager
def _between(begin: Callable[[], None], end: Callable[[], None]) -> Iterator[None]:
    begin()
    try:
        yield
    finally:
        end()


def _read_state(state: Any) -> tuple[dict[str, int], int, str | None]:
    """A saved state's counters, segment and run directory; ValueError, saying why, where they cannot be."""
    try:
        counters = {key: int(state.get(key, 0)) for key in ("step", "grad_syncs", "micro_batches")}
        run_dir = state.get("run_dir")
        if run_dir is not None and not isinstance(run_dir, str):
            raise TypeError(f"run_dir is {type(run_dir).__name__}")
        return counters, int(state.get("segment", 0)), run_dir
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"a saved pytscope state that cannot be read ({exc})") from None


def _end_at_exit(scope: Scope, error_before: BaseException | None) -> None:
    """The interpreter is exiting and the run was not ended. After an unhandled exception the other ranks are
    blocked in the step this process left and will not come to a final gather: this rank only stops (its
    records go to its own file, with the exception). Otherwise the user forgot `finish()`: finish. An
    interactive session keeps its last error (`error_before`, or one a later cell raised and survived). A
    Ctrl-C is the KeyboardInterrupt it raised, also where the process caught it and exited without error (a
    worker of `torch.multiprocessing.spawn` does): an interrupted rank, not one that forgot finish(); such a
    worker's exception is the one its wrapper caught and left for the parent."""
    error = getattr(sys, "last_value", None)  # set by the interpreter for the exception that ends it
    interactive = hasattr(sys, "ps1") or "IPython" in sys.modules
    ends = None if scope.session is None else scope.session.ends
    if (error is None or error is error_before) and ends is not None:
        if (caught := ends.swallowed_error()) is not None:  # (its exception, which spawn's worker caught)
            return scope.stop(f"the process raised {caught[:200]}")
        if ends.interrupted:
            error = KeyboardInterrupt()
    if error is not None and error is not error_before and not interactive:
        scope.stop(f"the process {raised(error)}")
    else:
        scope.finish(forgotten=True)


def _cuda_device_of(model: Any) -> Any:
    """The CUDA device of `model`'s first parameter; None off CUDA."""
    try:
        param = next(model.parameters())
    except (StopIteration, AttributeError):
        return None
    return param.device if param.is_cuda else None
