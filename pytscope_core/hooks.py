"""Torch hooks that feed the recorder: model forward, the autograd engine, optimizer steps, the data loader.

Nothing global is patched. The model gets a forward pre-hook and a forward hook; the forward hook puts a
tensor hook on the output, which fires early in backward and queues an autograd engine final callback.
That callback runs when the graph has finished computing ("graph done") and before DDP's own finalize,
which waits for the gradient all-reduce; a second callback queued from the first runs after that wait.
So `comm` = exposed gradient communication including any wait for slower peers, with no Python on DDP's
per-bucket path. The loader is watched by giving that one instance a subclass whose iterator marks the
wait for each batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from .recorder import StepRecorder
from .timeline import Mark


def batch_size(batch: Any, _depth: int = 0) -> float:
    """Leading dimension of the first tensor found in a batch (tensor, sequence or mapping), else NaN."""
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
        self._on_error = on_error
        self._handles: list[Any] = []
        self._loaders: list[tuple[Any, type]] = []
        self._sync_pending = False
        self._in_backward = False
        self._batch_samples = math.nan
        self._queue_callback: Callable[[Callable[[], None]], None] | None = None

    # -- installation ---------------------------------------------------------------------------------
    def watch_model(self, model: Any) -> None:
        import torch

        self._queue_callback = torch.autograd.Variable._execution_engine.queue_callback
        self.is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self._handles.append(model.register_forward_pre_hook(self._forward_pre))
        self._handles.append(model.register_forward_hook(self._forward_post))

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
        for loader, base in self._loaders:
            _set_class(loader, base)
            loader.__dict__.pop("_pytscope_hooks", None)
        self._loaders.clear()

    # -- model ----------------------------------------------------------------------------------------
    def _forward_pre(self, module: Any, args: Any) -> None:
        if not self.active or self._in_backward or not module.training:
            return
        try:
            import torch

            if not torch.is_grad_enabled():
                return
            if self.loader_watched:
                self.recorder.mark(Mark.FORWARD_BEGIN)
            else:
                self._batch_samples = batch_size(args)
                self.recorder.loop_top(Mark.FORWARD_BEGIN)
        except Exception as exc:
            self._on_error(exc)

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        if not self.active or self._in_backward or not module.training:
            return
        try:
            # DDP decides in forward whether this backward all-reduces (no_sync() turns it off).
            self.forward_done(
                output, grad_sync=self.is_ddp and bool(getattr(module, "require_backward_grad_sync", True))
            )
        except Exception as exc:
            self._on_error(exc)

    def forward_done(self, output: Any, grad_sync: bool) -> None:
        """End of a micro-batch's forward: its backward will be timed through a hook on `output`."""
        rec = self.recorder
        if not rec.in_step:
            return
        rec.mark(Mark.FORWARD_END)
        rec.count_micro_batch(self._batch_samples)
        t = first_grad_tensor(output)
        if t is not None:
            if self._queue_callback is None:
                import torch

                self._queue_callback = torch.autograd.Variable._execution_engine.queue_callback
            t.register_hook(self._output_grad)
            self._sync_pending = grad_sync

    # -- autograd -------------------------------------------------------------------------------------
    def backward_begin(self) -> None:
        """Start of backward: from the output tensor's hook, or called by an integration (Lightning)."""
        if not self.active or self._in_backward:
            return
        self._in_backward = True
        self.recorder.mark(Mark.BACKWARD_BEGIN)
        assert self._queue_callback is not None
        self._queue_callback(self._graph_done)

    def _output_grad(self, grad: Any) -> None:
        try:
            self.backward_begin()
        except Exception as exc:
            self._on_error(exc)

    def _graph_done(self) -> None:
        try:
            self.recorder.mark(Mark.GRAPH_DONE)
            assert self._queue_callback is not None
            self._queue_callback(self._backward_end)  # runs after DDP's finalize, queued before it
        except Exception as exc:
            self._on_error(exc)

    def _backward_end(self) -> None:
        try:
            self.recorder.mark(Mark.BACKWARD_END)
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
            self.recorder.mark(Mark.OPTIMIZER_BEGIN)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active:
            try:
                self.recorder.optimizer_stepped()
            except Exception as exc:
                self._on_error(exc)

    # -- data -----------------------------------------------------------------------------------------
    def next_batch(self, it: Iterator[Any]) -> Any:
        if not self.active:
            return next(it)
        self.data_begin()
        try:
            batch = next(it)
        except StopIteration:
            self.epoch_end()
            raise
        self.data_end(batch)
        return batch

    def data_begin(self) -> None:
        """Loop top: the wait for the next batch starts."""
        rec = self.recorder
        if self._epoch_paused:
            rec.mark(Mark.PAUSE_END)
            self._epoch_paused = False
        rec.loop_top(Mark.DATA_BEGIN)

    def data_end(self, batch: Any) -> None:
        self.recorder.mark(Mark.DATA_END)
        self._batch_samples = batch_size(batch)

    def epoch_end(self) -> None:
        # Between epochs (evaluation, checkpointing) is not part of any step.
        self.recorder.mark(Mark.DATA_END)
        self.recorder.mark(Mark.PAUSE_BEGIN)
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
