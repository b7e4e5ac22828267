"""`fusegen convert`: rewrite a canonical checkpoint into the fused layout, so a server can mmap merged tensors as-is.

In the fused layout each merged linear is stored whole (`model.layers.0.self_attn.qkv_proj.weight`), every header
carries `{"format": "pt", "fusegen_layout": "fused", "fusegen_stacked": <row order>}`, and `load_checkpoint` detects it
from that metadata.

Why the weights are named `fused*.safetensors` rather than `model*.safetensors`: handed a directory with fused
tensors in `model.safetensors`, `LlamaForCausalLM.from_pretrained` does not fail. It prints a load report (qkv_proj
"UNEXPECTED", q/k/v "MISSING"), randomly initialises the missing weights and returns a model that generates garbage.
Neither config field it could check helps: a concrete class ignores `architectures`, and a foreign `model_type` only
logs a warning (it would also break `AutoConfig`, which serving stacks need to read the config). What it cannot get
past is having no weight file it recognises, so the fused files use a stem Transformers never looks for (also not via
`variant=`, which only inserts into `model.<variant>.safetensors`), and it raises
`OSError: Error no file named model.safetensors ... found in directory ...`. For humans and other tools config.json
also says what this is: `architectures` names the fused class (vLLM refuses unknown architectures) and
`fusegen_layout: "fused"` is set; `model_type` is kept so the config still loads with `AutoConfig`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

import fusegen
from fusegen.errors import EXIT_OK, InputError, command
from fusegen.runtime.loading import (
    FUSED,
    LAYOUT_KEY,
    STACKED_KEY,
    STEMS,
    Checkpoint,
    open_checkpoint,
    parse_size,
    plan_load,
    stacked_mapping,
    write_safetensors,
)

# Small non-weight files a server needs next to the weights; copied verbatim.
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def import_fused_module(generated_dir: str | os.PathLike, model_type: str) -> ModuleType:
    """Import `generated_dir/fused_<model_type>.py` by path (the directory need not be a package on sys.path).

    The module is registered in `sys.modules` under a name derived from its resolved path, because `load_checkpoint`
    finds `STACKED_PARAMS_MAPPING` through `sys.modules[type(model).__module__]`.
    """
    path = Path(generated_dir) / f"fused_{model_type}.py"
    if not path.is_file():
        raise InputError(f"no {path}: run `fusegen build {model_type}`, or pass --generated-dir")
    resolved = path.resolve()
    name = f"fusegen_generated_fused_{model_type}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise InputError(f"cannot import {path}: {type(error).__name__}: {error}") from error
    return module


def causal_lm_class(module: ModuleType) -> type:
    """The generated file's single generation class (`...ForCausalLM`, `BertLMHeadModel`, ...), via its `__all__`."""
    from transformers import GenerationMixin

    names = [
        name
        for name in getattr(module, "__all__", ())
        if isinstance(getattr(module, name, None), type) and issubclass(getattr(module, name), GenerationMixin)
    ]
    if len(names) != 1:
        raise InputError(f"{module.__file__}: expected one causal-LM class in __all__, found {names}")
    return getattr(module, names[0])


def read_config(checkpoint_dir: str | os.PathLike):
    """The checkpoint's config via AutoConfig; any failure is the user's input, so it becomes an InputError."""
    from transformers import AutoConfig

    if not (Path(checkpoint_dir) / "config.json").is_file():  # else AutoConfig takes the path for a hub repo id
        raise InputError(f"{checkpoint_dir}: no config.json (not a checkpoint directory?)")
    _check_model_type(Path(checkpoint_dir) / "config.json")
    try:
        return AutoConfig.from_pretrained(checkpoint_dir)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"{checkpoint_dir}: cannot read config.json: {error}") from error


