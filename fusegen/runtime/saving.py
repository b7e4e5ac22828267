"""Saving a fused model in the canonical layout the original Transformers class loads, without `save_pretrained`.

Merged tensors are written as their canonical pieces: views of the merged tensor split by `output_sizes` (bit-exact,
no copy of the model). `write_safetensors` shards by size, writes each file under a temporary name and renames it, so
a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from .files import CANONICAL, STEMS
from .merged import stacked_mapping
from .plan import model_targets

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like `"5GB"` (decimal, as Transformers reads it) or `"5GiB"` (binary)."""
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE_RE.match(str(size))
        if not match:
            raise ValueError(f"cannot read {size!r} as a size (e.g. 5GB, 500MB, 20KB, 4GiB)")
        number, prefix, binary = match.groups()
        base = 1024 if binary else 1000
        value = int(float(number) * base ** " KMGT".index(prefix.upper() or " "))
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def _replace_atomically(write: Callable[[Path], None], target: Path) -> None:
    """Write via a temporary sibling and rename, so a reader never sees a half-written file."""
    temporary = target.with_name(f".{target.name}.partial")
    write(temporary)
    os.replace(temporary, target)


def _stale_files(directory: Path, stem: str, keep: set[Path]) -> list[Path]:
    """Earlier weight files of the same stem that this save does not rewrite (they would confuse loaders)."""
    pattern = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.safetensors(\.index\.json)?$")
    return [path for path in directory.iterdir() if pattern.match(path.name) and path not in keep]


def write_safetensors(
    directory: str | os.PathLike,
    stem: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata: Mapping[str, str],
    max_shard_size: int | str = "5GB",
) -> list[Path]:
    """Write `tensors` as `{stem}.safetensors`, or as `{stem}-0000i-of-0000n.safetensors` plus an index when they
    exceed `max_shard_size`. `tensors` is consumed lazily, so at most one shard is held in memory.

    Each file is written under a temporary name and renamed, and stale files of the same stem are removed last; other
    files in `directory` are left alone. Returns the files written (index last).
    """
    directory, limit = Path(directory), parse_size(max_shard_size)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes, total = 0, 0

    def flush() -> None:
        temporary = directory / f".{stem}-{len(shards) + 1:05d}.partial"
        save_file(pending, str(temporary), metadata=dict(metadata))
        shards.append((temporary, list(pending)))

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + nbytes > limit:
            flush()
            pending, pending_bytes = {}, 0
        pending[name] = tensor.detach().to("cpu").contiguous()
        pending_bytes, total = pending_bytes + nbytes, total + nbytes
    if pending or not shards:
        flush()
    pending = {}

    count = len(shards)
    names = (
        [f"{stem}.safetensors"]
        if count == 1
        else [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    )
    written = []
    for (temporary, _), name in zip(shards, names):
        os.replace(temporary, directory / name)
        written.append(directory / name)
    if count > 1:
        index = {
            "metadata": {"total_size": total, **metadata},
            "weight_map": {tensor: name for (_, tensor_names), name in zip(shards, names) for tensor in tensor_names},
        }
        index_path = directory / f"{stem}.safetensors.index.json"
        _replace_atomically(lambda p: p.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n"), index_path)
        written.append(index_path)
    for stale in _stale_files(directory, stem, set(written)):
        stale.unlink()
    return written


def canonical_tensors(model: torch.nn.Module, stacked: Mapping | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under canonical names: merged rows as views split by `output_sizes`, tied aliases once.

    Views, not copies, so saving never duplicates the model in memory.
    """
    targets = model_targets(model, stacked_mapping(model, stacked), CANONICAL)
    for group in targets.groups:
        yield group[0], targets.by_name[group[0]].view()


def save_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    stacked: Mapping | None = None,
) -> list[Path]:
    """Save `model` in the canonical layout the original Transformers class loads, plus `config.json`.

    Merged tensors are split back into their pieces by `output_sizes` (bit-exact); a tied `lm_head.weight` is omitted as
    Transformers does. Sharded with an index beyond `max_shard_size`. Returns the weight files written.
    """
    written = write_safetensors(
        path,
        STEMS[CANONICAL],
        canonical_tensors(model, stacked),
        metadata={"format": "pt"},
        max_shard_size=max_shard_size,
    )
    model.config.save_pretrained(path)
    return written
