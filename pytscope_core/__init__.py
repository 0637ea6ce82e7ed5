"""pytscope core: framework-neutral measurement, cross-rank aggregation, diagnosis and reporting."""

from .findings import Finding, Severity
from .scope import Scope

__version__ = "0.3.0"
__all__ = ["Finding", "Scope", "Severity", "__version__"]
