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
from fusegen.compiler import astutil
from fusegen.compiler.analyse import analyse_class
from fusegen.errors import InputError
from fusegen.compiler.imports import global_names, import_lines
from fusegen.compiler.instantiate import candidates, instantiate
from fusegen.compiler.plan import ClassOutcome, FusionPlan, Refusal, Refused
from fusegen.compiler.propagate import (
    classes_to_emit,
    constructed_classes,
    fused_name,
    fused_names,
    rename_classes,
    unreachable_reasons,
)
from fusegen.compiler.render import render
from fusegen.compiler.resolve import Target, resolve
from fusegen.compiler.rewrite_init import MERGED_LINEAR
from fusegen.compiler.splice import class_text
from fusegen.runtime.tp import fused_plan_from
from fusegen.compiler.trace import record_inputs

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
    validation: object | None = None
    """The `fusegen.compiler.validate.Validation` of the text, when it was validated."""


def analyse(name: str, refused: dict[str, dict[str, str]] | None = None) -> Analysis:
    """Stages 1-5: every candidate class's outcome, and the rewritten classes.

    `refused`: `{class: {merged: reason}}` fusions to refuse whatever the analysis finds (validation's verdicts).
    """
    target = resolve(name)
    model = instantiate(target)
    found = candidates(model)
    refused = refused or {}
    inputs = record_inputs(model, list(found.values()))

    def run(cls, instance, vetoes=None):
        return analyse_class(
            cls,
            instance,
            vars(sys.modules[cls.__module__]),
            {**refused.get(cls.__name__, {}), **(vetoes or {})},
            inputs.get(id(instance)),
        )

    results = {cls: run(cls, instance) for cls, instance in found.items()}
    vetoes = _vetoes(model, [outcome for outcome, _ in results.values()])
    while vetoes:
        for cls, instance in found.items():
            if cls.__name__ in vetoes:
                results[cls] = run(cls, instance, vetoes[cls.__name__])
        vetoes = _vetoes(model, [outcome for outcome, _ in results.values()])
    outcomes = [outcome for outcome, _ in results.values()]
    rewritten = {cls: classdef for cls, (_, classdef) in results.items() if classdef is not None}
    outcomes, rewritten = _reachable(target, model, outcomes, rewritten)
    return Analysis(target, model, outcomes, rewritten)


def _reachable(target: Target, model: nn.Module, outcomes: list[ClassOutcome], rewritten: dict) -> tuple[list, dict]:
    """Outcomes and rewritten classes with the fusions the causal LM never builds refused (so `report` shows them)."""
    if not rewritten:
        return outcomes, rewritten
    emitted = classes_to_emit(target.module, model, rewritten)
    stray = {cls.__name__ for cls in rewritten} - constructed_classes(emitted, target.causal_lm.__name__)
    if not stray:
        return outcomes, rewritten
    kept = {cls: classdef for cls, classdef in rewritten.items() if cls.__name__ not in stray}
    return _unreachable(outcomes, target, stray, model), kept


def build(name: str, validate: bool = True, refused: dict[str, dict[str, str]] | None = None) -> BuildResult:
    """The whole pipeline: the generated module's text for target `name`.

    `validate=False` skips translation validation (`fusegen.compiler.validate`): for tests of the analysis itself, which
    must see what the analysis alone would emit. `refused`: fusions to refuse up front (see `analyse`).
    """
    analysis = analyse(name, refused)
    target, model, outcomes, rewritten = analysis.target, analysis.model, analysis.outcomes, analysis.rewritten
    if not rewritten:
        return BuildResult(target, outcomes, None)
    emitted = classes_to_emit(target.module, model, rewritten)  # `analyse` already refused what is unreachable
    renames = fused_names(emitted)
    _add_methods(emitted, target, model)
    used: dict[str, tuple[ModuleType | None, str]] = {}
    for item in emitted.values():
        rename_classes(item.classdef, renames)
        for used_name in sorted(global_names(ast.unparse(item.classdef)) - set(renames.values()) - TEMPLATE_NAMES):
            _use(used, used_name, item)
    used[REGISTER] = used[STREAM] = used[REGISTER_AUTO] = (None, "")
    if CHECK in used:
        used[CHECK] = (None, "")
    sources = [class_text(name, item.classdef, item.module) for name, item in emitted.items()]
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
        imports=import_lines(used, {MERGED_LINEAR, REGISTER, STREAM, REGISTER_AUTO, CHECK}),
        stacked_params_mapping=repr(_stacked_mapping(plans)),
        packed_modules_mapping=repr({plan.merged: list(plan.projections) for plan in plans}),
        classes=sources,
        checkpoint_classes=repr(_checkpoint_classes(model, target, renames)),
        fused_causal_lm=renames[target.causal_lm.__name__],
        parents=repr(_parents(model, outcomes)),
        exports=repr(sorted(renames.values())),
        **_tensor_parallel(model, plans, _parents(model, outcomes), _checkpoint_classes(model, target, renames)),
    )
    result = BuildResult(target, outcomes, text, list(rewritten))
    return _validated(name, result, refused) if validate else result


