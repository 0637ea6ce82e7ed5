"""What torch.compile did to a model, read without importing the compiler.

`torch.compile(module)` returns a wrapper (`OptimizedModule`) around the module; `module.compile()` compiles the
module's whole call in place; Lightning replaces a compiled LightningModule's `forward` with the compiled one;
regional compilation does either to some submodules. Nothing here imports `torch._dynamo`: where a model was
compiled, it is loaded already.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

COMPILED_CALL = "_compiled_call_impl"
"""What `module.compile()` sets on the module, and what nn.Module's `__call__` then runs instead."""


def uncompiled(model: Any) -> Any:
    """The module inside `torch.compile(module)`'s wrapper, else `model` itself. The wrapper holds no
    parallelism of its own: Accelerate, for one, compiles the DDP-wrapped model."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod
    return model


def compiled_in_place(module: Any) -> bool:
    """`module.compile()` was called: its `__call__` runs the compiled `_call_impl`, forward and hooks inside."""
    return getattr(module, "__dict__", {}).get(COMPILED_CALL) is not None


def is_compiled(model: Any) -> bool:
    """`model`, or any module in it, runs code compiled by torch.compile."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False
    modules = getattr(model, "modules", None)
    for m in modules() if modules is not None else [model]:
        if isinstance(m, eval_frame.OptimizedModule) or compiled_in_place(m):
            return True
        # Lightning's compiled module: `module.forward = torch.compile(module.forward)`
        if hasattr(getattr(m, "__dict__", {}).get("forward"), "_torchdynamo_orig_callable"):
            return True
    return False


def compiled_anything() -> bool:
    """torch.compile has compiled a graph in this process (a model, or any function a model may call)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and utils.counters["stats"]["unique_graphs"] > 0


def is_compiling_function() -> Callable[[], bool]:
    """The function that is True while torch.compile traces (torch < 2.3 has it under `torch._dynamo` only)."""
    import torch

    found = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if found is None:
        import torch._dynamo

        found = torch._dynamo.is_compiling
    return found  # type: ignore[no-any-return]


def outside_compiled(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, run as written even where torch.compile traces its caller (a compiled `optimizer.step()`):
    there it is called through `torch.compiler.disable`, a graph break around the hook, because marks traced
    into compiled code would never run. (A graph break is an error under `fullgraph=True`, which torch itself
    does not manage for an optimizer step.) Eager, it costs one check (~0.1 us)."""
    import torch

    is_compiling = is_compiling_function()
    eager = torch.compiler.disable(hook)  # (torch.optim has loaded the compiler already)

    def run(*args: Any) -> Any:
        if is_compiling():
            return eager(*args)
        return hook(*args)

    return run


class CallWrappers:
    """Wrappers put on watched models where their calls can be timed from outside compiled code: the instance
    `forward` (for `torch.compile(model)`, the wrapper's, which calls the compiled code), or the compiled call
    of a model compiled in place. `remove()` leaves each model as it was."""

    def __init__(self, make: Callable[[Any, Callable[..., Any]], Callable[..., Any]]) -> None:
        self._make = make  # (the module whose flags count, the call to wrap) -> its wrapper
        self._wrapped: list[tuple[Any, str, Any]] = []  # (model, attribute, its instance value before)

    def __bool__(self) -> bool:
        return bool(self._wrapped)

    def wrap(self, model: Any) -> None:
        self._wrap(model, COMPILED_CALL if compiled_in_place(model) else "forward")

    def follow_compiled(self) -> list[Any]:
        """Models compiled in place after `wrap`: their forward is traced into the compiled call (where its
        wrapper steps aside), so the compiled call is wrapped too. Returns those models."""
        done = {(id(model), attr) for model, attr, _ in self._wrapped}
        found = [m for m, attr, _ in self._wrapped if attr == "forward" and compiled_in_place(m)]
        found = [m for m in found if (id(m), COMPILED_CALL) not in done]
        for model in found:
            self._wrap(model, COMPILED_CALL)
        return found

    def remove(self) -> None:
        for model, attr, before in reversed(self._wrapped):
            if before is None:
                model.__dict__.pop(attr, None)
            else:
                model.__dict__[attr] = before
        self._wrapped.clear()

    def _wrap(self, model: Any, attr: str) -> None:
        # Into the instance's own dict: a wrapper module whose `__setattr__` passes attributes on to the module
        # it wraps (Fabric's) would set ours there, where it calls the wrapper, which calls it, forever.
        before = model.__dict__.get(attr)
        model.__dict__[attr] = self._make(uncompiled(model), getattr(model, attr))
        self._wrapped.append((model, attr, before))
