"""Stage 1: turn a target name into the classes and module to compile."""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from types import ModuleType

from fusegen.errors import InputError


@dataclass(frozen=True)
class Target:
    model_type: str
    causal_lm: type
    config_class: type
    module: ModuleType
    """The modeling module the causal-LM class is defined in."""


def causal_lm_types() -> list[str]:
    """Model types registered with `AutoModelForCausalLM`, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def resolve(name: str) -> Target:
    """A Transformers causal-LM model type (`llama`) as a `Target`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    known = causal_lm_types()
    if name not in known:
        hint = difflib.get_close_matches(name, known, n=3)
        did_you_mean = f" Did you mean {', '.join(repr(h) for h in hint)}?" if hint else ""
        raise InputError(
            f"unknown model type {name!r}: Transformers registers no causal LM under that name.{did_you_mean} "
            "Run `fusegen list` to see the known model types."
        )
    config_class = CONFIG_MAPPING[name]
    try:
        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    except Exception as exc:  # an optional dependency of that model is missing, say
        raise InputError(f"model type {name!r}: cannot import its causal-LM class ({exc})") from exc
    if isinstance(causal_lm, (tuple, list)):
        causal_lm = causal_lm[0]
    return Target(name, causal_lm, config_class, sys.modules[causal_lm.__module__])
