"""`fusegen convert`: rewrite a canonical checkpoint into the fused layout, so a server can mmap merged tensors as-is.

In the fused layout each merged linear is stored whole (`model.layers.0.self_attn.qkv_proj.weight`), and the
checkpoint says what it is in three places:

- every safetensors header: `{"format": "pt", "fusegen_layout": "fused", "fusegen_stacked": <row order>,
  "fusegen_version", "fusegen_class", "fusegen_source": <source fingerprint>}` (what `load_checkpoint` reads);
- config.json: `architectures: [<fused class>]`, `fusegen_layout: "fused"`, and a `fusegen` entry with the layout,
  the weights file, the fused class, the row order and the source checkpoint's fingerprint (SHA-256 and size of every
  source weight file, the same digest the hub lists for a file, plus the SHA-256 of its config.json);
- config.json's `transformers_weights`: a refusal message, see below.

The two properties the layout must have, and how the file names and config give both:

- **The original class refuses it, loudly, naming fusegen.** Handed fused tensors in `model.safetensors`,
  `LlamaForCausalLM.from_pretrained` does not fail: it prints a load report (qkv_proj "UNEXPECTED", q/k/v "MISSING"),
  randomly initialises the missing weights and returns a model that generates garbage. The only config field a
  concrete class consults before touching weights is `transformers_weights` (the weights file to read); it must end
  in `.safetensors` or `.safetensors.index.json`, else Transformers raises `ValueError: The transformers file in the
  config seems to be incorrect: ... : <the value>`. So the value is a sentence naming fusegen and the class to use,
  and `LlamaForCausalLM` / `AutoModelForCausalLM.from_pretrained` raise that before building anything. The weights
  themselves are named `fused*.safetensors`, a stem Transformers never looks for (not even via `variant=`), so a
  config stripped of that entry still fails (`OSError: Error no file named model.safetensors ...`) instead of
  loading garbage. `model_type` is kept, so `AutoConfig` still reads the config (serving stacks need it), and vLLM
  refuses the unknown `architectures` entry.
- **The fused class loads it through `from_pretrained`, zero-copy.** Its `from_pretrained`
  (fusegen/runtime/pretrained.py) validates the files, checks the row order, and passes
  `transformers_weights=<the fused file>`, so Transformers memory-maps that file and hands every tensor, merged ones
  included, on as a view of the mapping, as it does for the original class and its own layout.
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
from fusegen.runtime.pretrained import FUSEGEN_KEY, WEIGHTS_KEY
from fusegen.tools.checkpoint_cli import add_checkpoint_arguments, refuse_existing, staged_directory

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


def read_config(checkpoint_dir: str | os.PathLike, model_type: str | None = None):
    """The checkpoint's config via AutoConfig; any failure is the user's input, so it becomes an InputError, and so
    does a config of another type than `model_type` (when given: the command's `--model`)."""
    from transformers import AutoConfig

    if not (Path(checkpoint_dir) / "config.json").is_file():  # else AutoConfig takes the path for a hub repo id
        raise InputError(f"{checkpoint_dir}: no config.json (not a checkpoint directory?)")
    _check_model_type(Path(checkpoint_dir) / "config.json")
    try:
        config = AutoConfig.from_pretrained(checkpoint_dir)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"{checkpoint_dir}: cannot read config.json: {error}") from error
    if model_type is not None and config.model_type != model_type:
        raise InputError(f"{checkpoint_dir} holds a {config.model_type!r} model, not {model_type!r}")
    return config


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
    """Yield each model tensor under its fused name, merged pieces in row order, one tensor at a time.

    `model` may live on the meta device: only its structure (names, shapes, `output_sizes`) is used, via the same plan
    `load_checkpoint` makes, so conversion validates exactly what loading would. Each tensor is allocated once, in the
    checkpoint's dtype (merged pieces of different dtypes are promoted as `torch.cat` would), and every piece is read
    from its file straight into its rows: no concatenated temporary, no memory-mapped page touched.
    """
    pieces: dict[str, list] = {}
    for copy in plan_load(model, checkpoint, strict=True).copies:
        pieces.setdefault(copy.destination.param, []).append(copy)
    for param, copies in pieces.items():
        copies.sort(key=lambda c: c.destination.start)
        first = copies[0].source
        if len(copies) == 1:
            tensor = torch.empty(first.shape, dtype=first.dtype)
            checkpoint.read_into(copies[0].name, tensor)
        else:
            dtype = first.dtype
            for copy in copies[1:]:
                dtype = torch.promote_types(dtype, copy.source.dtype)
            tensor = torch.empty((sum(c.source.shape[0] for c in copies), *first.shape[1:]), dtype=dtype)
            for copy in copies:
                checkpoint.read_into(copy.name, tensor.narrow(0, copy.destination.start, copy.source.shape[0]))
        yield param, tensor


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def source_fingerprint(source: Path, checkpoint: Checkpoint) -> dict:
    """What the fused checkpoint was made from: SHA-256 and size of each source weight file (the digest the hub lists
    for an LFS file, so a conversion can be traced to a hub revision) and of its index and config.json."""
    files = [*checkpoint.files, *([checkpoint.index] if checkpoint.index else [])]
    return {
        "files": {path.name: {"sha256": _sha256(path), "bytes": path.stat().st_size} for path in files},
        "config_sha256": _sha256(source / "config.json"),
    }


def refusal_message(class_name: str, weights: str) -> str:
    """config.json's `transformers_weights` in the fused layout: what the original class's from_pretrained raises
    with (it is not a `.safetensors` name, see the module docstring); the fused class replaces it on load."""
    return (
        f"fusegen fused layout ({weights} holds merged tensors such as qkv_proj): load it with the "
        f"fusegen-generated {class_name}, or load the canonical checkpoint it was converted from with "
        f"{class_name.removeprefix('Fused')}"
    )


def _fused_config(source_dir: Path, class_name: str, description: dict) -> dict:
    """The source config.json, marked as fused (see the module docstring for why each key)."""
    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    return {
        **config,
        "architectures": [class_name],
        LAYOUT_KEY: FUSED,
        FUSEGEN_KEY: description,
        WEIGHTS_KEY: refusal_message(class_name, description["weights"]),
    }


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
        fingerprint = source_fingerprint(source, checkpoint)
        metadata["fusegen_source"] = json.dumps(fingerprint, sort_keys=True)
        written = write_safetensors(
            staging, STEMS[FUSED], fused_tensors(model, checkpoint), metadata=metadata, max_shard_size=max_shard_size
        )
    description = {
        "layout": FUSED,
        "weights": written[-1].name,  # the index when sharded (written last), else the one file
        "class": model_class.__name__,
        "version": fusegen.__version__,
        "stacked": json.loads(metadata[STACKED_KEY]),
        "source": fingerprint,
    }
    config = _fused_config(source, model_class.__name__, description)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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
    shard. Everything is written into a staging directory renamed into place at the end
    (`fusegen.tools.checkpoint_cli.staged_directory`): a failed conversion leaves no `out_dir` behind.
    """
    source, target = Path(src_dir), Path(out_dir)
    refuse_existing(target)
    model_class = causal_lm_class(import_fused_module(generated_dir, model_type))
    config = read_config(source, model_type)
    with staged_directory(target) as staging:
        _write_fused(source, staging, model_class, config, max_shard_size, allow_pickle)
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
    add_checkpoint_arguments(parser, output=True)
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
