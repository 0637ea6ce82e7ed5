"""Torch hooks that feed the recorder: model forward, the autograd engine, optimizer steps, the data loader.

Little is patched globally (`GradScaler.step`, while an optimizer is watched: the user's scaler is not the
scope's to know) and little is registered per step: a pre-hook on the forward's output where it
earns its cost (`backward.BackwardTimer.forward_done`), and under FSDP2, where the waits sit behind hooks FSDP
itself registers per step, those (`fsdp.py`). The model instance's `forward` is wrapped
(module hooks would take every call off nn.Module's fast path); backward and exposed communication are
timed from the autograd engine (`backward.BackwardTimer`); optimizer steps from torch's step hooks; the
loader by giving that one instance a subclass whose iterator marks the wait for each batch (`loader.py`).

A compiled model is timed from outside what torch.compile traces: `torch.compile(model)` returns a wrapper
whose `forward` calls the compiled code, and `model.compile()` compiles the module's whole call, so there the
wrapper goes around that call instead. A wrapper that torch.compile reaches all the same (the model was
compiled after `watch`) steps aside while traced: it never adds a graph break or a guard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

from .backward import BackwardTimer
from .batches import batch_fingerprint, batch_tensor
from .collectives import restore_method, time_buffer_sync
from .compiled import CallWrappers, compiled_in_place, is_compiling_function, outside_compiled, uncompiled
from .flops import FlopEstimate
from .fsdp import FSDPCommTimer
from .loader import batches_per_epoch, watch_loader
from .parallelism import fsdp2_units
from .patches import Patch
from .recorder import StepRecorder
from .timeline import Mark

# Plain ints for the hot path (an enum member lookup costs more than the append it feeds).
_DATA_BEGIN = int(Mark.DATA_BEGIN)
_DATA_END = int(Mark.DATA_END)
_FORWARD_BEGIN = int(Mark.FORWARD_BEGIN)
_OPTIMIZER_BEGIN = int(Mark.OPTIMIZER_BEGIN)
_PAUSE_BEGIN = int(Mark.PAUSE_BEGIN)
_PAUSE_END = int(Mark.PAUSE_END)
FORWARD_UNSEEN = (
    "the first optimizer step came without a training forward of the watched model, so forward and gradient "
    "communication are not timed: if the model was compiled after watch(), watch the model torch.compile "
    "returned"
)


LOADER_UNSEEN = (
    "the loader given to watch() was not iterated before the first optimizer step (one from before "
    "accelerator.prepare()?), so steps are timed from the model's forward and the wait for data is in `other`: "
    "watch the loader the training loop iterates"
)


def end_windows_at_zero_grad(optimizer: Any, hooks: TorchHooks) -> Callable[[], None]:
    """Wrap `optimizer.zero_grad` on the instance to tell the recorder that gradients were cleared outside the
    optimizer's step (`StepRecorder.optimizer_skipped`: a step the optimizer skipped ends there; L-BFGS's
    closure clears them inside), and the backward timer once they are (`BackwardTimer.grads_cleared`);
    return the undo."""
    zero_grad = optimizer.zero_grad

    def cleared(*args: Any, **kwargs: Any) -> Any:
        if not hooks.optimizing:
            hooks.recorder.optimizer_skipped()
        try:
            return zero_grad(*args, **kwargs)
        finally:
            hooks.backward.grads_cleared()

    cleared.__wrapped__ = zero_grad  # type: ignore[attr-defined]
    cleared.pytscope_zero_grad = True  # type: ignore[attr-defined]
    optimizer.zero_grad = cleared
    return functools.partial(restore_method, optimizer, "zero_grad", "pytscope_zero_grad")


_SCALED: list[tuple[Any, TorchHooks]] = []  # (torch optimizer, the hooks watching it) for `GradScaler.step`


def end_steps_the_scaler_skips(optimizer: Any, hooks: TorchHooks) -> Callable[[], None]:
    """End the step where a GradScaler steps `optimizer`, also when it skips the optimizer's step on inf or
    NaN gradients (`StepRecorder.optimizer_skipped`). Otherwise the skipped step merges into the next: PyTorch's
    AMP recipe clears gradients first thing in the next iteration, after its loop top (the watched loader's
    fetch), and Lightning in the next batch's closure or through its own optimizer wrapper. `GradScaler.step`
    is wrapped on the class while any optimizer is watched (Accelerate's and Lightning's scalers step
    through it too); return the undo."""
    scaler_class = _scaler_class()
    if scaler_class is None:
        return lambda: None
    _SCALER_PATCH.install(scaler_class, "step")
    entry = (optimizer, hooks)
    _SCALED.append(entry)

    def undo() -> None:
        _SCALED[:] = [e for e in _SCALED if e is not entry]
        if not _SCALED:
            _SCALER_PATCH.remove(scaler_class, "step")

    return undo


def _ending_skipped_steps(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def scaler_step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        result = step(scaler, optimizer, *args, **kwargs)
        for watched, hooks in _SCALED:
            if watched is optimizer and not hooks.optimizing:
                hooks.recorder.optimizer_skipped(certain=True)  # (a no-op after a step the optimizer took)
        return result

    return scaler_step


def _scaler_class() -> Any:
    """torch's GradScaler (`torch.amp`'s from torch 2.3; CUDA's, and FSDP's sharded one, derive from it)."""
    import torch

    scaler = getattr(torch.amp, "GradScaler", None) or getattr(torch.cuda.amp, "GradScaler", None)
    return scaler if callable(getattr(scaler, "step", None)) else None


_SCALER_PATCH = Patch(_ending_skipped_steps)


def undo_all(undo: list[Callable[[], None]], on_error: Callable[[BaseException], None]) -> None:
    """Run and forget each undo, the last change first: one that fails is reported, and the others still run."""
    while undo:
        try:
            undo.pop()()
        except Exception as exc:
            on_error(exc)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's or Accelerate's wrapper (those step only on real steps)."""
    for attr in ("_optimizer", "optimizer"):
        inner = getattr(optimizer, attr, None)
        if inner is not None and hasattr(inner, "register_step_post_hook"):
            return inner
    return optimizer


