"""Batch waits on one data loader instance: that instance gets a subclass whose iterator times each `next()`.

Nothing global is patched: other loaders, and the loader's own class, are untouched, and pickling the
watched loader gives back the user's class without the hooks (spawned workers, `ddp_spawn`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol


class BatchHooks(Protocol):
    active: bool

    def next_batch(self, it: Iterator[Any]) -> Any: ...


LOADER_NOT_WATCHABLE = (
    "the loader given to watch() (a {kind}) cannot be timed in place: pytscope gives a DataLoader, or any "
    "iterable object of a class of its own, a subclass that times each fetch; steps are timed from the model's "
    "forward and the wait for data is in `other`: watch the DataLoader itself"
)
LOADER_TAKEN = (
    "the loader given to watch() is already watched by another Scope that has not finished, so steps are "
    "timed from the model's forward and the wait for data is in `other`: finish() the other Scope first"
)


def watch_loader(loader: Any, hooks: BatchHooks, warn: Callable[[str], None]) -> Callable[[], None] | None:
    """Route `loader`'s batches through `hooks.next_batch`; returns what undoes it, or None where it is not
    done: the loader already watched (by `hooks`; another's said with `warn`), or its class cannot be given
    a subclass in place (a built-in iterable: a list, a generator; an object without a `__dict__`: said)."""
    base = type(loader)
    if getattr(base, "_pytscope_watched", False):
        if hooks_of(loader) is not hooks:
            warn(LOADER_TAKEN)
        return None
    try:
        _set_class(loader, _watched_class(base))
    except TypeError:  # a built-in class (not a base, or its instances' class fixed), or __slots__ (layout)
        warn(LOADER_NOT_WATCHABLE.format(kind=base.__name__))
        return None
    loader.__dict__["_pytscope_hooks"] = hooks

    def undo() -> None:
        _set_class(loader, base)
        loader.__dict__.pop("_pytscope_hooks", None)

    return undo


def hooks_of(loader: Any) -> Any:
    """The hooks a watched `loader` routes its batches through (None if it is not watched)."""
    return getattr(loader, "__dict__", {}).get("_pytscope_hooks")


def batches_per_epoch(loader: Any) -> int:
    """`len(loader)`, or -1 where it has none (an iterable dataset) or cannot say."""
    try:
        return int(len(loader))
    except Exception:
        return -1


class _WatchedIterator:
    __slots__ = ("_it", "_next_batch")

    def __init__(self, it: Iterator[Any], hooks: BatchHooks) -> None:
        self._it = it
        self._next_batch = hooks.next_batch

    def __iter__(self) -> _WatchedIterator:
        return self

    def __next__(self) -> Any:
        return self._next_batch(self._it)

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


_WATCHED: dict[type, type] = {}


def _set_class(obj: Any, cls: type) -> None:
    # Accelerate's DataLoaderShard makes `__class__` a read-only property: use object's own descriptor.
    object.__dict__["__class__"].__set__(obj, cls)


def _watched_class(base: type) -> type:
    cls = _WATCHED.get(base)
    if cls is None:

        def __iter__(self: Any) -> Any:
            it = base.__iter__(self)  # type: ignore[attr-defined]
            hooks = self.__dict__.get("_pytscope_hooks")
            return _WatchedIterator(it, hooks) if hooks is not None and hooks.active else it

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            # Pickles as the user's own class, without the hooks.
            state = {k: v for k, v in self.__dict__.items() if k != "_pytscope_hooks"}
            return (_rebuild, (base, state))

        cls = type(
            base.__name__,
            (base,),
            {"__iter__": __iter__, "__reduce_ex__": __reduce_ex__, "_pytscope_watched": True},
        )
        cls.__qualname__ = base.__qualname__
        cls.__module__ = base.__module__
        _WATCHED[base] = cls
    return cls


def _rebuild(base: type, state: dict[str, Any]) -> Any:
    obj: Any = object.__new__(base)
    obj.__dict__.update(state)
    return obj
