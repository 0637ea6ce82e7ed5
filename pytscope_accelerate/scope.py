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
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from pytscope_core.scope import Scope


class AccelerateScope:
    """Records every rank's steps of an Accelerate loop; rank 0 diagnoses them live and at the end.

    Create it after `accelerator.prepare(...)` (the process group must exist), on every process. Keyword
    options are those of `pytscope_core.ScopeOptions`, as for `Scope` and `ScopeCallback`. Step N is the N-th
    optimizer step (1-based), as in plain loops.
    """

    def __init__(
        self, accelerator: Any, run_dir: str | os.PathLike[str] | None = None, **options: Any
    ) -> None:
        self.accelerator = accelerator
        self.scope = Scope(run_dir, integration="accelerate", precision=_precision(accelerator), **options)
        # Only rank 0 calls the sink, and accelerator.log only writes on the main process anyway.
        self.scope.set_metrics_sink(self._log_metrics)

    @property
    def run_dir(self) -> Any:
        return self.scope.run_dir

    def watch(self, model: Any = None, optimizer: Any = None, loader: Any = None) -> AccelerateScope:
        """Hook the prepared model, optimizer and (optionally) data loader. Call again with `loader=` for a
        loader made later, e.g. by `accelerator.skip_first_batches` after `load_state`."""
        self.scope.watch(model, optimizer, loader)
        return self

    def log(self, **scalars: Any) -> None:
        """Record scalars for the current step; `loss` drives convergence analysis. Never syncs a tensor."""
        self.scope.log(**scalars)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Time inside (evaluation, `save_state`) is not charged to the training step."""
        return self.scope.paused()

    def finish(self) -> Any:
        """Final gather and, on the main process, the end-of-run summary (printed and written to the run).

        Collective: every process calls it, before `accelerator.end_training()` destroys the process group.
        Idempotent; also runs at normal interpreter exit if forgotten.
        """
        return self.scope.finish()

    def stop(self, reason: str) -> Any:
        """End without meeting the other processes, where you catch an error and end this one another way: this
        rank's ungathered steps go to its own file, the main process reports what the run holds. Idempotent."""
        return self.scope.stop(reason)

    def state_dict(self) -> dict[str, Any]:
        """Small, plain, rank-agnostic: what `accelerator.save_state` stores for `register_for_checkpointing`."""
        return self.scope.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpointed run as a new segment; steps replayed after the checkpoint are not recounted."""
        self.scope.load_state_dict(state)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.accelerator.log(metrics, step=step)


def _precision(accelerator: Any) -> str | None:
    """The peak-table precision of Accelerate's `mixed_precision` ("bf16"/"fp16" -> "bf16"); None: decided
    from the model."""
    mode = str(getattr(accelerator, "mixed_precision", "no"))
    return "bf16" if mode in ("bf16", "fp16", "fp8") else None
