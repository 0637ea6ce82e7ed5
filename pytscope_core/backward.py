"""Backward and exposed gradient communication, timed from the autograd engine.

A pre-hook on the autograd node of each forward's output marks the start of backward where that is worth
its cost (a large output layer, or a device clock); elsewhere persistent gradient-ready hooks on the
parameters whose gradients come first do. Either queues an autograd engine final callback. That callback
runs when the graph has finished computing ("graph done") and before DDP's own finalize, which waits for the
gradient all-reduce; a second callback queued from the first runs after that wait. So `comm` = exposed
gradient communication including any wait for slower peers, with no Python on DDP's per-bucket path
(docs/MEASUREMENTS.md, items 1-3).

A backward that none of the hooks saw (a branch of the model, e.g. one of several task heads, that the hooked
parameters are not in) is noticed when the next forward ends or the optimizer steps: its gradient sync is
still counted, so every rank's count, which schedules the gathers, stays the same, and the next backward
learns that branch's first gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .batches import first_tensor
from .clocks import HostClock
from .recorder import StepRecorder
from .timeline import Mark

OUTPUT_TRIAL = 8
"""Backwards over which it is learnt whether the output's pre-hook earns its cost (`forward_done`)."""
OUTPUT_MIN_GAP_NS = 100_000
"""On the host clock, the pre-hook stays when the gradient reaches the output at least 100 us (median over
the trial) before the first parameter's is ready: a large output layer. Otherwise the parameter hooks begin
backward, and the at most 100 us between the two goes to `other`: the pre-hook costs 5-40 us a step (its
trip into Python, from warm to cold caches), several points of a 1 ms step. On a device clock (CUDA events)
the host's gap says nothing of the device's, and the pre-hook always stays."""

RELEARN_LIMIT = 16
"""Backwards that may hook every parameter again, to learn a branch that went unseen. Past that (a branch used
very rarely, or a training-mode forward that is never backpropagated, every step), unseen backwards are
still counted, but not timed."""

_BACKWARD_BEGIN = int(Mark.BACKWARD_BEGIN)
_BACKWARD_END = int(Mark.BACKWARD_END)
_GRAPH_DONE = int(Mark.GRAPH_DONE)


def first_grad_tensor(output: Any) -> Any:
    """The first tensor in a module's output that will receive a gradient, or None."""
    return first_tensor(output, _receives_grad)


def _receives_grad(t: Any) -> bool:
    try:
        return bool(t.requires_grad) and t.grad_fn is not None
    except Exception:  # an array without them (numpy's), or a `__getattr__` that raises: receives none
        return False


