"""Stage 1: turn a target name into the classes and module to compile."""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType

from fusegen.errors import InputError


@dataclass(frozen=True)
class Target:
    model_type: str
    causal_lm: type
    """The class the generated file is built around: the head (`head`) Transformers registers for the model type.
    Named for the first head fusegen built; an encoder's base model or a seq2seq model is held here the same way."""
    config_class: type
    module: ModuleType
    """The modeling module the head class is defined in."""
    source: str
    """What the user named: a model type, `TYPE:HEAD` for a head other than the default, or a dotted module path."""
    head: str = "causal-lm"
    """The Auto mapping (`HEADS`) the class was taken from."""

    @property
    def file_stem(self) -> str:
        """`fused_<stem>.py`: the model type, with the head appended when it is not the type's default."""
        return self.model_type if ":" not in self.source else f"{self.model_type}_{self.head.replace('-', '_')}"

    @property
    def generates(self) -> bool:
        """Whether the head class is the type's causal LM (`AutoModelForCausalLM`'s class, or a module path's
        generation class): the generated file then lists its fused copy where pipelines look for causal LMs."""
        return self.head == "causal-lm" or _names("causal-lm").get(self.model_type) == self.causal_lm.__name__


HEADS = {
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING",
    "multimodal-lm": "MODEL_FOR_MULTIMODAL_LM_MAPPING",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
    "base": "MODEL_MAPPING",
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "dual-encoder": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING",
    "text-encoding": "MODEL_FOR_TEXT_ENCODING_MAPPING",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
}
"""The heads `fusegen build TYPE --head HEAD` can build: name -> the Auto mapping (in
`transformers.models.auto.modeling_auto`) that registers the class. `base` is `AutoModel`."""

UNIVERSE = (
    "image-text-to-text",
    "multimodal-lm",
    "causal-lm",
    "seq2seq-lm",
    "speech-seq2seq",
    "text-encoding",
    "masked-lm",
    "dual-encoder",
)
"""The mappings whose model types fusegen accepts by name: `fusegen build TYPE` for a type none of them registers
is an unknown model type (a vision-only or audio-classification type: name its head with `--head`)."""

ENCODERS = ("text-encoding", "masked-lm")
"""Mappings of encoder-only text models: a type registered there (and not as a generator) is served through its
base model (an embedding server's `AutoModel`), so that is its default head."""


def default_head(model_type: str) -> str | None:
    """The head a user would serve for `model_type`, or None when no mapping of `UNIVERSE` registers it.

    A type that reads images or audio is served through its image-text-to-text (else multimodal LM) class, not the
    text-only causal LM some of them also register (Gemma 3, Llama 4, Qwen 3.5); an encoder-decoder through its
    conditional-generation class (speech first: Whisper's causal LM is only its decoder); an encoder-only text
    model through its base model, even where it also registers a causal-LM head (BERT's `BertLMHeadModel`); any
    other causal LM through its causal LM; a CLIP-like dual encoder through its base model.
    """
    names = {head: _names(head) for head in UNIVERSE + ("base",)}
    for head in ("image-text-to-text", "multimodal-lm", "speech-seq2seq", "seq2seq-lm"):
        if model_type in names[head]:
            return head
    if any(model_type in names[head] for head in ENCODERS) and model_type in names["base"]:
        return "base"
    for head in ("causal-lm", "text-encoding", "masked-lm"):
        if model_type in names[head]:
            return head
    if model_type in names["dual-encoder"]:
        return "base" if model_type in names["base"] else "dual-encoder"
    return None


def head_class_name(model_type: str, head: str) -> str | None:
    """The class name the Auto mapping behind `head` registers for `model_type` (no import), or None."""
    name = _names(head).get(model_type)
    return name[0] if isinstance(name, (tuple, list)) else name


def mapping_target(model_type: str, head: str) -> str:
    """The target that builds `model_type` through the class the mapping `head` registers: the bare model type when
    that is the class its default head builds too (no import), else `TYPE:HEAD` (written to `fused_TYPE_HEAD.py`)."""
    default = default_head(model_type)
    same = default is not None and head_class_name(model_type, default) == head_class_name(model_type, head)
    return model_type if same else f"{model_type}:{head}"


def _names(head: str) -> dict:
    """`{model type: class name}` of the Auto mapping behind `head`."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, HEADS[head] + "_NAMES")


def causal_lm_types() -> list[str]:
    """Model types registered with `AutoModelForCausalLM`, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_types(head: str | None = None) -> list[str]:
    """Model types registered with the Auto mapping of `head`, or with any mapping of `UNIVERSE`, sorted."""
    heads = [head] if head is not None else UNIVERSE
    return sorted({name for each in heads for name in _names(each)})


