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

from fusegen.plan import FusionPlan

_QKV_STEMS = (("q", "k", "v"), ("query", "key", "value"))
_CASTS = {"to", "float", "half", "bfloat16", "type_as", "contiguous"}


def plain_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """Direct children that are exactly `nn.Linear`.

    Subclasses are left alone: a quantized or LoRA linear overrides `forward`,
    so concatenating its weights would not reproduce it.
    """
    return {name: child for name, child in module.named_children() if type(child) is nn.Linear}


def find_groups(graph: fx.Graph, module: nn.Module) -> list[FusionPlan]:
    """Every group of >= 2 plain linears called once each on the same input node."""
    linears = plain_linears(module)
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in linears:
            calls.setdefault(node.target, []).append(node)
    by_input: dict[fx.Node, list[fx.Node]] = {}
    for nodes in calls.values():
        node = nodes[0]
        if len(nodes) == 1 and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node):
            by_input.setdefault(node.args[0], []).append(node)
    plans = []
    for nodes in by_input.values():
        if len(nodes) >= 2 and _same_input_width(nodes, linears):
            plans.append(_plan(nodes))
    return sorted(plans, key=lambda plan: plan.projections)


def _same_input_width(nodes: list[fx.Node], linears: dict[str, nn.Linear]) -> bool:
    return len({linears[node.target].in_features for node in nodes}) == 1


def _plan(nodes: list[fx.Node]) -> FusionPlan:
    names = [str(node.target) for node in nodes]
    qkv = _qkv_order(names)
    if qkv is not None:
        return FusionPlan("qkv", merged_name(qkv), tuple(zip(qkv, ("q", "k", "v"))))
    glu = _glu_order(nodes)
    if glu is not None:
        return FusionPlan("glu", merged_name(glu), tuple((name, index) for index, name in enumerate(glu)))
    return FusionPlan("merged_column", merged_name(names), tuple((name, index) for index, name in enumerate(names)))


def merged_name(names: list[str]) -> str:
    """`q_proj, k_proj, v_proj` -> `qkv_proj`; `gate_proj, up_proj` -> `gate_up_proj`.

    The shared prefix and suffix are kept and the distinct stems joined, with
    no separator when every stem is one letter, as the serving engines name them.
    """
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


def _qkv_order(names: list[str]) -> list[str] | None:
    """The names ordered q, k, v if they are such a triplet (same affixes)."""
    if len(names) != 3:
        return None
    for stems in _QKV_STEMS:
        for name in names:
            for stem_position in _find_all(name, stems[0]):
                prefix, suffix = name[:stem_position], name[stem_position + len(stems[0]) :]
                ordered = [prefix + stem + suffix for stem in stems]
                if sorted(ordered) == sorted(names):
                    return ordered
    return None


def _find_all(text: str, part: str) -> list[int]:
    return [i for i in range(len(text)) if text.startswith(part, i)]


def _glu_order(nodes: list[fx.Node]) -> list[str] | None:
    """`[gate, up]` when `act(gate(x)) * up(x)` (either operand order), else None."""
    if len(nodes) != 2:
        return None
    for gate, up in (nodes, nodes[::-1]):
        for activated in gate.users:
            if activated.op not in ("call_module", "call_function", "call_method"):
                continue
            for product in activated.users:
                if _is_mul(product) and up in {_peel(arg) for arg in product.args}:
                    return [str(gate.target), str(up.target)]
    return None


def _is_mul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.mul, torch.mul)) or (
        node.op == "call_method" and node.target == "mul"
    )


def _peel(node: object) -> object:
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _CASTS:
        node = node.args[0]
    return node
