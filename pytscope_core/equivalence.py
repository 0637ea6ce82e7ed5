"""Does a W-worker data-parallel job compute what one worker would on the same global batch?

`check_equivalence` is a check to put in a test suite before a long distributed run: it trains a copy of
the model for a step (or a few) in W real gloo CPU processes under `DistributedDataParallel`, each rank on
the shard `DistributedSampler(shuffle=False)` would give it, and once in this process on the whole global
batch (plain forward, loss, backward, optimizer step: the truth). Both start from the same weights. It
compares the gradients after the first backward and the parameters after the last optimizer step,
element by element, with the `torch.allclose` rule |distributed - reference| <= atol + rtol * |reference|,
and when they differ it says where, by how much, and what usually causes that pattern: a loss scaled by the
world size, an accumulation loop that does not divide by its micro-batches, BatchNorm without
SyncBatchNorm, or per-rank randomness.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .dataparallel import WorkerError as WorkerError  # raised by check_equivalence: importable here
from .dataparallel import read_results, start_workers, train

if TYPE_CHECKING:
    from rich.console import RenderableType

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6
"""float32 defaults. A correct model differs from the reference only by summation order: small MLPs over
1-5 steps at W = 2 and 4 used at most 1.2% of this tolerance (README)."""

UNIFORM_RATIO_TOLERANCE = 0.03
"""A scaled loss scales every gradient by the same factor to float32 precision; 3% leaves room for the
small-gradient parameters while telling a constant factor from BatchNorm's or dropout's scatter."""

DEFAULT_TIMEOUT_S = 120.0


class EquivalenceError(AssertionError):
    """The distributed run differs from the single-process reference (an assertion in a test suite)."""

    def __init__(self, result: EquivalenceResult) -> None:
        super().__init__(result.describe())
        self.result = result


class EquivalenceSetupError(ValueError):
    """The check cannot run as asked (a batch that does not split, a function the workers cannot import)."""


@dataclass(frozen=True)
class ParameterDifference:
    """How one parameter of the distributed run differs from the reference."""

    name: str
    grad_max_abs: float  # after the first backward (and DDP's all-reduce), before the optimizer step
    grad_max_rel: float  # over elements whose reference magnitude exceeds atol
    grad_norm_ratio: float  # |distributed grad| / |reference grad|; NaN when the reference gradient is 0
    grad_ok: bool
    param_max_abs: float  # after the last optimizer step
    param_max_rel: float
    param_ok: bool
    tolerance_used: float  # max over elements of |difference| / (atol + rtol * |reference|); above 1 fails

    @property
    def ok(self) -> bool:
        return self.grad_ok and self.param_ok


@dataclass(frozen=True)
class EquivalenceResult:
    passed: bool
    world_size: int
    steps: int
    micro_batches: int  # forward calls rank 0's step ran in the first step (1 for the default step)
    rtol: float
    atol: float
    parameters: tuple[ParameterDifference, ...]
    cause: str | None  # the likely cause of a difference, None when it passed

    @property
    def first_difference(self) -> ParameterDifference | None:
        return next((p for p in self.parameters if not p.ok), None)

    @property
    def tolerance(self) -> str:
        return f"|distributed - reference| <= {self.atol:g} + {self.rtol:g} * |reference|"

    def describe(self) -> str:
        """One paragraph: the verdict, the first parameter that differs and by how much, the likely cause."""
        run = f"{self.world_size} workers, {self.steps} step{'s' if self.steps != 1 else ''}"
        first = self.first_difference
        if first is None:
            return f"distributed run ({run}) matches the single-process reference ({self.tolerance})"
        if not first.grad_ok:
            what, diff, rel = "gradient", first.grad_max_abs, first.grad_max_rel
        else:
            what, diff, rel = f"value after step {self.steps}", first.param_max_abs, first.param_max_rel
        return (
            f"distributed run ({run}) differs from the single-process reference: first at parameter "
            f"{first.name!r}, {what} max abs difference {diff:.3g} (max relative {rel:.3g}), "
            f"tolerance {self.tolerance}. Likely cause: {self.cause}"
        )


def default_step(model: Any, loss_fn: Callable[..., Any], inputs: Any, targets: Any) -> None:
    """The step every rank runs by default: forward, loss, backward."""
    loss_fn(model(inputs), targets).backward()


def default_optimizer(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.1)


def check_equivalence(
    model_factory: Callable[[], Any],
    loss_fn: Callable[[Any, Any], Any],
    batch: tuple[Any, Any],
    *,
    world_size: int = 2,
    steps: int = 1,
    step_fn: Callable[[Any, Callable[..., Any], Any, Any], None] | None = None,
    optimizer_factory: Callable[[Any], Any] | None = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> EquivalenceResult:
    """Run `steps` optimizer steps on `world_size` DDP ranks and in one process; raise if they differ.

    `batch` is the global batch `(inputs, targets)`; tensors (or tuples, lists, dicts of them) are split on
    dim 0 as `DistributedSampler(shuffle=False, drop_last=False)` would: rank r gets samples r, r+W, ...
    Every step uses the same batch. `step_fn(model, loss_fn, inputs, targets)` is what each rank runs on its
    shard (`model` is the DDP-wrapped module; do the backward passes, not the optimizer step); the
    reference always runs the plain full-batch step. `model_factory`, `loss_fn`, `step_fn` and
    `optimizer_factory(params)` (default SGD, lr 0.1) must be importable module-level objects: spawned
    workers import them. Returns the result when the runs match; raises `EquivalenceError` (an
    AssertionError carrying `.result`) when they do not, `WorkerError` when a worker fails or times out.
    """
    import torch
    from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm

    step_fn = step_fn or default_step
    optimizer_factory = optimizer_factory or default_optimizer
    if world_size < 1 or steps < 1:
        raise EquivalenceSetupError(f"world_size and steps must be at least 1, got {world_size} and {steps}")
    inputs, targets = _unpack(batch)
    n = _batch_size(inputs)
    if n % world_size:
        raise EquivalenceSetupError(
            f"the global batch of {n} samples does not split evenly over {world_size} workers: "
            "DistributedSampler(drop_last=False) would pad the last ranks with "
            f"{world_size - n % world_size} repeated sample(s), so the distributed step would not see the "
            "same data; use a batch size divisible by world_size"
        )
    for what, obj in [
        ("model_factory", model_factory),
        ("loss_fn", loss_fn),
        ("step_fn", step_fn),
        ("optimizer_factory", optimizer_factory),
    ]:
        try:
            pickle.dumps(obj)  # in memory: spawned workers receive these by reference to their module
        except Exception as exc:
            raise EquivalenceSetupError(
                f"{what} cannot be sent to the worker processes ({exc}); define it at module level in an "
                "importable module (lambdas and local functions cannot be)"
            ) from None

    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        with _reference_errors():
            model = model_factory()
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        batchnorm = [
            name
            for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, SyncBatchNorm)
        ]
        job = dict(
            model_factory=model_factory,
            loss_fn=loss_fn,
            step_fn=step_fn,
            optimizer_factory=optimizer_factory,
            state_dict=initial,
            inputs=inputs,
            targets=targets,
            steps=steps,
            seed=seed,
            timeout_s=timeout_s,
        )
        with tempfile.TemporaryDirectory(prefix="pytscope-equivalence-") as out_dir:
            # The workers start first so that their (slow) torch import overlaps the reference run here.
            workers = start_workers(world_size, job, out_dir)
            try:
                torch.manual_seed(seed)
                with _reference_errors():
                    reference = train(model, loss_fn, default_step, optimizer_factory, inputs, targets, steps)
                workers.wait(timeout_s)
                distributed = read_results(out_dir)
            finally:
                workers.stop()
    result = compare_to_reference(
        reference,
        distributed,
        world_size=world_size,
        steps=steps,
        micro_batches=int(distributed.get("micro_batches", np.array(1))),
        rtol=rtol,
        atol=atol,
        batchnorm_layers=batchnorm,
    )
    if not result.passed:
        raise EquivalenceError(result)
    return result


@contextlib.contextmanager
def _reference_errors() -> Iterator[None]:
    """What the user's code raises in this process (building the model; the reference run's forward, loss,
    backward and optimizer step on the full batch) as a `WorkerError`: a broken check is not a difference
    between the runs."""
    try:
        yield
    except Exception as exc:
        raise WorkerError(
            f"the one-process reference run failed: {type(exc).__name__}: {exc} (it calls "
            "loss_fn(model(inputs), targets).backward(), then the optimizer's step)"
        ) from exc


def compare_to_reference(
    reference: Mapping[str, np.ndarray],
    distributed: Mapping[str, np.ndarray],
    *,
    world_size: int,
    steps: int,
    micro_batches: int,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    batchnorm_layers: Sequence[str] = (),
) -> EquivalenceResult:
    """Compare arrays keyed `grad/<name>` and `param/<name>`, and name the likely cause of a difference."""
    names = [k[len("grad/") :] for k in reference if k.startswith("grad/")]
    rows = []
    for name in names:
        g_ref, g_dist = reference[f"grad/{name}"], distributed[f"grad/{name}"]
        p_ref, p_dist = reference[f"param/{name}"], distributed[f"param/{name}"]
        ref_norm = float(np.linalg.norm(g_ref))
        rows.append(
            ParameterDifference(
                name=name,
                grad_max_abs=_max_abs(g_dist, g_ref),
                grad_max_rel=_max_rel(g_dist, g_ref, atol),
                grad_norm_ratio=float(np.linalg.norm(g_dist)) / ref_norm if ref_norm > 0 else math.nan,
                grad_ok=bool(np.allclose(g_dist, g_ref, rtol=rtol, atol=atol)),
                param_max_abs=_max_abs(p_dist, p_ref),
                param_max_rel=_max_rel(p_dist, p_ref, atol),
                param_ok=bool(np.allclose(p_dist, p_ref, rtol=rtol, atol=atol)),
                tolerance_used=max(_used(g_dist, g_ref, rtol, atol), _used(p_dist, p_ref, rtol, atol)),
            )
        )
    passed = all(r.ok for r in rows)
    cause = None
    if not passed:
        grads = [(reference[f"grad/{n}"], distributed[f"grad/{n}"]) for n in names]
        cause = _likely_cause(rows, grads, world_size, steps, micro_batches, batchnorm_layers)
    return EquivalenceResult(passed, world_size, steps, micro_batches, rtol, atol, tuple(rows), cause)


def _likely_cause(
    rows: Sequence[ParameterDifference],
    grads: Sequence[tuple[np.ndarray, np.ndarray]],
    world_size: int,
    steps: int,
    micro_batches: int,
    batchnorm_layers: Sequence[str],
) -> str:
    if all(r.grad_ok for r in rows):
        return (
            f"the gradients of the first step match but the parameters after {steps} steps do not: look at "
            "the optimizer (state or learning rate that depends on the rank) or at randomness in later steps"
        )
    ratio = _uniform_ratio(grads)
    if ratio is not None:
        said = f"every gradient is {ratio:.3g}x the reference"
        causes = []
        # The step ran its micro-batches (that is how they were counted): a ratio equal to both their number
        # and the world size is said as such, the accumulation first; no ratio can tell the two apart.
        undivided = micro_batches > 1 and _near(ratio, micro_batches)
        if undivided:
            causes.append(
                f"an accumulation loop that does not divide the loss by the number of micro-batches "
                f"({micro_batches})"
            )
        if _near(ratio, world_size):
            if undivided:
                said += (
                    f", and {micro_batches} is both the number of micro-batches and the world size, so "
                    "either of two causes fits"
                )
            causes.append(
                f"the loss is scaled by the world size ({world_size}) (DDP already averages gradients "
                "across ranks: do not multiply the loss by world_size)"
            )
        if micro_batches > 1 and _near(ratio, world_size * micro_batches):
            causes.append(
                f"both a loss scaled by the world size ({world_size}) and an accumulation loop that does "
                f"not divide the loss by the number of micro-batches ({micro_batches})"
            )
        if world_size > 1 and _near(ratio, 1 / world_size):
            causes.append(
                f"the loss is summed over samples, not averaged (reduction='sum'?): DDP averages the "
                f"{world_size} ranks' gradients, so each rank's sum counts 1/{world_size}"
            )
        if causes:
            return f"{said}: " + "; or ".join(causes)
        return f"{said}: the loss is scaled by a constant somewhere in the step"
    if batchnorm_layers:
        shown = ", ".join(repr(n) for n in batchnorm_layers[:3]) + (
            " ..." if len(batchnorm_layers) > 3 else ""
        )
        return (
            f"BatchNorm without SyncBatchNorm computes statistics per rank: layers {shown} normalise each "
            "rank's shard with that shard's mean and variance, not the global batch's "
            "(torch.nn.SyncBatchNorm.convert_sync_batchnorm fixes it where SyncBatchNorm runs)"
        )
    return (
        "the differences are not a uniform ratio: look for per-rank randomness (dropout, augmentation seeds "
        "that differ by rank), a custom loss reduction or gradient hook, or data that is not the shard "
        "DistributedSampler gives the rank"
    )


def _uniform_ratio(grads: Sequence[tuple[np.ndarray, np.ndarray]]) -> float | None:
    """The factor c with distributed ~= c * reference for every parameter, or None when there is none."""
    norms = [float(np.linalg.norm(ref)) for ref, _ in grads]
    floor = 1e-6 * max(norms, default=0.0)  # parameters with no real gradient say nothing about a ratio
    pairs = [(ref, dist) for (ref, dist), norm in zip(grads, norms, strict=True) if norm > floor and norm > 0]
    if not pairs:
        return None
    ratio = float(np.median([np.linalg.norm(dist) / np.linalg.norm(ref) for ref, dist in pairs]))
    if ratio <= 0 or _near(ratio, 1.0):
        return None
    for ref, dist in pairs:
        if np.linalg.norm(dist - ratio * ref) > UNIFORM_RATIO_TOLERANCE * ratio * np.linalg.norm(ref):
            return None
    return ratio


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= UNIFORM_RATIO_TOLERANCE * abs(target)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _used(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> float:
    return float(np.max(np.abs(a - b) / (atol + rtol * np.abs(b)))) if a.size else 0.0


def _max_rel(a: np.ndarray, b: np.ndarray, atol: float) -> float:
    # Elements with a reference below atol are judged by atol alone; their relative difference is noise.
    big = np.abs(b) > atol
    return float(np.max(np.abs(a - b)[big] / np.abs(b[big]))) if big.any() else 0.0


def render_equivalence(result: EquivalenceResult) -> RenderableType:
    """Per-parameter differences, then the verdict with the tolerance and, on a failure, the likely cause."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False)
    for col in (
        "parameter",
        "grad max abs",
        "grad max rel",
        "grad ratio",
        "param max abs",
        "param max rel",
        "",
    ):
        table.add_column(col, justify="left" if col in ("parameter", "") else "right")
    for p in result.parameters:
        table.add_row(
            p.name,
            f"{p.grad_max_abs:.2e}",
            f"{p.grad_max_rel:.2e}",
            f"{p.grad_norm_ratio:.4g}",
            f"{p.param_max_abs:.2e}",
            f"{p.param_max_rel:.2e}",
            "ok" if p.ok else "DIFFERS",
        )
    verdict = Text("PASS" if result.passed else "FAIL", style="bold green" if result.passed else "bold red")
    return Group(table, Text.assemble("\n", verdict, " ", result.describe()))


def _unpack(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise EquivalenceSetupError(f"batch must be a pair (inputs, targets), got {type(batch).__name__}")
    return batch[0], batch[1]


def _batch_size(inputs: Any) -> int:
    import torch

    if isinstance(inputs, torch.Tensor) and inputs.dim() > 0:
        return int(inputs.shape[0])
    if isinstance(inputs, (tuple, list)) and inputs:
        return _batch_size(inputs[0])
    if isinstance(inputs, dict) and inputs:
        return _batch_size(next(iter(inputs.values())))
    raise EquivalenceSetupError("the batch's inputs hold no tensor with a batch dimension")
