"""The group search: the `nn.Linear` children of a traced class whose (first) call reads the same input node.

Works on the traced graph only; whether the source admits the rewrite is the rewrite modules' business. Which
kind claims which part of a group is `fusegen.fusions.linear.find_groups`'.
"""

from __future__ import annotations

from torch import fx, nn


def plain_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """Direct children that are exactly `nn.Linear`.

    Subclasses are left alone: a quantized or LoRA linear overrides `forward`,
    so concatenating its weights would not reproduce it.
    """
    return {name: child for name, child in module.named_children() if type(child) is nn.Linear}


def linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    """Direct children that are `nn.Linear` or a subclass of it.

    Groups are found among all of them, so that a subclass, a hooked or a
    parametrized linear in a group is refused by name (`fusegen.fusions.merged.live.check_projections`)
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


def same_input_groups(graph: fx.Graph, module: nn.Module) -> list[list[fx.Node]]:
    """Every group of >= 2 linear call nodes whose (first) call reads the same input node, of one input width."""
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
    return [nodes for nodes in by_input.values() if len(nodes) >= 2 and _same_input_width(nodes, linears)]


def _same_input_width(nodes: list[fx.Node], linears: dict[str, nn.Linear]) -> bool:
    return len({linears[node.target].in_features for node in nodes}) == 1
