"""GLU: a gated MLP's gate and up projections -> `gate_up_proj`, rows ordered gate, up.

Recognised by dataflow, not by name: `act(gate(x)) * up(x)` (either operand order, casts in between allowed) in
the traced graph. The row order matters to the loaders (shard ids 0 = gate, 1 = up) and to the rewritten forward,
which splits the merged output back into the two values.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch import fx

from fusegen.core.plan import FusionPlan
from fusegen.fusions import register
from fusegen.fusions.linear import LinearKind, roles

_CASTS = {"to", "float", "half", "bfloat16", "type_as", "contiguous"}


@register
class GLU(LinearKind):
    name = "glu"
    priority = 20
    label = ("gate/up", "a gate/up pair")

    def claim(self, nodes: list[fx.Node]) -> tuple[list[FusionPlan], list[fx.Node]]:
        plans = []
        for gate, up in find_glu_pairs(nodes):
            plans.append(self.plan([gate, up]))
            nodes = [node for node in nodes if node.target not in (gate, up)]
        return plans, nodes

    def present(self, names: Iterable[str]) -> bool:
        found = roles(names)
        return {"gate", "up"} <= found or {"w1", "w3"} <= found or {"wi_0", "wi_1"} <= found


def find_glu_pairs(nodes: list[fx.Node]) -> list[tuple[str, str]]:
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
