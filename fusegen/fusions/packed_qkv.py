"""Fusion kind `packed_qkv`: an attention whose checkpoint already stores q, k and v as one packed linear gets that
linear as a `MergedColumnLinear` that declares the row order of its pieces.

Falcon's `query_key_value` and GPT-BigCode's `c_attn` are packed already: one GEMM, and the class's own forward
splits its output. Nothing is left to merge. What no tensor name tells, and every runtime path that cuts the weight
needs, is which rows are q, which k and which v; that depends on the config:

- Falcon, `new_decoder_architecture`: per kv group, its query heads, then its key head, then its value head
  (`_split_heads` views the output as `(kv groups, heads per group + 2, head_dim)`): `RowLayout.grouped(kv heads,
  [heads per group * head_dim, head_dim, head_dim])`;
- Falcon classic and GPT-BigCode multi-head: per head q, k, v (`view(heads, 3 * head_dim)`):
  `RowLayout.grouped(heads, [head_dim] * 3)`;
- Falcon and GPT-BigCode multi-query: all query heads, then the key head, then the value head: contiguous.

What the kind rewrites, and why only that: the packed linear's constructor in `__init__`, nothing else. The
generated class computes

    if config.new_decoder_architecture:
        query_key_value_layout = RowLayout.grouped(config.num_kv_heads, [...])
    elif config.multi_query:
        query_key_value_layout = RowLayout.contiguous([...])
    else:
        query_key_value_layout = RowLayout.grouped(self.num_heads, [...])
    self.query_key_value = MergedColumnLinear(
        self.hidden_size, query_key_value_layout.sizes, bias=config.bias, layout=query_key_value_layout
    )

- The forward is kept as written: it already is one GEMM plus the class's own split, which reads the rows exactly
  as declared (the tests check each declaration against `_split_heads` and GPT-BigCode's inline split, by
  execution, for every variant). Rewriting it to `layout.split` would add a gather and prove nothing more.
- The attribute keeps its name, so the checkpoint's tensor (`query_key_value.weight`, in its own packed row order)
  loads and saves as it is, into and out of the original class: the generated file has no stacked mapping for it,
  and the runtime treats a layout-declaring merged linear that no mapping splits as stored whole
  (`fusegen.runtime.merged.stored_packed`): fusegen's loader and saver, quantization and PEFT take it as one
  linear, as the original class has it; TP (`fusegen.runtime.tp.apply_packed_tp_plan`) shards it by the declared
  layout (whole kv groups or heads per process); and code that wants canonical q/k/v (a split-layout engine,
  `MergedColumnSplit`, `linear_pieces`) asks the layout (`fusegen.runtime.layout.layout_of`).
- The declarations are one table (`PACKED`, source text): `declared_layout` evaluates it on a live module (what the
  build checks against the packed linear's size) and the rewrite emits it, so the two cannot disagree.

Soundness of the rewrite: `MergedColumnLinear` with every piece biased is `nn.Linear` (forward `F.linear`), of the
same shape and parameters; the layout changes no number, only what the runtime knows. Falcon's `FalconLinear`
computes `input @ weight.T (+ bias)`, which `F.linear` computes as one GEMM with the bias added: the same sums
(bit for bit in 150 of 150 random cases on the CPU this was written on, a probe, not a test); the build's
validation and `tests/test_packed_qkv.py` hold the logits to the project tolerance. The layout expressions are
evaluated at the packed constructor's place: every `self.` attribute they read is assigned before it (lexically)
and never after in `__init__`, and the names they read are not rebound (`packed-layout-inputs`), so they mean there
what they mean on the finished module, where the tests check them.
"""

from __future__ import annotations

import ast
import copy
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refused
from fusegen.core.rules import rules as section_rules
from fusegen.core.traced import Trace
from fusegen.fusions import register
from fusegen.fusions.base import Kind
from fusegen.fusions.merged.lookup import resolve_dotted
from fusegen.runtime.layout import RowLayout
from fusegen.runtime.linear import MergedColumnLinear

KIND = "packed_qkv"
ROW_LAYOUT = "RowLayout"
MERGED_LINEAR = "MergedColumnLinear"


@dataclass(frozen=True)
class PackedClass:
    """How one Transformers attention class packs q/k/v, as source text the kind evaluates and emits."""

    packed: str
    """The packed linear's attribute."""
    out_features: str
    """The `out_features` argument of the constructor call to rewrite, as written (picks the self-attention one)."""
    layouts: tuple[tuple[str | None, str], ...]
    """(condition, `RowLayout` expression): the first whose condition holds; the last has none."""
    applies: str = "True"
    """When an instance holds the packed q/k/v at all (GPT-BigCode's cross-attention packs only k/v)."""
    linear_classes: tuple[str, ...] = ()
    """`nn.Linear` subclasses of the class's own module accepted for the packed linear (see the module docstring)."""


