"""The one test kit: random models, small configs, checkpoint pairs, random inputs and the tolerance.

Shared by the tests, `bench/`, the tools (coverage) and the compiler's own validation (`fusegen/compiler/validate.py`),
so every equivalence figure in the project comes from the same initialisation and is held to the same bound. One
place for each: a test that drew its weights some other way could pass where the build's validation fails, or
the other way round, and nobody would know which figure to believe.

- `random_model` / `randomise`: THE initialisation policy (see `randomise`).
- `small_config`: the hand-written 2-layer config of the llama-like test models (`SMALL`).
- `tiny_config`: any model type's config shrunk generically (`fusegen.compiler.shrink`), text part selected.
- `save_random`, `load_pair`: an original checkpoint saved once, and original + fused both loaded from it.
- `random_input`: fixed token ids that avoid the config's special tokens.
- `TOLERANCE`, `GRAD_TOLERANCE`, `logits_tolerance`: defined by the compiler's validation, which holds every build to
  them (`logits_tolerance(expected)`, TOLERANCE times the logits' scale, is the one logits rule).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from fusegen.compiler.inputs import (  # re-exported: the compiler's, the tests use the same
    BATCH,
    LENGTH,
    SEED,
    extra_inputs,
    input_rows,
    model_config,
    random_input,
    random_model,
    randomise,
    tiny_config,
)
from fusegen.compiler.validate import GRAD_TOLERANCE, TOLERANCE, logits_tolerance

__all__ = [
    "BATCH",
    "GRAD_TOLERANCE",
    "LENGTH",
    "MODELS",
    "SEED",
    "SMALL",
    "SMALL_MLA",
    "TOLERANCE",
    "TOY_HELPERS",
    "TOY_NARROW_LOOP",
    "extra_inputs",
    "import_file",
    "input_rows",
    "load_fused",
    "load_pair",
    "logits_tolerance",
    "max_diff",
    "model_classes",
    "model_config",
    "original_classes",
    "random_input",
    "random_model",
    "randomise",
    "save_random",
    "small_config",
    "tiny_config",
    "toy_source",
]


MODELS = ("llama", "qwen2")
"""The model types the runtime tests run on: llama (no biases) and qwen2 (q/k/v biases); see `model_classes`."""

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
"""`small_config`'s sizes: 2 layers, hidden 64, 4 heads, vocab 128 (the kv-head count is left to each test)."""

SMALL_MLA = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
}
"""`small_config` overrides for DeepSeek V2/V3 (latent attention, routed experts): small latent ranks and head dims,
4 experts in one group; `q_lora_rank`, `first_k_dense_replace` and the kv-head count are left to each test."""


# --- models and configs ----------------------------------------------------------------------------------------------


def model_classes(model_type: str) -> tuple[type, type, type]:
    """`(config class, original causal LM, fused causal LM)` of a model type with a checked-in fused file.

    The fused file is imported as `generated.fused_<type>` from a checkout (the repository root on `sys.path`, as
    pytest and bench set it), else as `fusegen.models.fused_<type>` from an installed fusegen; one process uses one
    of the two, so a class is never compared with its own copy.
    """
    config_class, original_class = original_classes(model_type)
    return config_class, original_class, getattr(_fused_module(model_type), "Fused" + original_class.__name__)


def original_classes(model_type: str) -> tuple[type, type]:
    """`(config class, original causal LM)` of a model type, without importing any fused file."""
    from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    return config_class, MODEL_FOR_CAUSAL_LM_MAPPING[config_class]


def _fused_module(model_type: str):
    try:
        return importlib.import_module(f"generated.fused_{model_type}")
    except ModuleNotFoundError as error:
        if error.name != "generated":
            raise  # the checkout's package exists but lacks this file, or the file's own import fails: say so
        return importlib.import_module(f"fusegen.models.fused_{model_type}")


def small_config(config_class, **overrides):
    """A llama-like config with `SMALL`'s sizes and `overrides` (`num_key_value_heads=2`, ...)."""
    return config_class(**{**SMALL, **overrides})


# --- the initialisation policy ---------------------------------------------------------------------------------------


# --- checkpoints -----------------------------------------------------------------------------------------------------


def save_random(model_class, config, path: Path, seed: int = SEED, **save_kwargs):
    """A `random_model` saved with `save_pretrained` to `path`; returns the model."""
    model = random_model(model_class, config, seed)
    model.save_pretrained(path, **save_kwargs)
    return model