def _check_model_type(path: Path) -> None:
    """A config.json whose `model_type` this Transformers does not know: one line naming it, not AutoConfig's essay."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        model_type = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise InputError(f"{path}: not a JSON object: {error}") from error
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING_NAMES:
        raise InputError(f"{path}: model_type {model_type!r} is not a model type this Transformers knows")


def fused_tensors(model: torch.nn.Module, checkpoint: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each model tensor under its fused name, concatenating merged pieces in row order, one at a time.

    `model` may live on the meta device: only its structure (names, shapes, `output_sizes`) is used, via the same plan
    `load_checkpoint` makes, so conversion validates exactly what loading would.
    """
    pieces: dict[str, list] = {}
    for copy in plan_load(model, checkpoint, strict=True).copies:
        pieces.setdefault(copy.destination.param, []).append(copy)
    for param, copies in pieces.items():
        copies.sort(key=lambda c: c.destination.start)
        tensors = [checkpoint.tensor(copy.name) for copy in copies]
        yield param, tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _fused_config(source_dir: Path, class_name: str) -> dict:
    """The source config.json, marked as fused (see the module docstring for why these two keys)."""
    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    return {**config, "architectures": [class_name], LAYOUT_KEY: FUSED}


def _empty_or_absent(out_dir: Path) -> None:
    """Refuse to mix a new checkpoint into an existing one: the output must not exist or be an empty directory."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InputError(f"{out_dir} exists and is not an empty directory; choose a new OUT_DIR")


def _write_fused(source: Path, staging: Path, model_class: type, config, max_shard_size, allow_pickle: bool) -> None:
    """Write every file of the fused checkpoint into `staging`."""
    with torch.device("meta"):
        model = model_class(config)
    stacked = stacked_mapping(model)
    metadata = {
        "format": "pt",
        LAYOUT_KEY: FUSED,
        STACKED_KEY: json.dumps({merged: list(pieces) for merged, pieces in stacked.items()}),
        "fusegen_version": fusegen.__version__,
        "fusegen_class": model_class.__name__,
    }
    with open_checkpoint(source, allow_pickle=allow_pickle) as checkpoint:
        write_safetensors(
            staging, STEMS[FUSED], fused_tensors(model, checkpoint), metadata=metadata, max_shard_size=max_shard_size
        )
    (staging / "config.json").write_text(json.dumps(_fused_config(source, model_class.__name__), indent=2) + "\n")
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, staging / name)


def convert_checkpoint(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    model_type: str,
    *,
    generated_dir: str | os.PathLike = "generated",
    max_shard_size: int | str = "5GB",
    allow_pickle: bool = False,
) -> Path:
    """Convert `src_dir` (canonical layout) into a fused-layout checkpoint at `out_dir`; returns `out_dir`.

    Streams one merged tensor at a time (the model is built on `meta` only for its structure), so memory stays near one
    shard. Everything is written into a staging directory renamed into place at the end: a failed conversion leaves no
    `out_dir` behind.
    """
    source, target = Path(src_dir), Path(out_dir)
    _empty_or_absent(target)
    model_class = causal_lm_class(import_fused_module(generated_dir, model_type))
    config = read_config(source)
    if config.model_type != model_type:
        raise InputError(f"{source} holds a {config.model_type!r} model, not {model_type!r}")
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _write_fused(source, staging, model_class, config, max_shard_size, allow_pickle)
        if target.exists():
            target.rmdir()
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _shard_size(text: str) -> int:
    """argparse type: reject a bad size as a usage error (exit 2) before any work starts."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `fusegen convert CHECKPOINT_DIR OUT_DIR --model TYPE`."""
    parser = subparsers.add_parser("convert", help="write a fused-layout copy of a checkpoint for serving")
    parser.add_argument("checkpoint_dir", type=Path, metavar="CHECKPOINT_DIR")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument("--model", required=True, metavar="TYPE", help="model type, e.g. llama")
    parser.add_argument("--generated-dir", type=Path, default=Path("generated"), metavar="DIR")
    parser.add_argument("--max-shard-size", type=_shard_size, default="5GB", metavar="SIZE", help="e.g. 5GB, 500MB")
    parser.add_argument("--allow-pickle", action="store_true", help="accept pytorch_model.bin (weights_only load)")
    return parser


@command
def run(args: argparse.Namespace) -> int:
    """Exit 0 on success, 2 on bad input (message on stderr as `fusegen: error: ...`, see fusegen.errors)."""
    out = convert_checkpoint(
        args.checkpoint_dir,
        args.out_dir,
        args.model,
        generated_dir=args.generated_dir,
        max_shard_size=args.max_shard_size,
        allow_pickle=args.allow_pickle,
    )
    print(f"wrote {out} (fused layout)")
    return EXIT_OK