def _validated(name: str, result: BuildResult, refused: dict | None) -> BuildResult:
    """`result` if its text computes what the original computes (`fusegen.compiler.validate`); else the build again with
    the fusions of one class refused (rule `validation-mismatch`, naming the config and the figure), trying each
    fused class in turn until the rest validates; else no text and every fusion refused.

    A retry is itself validated, so what is written has always passed; only a failing build pays for the retries.
    """
    from fusegen.compiler import validate

    try:
        report = validate.validate(result.target, result.text)
    except Exception as error:  # noqa: BLE001 - an unvalidated file is not written; say why instead of crashing
        report = validate.Validation([validate.Check("tiny", "mismatch", f"validation failed: {error!r}"[:500])])
    result.validation = report
    mismatch = report.mismatch
    if mismatch is None:
        return result
    reason = validate.refusal_reason(mismatch)
    if not refused:
        for outcome in (o for o in result.outcomes if o.fused):
            retry = build(name, refused={outcome.class_name: {plan.merged: reason for plan in outcome.fused}})
            if retry.text is not None:
                return retry
    outcomes = [
        ClassOutcome(
            outcome.class_name,
            [],
            outcome.refused + [Refusal(plan.projections, validate.RULE, reason) for plan in outcome.fused],
            outcome.trace_error,
        )
        for outcome in result.outcomes
    ]
    return BuildResult(result.target, outcomes, None, [], report)


def _add_methods(emitted: dict, target: Target, model: nn.Module) -> None:
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


