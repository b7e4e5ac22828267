"""Sibling merge (`merged_column`): any other group of two or more linears reading one value, in call order.

It claims what the kinds before it (qkv, glu) leave of a same-input group, and is the kind of the smaller groups
tried when a group is refused (`fusegen.fusions.linear`). Most groups are named by joining their stems
(`k_proj` + `v_proj` -> `kv_proj`); a group the serving engines, their loaders and quantization configs already
name otherwise gets their name: MLA's latent projections `q_a_proj` + `kv_a_proj_with_mqa` -> `fused_qkv_a_proj`.
"""

from __future__ import annotations

from torch import fx

from fusegen.core.plan import FusionPlan
from fusegen.fusions import register
from fusegen.fusions.linear import SIBLINGS, LinearKind, join_names

CONVENTIONAL_NAMES = {frozenset({"q_a_proj", "kv_a_proj_with_mqa"}): "fused_qkv_a_proj"}
"""Merged names the serving engines, their loaders and quantization configs already use for a group."""


@register
class Siblings(LinearKind):
    name = SIBLINGS
    priority = 90

    def claim(self, nodes: list[fx.Node]) -> tuple[list[FusionPlan], list[fx.Node]]:
        if len(nodes) < 2:
            return [], nodes
        return [self.plan([str(node.target) for node in nodes])], []

    def merged_name(self, names: list[str]) -> str:
        return merged_name(names)


def merged_name(names: list[str]) -> str:
    """The engines' name for the group if they have one (`fused_qkv_a_proj`), else the stems joined
    (`fusegen.fusions.linear.join_names`: `q_proj, k_proj, v_proj` -> `qkv_proj`)."""
    return CONVENTIONAL_NAMES.get(frozenset(names)) or join_names(names)
