"""QKV: an attention's query, key and value projections -> `qkv_proj`, rows ordered q, k, v.

Recognised by name: three linears of one same-input group whose names differ only in the stem (`q`/`k`/`v` or
`query`/`key`/`value`, same prefix and suffix). The shard ids `q`, `k`, `v` tell the loaders which checkpoint
tensor is which; under tensor parallelism the merged linear is sharded by attention heads (`head_sharded`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

from fusegen.core.plan import FusionPlan
from fusegen.fusions import register
from fusegen.fusions.linear import LinearKind, join_names, roles

STEMS = (("q", "k", "v"), ("query", "key", "value"))


@register
class QKV(LinearKind):
    name = "qkv"
    priority = 10
    head_sharded = True
    label = ("q/k/v", "a q/k/v triplet")

    def claim(self, nodes: list[fx.Node]) -> tuple[list[FusionPlan], list[fx.Node]]:
        qkv = find_qkv([str(node.target) for node in nodes])
        if qkv is None:
            return [], nodes
        return [self.plan(qkv, ("q", "k", "v"))], [node for node in nodes if node.target not in qkv]

    def merged_name(self, names: list[str]) -> str:
        """`qkv_proj` for BERT-style `query`/`key`/`value` (`query_proj`... likewise) and T5's bare `q`/`k`/`v` too,
        as vLLM and the serving tools that follow it name the merged linear; `q_proj`-style names join as every kind
        joins them. Where another class of the same file merges other pieces into the shortened name, the analysis
        gives this group the joined name instead (`fusegen.compiler.analyse.names_to_join`)."""
        joined = join_names(names)
        if joined == "qkv":  # T5's bare `q`, `k`, `v`
            return "qkv_proj"
        if "query_key_value" not in joined:
            return joined
        short = joined.replace("query_key_value", "qkv")
        return short + "_proj" if short.endswith("qkv") else short

    def present(self, names: Iterable[str]) -> bool:
        found = roles(names)
        return {"q", "k", "v"} <= found or {"query", "key", "value"} <= found


def find_qkv(names: list[str]) -> list[str] | None:
    """Three of `names` forming a q/k/v triplet (same affixes), ordered q, k, v."""
    for stems in STEMS:
        for name in names:
            for stem_position in _find_all(name, stems[0]):
                prefix, suffix = name[:stem_position], name[stem_position + len(stems[0]) :]
                ordered = [prefix + stem + suffix for stem in stems]
                if all(candidate in names for candidate in ordered):
                    return ordered
    return None


def _find_all(text: str, part: str) -> list[int]:
    return [i for i in range(len(text)) if text.startswith(part, i)]
