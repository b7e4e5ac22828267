"""`fusegen export CKPT OUT --model TYPE`: a checkpoint that loads as the fused class through remote code.

OUT holds CKPT's files unchanged (the canonical weights, tokenizer, generation config), a copy of the generated
`fused_<type>.py`, and a `config.json` whose `auto_map` names the fused classes in it, so

    AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

builds the fused class, and `AutoModel` the fused base model: vLLM's Transformers backend builds
`AutoModel.from_config(config, trust_remote_code=True)` and puts its own LM head on it, so without that entry it would
serve the original base model from a fused export (docs/serving.md). Meanwhile `architectures` still names the original class (engines that ignore `auto_map`, and
`trust_remote_code=False`, load the original). The generated file imports `fusegen.runtime`; where it is not
installed, Transformers refuses the file with "requires the following packages ...: fusegen. Run `pip install
fusegen`". OUT is assembled in a staging directory renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from fusegen.errors import EXIT_OK, InputError, command
from fusegen.runtime.auto import CONFIG_NAME, canonical_architectures
from fusegen.runtime.merged import normalise_stacked
from fusegen.runtime.pretrained import FUSEGEN_KEY
from fusegen.tools.checkpoint_cli import add_checkpoint_arguments, refuse_existing, staged_directory
from fusegen.tools.convert import causal_lm_class, import_fused_module, read_config

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "fused.safetensors", "fused.safetensors.index.json")


def export(
    src_dir: str | os.PathLike, out_dir: str | os.PathLike, model_type: str, *, generated_dir="generated"
) -> Path:
    """Write the remote-code checkpoint directory `out_dir` from the checkpoint `src_dir`; returns it.

    `src_dir` is canonical, or the fused layout `fusegen convert` writes (`fused*.safetensors`, config.json's
    `fusegen` entry): its merged rows must be in the order of the generated file's `STACKED_PARAMS_MAPPING`, which is
    the order the fused class and vLLM's merged layers split them in (a fused tensor carries no names for its rows).
    """
    source, target = Path(src_dir), Path(out_dir)
    refuse_existing(target)
    module = import_fused_module(generated_dir, model_type)
    fused_class = causal_lm_class(module)
    read_config(source, model_type)
    if not any((source / name).is_file() for name in WEIGHTS):
        raise InputError(f"{source}: no {' or '.join(WEIGHTS)} (export copies safetensors weights)")
    code_name = Path(module.__file__).name
    document = json.loads((source / CONFIG_NAME).read_text(encoding="utf-8"))
    rows = (document.get(FUSEGEN_KEY) or {}).get("stacked")
    if rows is not None and normalise_stacked(rows) != normalise_stacked(module.STACKED_PARAMS_MAPPING):
        raise InputError(
            f"{source}: merged rows {rows} in config.json, but {Path(module.__file__).name} stacks "
            f"{normalise_stacked(module.STACKED_PARAMS_MAPPING)}; convert the canonical checkpoint again"
        )
    document["architectures"] = canonical_architectures(document.get("architectures")) or [
        fused_class.__name__.removeprefix("Fused")
    ]
    stem = Path(code_name).stem
    document["auto_map"] = {
        "AutoModel": f"{stem}.{base_model_class(module, model_type).__name__}",
        "AutoModelForCausalLM": f"{stem}.{fused_class.__name__}",
    }
    with staged_directory(target) as staging:
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name not in (CONFIG_NAME, code_name):
                shutil.copy2(path, staging / path.name)
        shutil.copy2(module.__file__, staging / code_name)
        (staging / CONFIG_NAME).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return target


def base_model_class(module, model_type: str) -> type:
    """The generated file's fused copy of the base model class `AutoModel` builds for `model_type`
    (`MODEL_MAPPING_NAMES`: llama -> LlamaModel, gemma3_text -> Gemma3TextModel), i.e. `Fused<that name>`."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = "Fused" + str(MODEL_MAPPING_NAMES.get(model_type, ""))
    found = getattr(module, name, None)
    if name not in getattr(module, "__all__", ()) or not (
        isinstance(found, type) and issubclass(found, PreTrainedModel)
    ):
        raise InputError(f"{module.__file__}: no fused base model class {name!r} for model type {model_type!r}")
    return found


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `fusegen export CHECKPOINT_DIR OUT_DIR --model TYPE`."""
    parser = subparsers.add_parser("export", help="write a checkpoint that loads as the fused class (remote code)")
    add_checkpoint_arguments(parser, output=True)
    return parser


@command
def run(args: argparse.Namespace) -> int:
    """Exit 0 on success, 2 on bad input (one `fusegen: error:` line, through `fusegen.errors.command`)."""
    try:
        out = export(args.checkpoint_dir, args.out_dir, args.model, generated_dir=args.generated_dir)
    except ValueError as error:  # a config.json Transformers cannot parse, say: the input's fault, not ours
        raise InputError(str(error)) from error
    print(f"wrote {out} (loads as the fused class with trust_remote_code=True)")
    return EXIT_OK
