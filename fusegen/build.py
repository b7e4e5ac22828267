"""The pipeline end to end: a target name in, a generated module's text out."""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
from dataclasses import dataclass, field
from types import ModuleType

import transformers
from torch import nn

import fusegen
from fusegen import astutil
from fusegen.analyse import analyse_class
from fusegen.errors import InputError
from fusegen.imports import global_names, import_lines
from fusegen.instantiate import candidates, instantiate
from fusegen.plan import ClassOutcome, FusionPlan, Refusal, Refused
from fusegen.propagate import classes_to_emit, constructed_classes, fused_name, rename_classes
from fusegen.render import render
from fusegen.resolve import Target, resolve
from fusegen.rewrite_init import MERGED_LINEAR
from fusegen.runtime.tp import fused_plan_from

REGISTER = "register_stacked_checkpoint"
STREAM = "stream_weights"
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
FROM_PRETRAINED_METHOD = '''
@classmethod
def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    """Transformers' from_pretrained, for the canonical layout and `fusegen convert`'s fused one (validated first)."""
    from fusegen.runtime import fused_from_pretrained

    return fused_from_pretrained(cls, super().from_pretrained, pretrained_model_name_or_path, *model_args, **kwargs)
'''
LOAD_WEIGHTS_METHOD = '''
def load_weights(self, weights):
    """vLLM's loader interface: stream `(name, tensor)` pairs, canonical or fused names, into this model."""
    return stream_weights(self, weights)
'''


@dataclass
class Analysis:
    target: Target
    model: nn.Module
    outcomes: list[ClassOutcome]
    rewritten: dict[type, ast.ClassDef]
    """Rewritten class statements of the classes with at least one fusion."""


@dataclass
class BuildResult:
    target: Target
    outcomes: list[ClassOutcome]
    text: str | None
    """The generated module, or None when nothing could be fused."""
    fused_classes: list[type] = field(default_factory=list)
    """The original classes that were rewritten (in analysis order)."""


def analyse(name: str) -> Analysis:
    """Stages 1-5: every candidate class's outcome, and the rewritten classes."""
    target = resolve(name)
    model = instantiate(target)
    found = candidates(model)
    results = {cls: analyse_class(cls, instance, vars(sys.modules[cls.__module__])) for cls, instance in found.items()}
    vetoes = _vetoes(model, [outcome for outcome, _ in results.values()])
    while vetoes:
        for cls, instance in found.items():
            if cls.__name__ in vetoes:
                results[cls] = analyse_class(cls, instance, vars(sys.modules[cls.__module__]), vetoes[cls.__name__])
        vetoes = _vetoes(model, [outcome for outcome, _ in results.values()])
    outcomes = [outcome for outcome, _ in results.values()]
    rewritten = {cls: classdef for cls, (_, classdef) in results.items() if classdef is not None}
    return Analysis(target, model, outcomes, rewritten)


def build(name: str) -> BuildResult:
    """The whole pipeline: the generated module's text for target `name`."""
    analysis = analyse(name)
    target, model, outcomes, rewritten = analysis.target, analysis.model, analysis.outcomes, analysis.rewritten
    if not rewritten:
        return BuildResult(target, outcomes, None)
    emitted = classes_to_emit(target.module, model, rewritten)
    stray = {cls.__name__ for cls in rewritten} - constructed_classes(emitted, target.causal_lm.__name__)
    if stray:
        outcomes = _unreachable(outcomes, target, stray)
        rewritten = {cls: classdef for cls, classdef in rewritten.items() if cls.__name__ not in stray}
        if not rewritten:
            return BuildResult(target, outcomes, None)
        emitted = classes_to_emit(target.module, model, rewritten)
    renames = {name: fused_name(name) for name in emitted}
    _add_methods(emitted, target, model)
    used: dict[str, tuple[ModuleType | None, str]] = {}
    for item in emitted.values():
        rename_classes(item.classdef, renames)
        for used_name in sorted(global_names(ast.unparse(item.classdef)) - set(renames.values()) - TEMPLATE_NAMES):
            _use(used, used_name, item)
    used[REGISTER] = used[STREAM] = (None, "")
    sources = [ast.unparse(item.classdef) for item in emitted.values()]
    plans = [plan for outcome in outcomes for plan in outcome.fused]
    text = render(
        fusegen_version=fusegen.__version__,
        transformers_version=transformers.__version__,
        source_module=target.module.__name__,
        model_type=target.model_type,
        build_target=target.source,
        fingerprint=hashlib.sha256(inspect.getsource(target.module).encode()).hexdigest(),
        fused_lines=[f"{fused_name(o.class_name)}: {plan.describe()}" for o in outcomes for plan in o.fused],
        refused_lines=[f"{o.class_name}: {refusal.describe()}" for o in outcomes for refusal in o.refused],
        causal_lm=target.causal_lm.__name__,
        imports=import_lines(used, {MERGED_LINEAR, REGISTER, STREAM}),
        stacked_params_mapping=repr(_stacked_mapping(plans)),
        packed_modules_mapping=repr({plan.merged: list(plan.projections) for plan in plans}),
        classes=sources,
        checkpoint_classes=repr(_checkpoint_classes(model, target, renames)),
        parents=repr(_parents(model, outcomes)),
        exports=repr(sorted(renames.values())),
        **_tensor_parallel(model, plans, _parents(model, outcomes), _checkpoint_classes(model, target, renames)),
    )
    return BuildResult(target, outcomes, text, list(rewritten))