_PER_HEAD = "RowLayout.grouped(self.num_heads, [self.head_dim, self.head_dim, self.head_dim])"
PACKED = {
    "transformers.models.falcon.modeling_falcon.FalconAttention": PackedClass(
        "query_key_value",
        "qkv_out_dim",
        (
            (
                "config.new_decoder_architecture",
                (
                    "RowLayout.grouped(config.num_kv_heads, [config.num_attention_heads // config.num_kv_heads"
                    " * self.head_dim, self.head_dim, self.head_dim])"
                ),
            ),
            ("config.multi_query", "RowLayout.contiguous([self.hidden_size, self.head_dim, self.head_dim])"),
            (None, _PER_HEAD),
        ),
        linear_classes=("FalconLinear",),
    ),
    "transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention": PackedClass(
        "c_attn",
        "self.embed_dim + 2 * self.kv_dim",
        (("self.multi_query", "RowLayout.contiguous([self.embed_dim, self.kv_dim, self.kv_dim])"), (None, _PER_HEAD)),
        applies="not self.is_cross_attention",
    ),
}


def class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class PackedPlan(FusionPlan):
    layout: RowLayout | None = field(default=None, compare=True)
    """The packed linear's row order in the traced instance (`merged` names the linear: `query_key_value`)."""

    def describe(self) -> str:
        return f"{self.merged}: packed q/k/v, row layout declared per config ({self.kind})"


def _evaluate(expression: str, module: nn.Module) -> object:
    scope = {"self": module, "config": getattr(module, "config", None), ROW_LAYOUT: RowLayout}
    return eval(compile(expression, "<packed_qkv>", "eval"), scope)


def declared_layout(module: nn.Module) -> tuple[str, RowLayout] | None:
    """(packed linear's attribute, its row layout) for an attention of a class in `PACKED`, else None."""
    entry = PACKED.get(class_key(type(module)))
    if entry is None or not _evaluate(entry.applies, module):
        return None
    for condition, layout in entry.layouts:
        if condition is None or _evaluate(condition, module):
            return entry.packed, _evaluate(layout, module)
    raise AssertionError("the last layout of a PACKED entry has no condition")


def merged_linear(module: nn.Module, plan: PackedPlan) -> MergedColumnLinear:
    """The `MergedColumnLinear` the generated class holds instead of `module`'s packed linear, sharing its
    parameters (not copied), with the declared layout."""
    packed = getattr(module, plan.merged)
    merged = MergedColumnLinear(
        packed.in_features, plan.layout.sizes, bias=packed.bias is not None, device="meta", layout=plan.layout
    )
    merged.weight, merged.bias = packed.weight, packed.bias
    return merged


def split_canonical(module: nn.Module, plan: PackedPlan) -> dict[str, torch.Tensor]:
    """The packed weight as canonical `q`, `k`, `v` weights (what a split-layout checkpoint or engine expects)."""
    return dict(zip("qkv", plan.layout.split(getattr(module, plan.merged).weight.detach())))


_LINEAR_SIGNATURE = inspect.signature(nn.Linear.__init__)


