"""`from_pretrained` of the generated classes: both checkpoint layouts, validated before a byte is mapped.

Every generated pretrained base inherits `FusedPreTrainedMixin` (at the end of this module) first; its
`from_pretrained` calls `fused_from_pretrained` with Transformers' own `from_pretrained` as `load`. For a local
checkpoint directory it does two things before handing over:

1. **Validation** (`open_checkpoint`, headers only): every weight file is inside the directory (an index cannot name
   `../x`), every header parses, every file is as long as its header's data offsets say (a truncated file is a
   `CheckpointError` here, before Transformers memory-maps it; touching a mapping past the end of a file is SIGBUS),
   no tensor is in two shards, the index agrees with the shards, and a directory holding only pickles
   (`pytorch_model.bin*`) is refused unless `allow_pickle=True` is passed, as in `load_checkpoint`.
2. **The fused layout** (written by `fusegen convert`): the weights are named `fused*.safetensors`, which Transformers
   never looks for, and config.json's `transformers_weights` holds a refusal message (see fusegen/tools/convert.py for why).
   Here that entry is overridden with the real file name, so Transformers memory-maps the fused file and hands each
   merged tensor on as a zero-copy view, exactly as the original class loads its own checkpoint. The file's row order
   (`fusegen_stacked` in the header metadata) must equal the class's `STACKED_PARAMS_MAPPING`: the same total size
   with q and k swapped would otherwise load without a word.

Loading then runs inside a `reading_session`, so canonical q/k/v pieces are read from the file into their merged
parameter's slices (fusegen/runtime/streaming.py).

Anything else (a hub repo id, `variant=`, `gguf_file=`, `state_dict=`, `use_safetensors=False`, a config naming its
own `transformers_weights`, a directory without weight files such as a PEFT adapter) goes to Transformers unchanged:
those are resolved by Transformers in ways this module does not second-guess.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .auto import generated_class, original_class
from .files import FUSED, LAYOUT_KEY, Checkpoint, CheckpointError, open_checkpoint, weight_file_schemes
from .merged import normalise_stacked
from .quantized import load_scope
from .streaming import reading_session

FUSEGEN_KEY = "fusegen"  # config.json: what `fusegen convert` wrote (layout, weights file, source fingerprint, ...)
WEIGHTS_KEY = "transformers_weights"  # config.json: the weights file Transformers' from_pretrained reads
_SKIP_KWARGS = ("state_dict", "gguf_file", "variant")


def _config_json(root: Path) -> dict:
    try:
        document = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _validated_directory(path: object, kwargs: dict) -> Path | None:
    """The local checkpoint directory this call will read weights from, or None to leave the call to Transformers."""
    if path is None or any(kwargs.get(name) is not None for name in _SKIP_KWARGS):
        return None
    if kwargs.get("use_safetensors") is False:
        return None
    root = Path(path) / (kwargs.get("subfolder") or "")
    if not root.is_dir() or not weight_file_schemes(root):
        return None
    explicit = _config_json(root).get(WEIGHTS_KEY)
    if explicit is not None and FUSEGEN_KEY not in _config_json(root):
        return None
    return root


def _hub_blobs(root: Path) -> list[Path]:
    """A hub cache snapshot (`.../snapshots/<rev>/`) links its files into `../../blobs/`; trust that directory."""
    blobs = root.resolve().parent.parent / "blobs" if root.parent.name == "snapshots" else None
    return [blobs] if blobs is not None and blobs.is_dir() else []


def _class_mapping(cls: type) -> dict[str, tuple[str, ...]]:
    return normalise_stacked(getattr(sys.modules.get(cls.__module__), "STACKED_PARAMS_MAPPING", None) or {})


def check_fused_rows(cls: type, checkpoint: Checkpoint) -> None:
    """A fused checkpoint's merged rows must be in the class's order (same sizes, other order would load silently)."""
    ours = _class_mapping(cls)
    for merged, theirs in (checkpoint.stacked or {}).items():
        if merged in ours and tuple(theirs) != ours[merged]:
            raise CheckpointError(
                f"merged rows of {merged} are {list(theirs)} in the checkpoint but {list(ours[merged])} in "
                f"{cls.__name__}; convert the canonical checkpoint again with this fusegen",
                file=checkpoint.files[0],
            )


def _point_at(root: Path, weights: str, kwargs: dict) -> dict:
    """`kwargs` with the config's `transformers_weights` replaced by the fused weights file."""
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        config = copy.deepcopy(config)
        setattr(config, WEIGHTS_KEY, weights)
        return {**kwargs, "config": config}
    source = Path(config) if config is not None else root
    if WEIGHTS_KEY not in _config_json(source if source.is_dir() else root):
        raise CheckpointError(
            f"a fused-layout checkpoint whose config.json lacks {WEIGHTS_KEY!r}; write it with `fusegen convert`",
            file=source / "config.json",
        )
    return {**kwargs, WEIGHTS_KEY: weights}


