"""Which checkpoint conversions a fused model loads and saves with: its OWN classes' merges, at their places in its
OWN tree, with its own choice of merge op, whatever else this process defined, built or registered.

Transformers keeps one process-global registry keyed by class NAME (then model type), which
`get_model_conversion_mapping(model)` reads when a model loads, saves, or gets an adapter. Two things make a name a
poor key for fused classes: two generated modules may define classes of one name with different merges
(`FusedGemma3TextModel` is in fused_gemma3.py and in fused_gemma3_text.py; a test builds its own file beside a
checked-in one), and one class needs different conversions in different trees (Aria's text model gets `aria_text`'s
MoE stacking under Aria). So nothing registered under a name is trusted as state:

- each class's merge converters are kept ON the class object (`merges_of`), bound when the generated module
  registers them (`register_stacked_checkpoint`, called by the module below its class definitions), so they belong
  to that class only and no re-import of fusegen's modules loses them;
- right before each lookup made for a model, `register_for_tree(model)` registers, under the name of every fused
  class of that model's tree, what THAT model needs (`tree_conversions`: a function of the model alone), always
  overwriting, never skipping. The lookups: `from_pretrained`'s, which follows the root's `post_init` (the last thing
  a build runs) with nothing in between that builds or registers; saving, adapters and `load_checkpoint`'s renames,
  which call it first (fusegen/runtime/pretrained.py, renames.py);
- tensor parallelism's merge op (`PartitionedConcatenate`, which keeps this process's rows of replicated kv heads) is
  an input of that function, carried by the model being loaded tensor-parallel (`set_merge_op`, from
  `fusegen.runtime.tp.prepare_tensor_parallel`), not an edit of registered converters: registering again for the same
  model keeps it, and another model's registration neither undoes it nor inherits it.

Soundness: Transformers' lookup for a model reads exactly the names of the classes in its tree (and model types, which
fusegen never registers: `_check_registrable`), and each such name was just set from that model's classes, or, for a
class of the tree without merges whose name fusegen registered for another class, removed. Two classes of one tree
that one name cannot serve (two different classes of one name; one class at two places where its original gets
different conversions) are refused by name, since whichever were registered, one place would load wrong.

One thread at a time: the registration and Transformers' lookup are two steps on process-global state, so two
threads loading models whose trees share a class name could each read the other's registration. Load such models
from one thread (or hold one lock across each load).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from weakref import WeakSet

from torch import nn
from transformers import conversion_mapping
from transformers.conversion_mapping import (
    USER_REGISTERED_MAPPINGS,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.core_model_loading import WeightConverter

from .checkpoint import build_stacked_converters, conversions_signature, with_merges

MERGES_ATTRIBUTE = "fusegen_stacked_converters"
"""Attribute of a fused class (in its own `__dict__`, not inherited): the merge converters registered for it. Kept on
the class, so nothing a process does to fusegen's modules (a re-import, `importlib.reload`) loses it."""

_BOUND: WeakSet[type] = WeakSet()
"""The classes given merges here (for `restored_registry` to undo; weak: a generated module's classes may go)."""

_BY_NAME: dict[tuple[str, str], list[WeightConverter]] = {}
"""`(module, class name)` -> merge converters, for a name whose class the registering frame did not hold; it applies to
the class of that name defined in that module."""

_NAMES: set[str] = set()
"""The class names fusegen has registered with Transformers."""

MERGE_OP_ATTRIBUTE = "fusegen_merge_op"
"""Attribute of a module of a model's tree: the `MergedColumnConcatenate` subclass its merges use (`set_merge_op`)."""


def register_stacked_checkpoint(
    classes: str | type | Sequence[str | type],
    stacked: Mapping[str, Sequence[Any]],
    parents: Mapping[str, Sequence[str]] | None = None,
) -> list[WeightConverter]:
    """Make `from_pretrained`/`save_pretrained` of the given fused classes read and write the canonical unfused layout.

    `classes`: the fused `PreTrainedModel` classes (or their names, looked up in the calling frame, which is how a
    generated module names the classes it just defined) whose checkpoints use the canonical layout; the base model is
    enough (fusegen/runtime/checkpoint.py). `stacked`: merged linear name -> ordered pieces, e.g.
    `{"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]}`; the order must match the module's
    `output_sizes`. `parents`: merged linear name -> attribute names of the modules holding it (e.g. `["self_attn"]`),
    under every config of the model (`fusegen.compiler.scopes.checkpoint_scopes`); a merged name without an entry is
    matched by bare piece names. A holder under an attribute not listed is left unfilled, which the generated classes
    refuse (`fusegen.runtime.check_loading`) rather than initialise randomly.

    The merges are kept on the class object (`MERGES_ATTRIBUTE`); a name the calling frame does not hold is kept for the class of that
    name its module defines. Each name is also registered with Transformers right away, with its original's
    class-keyed conversions, for lookups fusegen does not make; a model's own lookups re-register for its tree
    (`register_for_tree`). Registering again (re-import, `importlib.reload`) replaces. Returns the merge converters.
    """
    wanted = [classes] if isinstance(classes, (str, type)) else list(classes)
    converters = build_stacked_converters(stacked, parents)
    names = [each.__name__ if isinstance(each, type) else each for each in wanted]
    for name in names:
        _check_registrable(name)
    frame = sys._getframe(1)
    module = frame.f_globals.get("__name__", "")
    for each, name in zip(wanted, names):
        cls = each if isinstance(each, type) else _in_frame(frame, name)
        if cls is not None:
            setattr(cls, MERGES_ATTRIBUTE, converters)
            _BOUND.add(cls)
        else:
            _BY_NAME[(module, name)] = converters
        original = get_checkpoint_conversion_mapping(name.removeprefix("Fused")) or []
        _install(name, with_merges(original, converters))
    return converters


