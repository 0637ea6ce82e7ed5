"""Wrappers put on a class or a module, for what the user calls and the scope never sees (torch's
`Join.__exit__`, `GradScaler.step`, torch.distributed's collectives), in place while some scope needs them, one
for all scopes. Ours are known by identity, never by an attribute: another tool's wrapper over ours copies our
attributes (`functools.wraps`), and a mock answers to any name. A wrapper of ours must pass every call through
unchanged when no scope needs it: one under another tool's wrapper stays there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_CHAIN_DEPTH = 16  # wrappers looked through for ours (a mock's `__wrapped__` is another mock, endlessly)


class Patch:
    """`wrap(function)` installed as `owner.name` (a class's method, a module's function), once however many
    scopes install it."""

    def __init__(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._wrap = wrap
        self._ours: list[Callable[..., Any]] = []  # those installed, wherever they are now

    def install(self, owner: Any, name: str) -> None:
        """Wrap `owner.name`, unless one of ours is already in its chain of wrappers."""
        method = getattr(owner, name)
        if not any(_in_chain(method, ours) for ours in self._ours):
            self._ours.append(self._wrap(method))
            setattr(owner, name, self._ours[-1])

    def remove(self, owner: Any, name: str) -> None:
        """Put back what ours wrapped where ours is on top (under another tool's wrapper, ours stays, idle)."""
        while any(owner.__dict__.get(name) is ours for ours in self._ours):
            ours = owner.__dict__[name]
            self._ours = [w for w in self._ours if w is not ours]
            setattr(owner, name, ours.__wrapped__)


def _in_chain(method: Any, wrapper: Callable[..., Any]) -> bool:
    """`wrapper` is `method` or inside it (wrappers that name what they wrap as `__wrapped__`)."""
    for _ in range(_CHAIN_DEPTH):
        if method is wrapper:
            return True
        method = getattr(method, "__wrapped__", None)
    return False
