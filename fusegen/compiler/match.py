"""Stage 4: ask every registered fusion kind (`fusegen.fusions`) for its plans in one traced class.

Works on the traced graph only; whether the source admits the rewrite is the
rewrite stage's business. Kinds of one family share one search (`Kind.family`):
the merged-linear kinds (QKV, GLU, the generic sibling merge) find their groups
together, each claiming what it recognises of a same-input group
(`fusegen.fusions.linear.find_groups`), so the family is asked once, through
its first kind. Every other kind matches a class itself.
"""

from __future__ import annotations

from torch import nn

from fusegen import fusions
from fusegen.core.plan import FusionPlan
from fusegen.core.traced import Trace


def find_plans(trace: Trace, module: nn.Module) -> list[FusionPlan]:
    """Every plan of every kind for the traced `module`, kinds in priority order, each family asked once."""
    plans: list[FusionPlan] = []
    asked: set[str] = set()
    for kind in fusions.kinds():
        if kind.family is not None:
            if kind.family in asked:
                continue
            asked.add(kind.family)
        plans.extend(kind.match(trace, module))
    return plans
