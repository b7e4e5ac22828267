"""How a fused model presents itself to Transformers' registries and files: canonical `config.json`, pipelines.

- `save_pretrained` of a fused model writes `architectures: ["LlamaForCausalLM"]`, the ORIGINAL class names, so
  engines and converters that pick a class by that field load the canonical checkpoint as what it is. A fused
  class is `"Fused" + <original name>` (fusegen's naming rule), so the original names are derived, not stored.
- `register_fused_causal_lm` lists the fused causal LM in `MODEL_FOR_CAUSAL_LM_MAPPING`'s extra entries, the
  place the text-generation pipeline (and Trainer's causal-LM check, by name) looks. The entry is keyed by the
  fused class itself, which no config ever is, so `AutoModelForCausalLM` keeps mapping `LlamaConfig` to
  `LlamaForCausalLM`: how original models load does not change.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .version import source_module

CONFIG_NAME = "config.json"


def original_name(class_name: str) -> str:
    """`FusedLlamaForCausalLM` -> `LlamaForCausalLM` (names without the prefix are kept)."""
    return class_name.removeprefix("Fused")


def generated_class(cls: type) -> tuple[type, str] | None:
    """The first class in `cls`'s MRO defined by a generated file, and the modeling module that file was built from.

    Walking the MRO (rather than reading `cls.__module__`) keeps a user's subclass in their own module working.
    """
    for klass in cls.__mro__:
        source = source_module(klass.__module__)
        if source is not None:
            return klass, source
    return None


def original_class(cls: type) -> type | None:
    """The Transformers class a generated class is the fused copy of: `FusedMixtralForCausalLM` ->
    `MixtralForCausalLM` in the source module; None if there is no such class (then nothing is delegated)."""
    found = generated_class(cls)
    if found is None:
        return None
    klass, source = found
    module = sys.modules.get(source)
    original = getattr(module, original_name(klass.__name__), None) if module is not None else None
    return original if isinstance(original, type) and original is not klass else None


def canonical_architectures(architectures) -> list[str] | None:
    return None if architectures is None else [original_name(name) for name in architectures]


def rewrite_config_architectures(directory: str | os.PathLike) -> None:
    """Make `directory/config.json` name the original classes; atomic (temporary sibling, then rename)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():  # e.g. a save of PEFT adapters only writes adapter_config.json
        return
    document = json.loads(path.read_text(encoding="utf-8"))
    canonical = canonical_architectures(document.get("architectures"))
    if canonical == document.get("architectures"):
        return
    document["architectures"] = canonical
    temporary = path.with_name(f".{path.name}.partial")
    temporary.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def save_pretrained(model, save, save_directory, *args, **kwargs):
    """`save_pretrained` of a generated model: Transformers' own, then `config.json` names the original classes.

    `push_to_hub=True` is refused: the upload would happen before the rewrite. `model.push_to_hub(repo)` saves
    through this method, so it uploads the canonical file.
    """
    if kwargs.get("push_to_hub"):
        raise ValueError(
            f"{type(model).__name__}.save_pretrained(push_to_hub=True) would upload config.json naming the fused class; "
            "call model.push_to_hub(repo_id) instead (it saves the canonical config)"
        )
    result = save(save_directory, *args, **kwargs)
    model.config.architectures = canonical_architectures(model.config.architectures)
    if kwargs.get("is_main_process", True) and _first_rank():
        rewrite_config_architectures(save_directory)  # one writer: under TP every rank saves into one directory
    return result


def _first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def register_fused_causal_lm(model_class: type) -> None:
    """List `model_class` where pipelines look for causal LMs, without remapping any config (see the docstring)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    extra = MODEL_FOR_CAUSAL_LM_MAPPING._extra_content
    for key in [k for k in extra if getattr(k, "__qualname__", None) == model_class.__qualname__]:
        if getattr(key, "__module__", None) == model_class.__module__:  # a re-import or reload replaces its entry
            del extra[key]
    extra[model_class] = model_class
