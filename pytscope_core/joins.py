"""Uneven inputs under torch's `Join` (DDP's `model.join()`, `Join([model, ...])`, Accelerate's
`join_uneven_inputs`): a rank out of batches keeps meeting the others' gathers from inside the join.

A rank that runs out of batches first waits in `Join.__exit__`, where each iteration of its loop shadows one
iteration of the ranks still training: the collectives of their forward and, where they sync, of their
backward (DDP's join hook). Those ranks still gather every `interval` steps, so the joined rank must meet
them there, or they wait `gather_timeout` for it and disable the scope. From a scope's creation to its end,
`Join.__exit__` is wrapped on the class (`JoinFollower`; a `with` statement reads it as it enters):

- before the join's loop, every rank closes its open step (its next loop top never comes) and meets the
  gather due there, as at a loop top;
- a join hook of the scope's, run after DDP's in each iteration, counts the gradient sync DDP shadowed and,
  where that ends one of the others' steps, meets the gather due there. The others gather at their next loop
  top, before the forward whose collectives the joined rank's next iteration waits in: so the joined rank
  gathers at the end of this iteration, never at the start of the next (that would deadlock);
- after the join, every rank takes the job's counts (the largest, in one collective), so steps are numbered
  alike again in the next epoch and the counts the ranks compare agree.

A joined rank sends no steps. Its gather header says where it joined (`joined_at`, its last step), so rank 0
compares neither its step counts nor its parameters (behind the others' until DDP syncs the final model at
the end of the join), and the run records the join (`DATA.UNEVEN_SHARDS`, measured).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from .patches import Patch
from .watchdog import JOINED

if TYPE_CHECKING:
    from .scope import Scope


class JoinFollower:
    """Follows this rank through the joins of one session's DDP model (see the module's docstring)."""

    _installed: ClassVar[list[JoinFollower]] = []

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.thread = 0  # the training thread: the one that installed it (watch())
        self.joined_at: int | None = None  # while out of batches inside a join: this rank's last step
        self._status = ""  # what the heartbeats said before the join
        self._syncs_per_step = 1  # as this rank's own steps synced, before the join

    def install(self) -> None:
        join_class = _join_class()
        if join_class is None or self in self._installed:
            return
        self.thread = threading.get_ident()
        _EXIT_PATCH.install(join_class, "__exit__")
        self._installed.append(self)

    def remove(self) -> None:
        if self not in self._installed:
            return
        self._installed.remove(self)
        join_class = _join_class()
        if not self._installed and join_class is not None:
            _EXIT_PATCH.remove(join_class, "__exit__")

    @classmethod
    def on_this_thread(cls) -> JoinFollower | None:
        thread = threading.get_ident()
        return next((f for f in reversed(cls._installed) if f.thread == thread), None)

    # -- through one join -----------------------------------------------------------------------------
    def ddp_hook_of(self, join: Any) -> Any:
        """DDP's join hook for the watched model in `join`, or None: not this scope's join."""
        model = self.scope.replicated_model
        if not self.scope.enabled or model is None:
            return None
        return next((h for h in join._join_hooks if getattr(h, "ddp", None) is model), None)

    def through(self, join: Any, run_join: Callable[[], Any]) -> Any:
        """Run the join's loop (`run_join`) with this rank's scope following it."""
        hook = self._attempt(self._before, join)
        try:
            result = run_join()
            self._attempt(self._after)
            return result
        finally:
            if self.joined_at is not None and self.scope.session is not None:
                self.scope.session.waiting_in(self._status)
            self.joined_at = None
            if hook is not None and hook in join._join_hooks:
                join._join_hooks.remove(hook)

    def _before(self, join: Any) -> Any:
        """Close the open step and meet the gather due at it (a rank that never stepped has none: the others'
        first step boundary schedules, and gathers not); add the scope's join hook after DDP's."""
        hook = _shadow_hook(self, self.ddp_hook_of(join).ddp)
        rec = self.scope.recorder
        rec.close()  # (an unstepped step's syncs are counted: the others' steps go on from them)
        self._syncs_per_step = max(1, rec.grad_syncs // rec.steps_done) if rec.steps_done else 1
        if self.scope.coordinator.scheduled and self._at_their_step_end():
            self._gather_if_due()
        join._join_hooks.append(hook)
        return hook

    def shadowed(self, synced: bool) -> None:
        """One iteration of the others, shadowed inside the join (called by the scope's join hook): where it
        ends one of their steps (`_at_their_step_end`), the gather due there."""
        if self.joined_at is None:
            rec = self.scope.recorder  # (its last step's number; one before the first, where it had none)
            self.joined_at = rec.last_label if rec.last_label is not None else rec.step_label(rec.steps_done)
            if self.scope.session is not None:
                self._status = self.scope.session.waiting_in(JOINED)
        if synced:
            self.scope.recorder.grad_syncs += 1
            if self._at_their_step_end():
                self._gather_if_due()

    def _at_their_step_end(self) -> bool:
        """Whether the others' gradient syncs now end one of their steps, where they check for a gather: every
        sync, or every k-th where each step syncs k times (accumulation without no_sync(): as rank 0 told at
        the last gather, or as this rank's own steps did, where no gather told it yet)."""
        per_step = max(self._syncs_per_step, self.scope.coordinator.syncs_per_step)
        return self.scope.recorder.grad_syncs % per_step == 0

    def _gather_if_due(self) -> None:
        on_step_closed = self.scope.recorder.on_step_closed
        if on_step_closed is not None:
            on_step_closed()  # (the scope's check at a step boundary: schedules, or gathers if due)

    def _after(self) -> None:
        """Every rank takes the job's counts (the most steps, syncs and micro-batches any rank has), and rank 0
        learns which ranks waited inside the join, where a gather during it did not tell it."""
        scope = self.scope
        if not scope.enabled or scope.session is None or not scope.coordinator.distributed:
            return
        rec = scope.recorder
        scope.coordinator.check_peers_enabled()
        joined = -1 if self.joined_at is None else self.joined_at
        every = scope.coordinator.all_gather_ints([rec.steps_done, rec.grad_syncs, rec.micro_batches, joined])
        if not every:
            return
        rec.steps_done, rec.grad_syncs, rec.micro_batches = (max(r[i] for r in every) for i in range(3))
        rec.last_label = rec.step_label(rec.steps_done)  # (a later join's last step is numbered from here)
        live = scope.session.live  # (rank 0)
        for rank, r in enumerate(every):
            if r[3] >= 0 and live is not None:
                live.joined(rank, r[3], scope.coordinator.gathers)

    def _attempt(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # the scope disables itself; the join goes on
            self.scope.fail(exc)
            return None


def _following(exit_: Callable[..., Any]) -> Callable[..., Any]:
    """`Join.__exit__`, followed by the scope recording on the calling thread, if its model is in the join."""

    @functools.wraps(exit_)
    def __exit__(join: Any, *exc_info: Any) -> Any:
        follower = JoinFollower.on_this_thread() if exc_info[0] is None else None
        if follower is None or follower.ddp_hook_of(join) is None:
            return exit_(join, *exc_info)
        return follower.through(join, lambda: exit_(join, *exc_info))

    return __exit__


_EXIT_PATCH = Patch(_following)


def _shadow_hook(follower: JoinFollower, ddp: Any) -> Any:
    from torch.distributed.algorithms.join import JoinHook

    class ShadowedSteps(JoinHook):
        """Runs after DDP's join hook, which left in `require_forward_param_sync` whether the others sync."""

        def main_hook(self) -> None:
            try:
                follower.shadowed(synced=bool(ddp.require_forward_param_sync))
            except Exception as exc:
                follower.scope.fail(exc)

    return ShadowedSteps()


def _join_class() -> Any:
    try:
        from torch.distributed.algorithms.join import Join
    except ImportError:
        return None
    return Join