def _forget_layout(config) -> None:
    """The layout keys describe files, not the model: a model saved later writes the canonical layout."""
    for key in (FUSEGEN_KEY, LAYOUT_KEY):
        if key in getattr(config, "__dict__", {}):
            delattr(config, key)


def save_canonical(model) -> None:
    """Make `save_pretrained` split the merged tensors again after a fused-layout load.

    Transformers' save reverses only the conversions that were USED at load (`model._weight_conversions`); loading
    the fused layout uses none, so the model would save merged tensors in `model.safetensors`, which the original
    class then loads with random q/k/v. Adding the registered merge converters back makes the save canonical.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    from .checkpoint import MergedColumnConcatenate
    from .registry import register_for_tree

    register_for_tree(model)
    merges = [
        conversion
        for conversion in get_model_conversion_mapping(model, add_legacy=False)
        if isinstance(conversion, WeightConverter)
        and any(isinstance(op, MergedColumnConcatenate) for op in conversion.operations)
    ]
    present = getattr(model, "_weight_conversions", None) or []
    known = {(tuple(c._original_source_patterns), tuple(c._original_target_patterns)) for c in present}
    merges = [
        c for c in merges if (tuple(c._original_source_patterns), tuple(c._original_target_patterns)) not in known
    ]
    model._weight_conversions = [*present, *merges]


def named_error(cls: type, error: CheckpointError) -> CheckpointError:
    """`error` with the name of the class whose `from_pretrained` was called in front of its problem (once)."""
    if error.problem.startswith(f"{cls.__name__}: "):
        return error
    return CheckpointError(f"{cls.__name__}: {error.problem}", file=error.file, tensor=error.tensor)


def reversible_conversions(conversions: list) -> list:
    """`conversions` without the quantizers' deserializers (a bitsandbytes pre-quantized load records its
    `Bnb4bitDeserialize` converter, whose op has no `reverse_op`, so Transformers' save raises NotImplementedError,
    for the original class too). Leaving them out is exact: a deserializer turns `q_proj.weight`, `q_proj.absmax`, ...
    into the module's state under the SAME module name, and the quantized module's own `state_dict` writes those
    serialized entries back (e.g. bitsandbytes' `_save_to_state_dict`), so there is nothing to reverse."""
    kept = []
    for conversion in conversions:
        try:
            [op.reverse_op for op in getattr(conversion, "operations", [])]
        except NotImplementedError:
            continue
        kept.append(conversion)
    return kept


def fused_from_pretrained(cls: type, load: Callable, path, *model_args, **kwargs):
    """Transformers' `from_pretrained` (`load`), after validating a local checkpoint and pointing it at a fused one.

    `allow_pickle=True` accepts a directory holding only `pytorch_model.bin*` (Transformers loads it with
    `weights_only=True`). See the module docstring for what is checked and what is left to Transformers.
    """
    allow_pickle = kwargs.pop("allow_pickle", False)
    root = _validated_directory(path, kwargs)
    layout = None
    if root is not None:
        try:
            with open_checkpoint(root, allow_pickle=allow_pickle, allowed_roots=_hub_blobs(root)) as checkpoint:
                layout = checkpoint.layout
                if layout == FUSED:
                    check_fused_rows(cls, checkpoint)
                    weights = (checkpoint.index or checkpoint.files[0]).relative_to(root).as_posix()
                    kwargs = _point_at(root, weights, kwargs)
        except CheckpointError as error:
            raise named_error(cls, error) from None
    with reading_session(), load_scope():
        loaded = load(path, *model_args, **kwargs)
    if layout == FUSED:
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        _forget_layout(model.config)
        save_canonical(model)
    return loaded


# --------------------------------------------------------------------------------------------------------------------
# The methods every generated pretrained base shares
# --------------------------------------------------------------------------------------------------------------------


class FusedPreTrainedMixin:
    """What a generated pretrained base adds to Transformers' `PreTrainedModel`; it is the first base of that class:
    `class FusedLlamaPreTrainedModel(FusedPreTrainedMixin, PreTrainedModel)`.

    Each method defers to the next class in the MRO (Transformers' own) around fusegen's step, so the order of
    bases is the whole contract; a method the copied class defines in its own body still wins, as it did when these
    methods were written into each generated file. Module-level data of the generated file (`TP_PLAN`) is looked up
    through the class's MRO, so subclasses defined elsewhere behave as the generated class does.
    """

    def post_init(self):
        """Transformers' post_init; then the fused classes of this model's tree get the checkpoint conversions their
        originals get at their places (`fusegen.runtime.registry.register_for_tree`): the root's post_init runs
        last, right before `from_pretrained` looks them up."""
        super().post_init()
        from .registry import register_for_tree

        register_for_tree(self)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Transformers' from_pretrained, for the canonical layout and `fusegen convert`'s fused one (validated first)."""
        return fused_from_pretrained(
            cls, super().from_pretrained, pretrained_model_name_or_path, *model_args, **kwargs
        )

    @classmethod
    def _finalize_model_loading(cls, model, load_config, loading_info):
        """Transformers' finalisation between fusegen's checks and fixes (fusegen/runtime/strict.py): raise instead of
        randomly initialising a merged parameter the checkpoint filled in part (one it lacks entirely is missing, as
        for the original); under tensor parallelism, give merged parameters read whole their honest placement
        (`tp.describe_loaded`); after it, stack the merged linears built split for a quantized load
        (fusegen/runtime/quantized.py)."""
        from .quantized import compose_merged_linears, piecewise_sites
        from .strict import check_loading

        check_loading(model, loading_info, load_config.pretrained_model_name_or_path, caller=cls.__name__)
        if any(getattr(module, "tp_partition", None) is not None for module in model.modules()):
            from .tp.styles import describe_loaded

            describe_loaded(model)  # merged parameters read whole (replicated kv heads) get their true placement
        loading_info = super()._finalize_model_loading(model, load_config, loading_info)
        if piecewise_sites(model):
            compose_merged_linears(model)
            save_canonical(model)
        return loading_info

    @classmethod
    def is_custom_code(cls):
        """False for a copy of Transformers' own code: load and initialise the way Transformers treats its models.

        Otherwise the copies count as custom code (their module is not under `transformers.`), which loads and
        initialises differently: non-persistent buffers filled in `_init_weights` are skipped and model-type
        checkpoint conversions are not applied at the root. A copy of a user's module stays custom code.
        """
        found = generated_class(cls)
        if found is not None and found[1].startswith("transformers."):
            return False
        return super().is_custom_code()

    @classmethod
    def _can_set_experts_implementation(cls):
        """The original class's answer. Transformers decides by searching the class's module source for the
        `@use_experts_implementation` decorator; the experts classes stay in the original module, so asked about
        the generated file, a fused MoE model would silently fall back to the eager per-expert loop."""
        original = original_class(cls)
        if original is not None and hasattr(original, "_can_set_experts_implementation"):
            return original._can_set_experts_implementation()
        return super()._can_set_experts_implementation()

    def init_parallel_plans(self):
        """Transformers' parallel plans, with the generated file's `TP_PLAN` rules for the merged projections, and
        the hooks that list a distributed model's merged parameters as their canonical pieces (`.distributed`).

        fusegen.runtime.tp is imported here, when a model is built, so importing a generated file stays light.
        """
        from .distributed import register_canonical_state_hooks
        from .tp import init_fused_parallel_plans

        found = generated_class(type(self))
        plan = getattr(sys.modules.get(found[0].__module__), "TP_PLAN", None) if found is not None else None
        init_fused_parallel_plans(self, plan)
        register_canonical_state_hooks(self)  # distributed (DTensor) state dicts in canonical names: FSDP2, TP

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Transformers' save_pretrained; config.json then names the original classes (fusegen.runtime.auto).

        Conversions that cannot be reversed are left out while saving (see `reversible_conversions`)."""
        from .auto import save_pretrained as save_pretrained_canonically
        from .registry import register_for_tree

        register_for_tree(self)  # a model built after this one may have registered its own tree's conversions
        used = getattr(self, "_weight_conversions", None)
        if used:
            self._weight_conversions = reversible_conversions(used)
        try:
            return save_pretrained_canonically(self, super().save_pretrained, save_directory, *args, **kwargs)
        finally:
            if used:
                self._weight_conversions = used

    def load_adapter(self, peft_model_id=None, adapter_name=None, peft_config=None, adapter_state_dict=None, **kwargs):
        """Transformers' load_adapter, with canonical (per-projection) LoRA tensors packed onto the merged linears."""
        from .peft import load_adapter as load_adapter_packed
        from .registry import register_for_tree

        register_for_tree(self)

        return load_adapter_packed(
            self, super().load_adapter, peft_model_id, adapter_name, peft_config, adapter_state_dict, **kwargs
        )

    def load_weights(self, weights):
        """vLLM's loader interface: stream `(name, tensor)` pairs, canonical or fused names, into this model.

        Inside vLLM (its parameters carry a `weight_loader`: vLLM's layers replaced some modules) each tensor goes
        through its vLLM parameter's `weight_loader`, with the stacked mapping's shard id (fusegen/runtime/vllm.py).
        """
        if any(hasattr(parameter, "weight_loader") for parameter in self.parameters()):
            from .vllm import load_weights as load_into_vllm_layers

            return load_into_vllm_layers(self, weights)
        from .loading import load_weights

        return load_weights(self, weights)
