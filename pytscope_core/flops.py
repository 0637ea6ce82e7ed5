"""Peak FLOP/s of known devices and FLOPs of one training step, for model FLOPs utilisation (MFU).

Peaks are dense (no sparsity) numbers from the vendors' data sheets, per precision (bf16, tf32, fp32). A device
name is matched exactly after normalising case and spaces, against the names `torch.cuda.get_device_name`
reports, so an unknown part gives None (MFU "n/a") instead of a wrong guess. FLOPs per step are counted with
torch's own per-op FLOP formulas on one warm-up step (`FlopEstimate`). Torch is imported only inside functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .compiled import compiled_anything, is_compiled

# Dense figures only: data sheets print sparse numbers (2x) next to dense ones, and mixing them up doubles
# MFU. TF32 is what fp32 matmuls run at when TF32 is allowed; "fp32" is the plain (non-tensor-core) rate.
PEAK_FLOPS_BY_PRECISION: dict[str, dict[str, float]] = {
    "a100 sxm": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "a100 pcie": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "h100 sxm": {"bf16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "h100 pcie": {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "h100 nvl": {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12},
    "h200": {"bf16": 989e12, "tf32": 494.7e12, "fp32": 67e12},
    "h200 nvl": {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12},
    "b200": {"bf16": 2250e12, "tf32": 1100e12, "fp32": 80e12},
    "l40s": {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "mi300x": {"bf16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12},
}
"""Dense peak FLOP/s per device and precision (bf16 = fp16 rate)."""

PRECISIONS = ("bf16", "tf32", "fp32")

PEAK_FLOPS: dict[str, float] = {k: v["bf16"] for k, v in PEAK_FLOPS_BY_PRECISION.items()}
"""Dense BF16/FP16 peak FLOP/s per device: the default when the training precision is not known."""

DEVICE_NAMES: dict[str, str] = {
    "nvidia a100-sxm4-40gb": "a100 sxm",
    "nvidia a100-sxm4-80gb": "a100 sxm",
    "nvidia a100-pcie-40gb": "a100 pcie",
    "nvidia a100-pcie-80gb": "a100 pcie",
    "nvidia a100 80gb pcie": "a100 pcie",
    "nvidia h100 80gb hbm3": "h100 sxm",
    "nvidia h100": "h100 sxm",
    "nvidia h100 pcie": "h100 pcie",
    "nvidia h100 nvl": "h100 nvl",
    "nvidia h200": "h200",
    "nvidia h200 nvl": "h200 nvl",
    "nvidia b200": "b200",
    "nvidia l40s": "l40s",
    "amd instinct mi300x": "mi300x",
    "amd instinct mi300x vf": "mi300x",
}
"""Reported device names (normalised) -> PEAK_FLOPS key; the keys themselves are accepted too."""


def _normalise(name: str) -> str:
    return " ".join(name.strip().lower().split())


def peak_flops_for(device_name: str | None, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a device at `precision` ("bf16", "tf32", "fp32") by its exact (normalised) name;
    None when unknown."""
    if not device_name:
        return None
    key = _normalise(device_name)
    return PEAK_FLOPS_BY_PRECISION.get(DEVICE_NAMES.get(key, key), {}).get(precision)


def training_precision(param_dtype: Any, autocast: bool) -> str:
    """The peak-table precision a step runs at: bf16/fp16 parameters or autocast -> "bf16"; fp32 matmuls ->
    "tf32" where torch allows TF32 for them, else "fp32"."""
    import torch

    if autocast or param_dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    allowed = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if allowed else "fp32"


# Size and layout queries, which tensors with their own sizes (nested tensors) answer themselves: torch's
# FLOP counter passes them on (NotImplemented) rather than run them, and so does ours.
_METADATA_OPS = (
    "sym_is_contiguous",
    "is_contiguous",
    "is_strides_like_format",
    "is_non_overlapping_and_dense",
    "size",
    "sym_size",
    "stride",
    "sym_stride",
    "storage_offset",
    "sym_storage_offset",
    "numel",
    "sym_numel",
    "dim",
)


