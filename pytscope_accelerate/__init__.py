"""pytscope for Hugging Face Accelerate: `AccelerateScope` wraps the core scope around a prepared training loop."""

from .scope import AccelerateScope

__all__ = ["AccelerateScope"]
