"""`ScopeCallback`: Lightning's training-loop events translated into pytscope core calls.

Lightning runs `training_step` and backward inside the torch optimizer's `step(closure)`, so the optimizer's
pre-hook would fire before the forward; the callback therefore marks the phases from Lightning's own hooks in
their real order: the wait for a batch is what Lightning's training loop brackets for its profiler
(`_on_before_fetch` / `_on_after_fetch`, around the fetch itself) and is the loop top, the forward starts
where the loop calls the strategy's `training_step` and ends in `on_before_backward` (backward itself is
timed by the core's gradient-ready hooks on the module's parameters), the optimizer starts where the closure
ends (after `on_before_optimizer_step` and gradient clipping) and ends at the torch optimizer's post-hook.
What runs between (every callback's and the module's `on_train_batch_start`, whatever the callbacks' order,
the loop's bookkeeping, moving the batch to the device) is `other`. The strategy's collectives (`self.log(...,
sync_dist=True)`'s reduce, a barrier) and the epoch loop's SIGTERM broadcast at the top of every batch are
waits for the other ranks, `comm`, wherever they fall. A `training_step(self, dataloader_iter)` fetches
inside: its step opens where the loop calls it, and its forward starts after the fetch. Validation, checkpoint
saving and epoch ends are paused from before their first hook, so they are not charged to a step. All the
logic (recording, gathers, diagnosis, the run directory, the summary) lives in `pytscope_core.Scope`; every
hook here is a few lines, and an exception in any of them disables the scope, never the fit.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities import rank_zero_warn
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("pytscope_lightning needs Lightning: pip install 'pytscope[lightning]'") from exc

from pytscope_core.collectives import DDP_BUFFER_SYNC, restore_method, time_methods, untime_methods
from pytscope_core.context import FIT_ENDED_EARLY
from pytscope_core.options import ScopeOptions
from pytscope_core.scope import Scope, raised
from pytscope_core.shards import uneven_shards_finding


def _guarded(hook: Callable[..., None]) -> Callable[..., None]:
    """Lightning's hook, run only while a scope exists and given that scope as its first argument; its
    exceptions go to the scope's failure path (one message, scope disabled), never to the fit."""

    @functools.wraps(hook)
    def wrapper(self: ScopeCallback, *args: Any, **kwargs: Any) -> None:
        scope = self.scope
        if scope is None:
            return
        try:
            hook(self, scope, *args, **kwargs)
        except Exception as exc:
            scope.fail(exc)

    return wrapper