class BackwardTimer:
    """Marks backward begin, graph done and backward end, and counts the gradient syncs that completed."""

    def __init__(self, recorder: StepRecorder, on_error: Callable[[BaseException], None]) -> None:
        self.recorder = recorder
        self.active = True
        self.in_backward = False  # forwards run inside backward (recomputation) are not training forwards
        self._on_error = on_error
        self._sync_pending = False  # this micro-batch's backward all-reduces (DDP outside no_sync())
        self._sync_step = 0  # the recorder's steps_done when that forward ended
        self._awaiting = False  # a forward ended and no hooked gradient has become ready since
        self._params: list[Any] = []  # every parameter watched for gradients
        self._grad_hooks: list[tuple[Any, Any]] = []  # (param, handle) watching for backward's first gradient
        self._kept: set[int] = set()  # ids of the parameters whose hooks stay after learning
        self._ready_order: list[Any] | None = None  # a learning backward: the order gradients became ready
        self._from_output = False  # this backward began at the output's pre-hook (not a parameter's hook)
        self._relearning = False  # learning again after a backward that no hook saw
        self._relearn_left = RELEARN_LIMIT
        self._queue_callback: Callable[[Callable[[], None]], None] | None = None
        self._output_hook = True  # a pre-hook on each forward's output (False once the trial finds it idle)
        self._trial_left = OUTPUT_TRIAL  # backwards left in which both hooks fire and their gap is measured
        self._output_ns = 0  # a trial backward: when the gradient reached the output (0: not yet)
        self._gaps: list[int] = []  # the trial's output-to-first-parameter gaps, in ns
        self._output_began = 0  # the trial's backwards that the output's pre-hook began
        self._grad_before: Any = None  # a synced forward's gradients (`_grad_states`)
        self._graph_task: Callable[[], int] = lambda: 0  # the autograd graph task running (-1: none)

    def watch(self, model: Any, grad_hooks: bool = True) -> None:
        """Hook the parameters of `model` whose gradients become ready first: they begin the backwards that
        the output's pre-hook (`forward_done`) does not (it was found not worth its cost, or the loss came
        from another of the model's outputs). The first backward hooks every parameter, and the first few
        ready keep theirs through the pre-hook's trial; where the pre-hook stays after it, none does (each
        Python hook in backward costs 10-20 us, the engine's trip back into Python). Else the first few
        keep theirs: any parameter ready before the last one queues the graph-done callback ahead of DDP's
        finalize, which DDP queues when its last bucket becomes ready. A backward that no hook saw learns
        again (`settle`), keeping the first gradients of that branch too. With `grad_hooks=False` (FSDP2,
        whose sharded parameters' hooks fire only after each unit's reduce-scatter, called by FSDP itself)
        backward is timed from the output's pre-hook alone.
        """
        self._queue_callback = _engine_queue_callback()
        self._graph_task = _graph_task_function()
        if not grad_hooks:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if not params or not hasattr(params[0], "register_post_accumulate_grad_hook"):
            return
        self._params.extend(params)
        self._learn()

    def _learn(self) -> None:
        """Hook every watched parameter for the next backward, to see which gradients become ready first."""
        hooked = {id(p) for p, _ in self._grad_hooks}
        for p in self._params:
            if id(p) not in hooked:
                self._grad_hooks.append((p, p.register_post_accumulate_grad_hook(self._grad_ready)))
        self._ready_order = []

    def forward_done(self, output: Any, grad_sync: bool) -> None:
        """A micro-batch's forward ended. Its backward begins where the gradient reaches `output` (its first
        tensor that will receive one), seen by a pre-hook on that tensor's autograd node: the parameter hooks
        see backward only once the first parameter's gradient is accumulated, after the gradient of the layer
        that made the output, so a large output layer's (a language model's vocabulary projection) would be
        charged to `other`. The pre-hook, registered per step, stays only where it earns its cost
        (`OUTPUT_MIN_GAP_NS`, learnt over the first OUTPUT_TRIAL backwards), and always without parameter
        hooks (FSDP2)."""
        self.settle()
        self._sync_pending = grad_sync
        self._awaiting = True
        if grad_sync:
            self._sync_step = self.recorder.steps_done
            if self._params:
                self._grad_before = _grad_states(self._params)
        t = (
            first_grad_tensor(output)
            if output is not None and (self._output_hook or not self._params)
            else None
        )
        if t is not None:
            if self._queue_callback is None:
                self._queue_callback = _engine_queue_callback()
            t.grad_fn.register_prehook(self._output_grad)

    def settle(self) -> None:
        """The last forward's backward has run by now (the next forward ended, or the optimizer steps). If no
        hook saw it begin, count its gradient sync all the same (every rank counts each synced backward once,
        whichever parameters it reached) and learn, at the next backward, which gradients come first there."""
        if not self._awaiting:
            return
        self._awaiting = False
        if self._sync_pending:
            self._sync_pending = False
            # Unless no backward ran at all (the loop skipped the batch after an error on some rank): a
            # synced backward wrote the gradients on every rank, whichever parameters it reached. The
            # forward's step may have ended since, with no backward (`StepRecorder._ends_unstepped`).
            if self._sync_step == self.recorder.untrained_step:
                pass  # (not this step's micro-batch to take back either)
            elif not self._params or _grad_states(self._params) != self._grad_before:
                self.recorder.count_grad_sync()
            else:
                self.recorder.forward_untrained()
        if self._params and self._ready_order is None and self._relearn_left > 0:
            self._relearn_left -= 1
            self._relearning = True
            self._learn()

    def remove(self) -> None:
        for _, handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        self._params.clear()

    def grads_cleared(self) -> None:
        """`zero_grad()` ran: what a backward since the forward would have written is gone (zeroed in place, a
        change of version), so the gradients are compared with now."""
        if self._sync_pending and self._params:
            self._grad_before = _grad_states(self._params)

    def running(self) -> bool:
        """Whether the backward that began is still running: a forward now is its recomputation. One that
        raised (an out-of-memory error the loop then skips) never ran the engine's callbacks: it ends where
        the next forward finds no backward executing, and its gradient sync never happened."""
        if self.in_backward and self._graph_task() == -1:
            self.in_backward = False
            self._sync_pending = False
            self.recorder.mark(_BACKWARD_END)
        return self.in_backward

    def begin(self) -> None:
        """Start of backward (the first gradient is ready): queue the graph-done callback."""
        if not self.active or self.in_backward:
            return
        self.in_backward = True
        self._awaiting = False
        self.recorder.mark(_BACKWARD_BEGIN)
        assert self._queue_callback is not None
        self._queue_callback(self._graph_done)

    def _grad_ready(self, param: Any) -> None:
        try:
            if self._ready_order is not None:
                self._ready_order.append(param)
            if self._output_ns:  # a trial backward's first parameter gradient, after the output's
                self._gaps.append(time.perf_counter_ns() - self._output_ns)
                self._output_ns = 0
            if not self.in_backward:  # the later hooks of this backward: nothing to do, and no call
                self._from_output = False
                self.begin()
        except Exception as exc:
            self._on_error(exc)

    def _output_grad(self, grad_outputs: Any) -> None:
        try:
            if not self.in_backward:
                self._from_output = True
                if self._trial_left and self._params:
                    self._output_ns = time.perf_counter_ns()
                    self._output_began += 1
                self.begin()
        except Exception as exc:
            self._on_error(exc)

    def _graph_done(self) -> None:
        try:
            self.recorder.mark(_GRAPH_DONE)
            if self._sync_pending:
                assert self._queue_callback is not None
                self._queue_callback(self._end)  # runs after DDP's finalize, queued before it
            else:
                self._end()  # nothing to wait for: backward ends here, with no second callback
            self._output_ns = 0
            if self._ready_order is not None:
                self._keep_first_ready()
            if self._trial_left:
                self._trial_left -= 1
                if not self._trial_left:
                    self._end_trial()
        except Exception as exc:
            self.in_backward = False
            self._on_error(exc)

    def _end_trial(self) -> None:
        """Keep the output's pre-hook (and drop the parameter hooks: each costs a trip into Python) where
        it begins backward much earlier than they would, or where the clock is a device's; else stop
        registering it (`OUTPUT_MIN_GAP_NS`)."""
        device_clock = not isinstance(self.recorder.clock, HostClock)
        gaps = sorted(self._gaps)
        # (No parameter gradient after the output's: `torch.autograd.grad` accumulates none.)
        unseen = not gaps and self._output_began > 0
        self._output_hook = device_clock or unseen or bool(gaps) and gaps[len(gaps) // 2] >= OUTPUT_MIN_GAP_NS
        if self._output_hook:
            self._kept.clear()  # a branch the pre-hook misses is learnt again when one goes unseen
            if self._ready_order is None:  # (else the learning under way prunes them)
                for _, handle in self._grad_hooks:
                    handle.remove()
                self._grad_hooks.clear()

    def _keep_first_ready(self, keep: int = 2) -> None:
        # A backward the output's pre-hook began needs no parameter hook. Else a few, not one: a parameter
        # unused in some step must not leave that backward untimed. Those kept after earlier learning stay:
        # each is the first gradient of some branch of the model that the output's pre-hook does not see.
        order, self._ready_order = self._ready_order or [], None
        output_begins = self._from_output and self._output_hook and not self._trial_left
        first = set() if output_begins else {id(p) for p in order[:keep]}
        if not (first or output_begins):
            return
        if self._relearning and self._relearn_left > 0 and (output_begins or first <= self._kept):
            # Learning after an unseen backward, but this one was seen all the same: learn again.
            self._relearn_left -= 1
            self._ready_order = []
            return
        self._relearning = False
        self._kept |= first
        kept = []
        for p, handle in self._grad_hooks:
            if id(p) in self._kept:
                kept.append((p, handle))
            else:
                handle.remove()
        self._grad_hooks = kept

    def _end(self) -> None:
        try:
            self.recorder.mark(_BACKWARD_END)
            if self._sync_pending:
                self.recorder.count_grad_sync()
                self._sync_pending = False
        except Exception as exc:
            self._on_error(exc)
        finally:
            self.in_backward = False


def _grad_states(params: list[Any]) -> tuple[Any, ...]:
    """The first and last parameters' gradients, each as (the tensor's id, its version) or None: a synced
    backward writes them on every rank, unless no rank used one (a branch of the model: so two, at its two
    ends). One call, on the hot path (every synced forward). (Equal ids of two tensors alive at different
    times only hide a change where the version is the same too.)"""
    grad = params[0].grad
    first = None if grad is None else (id(grad), grad._version)
    grad = params[-1].grad
    return first, None if grad is None else (id(grad), grad._version)


def _graph_task_function() -> Callable[[], int]:
    """torch's id of the autograd graph task running on this thread (-1: none); 0 always if it has none."""
    import torch

    return getattr(torch._C, "_current_graph_task_id", lambda: 0)  # type: ignore[no-any-return]


def _engine_queue_callback() -> Callable[[Callable[[], None]], None]:
    import torch

    return torch.autograd.Variable._execution_engine.queue_callback  # type: ignore[no-any-return]