@register
class PackedQKVKind(Kind):
    """Declares the row layout of an already packed q/k/v linear (see the module docstring)."""

    name = KIND
    priority = 90
    runtime_names = frozenset({MERGED_LINEAR, ROW_LAYOUT})
    summary = "packed q/k/v linear built as a MergedColumnLinear declaring its row layout"
    rules = section_rules(
        "Packed q/k/v declares its row layout",
        ("packed-linear-subclass", "the packed linear is neither nn.Linear nor a subclass the kind knows"),
        ("packed-size", "the packed linear's rows are not the declared layout's"),
        ("packed-source-changed", "`__init__` has not exactly one packed constructor written as the kind expects"),
        ("packed-layout-inputs", "what the layout reads is not settled where the packed linear is built"),
    )

    def candidate(self, module: nn.Module) -> bool:
        return class_key(type(module)) in PACKED

    def match(self, trace: Trace, module: nn.Module) -> list[FusionPlan]:
        found = declared_layout(module)
        if found is None:
            return []
        attribute, layout = found
        return [PackedPlan(KIND, attribute, layout=layout)]

    def check(self, module: nn.Module, plan: FusionPlan) -> None:
        """The packed child must be `nn.Linear` (or a known subclass of the class's module) of the declared size."""
        packed = getattr(module, plan.merged, None)
        known = PACKED[class_key(type(module))].linear_classes
        same_module = type(packed).__module__ == type(module).__module__
        if type(packed) is not nn.Linear and not (type(packed).__name__ in known and same_module):
            raise Refused("packed-linear-subclass", f"{plan.merged} is a {type(packed).__name__}, not nn.Linear")
        if packed.out_features != sum(plan.layout.sizes):
            raise Refused(
                "packed-size", f"{plan.merged} has {packed.out_features} rows, the layout {sum(plan.layout.sizes)}"
            )

    def rewrite(
        self, classdef: ast.ClassDef, plan: FusionPlan, module: nn.Module, namespace: dict, fused: list[FusionPlan]
    ) -> None:
        entry = PACKED[class_key(type(module))]
        init = astutil.method(classdef, "__init__")
        assign = _packed_assignment(init, entry)
        call = assign.value
        allowed = {nn.Linear, *(namespace.get(name) for name in entry.linear_classes)}
        if resolve_dotted(call.func, namespace) not in allowed:
            raise Refused("packed-linear-subclass", f"`{ast.unparse(call.func)}` is not a linear the kind knows", call)
        try:
            bound = _LINEAR_SIGNATURE.bind(None, *call.args, **{kw.arg: kw.value for kw in call.keywords})
        except TypeError as exc:
            raise Refused("packed-source-changed", f"`{ast.unparse(call)}`: {exc}", call) from exc
        if set(bound.arguments) - {"self", "in_features", "out_features", "bias"}:
            raise Refused("packed-source-changed", f"`{ast.unparse(call)}` passes more than sizes and bias", call)
        expressions = [ast.parse(text, mode="eval").body for _, text in entry.layouts]
        expressions += [ast.parse(text, mode="eval").body for text, _ in entry.layouts if text is not None]
        _check_layout_inputs(init, assign, expressions)
        local = astutil.fresh_name(f"{entry.packed}_layout", astutil.all_names(init))
        built = _layout_statement(entry, local)
        constructor = ast.parse(f"self.{entry.packed} = {MERGED_LINEAR}(__in__, {local}.sizes, layout={local})").body[
            0
        ]
        constructor.value.args[0] = copy.deepcopy(bound.arguments["in_features"])
        if "bias" in bound.arguments:
            constructor.value.keywords.insert(0, ast.keyword("bias", copy.deepcopy(bound.arguments["bias"])))
        block, index = astutil.block_path(init.body, assign)[-1]
        block[index : index + 1] = [
            ast.fix_missing_locations(ast.copy_location(s, assign)) for s in (built, constructor)
        ]


def _packed_assignment(init: ast.FunctionDef | None, entry: PackedClass) -> ast.Assign:
    """The one `self.<packed> = <linear>(in, <out_features>, ...)` of `__init__` (the self-attention one)."""
    found = [
        node
        for node in (astutil.walk(init) if init is not None else ())
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and astutil.self_attr(node.targets[0], entry.packed)
        and isinstance(node.value, ast.Call) and len(node.value.args) >= 2
        and ast.unparse(node.value.args[1]) == entry.out_features
    ]  # fmt: skip
    if len(found) != 1:
        raise Refused(
            "packed-source-changed",
            f"__init__ has {len(found)} constructions of self.{entry.packed} with out_features `{entry.out_features}`",
        )
    return found[0]


def _check_layout_inputs(init: ast.FunctionDef, assign: ast.Assign, expressions: list[ast.expr]) -> None:
    """Refuse unless every `self.` attribute the layout reads is assigned before the packed constructor and never
    after it, and no name it reads (`config`) is rebound in `__init__` (see the module docstring)."""
    attrs = {node.attr for expr in expressions for node in astutil.walk(expr) if astutil.self_attr(node)}
    names = {name for expr in expressions for name in astutil.loaded_names(expr)} - {"self", ROW_LAYOUT}
    order = list(_preorder(init))  # source order, whatever line numbers edited statements carry
    position = {id(node): index for index, node in enumerate(order)}
    after = position[id(assign)]
    stores = [
        node
        for node in order
        if isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del)) and node is not assign.targets[0]
    ]
    for node in stores:
        if isinstance(node, ast.Name) and node.id in names:
            raise Refused("packed-layout-inputs", f"`{node.id}` is rebound in __init__", node)
        if astutil.self_attr(node) and node.attr in attrs and position[id(node)] > after:
            raise Refused("packed-layout-inputs", f"`self.{node.attr}` changes after the packed constructor", node)
    assigned = {node.attr for node in stores if astutil.self_attr(node) and position[id(node)] < after}
    if attrs - assigned:
        missing = ", ".join(f"self.{name}" for name in sorted(attrs - assigned))
        raise Refused("packed-layout-inputs", f"{missing} is not assigned before the packed constructor", assign)


def _preorder(node: ast.AST):
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _preorder(child)


def _layout_statement(entry: PackedClass, local: str) -> ast.stmt:
    """`<local> = <layout>`, under an `if`/`elif`/`else` over the entry's conditions when it has several."""
    statement = None
    for condition, layout in reversed(entry.layouts):
        body = ast.parse(f"{local} = {layout}").body
        statement = body[0] if statement is None else ast.If(ast.parse(condition, mode="eval").body, body, [statement])
    return statement