def resolve(name: str, head: str | None = None) -> Target:
    """A model type (`llama`, `bert:masked-lm`) or a dotted module path (`mypkg.modeling_foo`) as a `Target`.

    `head` (a `HEADS` name or a class name some Auto mapping registers for the type) picks the class to build
    when the type has several; by default, `default_head`'s. `TYPE:HEAD` says the same in one word (what a
    generated file's header records, so `build --check` rebuilds the same head).
    """
    if "." in name and name.partition(":")[0] not in _config_types():  # `kosmos-2.5` is a model type
        if head is not None:
            raise InputError(f"--head applies to model types, not to the module path {name!r}")
        return resolve_module(name)
    if ":" in name:
        name, _, spelled = name.partition(":")
        if head is not None and head != spelled:
            raise InputError(f"target {name}:{spelled} names a head and --head names {head!r}: name one")
        head = spelled
    return resolve_model_type(name, head)


def resolve_module(dotted: str) -> Target:
    """The causal LM defined in an importable modeling module of the user's own.

    The module must define a `PreTrainedModel` subclass with a `config_class`
    and a generation head (`GenerationMixin`); the output is named after that
    config's `model_type`, exactly like a built-in model type.
    """
    from transformers import GenerationMixin, PreTrainedModel

    try:
        module = importlib.import_module(dotted)
    except Exception as exc:
        raise InputError(f"cannot import module {dotted!r}: {type(exc).__name__}: {exc}") from exc
    found = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
        and issubclass(cls, PreTrainedModel)
        and issubclass(cls, GenerationMixin)
        and getattr(cls, "config_class", None) is not None
    ]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(cls.__name__ for cls in found)})"
        raise InputError(
            f"module {dotted!r} defines {what} causal-LM classes (PreTrainedModel + GenerationMixin subclasses "
            "with a config_class); fusegen needs exactly one"
        )
    causal_lm = found[0]
    model_type = getattr(causal_lm.config_class, "model_type", "")
    if not model_type or not model_type.isidentifier():
        raise InputError(f"{causal_lm.config_class.__name__}.model_type must be an identifier, got {model_type!r}")
    return Target(model_type, causal_lm, causal_lm.config_class, module, source=dotted)


def resolve_model_type(name: str, head: str | None = None) -> Target:
    """A Transformers model type (`llama`, `qwen2_5_vl`, `bert`, `t5`) and the head to build as a `Target`."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    default = default_head(name)
    if default is None and (head is None or name not in CONFIG_MAPPING):
        known = model_types()
        hint = difflib.get_close_matches(name, known, n=3)
        did_you_mean = f" Did you mean {', '.join(repr(h) for h in hint)}?" if hint else ""
        raise InputError(
            f"unknown model type {name!r}: Transformers registers no causal LM, image-text-to-text, multimodal, "
            f"seq2seq, encoder or dual-encoder model under that name.{did_you_mean} "
            "Run `fusegen list` to see the known model types."
        )
    chosen = _head_named(name, head) if head is not None else default
    config_class = CONFIG_MAPPING[name]
    try:
        model_class = getattr(modeling_auto, HEADS[chosen])[config_class]
    except Exception as exc:  # an optional dependency of that model is missing, say
        raise InputError(f"model type {name!r}: cannot import its {chosen} class ({exc})") from exc
    if isinstance(model_class, (tuple, list)):
        model_class = model_class[0]
    source = name if chosen == default else f"{name}:{chosen}"
    return Target(name, model_class, config_class, sys.modules[model_class.__module__], source=source, head=chosen)


def _config_types():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return CONFIG_MAPPING_NAMES


def _head_named(model_type: str, head: str) -> str:
    """The `HEADS` name `head` stands for (itself, or the mapping that registers the class it names) for
    `model_type`; an `InputError` listing the type's heads when there is none."""
    offered = {each: _names(each).get(model_type) for each in HEADS}
    offered = {each: cls for each, cls in offered.items() if cls}
    if head in offered:
        return head
    by_class = [each for each, cls in offered.items() if cls == head]
    if by_class:
        return by_class[0]
    listed = ", ".join(f"{each} ({cls})" for each, cls in offered.items()) or "none"
    raise InputError(f"model type {model_type!r} has no head {head!r}; its heads: {listed}")
