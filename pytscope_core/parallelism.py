"""What a watched model is wrapped in, and whether pytscope can measure that wrapper's communication.

`comm` (and with it local work, the straggler analysis, the transfer/sync-wait split and the communication
lines of the budget) is only true where the hooks see the waits: DDP (after the autograd graph is done) and
FSDP2 (`fully_shard`, inside forward and backward). Elsewhere the waits hide inside forward, backward or the
optimizer and would be read as compute, so the run records that communication is *not measured* and every
report says so instead of giving a confident wrong answer. Recognised by type, never by importing optional
frameworks: DeepSpeed's engine is matched by class name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .compiled import uncompiled

DDP = "ddp"
FSDP2 = "fsdp2"
FSDP2_TP = "fsdp2+tp"
FSDP2_EARLY = "fsdp2 (torch < 2.6)"
FSDP1 = "fsdp1"
DEEPSPEED = "deepspeed"
TENSOR_PARALLEL = "tensor_parallel"
NONE = "none"

_WHY_BLIND = {
    FSDP2_TP: "FSDP2 with tensor-parallel (DTensor) parameters: the tensor-parallel collectives inside forward "
    "and backward are not timed",
    FSDP2_EARLY: "FSDP2 before torch 2.6 keeps its hooks elsewhere, which pytscope does not time; use torch 2.6 or "
    "later",
    FSDP1: "FSDP1 (FullyShardedDataParallel) runs its all-gathers and reduce-scatters inside its own flat-parameter "
    "hooks, which pytscope does not time; use FSDP2 (fully_shard)",
    DEEPSPEED: "DeepSpeed's engine communicates inside its own backward and step, which pytscope does not time",
    TENSOR_PARALLEL: "tensor-parallel (DTensor) collectives inside forward and backward are not timed",
    NONE: "no DDP or FSDP2 wrapper was seen, so any gradient communication is not timed (watch the model after "
    "wrapping it: DistributedDataParallel(...) or fully_shard(...))",
}


@dataclass(frozen=True)
class Parallelism:
    name: str  # one of the names above
    comm_measured: bool  # exposed communication is timed, so local work = wall - comm holds

    @property
    def note(self) -> str | None:
        """One line for the user where communication is not measured, else None."""
        return comm_note(self.name, self.comm_measured)


UNWATCHED = Parallelism(NONE, True)
"""Before any model is watched; `Scope.start` then decides from the world size."""


def comm_note(name: str | None, comm_measured: bool) -> str | None:
    """'communication not measured (why)': one line, the same in the summary, the JSON and the live output."""
    if comm_measured:
        return None
    why = _WHY_BLIND.get(name or NONE, f"{name}: its communication is not timed")
    return (
        f"communication not measured ({why}); waits for other ranks are counted as compute and the "
        "straggler analysis is off"
    )


def detect(model: Any, world_size: int) -> Parallelism:
    """The parallelism of `model` (the object handed to `watch`); with no wrapper, communication counts as
    measured only in a single-process run (there is none)."""
    name = _name(model)
    if name == NONE:
        return Parallelism(NONE, world_size <= 1)
    return Parallelism(name, name in (DDP, FSDP2))


def inside_fabric(model: Any) -> Any:
    """The module inside Lightning Fabric's wrapper (`fabric.setup`), DDP's wrapper or the model itself: its
    forward is what trains, and DDP's flags tell whether a backward syncs; the model otherwise."""
    return getattr(model, "_forward_module", model) if type(model).__name__ == "_FabricModule" else model


def unwatched_models(prepared: Iterable[Any], watched: Iterable[Any]) -> list[Any]:
    """The models of `prepared` (a framework's list of the models it set up) that train (a parameter requires
    grad) and that no model of `watched` is or wraps (DDP's `module`, inside torch.compile's wrapper)."""
    covered: set[int] = set()
    for model in watched:
        inner = uncompiled(model)
        covered.update((id(model), id(inner), id(getattr(inner, "module", None))))
    return [
        m
        for m in prepared
        if id(m) not in covered and any(p.requires_grad for p in getattr(m, "parameters", lambda: ())())
    ]


def current_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _name(model: Any) -> str:
    model = uncompiled(model)
    if model is None:
        return NONE
    if any(c.__name__ in ("DeepSpeedEngine", "PipelineEngine") for c in type(model).__mro__):
        return DEEPSPEED
    import torch

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DDP
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    if _fsdp1(modules):
        return FSDP1
    if fsdp2_units(model):
        return FSDP2_TP if _tensor_parallel(model, fsdp=True) else FSDP2
    if _early_fsdp2(modules):
        return FSDP2_EARLY
    if _tensor_parallel(model, fsdp=False):
        return TENSOR_PARALLEL
    return NONE


def fsdp2_units(model: Any) -> list[Any]:
    """The modules of `model` that `fully_shard` made into FSDP2 units (outermost first); [] without FSDP2."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 keeps FSDP2 elsewhere: not supported
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _early_fsdp2(modules: list[Any]) -> bool:
    """FSDP2 of torch 2.4 and 2.5 (`torch.distributed._composable.fsdp`), which `fsdp2_units` does not
    take: named as such, not mistaken for tensor parallelism (its parameters are DTensors) or no wrapper."""
    try:
        from torch.distributed._composable.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in modules)


def _fsdp1(modules: list[Any]) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in modules)


def _tensor_parallel(model: Any, fsdp: bool) -> bool:
    """DTensor parameters sharded or replicated over a mesh dimension other than FSDP's own. FSDP2 alone
    shards on one dimension (HSDP: replicate on the first, shard on the second), which is measured."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:
        return False
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        placements = tuple(p.placements)
        if not fsdp:
            return True
        if len(placements) == 1 and isinstance(placements[0], Shard):
            continue
        if len(placements) == 2 and isinstance(placements[0], Replicate) and isinstance(placements[1], Shard):
            continue  # HSDP
        return True
    return False
