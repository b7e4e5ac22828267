"""Runtime support imported by generated fused model files.

Kept deliberately small and dependent only on torch, transformers and safetensors (a dependency of Transformers),
so a generated model file works wherever Transformers does, without the compiler (jinja2, black, ...) installed.
"""

from . import format_composers as _format_composers  # noqa: F401 (registers its composers)
from . import peft as _peft
from .auto import register_fused_causal_lm
from .auto import save_pretrained as save_pretrained_canonically
from .checkpoint import MergedColumnConcatenate, MergedColumnSplit, build_stacked_converters
from .claims import class_is_honest
from .files import CheckpointError
from .layout import RowLayout
from .linear import MergedColumnLinear, linear_piece, linear_pieces, merged_piece
from .loading import load_checkpoint, load_weights
from .peft import AdapterError
from .peft import load_adapter as load_adapter_packed
from .pretrained import FusedPreTrainedMixin, fused_from_pretrained
from .registry import register_stacked_checkpoint
from .saving import save_checkpoint
from .strict import check_loading
from .version import StaleGeneratedFile, check_source

# PEFT learns about merged linears when it is imported (now, or later); importing this package never imports PEFT.
_peft.arm()

# Tensor parallelism (`.tp`) is imported on first use, e.g. when a generated model is built: importing a generated
# file must load only the modules above.
_TP_EXPORTS = (
    "LocalHeadsParallel",
    "MergedColumnParallel",
    "PartitionedConcatenate",
    "apply_packed_tp_plan",
    "init_fused_parallel_plans",
    "partition_rows",
)


def __getattr__(name: str):
    if name in _TP_EXPORTS:
        from . import tp

        return getattr(tp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdapterError",
    "CheckpointError",
    "FusedPreTrainedMixin",
    "LocalHeadsParallel",
    "MergedColumnConcatenate",
    "MergedColumnLinear",
    "MergedColumnParallel",
    "MergedColumnSplit",
    "PartitionedConcatenate",
    "RowLayout",
    "StaleGeneratedFile",
    "apply_packed_tp_plan",
    "build_stacked_converters",
    "check_loading",
    "check_source",
    "class_is_honest",
    "fused_from_pretrained",
    "init_fused_parallel_plans",
    "linear_piece",
    "linear_pieces",
    "load_adapter_packed",
    "load_checkpoint",
    "load_weights",
    "merged_piece",
    "partition_rows",
    "register_fused_causal_lm",
    "register_stacked_checkpoint",
    "save_checkpoint",
    "save_pretrained_canonically",
]
