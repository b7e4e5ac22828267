"""Stage 1: turn a target name into the classes and module to compile."""

from __future__ import annotations

import difflib
import importlib
import inspect
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
    source: str
    """What the user named: a model type, or a dotted module path."""


def causal_lm_types() -> list[str]:
    """Model types registered with `AutoModelForCausalLM`, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def resolve(name: str) -> Target:
    """A model type (`llama`) or a dotted module path (`mypkg.modeling_foo`) as a `Target`."""
    if "." in name:
        return resolve_module(name)
    return resolve_model_type(name)


def resolve_module(dotted: str) -> Target:
    """The causal LM defined in an importable modeling module of the user's own.

    The module must define a `PreTrainedModel` subclass with a `config_class`
    and a generation head (`GenerationMixin`); the output is named after that
    config's `model_type`, exactly like a built-in model type.
    """
    from transformers import GenerationMixin, PreTrainedModel

    try:
        module = importlib.import_module(dotted)
    except Exception as exc:
        raise InputError(f"cannot import module {dotted!r}: {type(exc).__name__}: {exc}") from exc
    found = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
        and issubclass(cls, PreTrainedModel)
        and issubclass(cls, GenerationMixin)
        and getattr(cls, "config_class", None) is not None
    ]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(cls.__name__ for cls in found)})"
        raise InputError(
            f"module {dotted!r} defines {what} causal-LM classes (PreTrainedModel + GenerationMixin subclasses "
            "with a config_class); fusegen needs exactly one"
        )
    causal_lm = found[0]
    model_type = getattr(causal_lm.config_class, "model_type", "")
    if not model_type or not model_type.isidentifier():
        raise InputError(f"{causal_lm.config_class.__name__}.model_type must be an identifier, got {model_type!r}")
    return Target(model_type, causal_lm, causal_lm.config_class, module, source=dotted)


def resolve_model_type(name: str) -> Target:
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
    return Target(name, causal_lm, config_class, sys.modules[causal_lm.__module__], source=name)
