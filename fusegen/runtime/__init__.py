"""Runtime support imported by generated fused model files.

Kept deliberately small and dependent only on torch and transformers, so a generated model file works wherever
Transformers does, without the compiler (jinja2, black, ...) installed.
"""

from .checkpoint import (
    MergedColumnConcatenate,
    MergedColumnSplit,
    build_stacked_converters,
    register_stacked_checkpoint,
)
from .linear import MergedColumnLinear

__all__ = [
    "MergedColumnConcatenate",
    "MergedColumnLinear",
    "MergedColumnSplit",
    "build_stacked_converters",
    "register_stacked_checkpoint",
]
