"""Stage 4: find groups of sibling linears that read the same value.

Works on the traced graph only; whether the source admits the rewrite is the
rewrite stages' business. A group becomes a `FusionPlan`: QKV when the names
are a query/key/value triplet (rows ordered q, k, v), GLU when one output goes
through an activation and is multiplied by the other (rows ordered gate, up),
otherwise a generic merged-column group in call order.
"""

from __future__ import annotations

import operator
import os

import torch
from torch import fx, nn

from fusegen.compiler.plan import FusionPlan

_QKV_STEMS = (("q", "k", "v"), ("query", "key", "value"))
_CASTS = {"to", "float", "half", "bfloat16", "type_as", "contiguous"}
_CONVENTIONAL_NAMES = {frozenset({"q_a_proj", "kv_a_proj_with_mqa"}): "fused_qkv_a_proj"}
"""Merged names the serving engines, their loaders and quantization configs already use for a group."""


def plain_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """Direct children that are exactly `nn.Linear`.

    Subclasses are left alone: a quantized or LoRA linear overrides `forward`,
    so concatenating its weights would not reproduce it.
    """
    return {name: child for name, child in module.named_children() if type(child) is nn.Linear}


def linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    """Direct children that are `nn.Linear` or a subclass of it.

    Groups are found among all of them, so that a subclass, a hooked or a
    parametrized linear in a group is refused by name (`safety.check_projections`)
    instead of silently left out.
    """
    return {name: child for name, child in module.named_children() if isinstance(child, nn.Linear)}


def linear_input(node: fx.Node) -> object:
    """The one input of a linear's call node: `p(x)` or `p(input=x)`, else None."""
    if len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if not node.args and set(node.kwargs) == {"input"}:
        return node.kwargs["input"]
    return None


def find_groups(graph: fx.Graph, module: nn.Module) -> list[FusionPlan]:
    """Every group of >= 2 linears whose (first) call reads the same input node."""
    linears = linear_children(module)
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in linears:
            calls.setdefault(node.target, []).append(node)
    by_input: dict[fx.Node, list[fx.Node]] = {}
    for nodes in calls.values():
        # A linear called more than once joins the group of its first call, so
        # the rewrite stage refuses the group and reports why.
        node = nodes[0]
        if isinstance(linear_input(node), fx.Node):
            by_input.setdefault(linear_input(node), []).append(node)
    plans = []
    for nodes in by_input.values():
        if len(nodes) >= 2 and _same_input_width(nodes, linears):
            plans.extend(_split_group(nodes))
    return sorted(plans, key=lambda plan: plan.projections)


def _split_group(nodes: list[fx.Node]) -> list[FusionPlan]:
    """A same-input group as plans: a q/k/v triplet, GLU pairs, then the rest.

    Attention and MLP projections may share an input in one class (parallel
    blocks); keeping them apart keeps the merged names meaningful and lets a
    tensor-parallel runtime shard each merged linear its own way.
    """
    plans = []
    names = [str(node.target) for node in nodes]
    qkv = _find_qkv(names)
    if qkv is not None:
        plans.append(FusionPlan("qkv", merged_name(qkv), tuple(zip(qkv, ("q", "k", "v")))))
        nodes = [node for node in nodes if node.target not in qkv]
    for gate, up in _find_glu_pairs(nodes):
        plans.append(FusionPlan("glu", merged_name([gate, up]), ((gate, 0), (up, 1))))
        nodes = [node for node in nodes if node.target not in (gate, up)]
    if len(nodes) >= 2:
        rest = [str(node.target) for node in nodes]
        plans.append(FusionPlan("merged_column", merged_name(rest), tuple((n, i) for i, n in enumerate(rest))))
    return plans


def _same_input_width(nodes: list[fx.Node], linears: dict[str, nn.Linear]) -> bool:
    return len({linears[node.target].in_features for node in nodes}) == 1


def merged_name(names: list[str]) -> str:
    """`q_proj, k_proj, v_proj` -> `qkv_proj`; `gate_proj, up_proj` -> `gate_up_proj`.

    The shared prefix and suffix are kept and the distinct stems joined, with
    no separator when every stem is one letter, as the serving engines name them.
    A group the engines name otherwise gets their name: MLA's `q_a_proj` and
    `kv_a_proj_with_mqa` -> `fused_qkv_a_proj`.
    """
    if frozenset(names) in _CONVENTIONAL_NAMES:
        return _CONVENTIONAL_NAMES[frozenset(names)]
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([name[::-1] for name in names])[::-1]
    suffix = suffix[suffix.find("_") :] if "_" in suffix else ""
    stems = [name[len(prefix) : len(name) - len(suffix)] for name in names]
    if not all(len(stem) == 1 for stem in stems):
        # Keep only whole words of the prefix: `query`/`quux` share `qu`, not a word.
        prefix = prefix[: prefix.rfind("_") + 1] if "_" in prefix else ""
        stems = [name[len(prefix) : len(name) - len(suffix)] for name in names]
    if not all(stems):
        return "_".join(names)
    joiner = "" if all(len(stem) == 1 for stem in stems) else "_"
    return prefix + joiner.join(stems) + suffix


def _find_qkv(names: list[str]) -> list[str] | None:
    """Three of `names` forming a q/k/v triplet (same affixes), ordered q, k, v."""
    for stems in _QKV_STEMS:
        for name in names:
            for stem_position in _find_all(name, stems[0]):
                prefix, suffix = name[:stem_position], name[stem_position + len(stems[0]) :]
                ordered = [prefix + stem + suffix for stem in stems]
                if all(candidate in names for candidate in ordered):
                    return ordered
    return None


def _find_all(text: str, part: str) -> list[int]:
    return [i for i in range(len(text)) if text.startswith(part, i)]


def _find_glu_pairs(nodes: list[fx.Node]) -> list[tuple[str, str]]:
    """(gate, up) pairs with `act(gate(x)) * up(x)`, in either operand order."""
    pairs: list[tuple[str, str]] = []
    for gate in nodes:
        for activated in gate.users:
            if activated.op not in ("call_module", "call_function", "call_method"):
                continue
            for product in activated.users:
                if not _is_mul(product):
                    continue
                for operand in product.args:
                    up = _peel(operand)
                    taken = {name for pair in pairs for name in pair}
                    if up in nodes and up is not gate and not {gate.target, up.target} & taken:
                        pairs.append((str(gate.target), str(up.target)))
    return pairs


def _is_mul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.mul, torch.mul)) or (
        node.op == "call_method" and node.target == "mul"
    )


def _peel(node: object) -> object:
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _CASTS:
        node = node.args[0]
    return node