def _add_methods(emitted: dict, target: Target, model: nn.Module) -> None:
    """The few methods fusegen adds to the copied classes, each only where the original lacks it.

    - the causal LM's `load_weights`, vLLM's streaming loader interface;
    - the base models' `init_parallel_plans`, so tensor parallelism shards the merged linears by partition;
    - `from_pretrained` on the pretrained base: validates a local checkpoint before Transformers maps it, and loads
      `fusegen convert`'s fused layout zero-copy (fusegen/runtime/pretrained.py);
    - `is_custom_code() -> False` on the pretrained base of a Transformers model: otherwise the copies count as
      custom code, which loads and initialises differently (non-persistent buffers filled in `_init_weights`
      are skipped, model-type checkpoint conversions are not applied at the root);
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
        add(name, "from_pretrained", FROM_PRETRAINED_METHOD)
        if target.module.__name__.startswith("transformers."):
            add(name, "is_custom_code", IS_CUSTOM_CODE_METHOD)
        if getattr(cls, "_can_set_experts_implementation", lambda: False)():
            add(name, "_can_set_experts_implementation", CAN_SET_EXPERTS_METHOD)


def _base_models(model: nn.Module, emitted: dict) -> list[str]:
    """Emitted `PreTrainedModel` classes nested in the causal LM (the base models)."""
    from transformers import PreTrainedModel

    names = {type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel) and m is not model}
    return sorted(names & set(emitted))


def _use(used: dict[str, tuple[ModuleType | None, str]], name: str, item) -> None:
    """Record that `item`'s class reads the global `name` from its module.

    Two modules may bind one name to different objects (each model module has
    its own `eager_attention_forward`); the later one is then imported under
    a prefixed alias and its class's references renamed to it.
    """
    module = item.module
    previous = used.setdefault(name, (module, name))[0]
    if previous is module or getattr(previous, name, None) is getattr(module, name, None):
        return
    alias = f"{module.__name__.rpartition('.')[2].removeprefix('modeling_')}_{name}"
    for node in ast.walk(item.classdef):
        if isinstance(node, ast.Name) and node.id == name:
            node.id = alias
    used[alias] = (module, name)


def _unreachable(outcomes: list[ClassOutcome], target: Target, stray: set[str]) -> list[ClassOutcome]:
    """The outcomes with the fusions of `stray` classes turned into refusals: the causal LM never builds them.

    This happens when a model constructs a submodule indirectly: through
    `AutoModel.from_config(config.text_config)`, or by looking its class up
    in a module-level table (`ATTENTION_CLASSES[config.attention_type]`).
    """
    reason = (
        f"{target.causal_lm.__name__} does not construct this class by name (it goes through a class table or "
        "AutoModel.from_config), so a fused copy would never be used"
    )
    return [
        (
            ClassOutcome(
                outcome.class_name,
                [],
                outcome.refused + [Refusal(plan.projections, "unreachable", reason) for plan in outcome.fused],
                outcome.trace_error,
            )
            if outcome.class_name in stray
            else outcome
        )
        for outcome in outcomes
    ]


def _stacked_mapping(plans: list[FusionPlan]) -> dict[str, list[tuple]]:
    """`{merged: [(projection, shard id), ...]}`; one meaning per merged name."""
    mapping: dict[str, list[tuple]] = {}
    for plan in plans:
        shards = [tuple(shard) for shard in plan.shards]
        if mapping.setdefault(plan.merged, shards) != shards:
            raise InputError(
                f"two classes merge different projections into {plan.merged}: {mapping[plan.merged]} vs {shards}"
            )
    return mapping


def _parent_names(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, set[str]]:
    """For each merged name, the attribute names under which its modules sit in the model."""
    merged_by_class = {o.class_name: [plan.merged for plan in o.fused] for o in outcomes if o.fused}
    found: dict[str, set[str]] = {}
    for path, module in model.named_modules():
        for merged in merged_by_class.get(type(module).__name__, []):
            found.setdefault(merged, set()).add(path.rpartition(".")[2])
    return found


def _parents(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, list[str]]:
    """Checkpoint scopes: `<parent>.<projection>` names feed each merged linear.

    Scoping by parent keeps a same-named projection of an unfused module
    elsewhere out of a merge. A module held directly in a `ModuleList` has an
    index for a parent; its projections are matched by bare name instead.
    """
    found = _parent_names(model, outcomes)
    return {merged: sorted(names) for merged, names in sorted(found.items()) if not any(n.isdigit() for n in names)}


def _vetoes(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, dict[str, str]]:
    """Fusions to refuse for reasons outside their class: `{class: {merged: reason}}`."""
    vetoes = checkpoint_conflicts(model, outcomes)
    for found in (prefused_checkpoints(model, outcomes), outside_references(model, outcomes)):
        for class_name, reasons in found.items():
            vetoes.setdefault(class_name, {}).update(reasons)
    return vetoes


def outside_references(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, dict[str, str]]:
    """Fusions whose projections other code reaches into (`module.q_proj` in `_init_weights`).

    The projection no longer exists after fusion, so such code would fail or
    silently skip it. Any `<expr>.<projection>` outside `self.` in the model's
    classes counts: a false alarm costs a fusion, a miss breaks loading.
    """
    names = {plan.merged: (o.class_name, plan.projections) for o in outcomes for plan in o.fused}
    if not names:
        return {}
    vetoes: dict[str, dict[str, str]] = {}
    classes = {
        cls
        for module in model.modules()
        for cls in type(module).__mro__
        if cls.__module__.startswith(("transformers.models.", type(model).__module__))
    }
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__name__)):
        try:
            classdef = astutil.parse_class(cls)
        except Refused:
            continue
        for node in ast.walk(classdef):
            if not isinstance(node, ast.Attribute) or astutil.self_attr(node):
                continue
            for merged, (class_name, projections) in names.items():
                if node.attr in projections:
                    vetoes.setdefault(class_name, {}).setdefault(
                        merged,
                        f"{cls.__name__} reads `{ast.unparse(node)}` (line {node.lineno}), which fusion removes",
                    )
    return vetoes


def prefused_checkpoints(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, dict[str, str]]:
    """Fusions whose projections the model's checkpoints already store merged.

    Transformers splits such a tensor on load (`query_key_value` -> q/k/v) with
    a conversion of its own, and applies at most one conversion per tensor, so
    ours would never see the pieces: refused, with the checkpoint's name.
    """
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    keys = [model.config.model_type] + [type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel)]
    splits = [
        (converter.source_patterns, converter.target_patterns)
        for key in dict.fromkeys(keys)
        for converter in get_checkpoint_conversion_mapping(key) or []
        if len(getattr(converter, "target_patterns", [])) > 1
    ]
    vetoes: dict[str, dict[str, str]] = {}
    for outcome in outcomes:
        for plan in outcome.fused:
            for sources, targets in splits:
                pieces = {
                    target.removesuffix(".weight").removesuffix(".bias").rpartition(".")[2] for target in targets
                }
                if pieces & set(plan.projections):
                    vetoes.setdefault(outcome.class_name, {}).setdefault(
                        plan.merged,
                        f"checkpoints store {', '.join(sources)} already merged (Transformers splits it into "
                        f"{', '.join(sorted(pieces))} on load)",
                    )
    return vetoes


def checkpoint_conflicts(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, dict[str, str]]:
    """Fusions whose checkpoint names an unfused module shares: `{class: {merged: reason}}`.

    A hybrid model may keep, at the same path (`layers.N.self_attn.q_proj`), a
    fused attention in some layers and an unfused one in others; the
    checkpoint cannot say which tensors to merge, so such a fusion is refused.
    """
    parents = _parents(model, outcomes)
    fused_classes = {o.class_name: o for o in outcomes if o.fused}
    conflicts: dict[str, dict[str, str]] = {}
    for path, module in model.named_modules():
        if type(module).__name__ in fused_classes:
            continue
        for outcome in fused_classes.values():
            for plan in outcome.fused:
                scoped = plan.merged not in parents or path.rpartition(".")[2] in parents[plan.merged]
                if scoped and any(isinstance(getattr(module, name, None), nn.Module) for name in plan.projections):
                    conflicts.setdefault(outcome.class_name, {}).setdefault(
                        plan.merged,
                        f"{path} ({type(module).__name__}) keeps unfused projections under the same checkpoint "
                        "names, so loading could not tell which tensors to merge",
                    )
    return conflicts


def _checkpoint_classes(model: nn.Module, target: Target, renames: dict[str, str]) -> list[str]:
    """Fused `PreTrainedModel` classes whose checkpoints need the stacked mapping.

    The base model class is enough: Transformers scopes a nested model's
    conversions to its prefix, and the causal LM nests it.
    """
    from transformers import PreTrainedModel

    names = []
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, PreTrainedModel) and module is not model and name in renames:
            names.append(renames[name])
    return sorted(set(names)) or [renames[target.causal_lm.__name__]]


def _tensor_parallel(model: nn.Module, plans: list[FusionPlan], parents: dict, classes: list[str]) -> dict:
    """Template data for tensor parallelism: the fused form of the config's `base_model_tp_plan` (or why there is
    none), and the base-model classes whose plans it replaces (see fusegen/runtime/tp.py)."""
    original = getattr(model.config, "base_model_tp_plan", None)
    plan, reason = fused_plan_from(original, _stacked_mapping(plans), parents)
    return {"tp_plan": repr(plan) if plan else None, "tp_reason": reason}
