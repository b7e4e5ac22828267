"""Stage 4: ask every registered fusion kind (`fusegen.fusions`) for its plans in one traced class.

Works on the traced graph only; whether the source admits the rewrite is the
rewrite stage's business. The merged-linear kinds share one search: groups of
sibling linears whose first call reads the same value, each offered to the
linear kinds in priority order (QKV, then GLU, then the generic sibling
merge), each claiming what it recognises. Other kinds match a class themselves.
"""

from __future__ import annotations

from torch import fx, nn

from fusegen import fusions
from fusegen.compiler.plan import FusionPlan
from fusegen.compiler.trace import Trace


def find_plans(trace: Trace, module: nn.Module) -> list[FusionPlan]:
    """Every plan of every kind for the traced `module`: the linear groups (sorted by projections), then the
    plans of the other kinds in priority order."""
    plans = find_groups(trace.graph, module)
    return plans + [plan for kind in fusions.kinds() for plan in kind.match(trace, module)]


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
    """A same-input group as plans: each linear kind, in priority order, claims what it recognises of the rest.

    Attention and MLP projections may share an input in one class (parallel
    blocks); keeping them apart keeps the merged names meaningful and lets a
    tensor-parallel runtime shard each merged linear its own way.
    """
    from fusegen.fusions.linear import LinearKind

    plans = []
    for kind in fusions.kinds():
        if isinstance(kind, LinearKind):
            claimed, nodes = kind.claim(nodes)
            plans.extend(claimed)
    return plans


def _same_input_width(nodes: list[fx.Node], linears: dict[str, nn.Linear]) -> bool:
    return len({linears[node.target].in_features for node in nodes}) == 1