class TorchHooks:
    """Owns every hook handle, so that `remove()` leaves the user's objects as they were."""

    def __init__(
        self,
        recorder: StepRecorder,
        on_error: Callable[[BaseException], None],
        warn: Callable[[str], None] = print,
    ) -> None:
        self.recorder = recorder
        self.loader_watched = False
        self.loader_batches: int | None = None  # the watched loader's batches per epoch (-1: it has no len)
        self.is_ddp = False
        self._paused = False  # pause() / resume(), around evaluation or checkpointing
        self.recording = True  # active, and neither paused nor between epochs (kept by `_update`)
        self._epoch_paused = False  # from a loader's last batch to the next epoch's first fetch
        self._on_error = on_error
        self._handles: list[Any] = []
        self._undo: list[Callable[[], None]] = []  # puts each watched loader back as it was
        self.wrappers = CallWrappers(self._timed_forward)  # on each watched model's (compiled) call
        self.backward = BackwardTimer(recorder, on_error)
        self.sharded: FSDPCommTimer | None = None  # FSDP2: the all-gather and reduce-scatter waits
        self._batch_samples = math.nan
        self.flop_estimate: FlopEstimate | None = None  # set by the scope when FLOPs per step are unknown
        self.first_forward: Callable[[], None] | None = None  # called once, inside the first training forward
        self._warn = warn  # says what limits the measurement, once, without disabling anything
        self._forward_checked = False  # at the first optimizer step: was the training forward seen?
        self.optimizing = False  # inside optimizer.step() (whose closure may clear gradients, as L-BFGS's)

    @property
    def active(self) -> bool:
        return self.backward.active

    @active.setter
    def active(self, value: bool) -> None:
        self.backward.active = value
        self._update()

    def _update(self) -> None:
        self.recording = self.backward.active and not self._paused and not self._epoch_paused

    # -- installation ---------------------------------------------------------------------------------
    def watch_model(self, model: Any) -> None:
        """Time `model`'s forward (its instance `forward` wrapped: module hooks would take every call off the
        fast path, ~8 us; an FSDP2 root's by hooks around FSDP's own; a model compiled in place, its compiled
        call), its backward and DDP's buffer broadcast."""
        import torch

        self.is_ddp = isinstance(uncompiled(model), torch.nn.parallel.DistributedDataParallel)
        self._undo.append(time_buffer_sync(uncompiled(model), self, self._on_error))
        self.watch_backward(model)
        if self.sharded is not None and self.sharded.is_unit(model) and not compiled_in_place(model):
            self.sharded.time_root_forward(model, self._forward_entered, self._forward_left)
            return
        self.wrappers.wrap(model)

    def _check_forward(self) -> None:
        """At the first optimizer step: no training forward of the watched model means it was compiled after
        `watch` (its wrapper steps aside in compiled code): compiled in place, its compiled call is wrapped now;
        into a new module, unseen, that is said once. A first step the forward opened: another loader."""
        self._forward_checked = True
        rec = self.recorder
        if self.loader_watched and rec.opened_at != _DATA_BEGIN:  # (the forward opened the first step)
            self.loader_watched = False
            self._warn(LOADER_UNSEEN)
            return
        if not self.wrappers or (rec.in_step and rec.completed[2] > rec.micro_batches):
            return
        if not self.wrappers.follow_compiled():
            self._warn(FORWARD_UNSEEN)

    def watch_backward(self, model: Any) -> None:
        """Time backward and exposed communication; under FSDP2, the units' collectives (`FSDPCommTimer`)."""
        units = fsdp2_units(model)
        if units and self.sharded is None:
            recording, in_backward = (lambda: self.recording), (lambda: self.backward.running())
            self.sharded = FSDPCommTimer(self.recorder, recording, in_backward, self._on_error)
            self.sharded.watch(units)
        self.backward.watch(model, grad_hooks=not units)

    def watch_optimizer(self, optimizer: Any, pre_hook: bool = True) -> None:
        """`pre_hook=False` where forward and backward run inside `step(closure)` (Lightning: marked there)."""
        inner = unwrap_optimizer(optimizer)
        self.recorder.iteration_steps = False  # (steps end where an optimizer steps)
        if pre_hook:
            self._handles.append(inner.register_step_pre_hook(outside_compiled(self._optimizer_pre)))
        self._handles.append(inner.register_step_post_hook(outside_compiled(self._optimizer_post)))
        self._undo += (end_windows_at_zero_grad(inner, self), end_steps_the_scaler_skips(inner, self))

    def watch_loader(self, loader: Any) -> None:
        undo = watch_loader(loader, self, self._warn)
        if undo is not None:
            self._undo.append(undo)
            self.loader_watched = True
            self.loader_batches = batches_per_epoch(loader)

    def remove(self) -> None:
        self.active = False
        if self.flop_estimate is not None:
            self.flop_estimate.cancel()
            self.flop_estimate = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.backward.remove()
        if self.sharded is not None:
            self.sharded.remove()
        self.wrappers.remove()
        undo_all(self._undo, self._on_error)

    # -- model ----------------------------------------------------------------------------------------
    def _timed_forward(self, module: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
        """`forward` with its marks; `module`'s `training` (and DDP's) flags count: a compiled one's inner module."""
        import torch

        is_grad_enabled = torch.is_grad_enabled
        is_compiling = is_compiling_function()
        backward = self.backward

        def timed(*args: Any, **kwargs: Any) -> Any:
            # Traced by torch.compile (checked first, so nothing below becomes a guard); recomputation inside
            # backward, and evaluation in a pause or between epochs, are not training.
            if (
                is_compiling()
                or not self.recording
                or backward.in_backward
                and backward.running()  # (a recomputation inside backward, unless that backward raised)
                or not module.training
                or not is_grad_enabled()
            ):
                return forward(*args, **kwargs)
            self._forward_entered(args or kwargs)  # (a model called with keywords only: `model(**batch)`)
            output = forward(*args, **kwargs)
            self._forward_left(module, output)
            return output

        return timed

    def _forward_entered(self, args: Any) -> None:
        rec = self.recorder
        try:
            if self.loader_watched and rec.in_step:
                rec.mark(_FORWARD_BEGIN)
            else:  # no loader, or none of its batches yet (it may not be the one the loop iterates)
                self.note_batch(args)
                rec.loop_top(_FORWARD_BEGIN)
            if self.flop_estimate is not None and self.flop_estimate.begin(rec.steps_done + 1):
                self.flop_estimate = None  # counted, or given up
            if self.first_forward is not None:
                probe, self.first_forward = self.first_forward, None
                probe()
        except Exception as exc:
            self._on_error(exc)

    def _forward_left(self, module: Any, output: Any) -> None:
        try:
            # DDP and FSDP2 decide in forward whether this backward syncs (no_sync(),
            # set_requires_gradient_sync(False) turn it off).
            sync = (
                self.is_ddp
                and module.require_backward_grad_sync
                or self.sharded is not None
                and self.sharded.sync_expected()
            )
            self.forward_done(output, sync)
        except Exception as exc:
            self._on_error(exc)

    def grad_sync_expected(self, ddp: Any = None) -> bool:
        """Whether the coming backward syncs gradients (DDP outside `no_sync()`, FSDP2 with sync on)."""
        if ddp is not None:
            return bool(ddp.require_backward_grad_sync)
        return self.sharded is not None and self.sharded.sync_expected()

    def forward_begin(self) -> None:
        """Start of a micro-batch's forward, for integrations that see the loop (the wrapper does it itself)."""
        rec = self.recorder
        rec.mark(_FORWARD_BEGIN)
        if self.flop_estimate is not None and self.flop_estimate.begin(rec.steps_done + 1):
            self.flop_estimate = None

    def end_flop_count(self) -> None:
        """What follows is not training (a pause, an epoch's end, the run's end): a FLOP count ends here."""
        if self.flop_estimate is not None and self.flop_estimate.interrupt(self.recorder.completed[0]):
            self.flop_estimate = None

    def forward_done(self, output: Any, grad_sync: bool) -> None:
        """End of a micro-batch's forward; its backward is timed from `output` where that earns its cost, else
        from the gradient-ready hooks (`backward.BackwardTimer.forward_done`)."""
        if self.recorder.in_step:
            self.recorder.forward_ended(self._batch_samples)
            # A batch's samples count once, however many forwards it feeds (two models, a GAN's two
            # passes): 0 for the next forwards of the same batch (NaN, a size not known, stays NaN). Several
            # optimizer steps on one fetched batch are one step (it closes at the next fetch).
            self._batch_samples *= 0.0
            self.backward.forward_done(output, grad_sync)

    # -- optimizer ------------------------------------------------------------------------------------
    def optimizer_begin(self) -> None:
        """The optimizer step starts: the step's forwards and backwards are done."""
        self.recorder.mark(_OPTIMIZER_BEGIN)
        self.backward.settle()

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizing = True
        if self.backward.active:
            try:
                self.optimizer_begin()
            except Exception as exc:
                self._on_error(exc)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizing = False
        if self.backward.active:
            try:
                self.recorder.optimizer_stepped()
                if not self._forward_checked:
                    self._check_forward()
            except Exception as exc:
                self._on_error(exc)

    # -- data -----------------------------------------------------------------------------------------
    def next_batch(self, it: Iterator[Any]) -> Any:
        if self._paused or not self.backward.active:  # e.g. evaluating over the training loader in a pause
            return next(it)
        try:
            self.data_begin()
        except Exception as exc:
            self._on_error(exc)
        try:
            batch = next(it)
        except StopIteration:
            try:
                self.epoch_end()
            except Exception as exc:
                self._on_error(exc)
            raise
        try:
            self.recorder.mark(_DATA_END)
            self.note_batch(batch)
        except Exception as exc:
            self._on_error(exc)
        return batch

    def data_begin(self) -> None:
        """Loop top: the wait for the next batch starts (a step that a forward before the loop opened restarts)."""
        if self._epoch_paused:
            self._epoch_begins()
        if not self._forward_checked and self.recorder.opened_at == _FORWARD_BEGIN:
            self.recorder.drop_unstepped()
        self.recorder.loop_top(_DATA_BEGIN)

    def data_end(self, batch: Any) -> None:
        """The batch arrived (an integration that sees it there)."""
        self.recorder.mark(_DATA_END)
        self.note_batch(batch)

    def data_fetched(self) -> None:
        """The batch arrived (an integration that sees it later: `note_batch` then)."""
        self.recorder.mark(_DATA_END)

    def note_batch(self, batch: Any) -> None:
        """The batch's size (samples per step) and, on the steps that take one, its fingerprint."""
        t = batch[0] if type(batch) in (tuple, list) and batch else batch  # (inputs, targets): the inputs
        try:
            shape = getattr(t, "shape", None)
        except Exception:  # a user's `__getattr__` that raises (a dict-like's KeyError): no shape there
            shape = None
        if not isinstance(shape, tuple):  # not a tensor or an array there: search the batch
            t = batch_tensor(batch)
            shape = getattr(t, "shape", None)
        self._batch_samples = shape[0] if shape else math.nan  # (a 0-d tensor's shape is empty)
        if self.recorder.wants_fingerprint:
            self.recorder.set_fingerprint(batch_fingerprint(t, batch))

    def pause(self) -> None:
        self._paused = True
        self._update()
        self.recorder.mark(_PAUSE_BEGIN)
        self.end_flop_count()

    def resume(self) -> None:
        self._paused = False
        self._update()
        self.recorder.mark(_PAUSE_END)

    def epoch_end(self) -> None:
        # Between epochs (evaluation, checkpointing) is not part of any step.
        self.recorder.mark(_DATA_END)
        self.recorder.mark(_PAUSE_BEGIN)
        self._epoch_paused = True
        self._update()
        self.end_flop_count()

    def _epoch_begins(self) -> None:
        self.recorder.mark(_PAUSE_END)
        self._epoch_paused = False
        self._update()