@functools.cache
def flop_tally_mode() -> type:
    """The class of a dispatch mode that adds up, in `flops`, what torch's own per-op FLOP formulas
    (`torch.utils.flop_counter.flop_registry`) give: `FlopCounterMode`'s total, without its module tracker.
    That tracker puts hooks on the user's autograd graph, and a step that takes `torch.autograd.grad` of a leaf
    input (a gradient penalty) then fails inside torch ("A leaf node was passed to _will_engine_execute_node");
    counting at the dispatcher touches no graph. As in torch's mode, an op that decomposes is counted by its
    parts; `cond` counts its costlier branch; other higher-order operators run uncounted instead of failing.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    metadata = {getattr(aten, name) for name in _METADATA_OPS if hasattr(aten, name)}
    metadata.add(torch.ops.prim.layout)
    prim_device = torch.ops.prim.device.default
    cond = getattr(torch.ops.higher_order, "cond", None)
    higher_order = getattr(torch._ops, "HigherOrderOperator", ())

    class FlopTally(TorchDispatchMode):
        supports_higher_order_operators = True  # they come to `__torch_dispatch__`, with this mode off

        def __init__(self) -> None:
            super().__init__()
            self.flops: Any = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if isinstance(func, higher_order):
                if func is cond:
                    _, true_branch, false_branch, operands = args
                    out, true_flops = self._tally(true_branch, operands)
                    false_flops = self._tally(false_branch, operands)[1]
                    self.flops += max(true_flops, false_flops)
                    return out
                return func(*args, **kwargs)
            if func._overloadpacket in metadata:
                return NotImplemented
            if func not in flop_registry and func is not prim_device:
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                try:
                    self.flops += formula(*args, **kwargs, out_val=out)
                except Exception:  # a count that fails is no count (`end`), never the user's error
                    self.flops = float("nan")
            return out

        def _tally(self, branch: Any, operands: Any) -> tuple[Any, Any]:
            before, self.flops = self.flops, 0
            try:
                with self:
                    out = branch(*operands)
                return out, self.flops
            finally:
                self.flops = before

    return FlopTally


class FlopEstimate:
    """FLOPs of one optimizer step, counted once on a warm-up step by `flop_tally_mode` (torch's FLOP formulas).

    The hooks call `begin` at every forward: the counter is entered at the first forward of step `at_step`
    and left at the first forward of a later step (or where a pause, an epoch's end or the run's end comes
    first: `TorchHooks.end_flop_count`), so every micro-batch's forward and backward count
    (autograd threads inherit the mode), and so does the optimizer's own matrix products (none for SGD or
    Adam; Muon's, say). It is never left inside the optimizer step: that may be compiled code, and leaving a
    dispatch mode there corrupts the thread's dispatch state when the compiled frame ends. The counted step
    runs slower, which is why it is a warm-up step, and so is the next one: statistics never see them.
    `on_done` receives the total (None when counting failed or found nothing); counting never raises into
    training.
    """

    def __init__(self, at_step: int, on_done: Callable[[float | None], None]) -> None:
        self.at_step = at_step
        self.on_done = on_done
        self._mode: Any = None
        self._done = False  # counted (or given up): never again

    @property
    def counting(self) -> bool:
        return self._mode is not None

    def begin(self, step: int) -> bool:
        """At a training forward of step `step`. True once counted (or given up): no need to call again."""
        if self._mode is not None:
            if step != self.at_step:
                self.end()
        elif not self._done and step == self.at_step:
            if compiled_anything():  # e.g. a compiled attention function: it cannot run under the counter
                self.cancel()
            else:
                self._enter()
        return self._done

    def interrupt(self, steps_completed: int) -> bool:
        """Time that is not training comes, in eager code: a count running ends with its step if that has
        stepped (`steps_completed` reached it), else without a result. True if a count was running."""
        if self._mode is None:
            return False
        if steps_completed >= self.at_step:
            self.end()
        else:
            self.cancel()
        return True

    def _enter(self) -> None:
        try:
            mode = flop_tally_mode()()
            mode.__enter__()
            self._mode = mode
        except Exception:
            self._done = True
            self.on_done(None)

    def end(self) -> None:
        self._done = True
        mode, self._mode = self._mode, None
        if mode is None:
            return
        try:
            mode.__exit__(None, None, None)
            total = float(mode.flops)
        except Exception:
            total = 0.0
        self.on_done(total if total > 0 else None)

    def cancel(self) -> None:
        """Leave the counter without a result (training ended or the scope was disabled mid-step)."""
        self._done = True
        mode, self._mode = self._mode, None
        if mode is not None:
            try:
                mode.__exit__(None, None, None)
            except Exception:
                pass


class StepFlops:
    """What MFU needs that the scope learns along the way: the training precision (for the peak table) and
    FLOPs per step, given by the user, by an integration, or counted once on a warm-up step. Facts learnt
    before the run directory exists wait in `learnt` until the session writes them."""

    def __init__(
        self,
        flops_per_step: float | None,
        warmup: int,
        precision: str | None,
        peak_flops: float | None = None,
    ) -> None:
        self.precision = precision  # None: decided from the model's parameters (and autocast)
        self.precision_given = precision is not None
        self.peak_given = peak_flops is not None  # `peak_flops=` given: the table's peak is never used
        self.device: str | None = None  # the run's device, once its meta (and table peak) is written
        self.warmup = warmup
        self.learnt: dict[str, Any] = {}
        self.estimate = FlopEstimate(self.counting_step(0), self._counted) if flops_per_step is None else None

    def counting_step(self, resumed_from_step: int) -> int:
        """A warm-up step followed by another (the counter slows both), not the first where the warm-up allows
        (lazy initialisation runs there); with a warm-up under 2 steps, none (0 never comes: steps count from
        1)."""
        return resumed_from_step + (2 if self.warmup >= 3 else 1 if self.warmup == 2 else 0)

    def resumed(self, resumed_from_step: int) -> None:
        if self.estimate is not None:
            self.estimate.at_step = self.counting_step(resumed_from_step)

    def given(self, flops: float) -> None:
        """FLOPs per step from an integration (e.g. Lightning's `flops_per_batch`): no counting then."""
        self.cancel()
        self.learnt.update(flops_per_step=flops, flops_estimated=False)

    def cancel(self) -> None:
        if self.estimate is not None:
            self.estimate.cancel()
            self.estimate = None

    def note_model(self, model: Any) -> None:
        if self.estimate is not None and is_compiled(model):
            # Compiled code cannot run under the counter (torch.compile falls back to eager for the step, or
            # raises with fullgraph=True): FLOPs come from `flops_per_step` only.
            self.cancel()
        if self.precision is None:
            param = next(iter(model.parameters()), None)
            if param is not None:
                self.precision = training_precision(param.dtype, autocast=False)

    def note_forward(self) -> None:
        """Inside the first training forward, where the user's autocast is in force: fp32 parameters under
        bf16/fp16 autocast train at the bf16 rate."""
        if not self.precision_given and autocast_active() and self.precision != "bf16":
            self.precision = "bf16"
            self.learnt.update(precision="bf16")
            if self.device is not None and not self.peak_given:  # the run began with another precision's peak
                self.learnt.update(peak_precision="bf16", peak_flops=peak_flops_for(self.device, "bf16"))

    def take_learnt(self) -> dict[str, Any]:
        learnt, self.learnt = self.learnt, {}
        return learnt

    def _counted(self, flops: float | None) -> None:
        if flops is not None:
            self.learnt.update(flops_per_step=flops, flops_estimated=True)


def autocast_active() -> bool:
    import torch

    try:
        return any(torch.is_autocast_enabled(device) for device in ("cuda", "cpu"))
    except TypeError:  # torch < 2.4 takes no device type
        return bool(torch.is_autocast_enabled())
