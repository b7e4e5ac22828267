"""What the checkpoint commands (`convert`, `export`, `verify`) share: their arguments, and an output directory that
is written whole or not at all.

An output directory is assembled under a staging name next to it and renamed into place only once every file is
written, so a failed command leaves no half-written checkpoint behind, and an existing checkpoint is never mixed
into or replaced: the output must not exist or be an empty directory (`refuse_existing`, checked before any work and
again by the rename, which only replaces an empty directory).
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fusegen.errors import InputError


def add_checkpoint_arguments(parser: argparse.ArgumentParser, *, output: bool) -> None:
    """`CHECKPOINT_DIR`, with `output` also `OUT_DIR --model TYPE`, then `--generated-dir DIR` (default generated)."""
    parser.add_argument("checkpoint_dir", type=Path, metavar="CHECKPOINT_DIR")
    if output:
        parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
        parser.add_argument("--model", required=True, metavar="TYPE", help="model type, e.g. llama")
    parser.add_argument("--generated-dir", type=Path, default=Path("generated"), metavar="DIR")


def refuse_existing(out_dir: Path) -> None:
    """Refuse to mix a new checkpoint into an existing one: the output must not exist or be an empty directory."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InputError(f"{out_dir} exists and is not an empty directory; choose a new OUT_DIR")


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield an empty staging directory beside `target`; renamed to `target` when the block succeeds, removed always.

    The staging name carries the process id, so two commands writing beside each other do not share one. An empty
    `target` is replaced; a non-empty one makes `rmdir` fail, so good output is never overwritten.
    """
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        yield staging
        if target.exists():
            target.rmdir()
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
