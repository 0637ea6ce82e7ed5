"""Exposed communication under FSDP2 (`fully_shard`): the waits inside forward and backward, billed to `comm`.

Under DDP a rank waits for its peers after its autograd graph is done; under FSDP2 it waits inside forward
and backward, at every sharded unit. Read from torch 2.13's `torch/distributed/fsdp/_fully_shard/`, the wait
points are:

- **pre-forward**: each unit's forward pre-hook (`FSDPState._pre_forward`, registered with `prepend=True`)
  unshards its parameters: the all-gather (`foreach_all_gather`), then `wait_for_unshard` (copy-out); with
  explicit forward prefetching also the next unit's all-gather.
- **pre-backward**: a tensor hook FSDP puts on each unit's output (`_pre_backward`) unshards again (all-gather,
  unless prefetched) and prefetches the next unit in backward order (its all-gather).
- **post-backward**: `RegisterPostBackwardFunction`, applied to the unit's inputs in pre-forward, runs
  `post_backward` once the gradients of those inputs are ready: the reduce-scatter (`foreach_reduce`), the wait
  on an older reduce-scatter, the reshard.
- **end of backward**: FSDP's engine final callback runs `post_backward` for units whose inputs need no
  gradient (the root; a unit fed token ids) and `finalize_backward`. `BackwardTimer` queues its graph-done
  callback before it (from a hook on the model's output, which FSDP's own hook follows), so that stretch is
  `comm` exactly as DDP's finalize is.

Each wait is bracketed by COMM_BEGIN/COMM_END marks, nested in the forward or backward phase (the innermost
open phase wins), with instance-level hooks only: two forward pre-hooks per unit, one placed before FSDP's
and one after; a tensor hook on the unit's output placed before FSDP's (from a forward hook that runs before
FSDP's post-forward hook) with a pre-hook on the output's autograd node (node pre-hooks run after every tensor
hook of that node); a pre- and a post-hook on the `RegisterPostBackwardFunction` node that an appended forward
pre-hook finds on the unit's inputs. A unit whose output is an inner unit's own (the root of an nn.Sequential of
sharded blocks) hooks that tensor twice; the two brackets overlap and make one, from the first begin to the
first end. Per unit and step that is three module-hook calls, four hook registrations and four hook calls
(benchmarks/overhead.py --fsdp measures it).

What a bracket holds: on CPU/gloo (verified, torch 2.13) the collectives are synchronous, so the collective
itself, the wait for slower peers, and FSDP's copy-in/copy-out and reshard around it; those copies are local
work of the same size on every rank, so they land in the transfer estimate, not in anyone's sync wait. On CUDA
the marks are events on the compute stream, so a bracket holds what that stream waits for (the all-gather
event, the older reduce-scatter); not yet verified on a GPU.

Assumed, and checked on torch 2.13 only: FSDP registers its forward pre-hook with `prepend=True` and its
forward hook without, at `fully_shard` time; its pre-backward hook is a tensor hook on the unit's output
(`register_hook`); its post-backward is an autograd function node named `RegisterPostBackwardFunctionBackward`
on the unit's inputs; whether a backward reduces is each parameter group's `reduce_grads`, which
`set_requires_gradient_sync` sets. Not bracketed: methods registered with `register_fsdp_forward_method`
(FSDP calls its hooks directly there), a unit whose output is several tensors when another than the first
receives its gradient first, and FSDP1 (`FullyShardedDataParallel`), which the run reports as not measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .backward import first_grad_tensor
from .compiled import is_compiling_function
from .recorder import StepRecorder
from .timeline import Mark

_COMM_BEGIN = int(Mark.COMM_BEGIN)
_COMM_END = int(Mark.COMM_END)
_POST_BACKWARD_NODE = "RegisterPostBackwardFunctionBackward"


class FSDPCommTimer:
    """Marks each FSDP2 unit's all-gather and reduce-scatter waits; `sync_expected` says whether the coming
    backward reduce-scatters (a gradient sync, counted once per backward like a DDP all-reduce round)."""

    def __init__(
        self,
        recorder: StepRecorder,
        recording: Callable[[], bool],
        in_backward: Callable[[], bool],
        on_error: Callable[[BaseException], None],
    ) -> None:
        import torch

        self._grad_enabled = torch.is_grad_enabled
        # A unit compiled in place runs these hooks inside its compiled call: there they step aside.
        self._compiling = is_compiling_function()
        self.recorder = recorder
        self._recording = recording  # the scope records training time now (active, not paused)
        self._in_backward = in_backward  # a forward inside backward: activation recomputation
        self._on_error = on_error
        self._handles: list[Any] = []
        self._units: list[Any] = []
        self._groups: list[Any] = []  # every unit's FSDP parameter groups (their `reduce_grads`)
        self._open = False  # a COMM_BEGIN waits for its COMM_END (never two: `_begin`)

    def watch(self, units: list[Any]) -> None:
        """Hook every unit (outermost first); FSDP's own hooks must already be registered (`fully_shard`)."""
        for unit in units:
            self._handles.append(unit.register_forward_pre_hook(self._before_unshard, prepend=True))
            self._handles.append(unit.register_forward_pre_hook(self._after_unshard, with_kwargs=True))
            self._handles.append(unit.register_forward_hook(self._before_fsdp_post_forward, prepend=True))
            # FSDP2 keeps each unit's gradient-sync setting on its parameter groups; read only.
            self._groups.extend(param_groups(unit._get_fsdp_state()))
        self._units.extend(units)

    @property
    def units(self) -> int:
        return len(self._units)

    def is_unit(self, module: Any) -> bool:
        return any(u is module for u in self._units)

    def time_root_forward(
        self, root: Any, entered: Callable[[Any], None], left: Callable[[Any, Any], None]
    ) -> None:
        """The root unit's forward marks (`entered(args)`, `left(module, output)`), from module hooks placed
        outside FSDP's: forward begins before FSDP's pre-forward (the root's all-gather), before `forward` is
        even called, and ends before its post-forward (which hooks the output). FSDP's hooks already took the
        root off nn.Module's fast path, so these cost no more than a wrapper would."""
        timing = [False]

        def before(mod: Any, args: Any, kwargs: Any) -> None:
            if self._compiling():
                return
            timing[0] = (
                self._recording() and not self._in_backward() and mod.training and self._grad_enabled()
            )
            if timing[0]:
                entered(args or kwargs)  # (a model called with keywords only: `model(**batch)`)

        def after(mod: Any, args: Any, output: Any) -> None:
            if not self._compiling() and timing[0]:
                timing[0] = False
                left(mod, output)

        self._handles.append(root.register_forward_pre_hook(before, prepend=True, with_kwargs=True))
        self._handles.append(root.register_forward_hook(after, prepend=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._groups.clear()
        self._units.clear()

    def sync_expected(self) -> bool:
        """Whether the coming backward reduce-scatters gradients (`set_requires_gradient_sync`)."""
        return any(g.reduce_grads for g in self._groups)

    # -- forward: the unit's all-gather before its forward runs --------------------------------------
    # Each hook steps aside first thing while torch.compile traces it (a unit compiled in place): marks traced
    # into compiled code would never run, and tracing them would break the graph. That unit's waits go untimed.
    def _before_unshard(self, module: Any, args: Any) -> None:
        if self._compiling():
            return
        try:
            if self._recording() and module.training and self._grad_enabled():
                self._begin()
        except Exception as exc:
            self._on_error(exc)

    def _after_unshard(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._compiling() or not self._open:
            return
        try:
            self._end()
            # FSDP has just passed the inputs through its post-backward node (when they need a gradient).
            t = first_grad_tensor((args, kwargs))
            node = getattr(t, "grad_fn", None)
            if node is not None and type(node).__name__ == _POST_BACKWARD_NODE:
                node.register_prehook(self._grad_begin)
                node.register_hook(self._grad_end)
        except Exception as exc:
            self._on_error(exc)

    def _before_fsdp_post_forward(self, module: Any, args: Any, output: Any) -> None:
        # Runs before FSDP's post-forward hook, which adds the pre-backward hook on the output: ours come first.
        if self._compiling():
            return
        try:
            if self._in_backward() or not (self._recording() and module.training and self._grad_enabled()):
                return
            t = first_grad_tensor(output)
            if t is not None:
                t.register_hook(self._grad_begin)
                t.grad_fn.register_prehook(self._grad_end)
        except Exception as exc:
            self._on_error(exc)

    # -- backward: pre-backward all-gathers and post-backward reduce-scatters -------------------------
    def _grad_begin(self, *unused: Any) -> None:
        try:
            if self._recording():
                self._begin()
        except Exception as exc:
            self._on_error(exc)

    def _grad_end(self, *unused: Any) -> None:
        try:
            if self._open:
                self._end()
        except Exception as exc:
            self._on_error(exc)

    def _begin(self) -> None:
        # One bracket at a time. A unit whose output is an inner unit's own (the root of a Sequential of
        # sharded blocks, a block returning its last sub-unit's output) hooks that tensor a second time: both
        # begins run before either end (tensor hooks all run before the node's pre-hooks). A second
        # COMM_BEGIN would leave one wait open past the only COMM_END that closes anything: to the end of a
        # backward begun before it (all of that backward comm), or else through the optimizer step to the
        # next loop top. The first end closes the bracket, after every FSDP pre-backward hook on the tensor.
        if self._open:
            return
        self._open = True
        self.recorder.mark(_COMM_BEGIN)

    def _end(self) -> None:
        self._open = False
        self.recorder.mark(_COMM_END)


def param_groups(state: Any) -> list[Any]:
    """An FSDP2 unit's parameter groups: a list since torch 2.11 or so (per-parameter meshes), one group or
    none (a unit without parameters of its own) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