def _unreachable(
    outcomes: list[ClassOutcome], target: Target, stray: set[str], model: nn.Module
) -> list[ClassOutcome]:
    """The outcomes with the fusions of `stray` classes turned into refusals: the causal LM never builds them.

    This happens when a model constructs a submodule indirectly, through
    `AutoModel.from_config(config.text_config)` (module-level class tables are
    re-emitted, see `fusegen.compiler.propagate.ClassTable`); each reason names the call.
    """
    reasons = unreachable_reasons(target.module, model, stray, target.causal_lm.__name__)
    return [
        (
            ClassOutcome(
                outcome.class_name,
                [],
                outcome.refused
                + [Refusal(plan.projections, "unreachable", reasons[outcome.class_name]) for plan in outcome.fused],
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


def _parents(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, list[str]]:
    """Checkpoint scopes: `<parent>.<projection>` names feed each merged linear, for every config of the model.

    Scoping by parent keeps a same-named projection of an unfused module
    elsewhere out of a merge. The parents are read off the source, not off the
    one instantiated model: every attribute name under which any class of the
    model constructs a class holding the merged linear (`self.mlp =
    DeepseekV2Moe(config) if ... else DeepseekV2MLP(config)` gives `mlp` even
    when the default config builds no dense layer). Only classes the model is
    built from can hold a fused class: they are the ones fusegen emits with
    their references renamed, and a class it does not emit constructs the
    original, unfused class. A holder constructed any other way (in a
    `ModuleList`, passed as a value, from a table) gets no scope at all: its
    projections are matched by bare name. A scope too wide only costs the
    pattern a match that Transformers undoes (a renamed key the model lacks
    falls back to the checkpoint's own name); one too narrow would leave a
    merged parameter unfilled, which loading then refuses (see
    `fusegen.runtime.check_loading`).
    """
    found = _construction_sites(model, outcomes)
    return {merged: sorted(names) for merged, names in sorted(found.items()) if "" not in names}


def _construction_sites(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, set[str]]:
    """For each merged name, the attributes its holders are assigned to; "" marks a construction of another form."""
    from fusegen.compiler.propagate import _model_classes

    classes = _model_classes(sys.modules[type(model).__module__], model)
    merged_by_class = {o.class_name: [plan.merged for plan in o.fused] for o in outcomes if o.fused}
    holders: dict[str, list[str]] = {}
    for cls in classes:
        for base in cls.__mro__:
            holders.setdefault(cls.__name__, []).extend(merged_by_class.get(base.__name__, []))
    holders = {name: merged for name, merged in holders.items() if merged}
    found: dict[str, set[str]] = {}
    tables = _class_tables(classes, set(holders))
    for cls in classes:
        try:
            classdef = astutil.parse_class(cls)
        except Refused:
            continue
        for holder, attribute in _holder_references(classdef, set(holders), tables):
            for merged in holders[holder]:
                found.setdefault(merged, set()).add(attribute)
    return found


def _class_tables(classes, holders: set[str]) -> dict[str, set[str]]:
    """Module-level names whose statements name holder classes (`CLASSES = {"a": Holder}`): name -> holders.

    A holder reached through such a name is constructed wherever the name is used, so each use counts as a
    reference to every holder it names (see `_holder_references`).
    """
    tables: dict[str, set[str]] = {}
    for filename in sorted({inspect.getsourcefile(cls) or "" for cls in classes} - {""}):
        for stmt in astutil._module_tree(filename).body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                named = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name) and n.id in holders}
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    if isinstance(target, ast.Name) and named:
                        tables.setdefault(target.id, set()).update(named)
    return tables


def _holder_references(
    classdef: ast.ClassDef, holders: set[str], tables: dict[str, set[str]] | None = None
) -> list[tuple[str, str]]:
    """(holder, attribute) per reference to a holder class in the methods of `classdef`.

    `self.<attribute> = Holder(...)`, also as a branch of a conditional
    expression, gives the attribute; so does `self.<attribute> = TABLE[key](...)`
    for every holder a module-level class table names. Every other reference
    gives "" (a type check `isinstance(m, Holder)` and `super(Holder, self)`
    construct nothing and are skipped).
    """
    tables = tables or {}
    direct: dict[int, str] = {}
    skipped: set[int] = set()
    functions = [stmt for stmt in classdef.body if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in (n for function in functions for n in ast.walk(function)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and astutil.self_attr(targets[0]) and node.value is not None:
                for call in _direct_calls(node.value):
                    table = call.func.value if isinstance(call.func, ast.Subscript) else call.func
                    direct[id(table)] = targets[0].attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass"):
                skipped.update(id(n) for argument in node.args[1:] for n in ast.walk(argument))
            elif node.func.id == "super" and node.args:
                skipped.add(id(node.args[0]))
    references = []
    for node in (n for function in functions for n in ast.walk(function)):
        if isinstance(node, ast.Name) and id(node) not in skipped:
            for holder in {node.id} & holders | tables.get(node.id, set()):
                references.append((holder, direct.get(id(node), "")))
    return references


def _direct_calls(expression: ast.expr) -> list[ast.Call]:
    """The calls whose result `expression` is: itself, or the branches of `a if c else b` / `a or b`."""
    if isinstance(expression, ast.Call):
        return [expression]
    if isinstance(expression, ast.IfExp):
        return _direct_calls(expression.body) + _direct_calls(expression.orelse)
    if isinstance(expression, ast.BoolOp):
        return [call for value in expression.values for call in _direct_calls(value)]
    return []


def _vetoes(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, dict[str, str]]:
    """Fusions to refuse for reasons outside their class: `{class: {merged: reason}}`."""
    vetoes = checkpoint_conflicts(model, outcomes)
    for found in (
        prefused_checkpoints(model, outcomes),
        outside_references(model, outcomes),
        merged_names_reused(outcomes),
    ):
        for class_name, reasons in found.items():
            vetoes.setdefault(class_name, {}).update(reasons)
    return vetoes


def merged_names_reused(outcomes: list[ClassOutcome]) -> dict[str, dict[str, str]]:
    """Fusions one of whose projections has the name another fusion gives its merged linear.

    MiniMax's lightning attention already holds a packed `qkv_proj`, which its
    full attention layers' q/k/v merge into: a checkpoint tensor `qkv_proj`
    would then be a piece in one layer and a merged tensor in the other. The
    fusion that consumes the name is refused; the one that produces it stays.
    """
    merged = {plan.merged: outcome.class_name for outcome in outcomes for plan in outcome.fused}
    vetoes: dict[str, dict[str, str]] = {}
    for outcome in outcomes:
        for plan in outcome.fused:
            for name in plan.projections:
                if name in merged:
                    vetoes.setdefault(outcome.class_name, {}).setdefault(
                        plan.merged,
                        f"{name} is also the merged name of {merged[name]}'s fusion, so a checkpoint tensor "
                        f"{name} could be either a piece or a merged tensor",
                    )
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

    With the parents read off the source (`_parents`), the scopes are every
    attribute a holder is built under, so this sees at least the paths it saw
    before. What it guards is no longer a silent wrong load: `from_pretrained`
    falls back to a tensor's own name when the merged name is absent at that
    path, `load_checkpoint` maps by the live model's merged modules, and what
    still goes unfilled raises (`fusegen.runtime.check_loading`). It guards the
    TP plan, whose rules are path patterns (`layers.*.self_attn.q_proj`) that
    cannot tell a fused layer from an unfused one at the same path. It checks
    the instantiated model only: an unfused module at such a path in another
    config still loads exactly, but under tensor parallelism its pieces would
    match no rule (left replicated); that gap is not closed here.
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