class ScopeCallback(Callback):
    """Why a Lightning fit is slow or unhealthy, on every rank, live and at the end.

    `Trainer(callbacks=[ScopeCallback(run_dir="runs/exp1")])`, then `pytscope report runs/exp1`. Keyword
    options are those of `pytscope_core.ScopeOptions` (validated here, in the user's process). Steps are
    numbered as Lightning's loggers number them (`trainer.global_step` while the step runs). Each fit is
    recorded: a later fit of the same trainer continues the run as a new segment, a fit of a new trainer
    starts a new run, unless it resumes a checkpoint, whose run it continues. After the fit,
    `callback.scope.summary` holds rank 0's summary (under `ddp_spawn` the fit ran in other processes: read
    the run directory instead, e.g. `pytscope report`).
    """

    def __init__(self, run_dir: str | None = None, **options: Any) -> None:
        self.options = ScopeOptions(run_dir=run_dir, **options)
        self.scope: Scope | None = None
        self._ddp: Any = None  # the strategy's DistributedDataParallel, when there is one
        self._restored: dict[str, Any] | None = None
        self._stage: str | None = None  # the trainer's current stage, from setup() ("fit", "validate" ...)
        self._fits = 0
        self._precision: str | None = None  # the trainer's training precision, from setup()
        self._fetch_timed = False  # the wait for data is bracketed by the training loop's fetch hooks
        self._optimizer_after_clipping = False  # the optimizer is marked after Lightning's gradient clipping
        self._fetch_in_step = False  # `training_step(self, dataloader_iter)` fetches its own batches

    # -- pickling (ddp_spawn) and checkpoints -------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # The scope holds hooks, files and a process group: each process builds its own in setup().
        return {**self.__dict__, "scope": None, "_ddp": None}

    def state_dict(self) -> dict[str, Any]:
        return self.scope.state_dict() if self.scope is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after setup() (fit(ckpt_path=...)): the scope continues that run now.
        # A state restored before any setup waits for it. Either way it is used once: a later fit of the same
        # trainer continues from where this one ends, not from the checkpoint again. validate/test/predict
        # (ckpt_path=...) restore callbacks too: no training continues there.
        if self._stage not in (None, "fit") or not state_dict:
            return
        if self.scope is not None and not self.scope.finished:
            if self.scope.options.run_dir != self.options.run_dir:
                # A new trainer (set up at step 0, so given a run of its own) resuming a checkpoint: the
                # checkpoint's run continues instead, as a fresh process resuming it would.
                self.scope = self._new_scope(self.options)
            self.scope.load_state_dict(state_dict)
        else:
            self._restored = state_dict

    # -- fit start and end --------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stage = stage
        if stage != "fit" or (self.scope is not None and not self.scope.finished):
            return
        previous = self.scope.state_dict() if self.scope is not None else None
        self._fits += 1
        options = self.options
        if previous is not None and trainer.global_step < previous["step"]:
            # A new trainer starts counting again: its steps would collide with the first fit's.
            base = options.run_dir or previous["run_dir"]
            options = options.replace(run_dir=f"{base}-fit{self._fits}")
        self._precision = _precision(trainer)
        self.scope = self._new_scope(options)
        restored, self._restored = self._restored, None
        if restored:
            self.scope.load_state_dict(restored)
        elif previous is not None and options.run_dir == self.options.run_dir:
            self.scope.load_state_dict({**previous, "run_dir": previous["run_dir"]})

    def _new_scope(self, options: ScopeOptions) -> Scope:
        return Scope(options=options, integration="lightning", step_origin=0, precision=self._precision)

    @_guarded
    def on_train_start(self, scope: Scope, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch(scope, trainer, pl_module)  # first: it picks the clock, which the run's metadata records
        scope.start()  # collective: every rank is here, after the strategy set up the process group
        # With `dataloader_iter`, Lightning's fetch hooks run inside training_step: the step opens there.
        self._fetch_in_step = is_param_in_hook_signature(
            pl_module.training_step, "dataloader_iter", explicit=True
        )
        self._fetch_timed = _time_fetches(scope, trainer, fetch_in_step=self._fetch_in_step)
        _mark_training_step(scope, trainer, opens_step=self._fetch_in_step and self._fetch_timed)
        _pause_where_hooks_come_late(scope, trainer)
        self._optimizer_after_clipping = _mark_optimizer_after_clipping(scope, trainer)
        for owner, names in _collectives(trainer):
            time_methods(owner, names, scope.hooks, scope.fail)
        self._check_shards(scope, trainer)

    @_guarded
    def on_train_end(self, scope: Scope, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here, not in on_fit_end: the final gather is collective and must run before DDP's teardown.
        _unhook_trainer(trainer)
        if scope.options.console and trainer.is_global_zero:
            with contextlib.suppress(Exception):  # (cosmetic: never a reason to lose the summary)
                _end_progress_bar(trainer)
        scope.finish()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The other ranks may be gone: end without meeting them, and never leave a watchdog behind.
        if self.scope is not None:
            _unhook_trainer(trainer)
            self.scope.stop(f"the fit {raised(exception)}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stage = None
        if stage == "fit" and self.scope is not None and not self.scope.finished:
            _unhook_trainer(trainer)
            self.scope.stop(FIT_ENDED_EARLY)

    # -- one step -----------------------------------------------------------------------------------------
    @_guarded
    def on_train_batch_start(
        self, scope: Scope, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._fetch_in_step and self._fetch_timed:  # the step opens where training_step is called
            return
        scope.resume()  # ends a checkpoint or epoch-boundary pause; a no-op on the timeline otherwise
        if not self._fetch_timed:
            scope.hooks.data_end(batch)
        scope.hooks.note_batch(batch)
        scope.recorder.label_step(trainer.global_step)  # what Lightning's loggers call this step

    @_guarded
    def on_before_backward(
        self, scope: Scope, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        # Lightning enters DDP's no_sync() for accumulation micro-batches: those backwards do not all-reduce.
        scope.hooks.forward_done(loss, grad_sync=scope.hooks.grad_sync_expected(self._ddp))

    @_guarded
    def on_before_optimizer_step(
        self, scope: Scope, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Only on a Lightning without the precision plugin's `_after_closure` (else marked where it ends).
        if not self._optimizer_after_clipping:
            scope.hooks.optimizer_begin()

    @_guarded
    def on_train_batch_end(
        self,
        scope: Scope,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        scope.log(loss=_loss_of(outputs, trainer, pl_module))
        if trainer.global_step > scope.recorder.current_label(open_step=True):
            # Lightning counted a step in this batch: its optimizer's, or one it skipped (a GradScaler skips
            # no step it is not called for, as after a training_step that returned None).
            scope.recorder.optimizer_skipped(certain=True)
        if not self._fetch_timed:  # loop top: from here to the next batch is the wait for data
            scope.hooks.data_begin()

    # -- time that is not a training step -----------------------------------------------------------------
    @_guarded
    def on_validation_start(self, scope: Scope, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scope.pause()  # (inside fit the pause began earlier, with the validation loop's run: see below)

    # No resume in on_validation_end: the module's own on_validation_end and the loop's teardown run after the
    # callbacks' hook. The pause runs to the end of the step it is in (the next fetch opens a new step) or,
    # without the fetch hooks, to the next batch (on_train_batch_start). No on_train_epoch_end either: the
    # epoch's end is paused before any callback's hook runs (`_pause_where_hooks_come_late`).

    # -- helpers ------------------------------------------------------------------------------------------
    def _watch(self, scope: Scope, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch

        if pl_module.device.type == "cuda":
            scope.use_cuda_clock(pl_module.device)
        model = trainer.strategy.model
        scope.note_parallelism(model)  # DDP, FSDP2 (ModelParallelStrategy), FSDP1 (FSDPStrategy), DeepSpeed
        # No optimizer pre-hook: Lightning calls step(closure) before the forward even starts.
        scope.watch(optimizer=list(trainer.optimizers), optimizer_pre_hook=False, manual_data=True)
        scope.watch_backward(pl_module)  # gradient-ready hooks; under FSDP2 its units' all-gathers too
        scope.set_metrics_sink(functools.partial(_log_metrics, trainer))
        flops_per_batch = getattr(pl_module, "flops_per_batch", None)  # what ThroughputMonitor reads
        if (
            self.options.flops_per_step is None
            and isinstance(flops_per_batch, (int, float))
            and flops_per_batch > 0
        ):
            scope.set_flops_per_step(float(flops_per_batch) * _batches_per_step(trainer, pl_module))
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._ddp = model
            scope.watch_replicas(model)
        if scope.parallelism.note is not None and trainer.world_size > 1:
            rank_zero_warn(f"pytscope: {type(trainer.strategy).__name__}: {scope.parallelism.note}.")

    def _check_shards(self, scope: Scope, trainer: pl.Trainer) -> None:
        batches = trainer.num_training_batches
        every_rank = scope.all_gather_ints([int(batches) if math.isfinite(batches) else -1])  # collective
        finding = uneven_shards_finding([r[0] for r in every_rank]) if every_rank is not None else None
        if finding is not None:
            scope.add_finding(finding)


def _precision(trainer: pl.Trainer) -> str | None:
    """The peak-table precision of Lightning's precision setting ("bf16-mixed" -> "bf16", "32-true" -> fp32
    or tf32); None when the setting says nothing (the scope then decides from the model)."""
    text = str(getattr(trainer, "precision", ""))
    if "16" in text.split("-")[0]:
        return "bf16"
    if text.startswith("32") or text.startswith("64"):
        import torch

        from pytscope_core.flops import training_precision

        return training_precision(torch.float32, autocast=False)
    return None


def _batches_per_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    return int(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1


def _time_fetches(scope: Scope, trainer: pl.Trainer, fetch_in_step: bool = False) -> bool:
    """Mark the wait for each training batch around the fetch itself, with the hooks Lightning's training loop
    hands its data fetcher for profiling (this loop instance only; undone at train end). False on a Lightning
    without them: the callback then takes the time from `on_train_batch_end` to the next batch as the wait.
    `fetch_in_step`: the fetch is inside training_step (`dataloader_iter`), whose call opened the step with
    the wait for data (`_mark_training_step`); the forward follows the fetch.
    """
    loop = trainer.fit_loop.epoch_loop
    before, after = getattr(loop, "_on_before_fetch", None), getattr(loop, "_on_after_fetch", None)
    if not callable(before) or not callable(after):
        return False
    hooks = scope.hooks

    def on_before_fetch() -> None:
        if not fetch_in_step:
            try:
                hooks.data_begin()  # the loop top
            except Exception as exc:
                scope.fail(exc)
        before()

    def on_after_fetch() -> None:
        after()
        try:
            hooks.data_fetched()
            if fetch_in_step:
                hooks.forward_begin()
        except Exception as exc:
            scope.fail(exc)

    loop._on_before_fetch = on_before_fetch  # type: ignore[method-assign]
    loop._on_after_fetch = on_after_fetch  # type: ignore[method-assign]
    return True


def _pause_where_hooks_come_late(scope: Scope, trainer: pl.Trainer) -> None:
    """Pause from the start of every `trainer.save_checkpoint` (ModelCheckpoint's and the user's), of every
    validation run inside fit and of every epoch's end, to the next batch (this trainer only; undone at train
    end). Lightning's hooks come too late for all three: the model's and optimizers' state (an FSDP full state
    dict) is gathered before `on_save_checkpoint`, the validation loader's workers start before
    `on_validation_start`, and the callbacks listed before this one run their `on_train_epoch_end` before its
    own. The epoch's end is the fit loop's `on_advance_end` (every callback's and the module's
    `on_train_epoch_end`, epoch-interval schedulers, epoch metrics); its pause runs to the end of the epoch's
    last step (the next fetch opens a new step, so the next epoch's loader start-up is its first step's wait
    for data)."""
    for owner, name in _paused_methods(trainer):
        _pause_before(scope, owner, name)


def _paused_methods(trainer: pl.Trainer) -> tuple[tuple[Any, str], ...]:
    return (
        (trainer, "save_checkpoint"),
        (trainer.fit_loop.epoch_loop.val_loop, "run"),
        (trainer.fit_loop, "on_advance_end"),
    )


def _mark_training_step(scope: Scope, trainer: pl.Trainer, opens_step: bool) -> None:
    """Mark where the loop calls the strategy's `training_step` (wrapped on this instance; undone at train
    end), after every callback's and the module's `on_train_batch_start`, so that their work is `other`
    whatever the order of the callbacks (this callback's own hook runs among them). The forward begins there.
    A `training_step(self, dataloader_iter)` fetches its batch inside: there (`opens_step`) its step opens
    instead, with the wait for data, and that work ends the step before, as work after an optimizer step does
    in a loop that fetches at its top."""
    strategy, hooks = trainer.strategy, scope.hooks
    training_step = strategy.training_step

    def mark() -> None:
        if not opens_step:
            hooks.forward_begin()
            return
        scope.resume()  # ends a checkpoint or epoch-boundary pause
        hooks.data_begin()  # the loop top
        scope.recorder.label_step(trainer.global_step)  # what Lightning's loggers call this step

    @functools.wraps(training_step)
    def marked_first(*args: Any, **kwargs: Any) -> Any:
        try:
            mark()
        except Exception as exc:
            scope.fail(exc)
        return training_step(*args, **kwargs)

    marked_first.pytscope_step = True  # type: ignore[attr-defined]
    strategy.training_step = marked_first  # type: ignore[method-assign]


def _pause_before(scope: Scope, owner: Any, name: str) -> None:
    """`owner.name` wrapped on the instance: the scope pauses, then the method runs."""
    method = getattr(owner, name)

    @functools.wraps(method)
    def paused_first(*args: Any, **kwargs: Any) -> Any:
        try:
            scope.pause()
        except Exception as exc:
            scope.fail(exc)
        return method(*args, **kwargs)

    paused_first.pytscope_pause = True  # type: ignore[attr-defined]
    setattr(owner, name, paused_first)


def _mark_optimizer_after_clipping(scope: Scope, trainer: pl.Trainer) -> bool:
    """Begin the optimizer phase where the closure ends, after `on_before_optimizer_step` and the gradient
    clipping Lightning runs after it (the precision plugin's `_after_closure`), so that clipping is `other`,
    as in a plain loop. False on a Lightning without it."""
    plugin = trainer.strategy.precision_plugin
    if not callable(getattr(plugin, "_after_closure", None)):
        return False
    _call_after(scope, plugin, "_after_closure", scope.hooks.optimizer_begin, "pytscope_optimizer")
    return True


def _call_after(scope: Scope, owner: Any, name: str, then: Callable[[], None], marker: str) -> None:
    """Wrap `owner.name` on the instance so that `then()` runs after each call (an error in it disables the
    scope); undone at train end (`restore_method` with `marker`)."""
    method = getattr(owner, name)

    @functools.wraps(method)
    def then_too(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        try:
            then()
        except Exception as exc:
            scope.fail(exc)
        return result

    setattr(then_too, marker, True)
    setattr(owner, name, then_too)


def _collectives(trainer: pl.Trainer) -> tuple[tuple[Any, tuple[str, ...]], ...]:
    """Where a step waits for the other ranks besides the gradient all-reduce (`pytscope_core.collectives`):
    the strategy's collectives (the loop's, the user's, `self.log(..., sync_dist=True)`'s reduce), the
    epoch loop's broadcast of a SIGTERM flag at the top of every batch under DDP, and DDP's broadcast of its
    buffers (BatchNorm's) as each forward starts."""
    strategy = ("barrier", "broadcast", "reduce", "all_gather", "reduce_boolean_decision")
    return (
        (trainer.strategy, strategy),
        (trainer.fit_loop.epoch_loop, ("_broadcast_sigterm_tensor",)),
        (trainer.strategy.model, DDP_BUFFER_SYNC),
    )


def _unhook_trainer(trainer: pl.Trainer) -> None:
    # The loop hands these to each epoch's fetcher: with the instance's own gone, the next fit profiles as
    # usual; the trainer's own save_checkpoint, the loops' validation run and epoch end, the strategy's
    # training_step and the collectives are back.
    for name in ("_on_before_fetch", "_on_after_fetch"):
        trainer.fit_loop.epoch_loop.__dict__.pop(name, None)
    for owner, name in _paused_methods(trainer):
        restore_method(owner, name, "pytscope_pause")  # (unless another tool wrapped it since: it keeps ours)
    for owner, names in _collectives(trainer):
        untime_methods(owner, names)
    restore_method(trainer.strategy.precision_plugin, "_after_closure", "pytscope_optimizer")
    restore_method(trainer.strategy, "training_step", "pytscope_step")


def _end_progress_bar(trainer: pl.Trainer) -> None:
    """Leave Lightning's own progress bar in its last frame now, as its training end or teardown would a
    moment later, so that the end-of-run summary prints below it and ends the output (it was drawn again
    after the summary)."""
    bar = trainer.progress_bar_callback
    if isinstance(bar, RichProgressBar) and bar.progress is not None:
        bar.progress.stop()  # (rich's stop is idempotent: Lightning's own call after it does nothing)
    elif isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        # (It closes the training bar, which Lightning's own call after it closes again: a no-op.)
        bar.on_train_end(trainer, trainer.lightning_module)


def _loss_of(outputs: Any, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The training step's loss as the user computed it, still on its device (no sync here)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if loss is None or not hasattr(loss, "detach"):
        return None
    if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
        # Lightning hands back the loss divided by the accumulation factor; undo it so runs compare.
        return loss.detach() * trainer.accumulate_grad_batches
    return loss


def _log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    # The step Lightning's own loggers and monitors log at: batches that stepped, once per batch whatever
    # the number of optimizers (`global_step` counts each optimizer's steps under manual optimization).
    at = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=at)
