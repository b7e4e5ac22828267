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

# Tensor parallelism (`.tp`) is imported on first use, e.g. when a generated model is built: importing a generated
# file must load only the modules above.
_TP_EXPORTS = (
    "LocalHeadsParallel",
    "MergedColumnParallel",
    "PartitionedConcatenate",
    "init_fused_parallel_plans",
    "partition_rows",
)


def __getattr__(name: str):
    if name == "fused_from_pretrained":  # imported when a generated class's from_pretrained runs, not on import
        from .pretrained import fused_from_pretrained

        return fused_from_pretrained
    if name in _TP_EXPORTS:
        from . import tp

        return getattr(tp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "LocalHeadsParallel",
    "MergedColumnConcatenate",
    "MergedColumnLinear",
    "MergedColumnParallel",
    "MergedColumnSplit",
    "PartitionedConcatenate",
    "build_stacked_converters",
    "fused_from_pretrained",
    "init_fused_parallel_plans",
    "load_checkpoint",
    "load_weights",
    "partition_rows",
    "register_stacked_checkpoint",
    "save_checkpoint",
    "stream_weights",
]