def _in_frame(frame, name: str) -> type | None:
    """The class called `name` that the registering frame holds (its locals, then its globals), if any."""
    for scope in (frame.f_locals, frame.f_globals):
        found = scope.get(name)
        if isinstance(found, type) and found.__name__ == name:
            return found
    return None


def _check_registrable(class_name: str) -> None:
    """Refuse names whose registration would change how ORIGINAL Transformers models load or save.

    Transformers looks mappings up by class name and then by `model_type`, so registering `"llama"` or `"LlamaModel"`
    would make stock Llama checkpoints go through our converters. Fused class names never collide with these.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not isinstance(class_name, str) or not class_name.isidentifier():
        raise ValueError(f"class name must be an identifier, got {class_name!r}")
    builtin = get_checkpoint_conversion_mapping(class_name) is not None and class_name not in USER_REGISTERED_MAPPINGS
    if builtin or class_name in CONFIG_MAPPING_NAMES or hasattr(transformers, class_name):
        raise ValueError(f"{class_name!r} belongs to Transformers itself; register the fused class names instead")


def merges_of(cls: type) -> list[WeightConverter] | None:
    """The merge converters registered for the class `cls` itself (not for another class of its name), or None."""
    found = cls.__dict__.get(MERGES_ATTRIBUTE)
    return found if found is not None else _BY_NAME.get((cls.__module__, cls.__name__))


def set_merge_op(model: nn.Module, op: type) -> None:
    """Make the merges of `model`'s tree (and of any tree holding it) use `op`, a `MergedColumnConcatenate`
    subclass, from its next registration on (the root's `post_init`, before `from_pretrained` looks them up)."""
    setattr(model, MERGE_OP_ATTRIBUTE, op)


def _merge_op_of(root: nn.Module) -> type | None:
    ops = {getattr(module, MERGE_OP_ATTRIBUTE, None) for module in root.modules()} - {None}
    if len(ops) > 1:
        raise ValueError(f"{type(root).__name__}: its modules ask for different merge ops {sorted(map(str, ops))}")
    return ops.pop() if ops else None


def tree_conversions(root: nn.Module) -> dict[str, list]:
    """Class name -> the conversions to register for it, for each fused class with merges in `root`'s tree: what
    Transformers gives its original at its place, with its own merges, in the tree's merge op.

    Transformers (`get_model_conversion_mapping`) walks the `PreTrainedModel`s of a model and looks each up by class
    name, else by model type; a model whose class or (looked up by type) model type an ancestor already got is
    skipped, since the ancestor's conversions cover its keys. A fused class with merges is found by its own name, so
    the model-type lookup never happens for it. Here the same walk is made with the ORIGINAL class names, and each
    such fused class gets what its original got at its place: its class-keyed conversions, its model type's (the
    original `AriaTextModel` under `AriaForConditionalGeneration` gets `"aria_text"`'s, which rename the legacy
    `experts.fc1` to the stacked `experts.gate_up_proj`), or nothing (the original `Inkling2Model` under
    `Inkling2ForConditionalGeneration`, whose `"inkling2"` conversions are unscoped at the root already: applied twice,
    `position_embedding` would become `position_embedding.weight.weight`).

    Raises `ValueError` naming the classes and places when one name cannot serve the tree: two different classes of
    one name in it, or one class at two places whose originals get different conversions there.
    """
    from transformers import PreTrainedModel

    merge_op = _merge_op_of(root)
    claimed: dict[str, list[str]] = {}
    decided: dict[str, tuple[type, str, list]] = {}
    for path, module in root.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        cls = type(module)
        merges = merges_of(cls)
        name = cls.__name__
        original = name.removeprefix("Fused") if merges is not None else name
        model_type = getattr(module.config, "model_type", None)
        found = _original_walk_step(module, path, original, model_type, claimed)
        if merges is None:
            continue
        conversions = with_merges(found or [], merges, merge_op)
        first_cls, first_path, first = decided.setdefault(name, (cls, path, conversions))
        where = f"{type(root).__name__}: {name} at {first_path or 'the root'!r} and at {path!r}"
        if first_cls is not cls:
            raise ValueError(
                f"{where} are two different classes (from {first_cls.__module__} and {cls.__module__}); Transformers "
                "looks checkpoint conversions up by class name, so one of them would load with the other's"
            )
        if conversions_signature(first) != conversions_signature(conversions):
            raise ValueError(
                f"{where}: Transformers gives its original {original} different checkpoint conversions at these "
                "places, and it looks them up by class name, so one place would load with the other's"
            )
    return {name: conversions for name, (_, _, conversions) in decided.items()}


def register_for_tree(root: nn.Module) -> None:
    """Register with Transformers exactly what `root` loads and saves with (`tree_conversions`), right before a lookup
    made for it; a class of its tree without merges whose name fusegen registered for another class is unregistered,
    so Transformers looks it up by model type as it would have.

    Runs for each built model (`FusedPreTrainedMixin.post_init`: the root's runs last, right before `from_pretrained`
    looks the conversions up) and again before each later lookup (saving, adapters, `load_checkpoint`'s renames),
    since a model built in between registers its own tree's."""
    from transformers import PreTrainedModel

    for module in root.modules():
        name = type(module).__name__
        if isinstance(module, PreTrainedModel) and name in _NAMES and merges_of(type(module)) is None:
            _NAMES.discard(name)
            _checkpoint_cache().pop(name, None)
            USER_REGISTERED_MAPPINGS.discard(name)
    for name, conversions in tree_conversions(root).items():
        _install(name, conversions)


def _install(name: str, conversions: list) -> None:
    register_checkpoint_conversion_mapping(name, conversions, overwrite=True)
    _NAMES.add(name)


def _checkpoint_cache() -> dict:
    get_checkpoint_conversion_mapping("llama")  # builds Transformers' cache if nothing has yet
    return conversion_mapping._checkpoint_conversion_mapping_cache


@contextmanager
def restored_registry():
    """Undo, on leaving the block, every registration made in it: Transformers' conversion registry (its cache and
    `USER_REGISTERED_MAPPINGS`) and the merges fusegen bound to classes, as they were on entering. For a validation import of
    generated text (fusegen/compiler/validate.py) and for tests that register or build classes of their own."""
    cache = _checkpoint_cache()
    bound = {cls: cls.__dict__[MERGES_ATTRIBUTE] for cls in _BOUND if MERGES_ATTRIBUTE in cls.__dict__}
    saved = (dict(cache), set(USER_REGISTERED_MAPPINGS), bound, dict(_BY_NAME), set(_NAMES))
    try:
        yield
    finally:
        cache.clear()
        cache.update(saved[0])
        USER_REGISTERED_MAPPINGS.clear()
        USER_REGISTERED_MAPPINGS.update(saved[1])
        for cls in list(_BOUND):
            if MERGES_ATTRIBUTE in cls.__dict__:
                delattr(cls, MERGES_ATTRIBUTE)
        _BOUND.clear()
        for cls, converters in bound.items():
            setattr(cls, MERGES_ATTRIBUTE, converters)
            _BOUND.add(cls)
        _BY_NAME.clear()
        _BY_NAME.update(saved[3])
        _NAMES.clear()
        _NAMES.update(saved[4])


def _original_walk_step(module, path: str, original: str, model_type: str | None, claimed: dict) -> list | None:
    """One step of Transformers' walk, for the original class `original` at `path`: its conversions (None: none),
    recording in `claimed` what it claims for its descendants."""
    registered = original in USER_REGISTERED_MAPPINGS or model_type in USER_REGISTERED_MAPPINGS
    custom = module.is_custom_code() and not registered
    if custom or _under(path, claimed.get(original, ())):
        return None
    found = get_checkpoint_conversion_mapping(original)
    by_class = found is not None
    if not by_class:
        if model_type and _under(path, claimed.get(model_type, ())):
            return None
        found = get_checkpoint_conversion_mapping(model_type) if model_type is not None else None
    if found is None:
        return None
    claimed.setdefault(original, []).append(path)
    if not by_class and model_type:
        claimed.setdefault(model_type, []).append(path)
    return found


def _under(path: str, ancestors) -> bool:
    return any(seen == "" or path.startswith(seen + ".") for seen in ancestors)