def load_fused(path: Path, **kwargs):
    """The fused causal LM of the checkpoint's model type, `from_pretrained(path, **kwargs)`, in eval mode.

    Raises `AssertionError` naming the tensors when the load reports any missing, unexpected or mismatched key: a
    comparison against a model with random leftovers would measure nothing.
    """
    from transformers import AutoConfig

    _, _, fused_class = model_classes(AutoConfig.from_pretrained(path).model_type)
    fused, info = fused_class.from_pretrained(path, output_loading_info=True, **kwargs)
    problems = {key: value for key, value in info.items() if value}
    assert not problems, f"{fused_class.__name__}.from_pretrained({path}): {problems}"
    return fused.eval()


def load_pair(path: Path, **kwargs):
    """`(original, fused)` both `from_pretrained(path, **kwargs)` from the one saved checkpoint, eval mode."""
    from transformers import AutoConfig

    _, original_class, _ = model_classes(AutoConfig.from_pretrained(path).model_type)
    original = original_class.from_pretrained(path, **kwargs).eval()
    return original, load_fused(path, **kwargs)


def max_diff(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """Max |expected - actual| as a float (what every equivalence assertion holds to `TOLERANCE`)."""
    return (expected.float() - actual.float()).abs().max().item()


def import_file(path: Path, name: str):
    """The Python file `path` (a generated file built into a temporary directory, say) executed as module `name`.

    Registered in `sys.modules` before it runs, as an import does: dataclasses and the runtime look a class's module
    up by `__module__` (`load_checkpoint` finds `STACKED_PARAMS_MAPPING` through it). The caller removes it if it must.
    """
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- toy models ------------------------------------------------------------------------------------------------------


def toy_source(model_type: str, init: str, forward: str, extra: str = "", layer: str = "") -> str:
    """The source of a toy causal LM (config, `ToyBlock` with q/k/v projections, layer, model, head) written as a
    module of its own, so it compiles through the same path as a Transformers model type (`fusegen build
    <dotted path>`): `init` is the block's extra `__init__` lines, `forward` its forward body, `extra` goes at module
    level (helpers, subclasses, global hooks), `layer` into `ToyLayer.__init__` after the block is built (hooks,
    replacements). The hazard tests and the fuzzer (`fusegen.tools.fuzz`) write their cases with it."""
    source = TOY_MODULE.replace("{model_type}", model_type).replace("{init}", init.rstrip("\n") or "        pass")
    source = source.replace("{extra}", extra.rstrip("\n")).replace("{layer}", layer.rstrip("\n"))
    return source.replace("{forward}", forward.rstrip("\n"))


TOY_HELPERS = '''
CACHE = []


class Box:
    """A user object holding a tensor: its `view` writes what it holds."""

    def __init__(self, t):
        self.t = t

    def view(self):
        self.t.mul_(2)
        return self.t


class Keeper(nn.Module):
    """A user module that keeps a reference to what it is handed."""

    def forward(self, t):
        self.kept = t
        return t


def poke():
    sys._getframe(1).f_locals["x"].mul_(2)


def poke_inspect():
    inspect.currentframe().f_back.f_locals["x"].add_(1)


def poke_at(depth):
    sys._getframe(depth).f_locals["x"].mul_(2)


def outer_helper():
    poke_at(2)


def harmless_helper():
    return 1


class Scaled(nn.Linear):
    def forward(self, t):
        return super().forward(t) * 2


class PlainSubclass(nn.Linear):
    pass


class Double(nn.Module):
    def forward(self, w):
        return w * 2
'''
"""Module-level helpers the hazard tests and the fuzzer pass to `toy_source` as `extra`: user objects and modules that
write or keep what they are handed (`Box`, `Keeper`), frame pokes, `nn.Linear` subclasses, a parametrization."""

TOY_NARROW_LOOP = (
    "        for module in self.modules():\n            if type(module) is nn.Linear and module.out_features == 8:\n"
)
"""`ToyLayer.__init__` lines (for `toy_source`'s `layer`) that visit the block's k and v projections, the linears
with 8 outputs, for the line after them to hook, subclass or parametrize."""

TOY_MODULE = """
import inspect
import operator
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


def apply(module, x):
    return module(x)


def scale_in_place(x):
    x.mul_(2)
    return x


class Mutator(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x


{extra}


class ToyConfig(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, vocab_size=32, hidden_size=16, num_hidden_layers=2, flag=True, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.flag = flag
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class ToyBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.flag = config.flag
        self.hidden_size = config.hidden_size
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size // 2, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size // 2, bias=False)
{init}

    def forward(self, x):
{forward}


    def reset_state(self):
        self.state.zero_()


class ToyPreTrainedModel(PreTrainedModel):
    config_class = ToyConfig
    base_model_prefix = "model"


class ToyLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.block = ToyBlock(config)
{layer}

    def forward(self, x):
        return x + self.block(x)


class ToyModel(ToyPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ToyLayer(config) for _ in range(config.num_hidden_layers)])
        self.post_init()

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class ToyForCausalLM(ToyPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = ToyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))
"""
