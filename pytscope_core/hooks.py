"""Torch hooks that feed the recorder: model forward, the autograd engine, optimizer steps, the data loader.

Nothing global is patched, and nothing is registered per step. The model instance's `forward` is wrapped
(module hooks would take every call off nn.Module's fast path). Persistent gradient-ready hooks on the
parameters whose gradients come first mark the start of backward and queue an autograd engine final
callback. That callback runs when the graph has finished computing ("graph done") and before DDP's own
finalize, which waits for the gradient all-reduce; a second callback queued from the first runs after that
wait. So `comm` = exposed gradient communication including any wait for slower peers, with no Python on
DDP's per-bucket path. The loader is watched by giving that one instance a subclass whose iterator marks
the wait for each batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from .recorder import StepRecorder
from .timeline import Mark

# Plain ints for the hot path (an enum member lookup costs more than the append it feeds).
_BACKWARD_BEGIN = int(Mark.BACKWARD_BEGIN)
_BACKWARD_END = int(Mark.BACKWARD_END)
_DATA_BEGIN = int(Mark.DATA_BEGIN)
_DATA_END = int(Mark.DATA_END)
_FORWARD_BEGIN = int(Mark.FORWARD_BEGIN)
_FORWARD_END = int(Mark.FORWARD_END)
_GRAPH_DONE = int(Mark.GRAPH_DONE)
_OPTIMIZER_BEGIN = int(Mark.OPTIMIZER_BEGIN)
_PAUSE_BEGIN = int(Mark.PAUSE_BEGIN)
_PAUSE_END = int(Mark.PAUSE_END)


def batch_size(batch: Any, _depth: int = 0) -> float:
    """Leading dimension of the first tensor found in a batch (tensor, sequence or mapping), else NaN."""
    if type(batch) in (tuple, list) and batch and hasattr(batch[0], "shape"):  # (inputs, targets): the usual
        batch = batch[0]
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) > 0:
        return float(shape[0])
    if _depth < 3:
        if isinstance(batch, dict):
            for value in batch.values():
                n = batch_size(value, _depth + 1)
                if n == n:
                    return n
        elif isinstance(batch, (list, tuple)):
            for value in batch[:4]:
                n = batch_size(value, _depth + 1)
                if n == n:
                    return n
    return math.nan


def first_grad_tensor(output: Any, _depth: int = 0) -> Any:
    """The first tensor in a module's output that will receive a gradient, or None."""
    if getattr(output, "requires_grad", False) and getattr(output, "grad_fn", None) is not None:
        return output
    if _depth < 3:
        values = (
            output.values()
            if isinstance(output, dict)
            else output
            if isinstance(output, (list, tuple))
            else ()
        )
        for value in values:
            t = first_grad_tensor(value, _depth + 1)
            if t is not None:
                return t
    return None


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's or Accelerate's wrapper (those step only on real steps)."""
    for attr in ("_optimizer", "optimizer"):
        inner = getattr(optimizer, attr, None)
        if inner is not None and hasattr(inner, "register_step_post_hook"):
            return inner
    return optimizer


class TorchHooks:
    """Owns every hook handle, so that `remove()` leaves the user's objects as they were."""

    def __init__(self, recorder: StepRecorder, on_error: Callable[[BaseException], None]) -> None:
        self.recorder = recorder
        self.active = True
        self.loader_watched = False
        self.is_ddp = False
        self.paused = False  # set by the scope around evaluation / checkpointing
        self._on_error = on_error
        self._handles: list[Any] = []
        self._loaders: list[tuple[Any, type]] = []
        self._models: list[tuple[Any, Any]] = []  # (model, the instance `forward` it had before, if any)
        self._grad_hooks: list[tuple[Any, Any]] = []  # (param, handle) watching for backward's first gradient
        self._ready_order: list[Any] | None = None  # first backward: the order gradients became ready
        self._sync_pending = False
        self._in_backward = False
        self._batch_samples = math.nan
        self._queue_callback: Callable[[Callable[[], None]], None] | None = None

    # -- installation ---------------------------------------------------------------------------------
    def watch_model(self, model: Any) -> None:
        """Time the forward of `model` (its instance `forward` is wrapped: registered module hooks would
        push every call off nn.Module's fast path, ~8 us) and its backward (`watch_backward`)."""
        import torch

        self.is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        before = model.__dict__.get("forward")
        model.forward = self._timed_forward(model, model.forward)
        self._models.append((model, before))
        self.watch_backward(model)

    def watch_backward(self, model: Any) -> None:
        """Mark backward's start and "graph done" from persistent gradient-ready hooks on the parameters.

        A per-step hook on the output tensor costs ~13 us to register; a persistent one on a parameter costs
        ~1 us to fire. The first backward hooks every parameter to learn which gradients become ready first,
        then keeps the first few only: any parameter ready before the last one queues the graph-done callback
        ahead of DDP's finalize, which DDP queues when its last bucket becomes ready.
        """
        import torch

        self._queue_callback = torch.autograd.Variable._execution_engine.queue_callback
        params = [p for p in model.parameters() if p.requires_grad]
        if not params or not hasattr(params[0], "register_post_accumulate_grad_hook"):
            return
        self._ready_order = []
        for p in params:
            self._grad_hooks.append((p, p.register_post_accumulate_grad_hook(self._grad_ready)))

    def watch_optimizer(self, optimizer: Any, pre_hook: bool = True) -> None:
        """`pre_hook=False` where the framework runs forward and backward inside `step(closure)` (Lightning):
        the integration then marks the optimizer's start itself."""
        inner = unwrap_optimizer(optimizer)
        if pre_hook:
            self._handles.append(inner.register_step_pre_hook(self._optimizer_pre))
        self._handles.append(inner.register_step_post_hook(self._optimizer_post))

    def watch_loader(self, loader: Any) -> None:
        base = type(loader)
        if getattr(base, "_pytscope_watched", False):
            return
        _set_class(loader, _watched_class(base))
        loader.__dict__["_pytscope_hooks"] = self
        self._loaders.append((loader, base))
        self.loader_watched = True

    def remove(self) -> None:
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for _, handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        for model, before in self._models:
            if before is None:
                model.__dict__.pop("forward", None)
            else:
                model.forward = before
        self._models.clear()
        for loader, base in self._loaders:
            _set_class(loader, base)
            loader.__dict__.pop("_pytscope_hooks", None)
        self._loaders.clear()

    # -- model ----------------------------------------------------------------------------------------
    def _timed_forward(self, module: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        is_grad_enabled = torch.is_grad_enabled
        rec = self.recorder

        def timed(*args: Any, **kwargs: Any) -> Any:
            # Recomputation inside backward, and evaluation in a pause or between epochs, are not training.
            if self._quiet or not module.training or not is_grad_enabled():
                return forward(*args, **kwargs)
            try:
                if self.loader_watched:
                    rec.mark(_FORWARD_BEGIN)
                else:
                    self._batch_samples = batch_size(args)
                    rec.loop_top(_FORWARD_BEGIN)
            except Exception as exc:
                self._on_error(exc)
            output = forward(*args, **kwargs)
            try:
                # DDP decides in forward whether this backward all-reduces (no_sync() turns it off).
                self.forward_done(output, self.is_ddp and module.require_backward_grad_sync)
            except Exception as exc:
                self._on_error(exc)
            return output

        return timed

    @property
    def _quiet(self) -> bool:
        return not self.active or self._in_backward or self.paused or self._epoch_paused

    def forward_done(self, output: Any, grad_sync: bool) -> None:
        """End of a micro-batch's forward. Without gradient-ready hooks (`watch_backward`), the backward is
        timed through a hook on `output` instead."""
        rec = self.recorder
        if not rec._open:
            return
        rec.mark(_FORWARD_END)
        rec._step_micro += 1
        rec._samples += self._batch_samples
        self._sync_pending = grad_sync
        if not self._grad_hooks and output is not None:
            t = first_grad_tensor(output)
            if t is not None:
                if self._queue_callback is None:
                    import torch

                    self._queue_callback = torch.autograd.Variable._execution_engine.queue_callback
                t.register_hook(self._output_grad)

    # -- autograd -------------------------------------------------------------------------------------
    def backward_begin(self) -> None:
        """Start of backward (the first gradient is ready): queue the graph-done callback."""
        if not self.active or self._in_backward:
            return
        self._in_backward = True
        self.recorder.mark(_BACKWARD_BEGIN)
        assert self._queue_callback is not None
        self._queue_callback(self._graph_done)

    def _grad_ready(self, param: Any) -> None:
        try:
            if self._ready_order is not None:
                self._ready_order.append(param)
            self.backward_begin()
        except Exception as exc:
            self._on_error(exc)

    def _output_grad(self, grad: Any) -> None:
        try:
            self.backward_begin()
        except Exception as exc:
            self._on_error(exc)

    def _graph_done(self) -> None:
        try:
            self.recorder.mark(_GRAPH_DONE)
            if self._ready_order is not None:
                self._keep_first_ready()
            if self._sync_pending:
                assert self._queue_callback is not None
                self._queue_callback(self._backward_end)  # runs after DDP's finalize, queued before it
            else:
                self._backward_end()  # nothing to wait for: no second callback
        except Exception as exc:
            self._in_backward = False
            self._on_error(exc)

    def _keep_first_ready(self, keep: int = 2) -> None:
        # A few, not one: a parameter unused in some step must not leave that backward untimed.
        order, self._ready_order = self._ready_order or [], None
        first = {id(p) for p in order[:keep]}
        if not first:
            return
        kept = []
        for p, handle in self._grad_hooks:
            if id(p) in first:
                kept.append((p, handle))
            else:
                handle.remove()
        self._grad_hooks = kept

    def _backward_end(self) -> None:
        try:
            self.recorder.mark(_BACKWARD_END)
            if self._sync_pending:
                self.recorder.count_grad_sync()
                self._sync_pending = False
        except Exception as exc:
            self._on_error(exc)
        finally:
            self._in_backward = False

    # -- optimizer ------------------------------------------------------------------------------------
    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active:
            self._guard(self.recorder.mark, _OPTIMIZER_BEGIN)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active:
            try:
                self.recorder.optimizer_stepped()
            except Exception as exc:
                self._on_error(exc)

    # -- data -----------------------------------------------------------------------------------------
    def next_batch(self, it: Iterator[Any]) -> Any:
        if not self.active or self.paused:  # e.g. evaluating over the training loader inside a pause
            return next(it)
        try:
            self.data_begin()
        except Exception as exc:
            self._on_error(exc)
        try:
            batch = next(it)
        except StopIteration:
            self._guard(self.epoch_end)
            raise
        try:
            self.recorder.mark(_DATA_END)
            self._batch_samples = batch_size(batch)
        except Exception as exc:
            self._on_error(exc)
        return batch

    def _guard(self, hook: Callable[..., None], *args: Any) -> None:
        try:
            hook(*args)
        except Exception as exc:
            self._on_error(exc)

    def data_begin(self) -> None:
        """Loop top: the wait for the next batch starts."""
        rec = self.recorder
        if self._epoch_paused:
            rec.mark(_PAUSE_END)
            self._epoch_paused = False
        rec.loop_top(_DATA_BEGIN)

    def data_end(self, batch: Any) -> None:
        self.recorder.mark(_DATA_END)
        self._batch_samples = batch_size(batch)

    def epoch_end(self) -> None:
        # Between epochs (evaluation, checkpointing) is not part of any step.
        self.recorder.mark(_DATA_END)
        self.recorder.mark(_PAUSE_BEGIN)
        self._epoch_paused = True

    _epoch_paused = False


class _WatchedIterator:
    __slots__ = ("_it", "_hooks")

    def __init__(self, it: Iterator[Any], hooks: TorchHooks) -> None:
        self._it = it
        self._hooks = hooks

    def __iter__(self) -> _WatchedIterator:
        return self

    def __next__(self) -> Any:
        return self._hooks.next_batch(self._it)

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


_WATCHED: dict[type, type] = {}


def _set_class(obj: Any, cls: type) -> None:
    # Accelerate's DataLoaderShard makes `__class__` a read-only property: use object's own descriptor.
    object.__dict__["__class__"].__set__(obj, cls)


def _watched_class(base: type) -> type:
    cls = _WATCHED.get(base)
    if cls is None:

        def __iter__(self: Any) -> Any:
            it = base.__iter__(self)  # type: ignore[attr-defined]
            hooks = self.__dict__.get("_pytscope_hooks")
            return _WatchedIterator(it, hooks) if hooks is not None and hooks.active else it

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            # Pickles as the user's own class, without the hooks.
            state = {k: v for k, v in self.__dict__.items() if k != "_pytscope_hooks"}
            return (_rebuild, (base, state))

        cls = type(
            base.__name__,
            (base,),
            {"__iter__": __iter__, "__reduce_ex__": __reduce_ex__, "_pytscope_watched": True},
        )
        cls.__qualname__ = base.__qualname__
        cls.__module__ = base.__module__
        _WATCHED[base] = cls
    return cls


def _rebuild(base: type, state: dict[str, Any]) -> Any:
    obj: Any = object.__new__(base)
    obj.__dict__.update(state)
    return obj
