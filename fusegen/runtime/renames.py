"""Transformers' checkpoint key renames, applied to the names of a checkpoint `load_checkpoint` reads.

`from_pretrained` renames checkpoint keys before it matches them to the model: legacy prefixes of a model whose
module tree moved (Qwen2.5-VL's `model.layers.*` and `visual.*` saved by checkpoints before its language model was
nested, now `model.language_model.layers.*` and `model.visual.*`), the `language_model.`/`vision_tower.` prefixes of
LLaVA-style checkpoints, and the like. They live in `transformers.conversion_mapping`, looked up for every
`PreTrainedModel` in the model by class name and model type (`get_model_conversion_mapping`); a generated file
registers its fused classes with the original's conversions, so the same list comes back for the fused model.

`load_checkpoint` matches names exactly, so it must see the names `from_pretrained` would: each checkpoint name is
passed through exactly those renames (the `WeightRenaming`s; the merging converters are left out, since the loader
maps q/k/v pieces to merged rows itself). A model without renames gets every name back unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .files import CheckpointError


def model_names(model: nn.Module, names: Iterable[str], where: str) -> dict[str, str]:
    """`{name the model uses: checkpoint name}` for checkpoint tensor `names`, through Transformers' renames of
    `model`; raises `CheckpointError` (naming both tensors and `where`) when two checkpoint names land on one name."""
    renamings = _renamings(model)
    found: dict[str, str] = {}
    for name in names:
        renamed = _rename(name, renamings) if renamings else name
        if renamed in found:
            raise CheckpointError(
                f"two checkpoint tensors, {found[renamed]} and {name}, are both {renamed} after Transformers' "
                "renames of this model's keys",
                file=where,
                tensor=name,
            )
        found[renamed] = name
    return found


def _renamings(model: nn.Module) -> list:
    """The `WeightRenaming`s `from_pretrained` applies to `model`'s checkpoint keys (none for a plain module)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    from .registry import register_for_tree

    if not isinstance(model, PreTrainedModel):
        return []
    register_for_tree(model)
    return [each for each in get_model_conversion_mapping(model) if isinstance(each, WeightRenaming)]


def _rename(name: str, renamings: list) -> str:
    from transformers.core_model_loading import rename_source_key

    renamed, _ = rename_source_key(name, renamings, [])
    return renamed
