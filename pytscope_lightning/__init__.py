"""pytscope for PyTorch Lightning: add `ScopeCallback()` to the Trainer's callbacks."""

from .callback import ScopeCallback

__all__ = ["ScopeCallback"]
