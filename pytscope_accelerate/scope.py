"""`AccelerateScope`: pytscope on an Accelerate training loop, as a thin adapter over `pytscope_core.Scope`.

The core already does the torch-level work on the objects `accelerator.prepare` returns: forward timing on
the (DDP-wrapped) model, exposed gradient communication through an autograd graph-done callback (under the
FSDP plugin at version 2, also FSDP's all-gathers and reduce-scatters; other wrappers, e.g. DeepSpeed's
engine, are recorded as "communication not measured"), step hooks
on the torch optimizer inside `AcceleratedOptimizer` (which steps it only when gradients sync, so an
`accelerator.accumulate` window is one step), and batch waits on the prepared loader instance. This adapter
only connects Accelerate's own channels: live metrics go to `accelerator.log` (whatever trackers the user
set up), the scope's state travels with `accelerator.save_state` / `load_state` through
`register_for_checkpointing`, and the end-of-run summary is produced by `finish()` or at interpreter exit.
The accelerator's own collectives (`wait_for_everyone`, `reduce`, `gather`, `gather_for_metrics`) are waits
for the other ranks, `comm`, wherever the loop calls them. A new scope on the same accelerator (a loop started
again, as by `find_executable_batch_size` after an out-of-memory error) ends the one before it.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any

from pytscope_core.collectives import time_methods, untime_methods
from pytscope_core.parallelism import unwatched_models
from pytscope_core.scope import Scope

COLLECTIVES = ("wait_for_everyone", "reduce", "gather", "gather_for_metrics")
"""The accelerator's methods that wait for the other ranks (timed as `comm` on the instance, while a scope lives)."""

_LIVE: weakref.WeakKeyDictionary[Any, AccelerateScope] = weakref.WeakKeyDictionary()
"""The scope each accelerator has now: a new one ends the one before it."""


class AccelerateScope:
    """Records every rank's steps of an Accelerate loop; rank 0 diagnoses them live and at the end.

    Create it after `accelerator.prepare(...)` (the process group must exist), on every process. Keyword
    options are those of `pytscope_core.ScopeOptions`, as for `Scope` and `ScopeCallback`. Step N is the N-th
    optimizer step (1-based), as in plain loops (several optimizers stepping on one batch: one step).
    """

    def __init__(
        self, accelerator: Any, run_dir: str | os.PathLike[str] | None = None, **options: Any
    ) -> None:
        self.accelerator = accelerator
        self.scope = Scope(run_dir, integration="accelerate", precision=_precision(accelerator), **options)
        # Only rank 0 calls the sink, and accelerator.log only writes on the main process anyway.
        self.scope.set_metrics_sink(self._log_metrics)
        previous = _LIVE.get(accelerator)
        if previous is not None:  # an exception left its loop and was caught: it would watch a hang
            previous.stop("a new AccelerateScope took over its accelerator (the training loop started again)")
        _unregister_ended(accelerator)
        _LIVE[accelerator] = self
        self._models: list[Any] = []  # the models given to watch()
        time_methods(accelerator, COLLECTIVES, self.scope.hooks, self.scope.fail)

    @property
    def run_dir(self) -> Any:
        return self.scope.run_dir

    def watch(self, model: Any = None, optimizer: Any = None, loader: Any = None) -> AccelerateScope:
        """Hook the prepared model, optimizer and (optionally) data loader. Call again with `loader=` for a
        loader made later, e.g. by `accelerator.skip_first_batches` after `load_state`, and with each other
        model `prepare` returned that trains."""
        self.scope.watch(model, optimizer, loader)
        if model is not None:
            if not self._models:  # checked at the first training forward, when every watch() is done
                self.scope.hooks.first_forward = _then(self.scope.hooks.first_forward, self._check_models)
            self._models.append(model)
        return self

    def log(self, **scalars: Any) -> None:
        """Record scalars for the current step; `loss` drives convergence analysis. Never syncs a tensor."""
        self.scope.log(**scalars)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Time inside (evaluation, `save_state`) is not charged to the training step."""
        return self.scope.paused()

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """Time inside is a wait of the loop's that nothing else times (an asynchronous collective's `wait()`,
        another library's collective): communication, so the process the others wait for is named."""
        return self.scope.collective()

    def finish(self) -> Any:
        """Final gather and, on the main process, the end-of-run summary (printed and written to the run).

        Collective: every process calls it, before `accelerator.end_training()` destroys the process group.
        Idempotent; also runs at normal interpreter exit if forgotten.
        """
        self._release()
        return self.scope.finish()

    def stop(self, reason: str) -> Any:
        """End without meeting the other processes, where you catch an error and end this one another way: this
        rank's ungathered steps go to its own file, the main process reports what the run holds. Idempotent."""
        self._release()
        return self.scope.stop(reason)

    def state_dict(self) -> dict[str, Any]:
        """Small, plain, rank-agnostic: what `accelerator.save_state` stores for `register_for_checkpointing`."""
        return self.scope.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpointed run as a new segment; steps replayed after the checkpoint are not recounted."""
        self.scope.load_state_dict(state)

    def _check_models(self) -> None:
        missed = unwatched_models(getattr(self.accelerator, "_models", ()), self._models)
        if missed and self.accelerator.num_processes > 1:
            names = ", ".join(type(m).__name__ for m in missed)
            self.scope.note(
                f"accelerator.prepare() returned {len(missed)} more model(s) that train than watch() was given "
                f"({names}): their forward is timed as `other` and their gradient all-reduce as `backward`, so "
                "a rank slower there may not be named: watch each model (scope.watch(model))"
            )

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.accelerator.log(metrics, step=step)

    def _release(self) -> None:
        """The accelerator's collectives as they were, and no longer this scope's accelerator."""
        if _LIVE.get(self.accelerator) is self:
            del _LIVE[self.accelerator]
            untime_methods(self.accelerator, COLLECTIVES)


def _then(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        if first is not None:
            first()
        then()

    return both


def _unregister_ended(accelerator: Any) -> None:
    """Take the ended scopes (one taken over, or finished before a second training in the process) out of
    `accelerator.save_state`'s objects: the new one, registered next, takes their place as in a process that
    registers once, so a checkpoint neither carries an ended run's state nor fails to load where the new
    run registers one scope."""
    objects = getattr(accelerator, "_custom_objects", None)
    if isinstance(objects, list):
        objects[:] = [o for o in objects if not (isinstance(o, AccelerateScope) and o.scope.finished)]


def _precision(accelerator: Any) -> str | None:
    """The peak-table precision of Accelerate's `mixed_precision` ("bf16"/"fp16" -> "bf16"); None: decided
    from the model."""
    mode = str(getattr(accelerator, "mixed_precision", "no"))
    return "bf16" if mode in ("bf16", "fp16", "fp8") else None
