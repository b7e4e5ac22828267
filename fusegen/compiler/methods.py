"""Stage 6b: the methods fusegen adds to the emitted classes, and the fusegen.runtime names they and the template use.

Each method is added only where the original class lacks it (see `add_methods`).
"""

from __future__ import annotations

import ast

from torch import nn

from fusegen.compiler import astutil
from fusegen.compiler.resolve import Target

REGISTER = "register_stacked_checkpoint"
REGISTER_AUTO = "register_fused_causal_lm"
STREAM = "stream_weights"
CHECK = "check_loading"
TEMPLATE_NAMES = {"STACKED_PARAMS_MAPPING", "packed_modules_mapping", "TP_PLAN"}
"""Module-level names the template defines; generated methods may read them."""
INIT_PARALLEL_PLANS_METHOD = '''
def init_parallel_plans(self):
    """Transformers' parallel plans, with TP_PLAN's rules for the merged projections.

    fusegen.runtime.tp is imported here, when a model is built, so importing this file stays light.
    """
    from fusegen.runtime import init_fused_parallel_plans

    init_fused_parallel_plans(self, TP_PLAN)
'''
IS_CUSTOM_CODE_METHOD = '''
@classmethod
def is_custom_code(cls):
    """Generated from Transformers' own code: load and initialise the way Transformers treats its own models."""
    return False
'''
CAN_SET_EXPERTS_METHOD = '''
@classmethod
def _can_set_experts_implementation(cls):
    """The experts classes live in the original module, which has the decorator Transformers looks for here."""
    return True
'''
STRICT_LOADING_METHOD = '''
@classmethod
def _finalize_model_loading(cls, model, load_config, loading_info):
    """Raise instead of randomly initialising a merged parameter the checkpoint did not fill (see check_loading)."""
    check_loading(model, loading_info, load_config.pretrained_model_name_or_path)
    return super()._finalize_model_loading(model, load_config, loading_info)
'''
FROM_PRETRAINED_METHOD = '''
@classmethod
def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    """Transformers' from_pretrained, for the canonical layout and `fusegen convert`'s fused one (validated first)."""
    from fusegen.runtime import fused_from_pretrained

    return fused_from_pretrained(cls, super().from_pretrained, pretrained_model_name_or_path, *model_args, **kwargs)
'''
SAVE_PRETRAINED_METHOD = '''
def save_pretrained(self, save_directory, *args, **kwargs):
    """Transformers' save_pretrained; config.json then names the original classes (fusegen.runtime.auto)."""
    from fusegen.runtime import save_pretrained_canonically

    return save_pretrained_canonically(self, super().save_pretrained, save_directory, *args, **kwargs)
'''
LOAD_ADAPTER_METHOD = '''
def load_adapter(self, peft_model_id=None, adapter_name=None, peft_config=None, adapter_state_dict=None, **kwargs):
    """Transformers' load_adapter, with canonical (per-projection) LoRA tensors packed onto the merged linears."""
    from fusegen.runtime import load_adapter_packed

    return load_adapter_packed(
        self, super().load_adapter, peft_model_id, adapter_name, peft_config, adapter_state_dict, **kwargs
    )
'''
LOAD_WEIGHTS_METHOD = '''
def load_weights(self, weights):
    """vLLM's loader interface: stream `(name, tensor)` pairs, canonical or fused names, into this model."""
    return stream_weights(self, weights)
'''


def add_methods(emitted: dict, target: Target, model: nn.Module) -> None:
    """The few methods fusegen adds to the copied classes, each only where the original lacks it.

    - the causal LM's `load_weights`, vLLM's streaming loader interface;
    - the base models' `init_parallel_plans`, so tensor parallelism shards the merged linears by partition;
    - `_finalize_model_loading` on the pretrained base: `from_pretrained` raises `CheckpointError` instead of
      randomly initialising a merged parameter the checkpoint did not fill (fusegen/runtime/strict.py);
    - `from_pretrained` on the pretrained base: validates a local checkpoint before Transformers maps it, and loads
      `fusegen convert`'s fused layout zero-copy (fusegen/runtime/pretrained.py);
    - `is_custom_code() -> False` on the pretrained base of a Transformers model: otherwise the copies count as
      custom code, which loads and initialises differently (non-persistent buffers filled in `_init_weights`
      are skipped, model-type checkpoint conversions are not applied at the root);
    - `save_pretrained` and `load_adapter` on the pretrained base: config.json names the original classes, and
      canonical PEFT adapters load onto the merged linears (fusegen.runtime.auto, fusegen.runtime.peft);
    - `_can_set_experts_implementation() -> True` on the pretrained base of any model whose original answers True:
      Transformers decides by searching the class's module source for the experts decorator, and the experts
      classes stay in the original module, so without it a fused MoE model silently falls back to the eager
      per-expert loop.
    """
    from transformers import PreTrainedModel

    def add(name: str, method: str, source: str) -> None:
        if name in emitted and astutil.method(emitted[name].classdef, method) is None:
            emitted[name].classdef.body.append(ast.parse(source).body[0])

    add(target.causal_lm.__name__, "load_weights", LOAD_WEIGHTS_METHOD)
    for name in _base_models(model, emitted):
        add(name, "init_parallel_plans", INIT_PARALLEL_PLANS_METHOD)
    classes = {cls.__name__: cls for module in model.modules() for cls in type(module).__mro__}
    for name in emitted:
        cls = classes.get(name)
        is_base = cls is not None and not {base.__name__ for base in cls.__bases__} & set(emitted)
        if not (is_base and issubclass(cls, PreTrainedModel)):
            continue
        add(name, "_finalize_model_loading", STRICT_LOADING_METHOD)
        add(name, "from_pretrained", FROM_PRETRAINED_METHOD)
        if target.module.__name__.startswith("transformers."):
            add(name, "is_custom_code", IS_CUSTOM_CODE_METHOD)
        add(name, "save_pretrained", SAVE_PRETRAINED_METHOD)
        add(name, "load_adapter", LOAD_ADAPTER_METHOD)
        if getattr(cls, "_can_set_experts_implementation", lambda: False)():
            add(name, "_can_set_experts_implementation", CAN_SET_EXPERTS_METHOD)


def _base_models(model: nn.Module, emitted: dict) -> list[str]:
    """Emitted `PreTrainedModel` classes nested in the causal LM (the base models)."""
    from transformers import PreTrainedModel

    names = {type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel) and m is not model}
    return sorted(names & set(emitted))
