"""Stage 6: the base class fusegen adds to the emitted classes, and the fusegen.runtime names they and the template use.

It adds one base class: `fusegen.runtime.FusedPreTrainedMixin` becomes the first base of each pretrained base, so the
methods fusegen adds live once in the runtime (fusegen/runtime/pretrained.py) instead of in every generated file.
"""

from __future__ import annotations

import ast

from torch import nn

REGISTER = "register_stacked_checkpoint"
REGISTER_AUTO = "register_fused_causal_lm"
CHECK = "check_loading"
MIXIN = "FusedPreTrainedMixin"
"""The runtime class every generated pretrained base inherits first (fusegen/runtime/pretrained.py)."""
TEMPLATE_NAMES = {"STACKED_PARAMS_MAPPING", "packed_modules_mapping", "TP_PLAN"}
"""Module-level names the template defines; the runtime reads them from the generated module."""


def add_runtime_base(emitted: dict, model: nn.Module) -> None:
    """Make `FusedPreTrainedMixin` the first base of each pretrained base (an emitted `PreTrainedModel` subclass
    none of whose bases is emitted), so every generated model class inherits the methods fusegen adds:

    `from_pretrained` (validation, fused layout), `_finalize_model_loading` (strict loading), `save_pretrained`
    (canonical config.json), `load_adapter` (canonical PEFT adapters), `load_weights` (vLLM's interface),
    `init_parallel_plans` (TP_PLAN), `is_custom_code` and `_can_set_experts_implementation` (answered as for the
    original classes). Why each exists is in the mixin's docstrings. A method the copied class defines in its own
    body still wins over the mixin's, as it did when these methods were written into the class.
    """
    from transformers import PreTrainedModel

    classes = {cls.__name__: cls for module in model.modules() for cls in type(module).__mro__}
    for name, item in emitted.items():
        cls = classes.get(name)
        is_base = cls is not None and not {base.__name__ for base in cls.__bases__} & set(emitted)
        if is_base and issubclass(cls, PreTrainedModel):
            item.classdef.bases.insert(0, ast.Name(MIXIN, ast.Load()))
