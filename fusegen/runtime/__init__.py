"""Runtime support imported by generated fused model files.

Kept deliberately small and dependent only on torch, transformers and safetensors (a dependency of Transformers),
so a generated model file works wherever Transformers does, without the compiler (jinja2, black, ...) installed.
"""

from .checkpoint import (
    MergedColumnConcatenate,
    MergedColumnSplit,
    build_stacked_converters,
    register_stacked_checkpoint,
)
from .linear import MergedColumnLinear
from .loading import CheckpointError, load_checkpoint, load_weights, save_checkpoint

# What a generated causal LM's `load_weights` method calls (a distinct name, so the method does not shadow it).
stream_weights = load_weights

__all__ = [
    "CheckpointError",
    "MergedColumnConcatenate",
    "MergedColumnLinear",
    "MergedColumnSplit",
    "build_stacked_converters",
    "load_checkpoint",
    "load_weights",
    "register_stacked_checkpoint",
    "save_checkpoint",
    "stream_weights",
]
