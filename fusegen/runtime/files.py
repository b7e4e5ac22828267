"""Step 1 of loading a checkpoint: find its weight files and read their headers, no tensor data.

`open_checkpoint` finds the weight files, checks every path stays inside the checkpoint directory, reads the
safetensors headers (names, shapes, dtypes, layout metadata) and cross-checks them with the index. The `Checkpoint` it
returns reads tensor bytes on demand (`read_into`), straight from the file into the destination's memory.

Two on-disk layouts are understood. The canonical one is Transformers' own (`q_proj`/`k_proj`/`v_proj` tensors in
`model*.safetensors`). The fused one (written by `fusegen convert`) stores merged tensors as such in
`fused*.safetensors`, with `fusegen_layout: fused` in every header; see `fusegen/tools/convert.py` for why its file
names differ. The load plan is `fusegen/runtime/plan.py`, the copy `fusegen/runtime/loading.py`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open

from .merged import normalise_stacked

CANONICAL, FUSED = "canonical", "fused"
LAYOUT_KEY = "fusegen_layout"
STACKED_KEY = "fusegen_stacked"
# Weight-file stems per layout. Fused checkpoints deliberately avoid Transformers' `model` stem, see convert.py.
STEMS = {CANONICAL: "model", FUSED: "fused"}
_PICKLE_SINGLE, _PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

# safetensors dtype names (as `get_slice().get_dtype()` reports them) -> torch dtypes, so plans can check dtype kinds and
# compute sizes without reading data. Names torch lacks are simply absent and reported as unsupported.
_SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
    }.items()
    if hasattr(torch, attr)
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked. The message names the file and, where one is involved, the tensor.

    A `ValueError` so callers that already treat bad input as `ValueError` keep working; `file` and `tensor` are kept as
    attributes for programs that want to act on them.
    """

    def __init__(self, problem: str, *, file: str | os.PathLike | None, tensor: str | None = None):
        self.problem, self.file, self.tensor = problem, None if file is None else str(file), tensor
        where = self.file or "<checkpoint>"
        super().__init__(f"{where}: tensor {tensor!r}: {problem}" if tensor else f"{where}: {problem}")

    def __reduce__(self):  # keyword-only init: spell out how to rebuild it (multiprocessing pickles exceptions)
        return _rebuild_error, (self.problem, self.file, self.tensor)


def _rebuild_error(problem: str, file: str | None, tensor: str | None) -> CheckpointError:
    return CheckpointError(problem, file=file, tensor=tensor)


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says about one tensor: enough to plan and size a copy without reading it."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


class _DuplicateKey(Exception):
    """Raised by the JSON hook: `json` would otherwise keep the last of two equal keys without a word."""

    def __init__(self, key: str):
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    """Whether `path`, with every symlink followed, lies in one of `roots` (already resolved)."""
    resolved = path.resolve()
    return any(resolved == root or resolved.is_relative_to(root) for root in roots)


def _contained_file(path: Path, roots: Sequence[Path], *, cited: Path, tensor: str | None = None) -> Path:
    """Return `path` if it is a regular file inside the allowed roots; refuse it otherwise.

    Checked for every file read, not only index entries: a `model.safetensors` symlink can point anywhere too.
    """
    if not _inside(path, roots):
        raise CheckpointError(
            f"{path.name} resolves to {path.resolve()}, outside the checkpoint directory; refused "
            "(pass allowed_roots= to trust another directory, e.g. a hub cache's blobs/)",
            file=cited,
            tensor=tensor,
        )
    if not path.is_file():
        raise CheckpointError(f"names {path.name}, which does not exist or is not a file", file=cited, tensor=tensor)
    return path


def _shard_path(root: Path, relative: object, roots: Sequence[Path], *, index: Path, tensor: str) -> Path:
    """Resolve an index's shard entry, refusing absolute paths and `..` before touching the file system."""
    if not isinstance(relative, str) or not relative:
        raise CheckpointError(f"shard name {relative!r} is not a file name", file=index, tensor=tensor)
    posix = PurePosixPath(relative.replace("\\", "/"))
    if posix.is_absolute() or PureWindowsPath(relative).drive or ".." in posix.parts:
        raise CheckpointError(
            f"shard path {relative!r} escapes the checkpoint directory; refused", file=index, tensor=tensor
        )
    return _contained_file(root / posix, roots, cited=index, tensor=tensor)


def _read_index(index: Path, root: Path, roots: Sequence[Path]) -> dict[str, Path]:
    """Parse an index's `weight_map` (tensor -> shard path), validating every shard path."""
    try:
        document = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as duplicate:
        raise CheckpointError(
            "listed twice in the index (the same tensor in two shards)", file=index, tensor=duplicate.key
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"unreadable index: {error}", file=index) from error
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError("index has no `weight_map` object", file=index)
    return {name: _shard_path(root, shard, roots, index=index, tensor=name) for name, shard in weight_map.items()}


@dataclass(frozen=True)
class _Found:
    """Which weight files make up a checkpoint, before any of them is opened."""

    kind: str  # "safetensors" | "pickle"
    index: Path | None
    files: tuple[Path, ...]
    listed: dict[str, Path] | None  # tensor -> file, as the index says


def weight_file_schemes(root: Path) -> list[tuple[str, Path, Path]]:
    """(kind, single file, index) per naming scheme that has any file present, in the order Transformers prefers."""
    schemes = [
        ("safetensors", root / f"{STEMS[CANONICAL]}.safetensors", root / f"{STEMS[CANONICAL]}.safetensors.index.json"),
        ("safetensors", root / f"{STEMS[FUSED]}.safetensors", root / f"{STEMS[FUSED]}.safetensors.index.json"),
        ("pickle", root / _PICKLE_SINGLE, root / _PICKLE_INDEX),
    ]
    return [scheme for scheme in schemes if scheme[1].exists() or scheme[2].exists()]


def _find_files(root: Path, *, allow_pickle: bool, roots: Sequence[Path]) -> _Found:
    """Pick the checkpoint's weight files, refusing ambiguity (two layouts, single file plus index) and pickles."""
    if not root.is_dir():
        raise CheckpointError("not a checkpoint directory", file=root)
    found = weight_file_schemes(root)
    if not found:
        raise CheckpointError(
            "no weights: expected model.safetensors, model.safetensors.index.json, fused.safetensors(.index.json) "
            "or pytorch_model.bin(.index.json)",
            file=root,
        )
    safetensors_schemes = [scheme for scheme in found if scheme[0] == "safetensors"]
    if len(safetensors_schemes) > 1:
        names = [p.name for _, single, index in safetensors_schemes for p in (single, index) if p.exists()]
        raise CheckpointError(
            f"holds both canonical and fused weight files ({', '.join(names)}); ambiguous", file=root
        )
    kind, single, index = (safetensors_schemes or found)[0]
    if kind == "pickle" and not allow_pickle:
        raise CheckpointError(
            "only pickle weights (pytorch_model.bin*): refused, since unpickling can run code; "
            "convert to safetensors or pass allow_pickle=True (loads with torch.load(weights_only=True))",
            file=single if single.exists() else index,
        )
    if single.exists() and index.exists():
        raise CheckpointError(f"both {single.name} and {index.name} exist; remove the stale one", file=root)
    if single.exists():
        return _Found(kind, None, (_contained_file(single, roots, cited=single),), None)
    listed = _read_index(_contained_file(index, roots, cited=index), root, roots)
    return _Found(kind, index, tuple(dict.fromkeys(listed.values())), listed)


def _raw_header(path: Path) -> tuple[int, dict]:
    """(offset where tensor data starts, header JSON), parsed with the stdlib; ValueError/OSError if malformed."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, too short for a header")
        header_size = int.from_bytes(prefix, "little")
        if 8 + header_size > size:
            raise ValueError(f"header claims {header_size} bytes, the file has {size}")
        header = json.loads(handle.read(header_size))
    return 8 + header_size, header


def _diagnose_safetensors(path: Path) -> tuple[str | None, str]:
    """Explain why safetensors refused a file, naming the first tensor whose bytes are missing if it is truncated.

    Used only after safetensors has already refused the file, so its validation stays the authority.
    """
    try:
        data_start, header = _raw_header(path)
        available = path.stat().st_size - data_start
    except (OSError, ValueError) as error:
        return None, f"corrupt safetensors file ({error})"
    if not isinstance(header, dict):
        return None, "corrupt safetensors file (header is not a JSON object)"
    ends = sorted(
        (spec["data_offsets"][-1], name)
        for name, spec in header.items()
        if isinstance(spec, dict) and isinstance(spec.get("data_offsets"), list) and spec["data_offsets"]
        if isinstance(spec["data_offsets"][-1], int)
    )
    for end, name in ends:
        if end > available:
            return name, f"truncated safetensors file: tensor data runs to byte {end}, the file holds {available}"
    return None, "corrupt safetensors file"


def _read_exactly(file, offset: int, buffer: memoryview) -> None:
    """Fill `buffer` from `offset`; raw reads may return short, and a file cut after validation must not pass."""
    file.seek(offset)
    done = 0
    while done < len(buffer):
        count = file.readinto(buffer[done:])
        if not count:
            raise OSError(f"file ended {len(buffer) - done} bytes early")
        done += count


def _raw_readable(destination: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether file bytes can go straight into `destination`'s memory: same dtype, CPU, contiguous, little-endian."""
    return (
        destination.dtype == dtype
        and destination.device.type == "cpu"
        and destination.dim() > 0
        and destination.is_contiguous()
        and sys.byteorder == "little"  # safetensors stores little-endian
    )


_BOUNCE_BYTES = 1 << 24


def _read_converting(file, offset: int, info: TensorInfo, destination: torch.Tensor) -> None:
    """Read a tensor stored as `info.dtype` into `destination` of another dtype or device, in chunks of <= 16 MiB.

    Positioned reads into one small reusable buffer, each chunk converted by `copy_` into its elements of the
    destination: no whole-tensor temporary and no memory-mapped page (a file cut after validation is a short read,
    hence an error, where reading the mapping would kill the process with SIGBUS).
    """
    numel, itemsize = info.nbytes // info.dtype.itemsize, info.dtype.itemsize
    per_chunk = max(1, _BOUNCE_BYTES // itemsize)
    target = destination.view(-1) if destination.is_contiguous() else None
    if target is None:  # a strided destination: read the whole tensor once, then copy
        whole = torch.empty(info.shape, dtype=info.dtype)
        _read_exactly(file, offset, memoryview(whole.view(torch.uint8).reshape(-1).numpy()))
        destination.copy_(whole)
        return
    bounce = torch.empty(min(numel, per_chunk) * itemsize, dtype=torch.uint8)
    for start in range(0, numel, per_chunk):
        count = min(per_chunk, numel - start)
        chunk = bounce[: count * itemsize]
        _read_exactly(file, offset + start * itemsize, memoryview(chunk.numpy()))
        target[start : start + count].copy_(chunk.view(info.dtype))


class _SafetensorsFile:
    """One opened `.safetensors` file: header validated by safetensors, data read on demand.

    Data goes straight from the file into the destination's memory (`readinto`) when the bytes are usable as-is:
    no temporary tensor, and no memory-mapped pages left resident (which would count towards RSS while the file is
    open). Otherwise (dtype conversion, GPU destination) through a small reusable buffer and `copy_`
    (`_read_converting`); only a big-endian host reads through safetensors' memory-mapped tensor.
    """

    def __init__(self, path: Path, stack: ExitStack):
        self.path = path
        try:
            self._handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            data_start, header = _raw_header(path)
        except (SafetensorError, OSError, ValueError) as error:
            tensor, problem = _diagnose_safetensors(path)
            raise CheckpointError(f"{problem} ({error})", file=path, tensor=tensor) from error
        self._file = stack.enter_context(path.open("rb", buffering=0))
        self._offsets = {
            name: data_start + spec["data_offsets"][0] for name, spec in header.items() if name != "__metadata__"
        }
        self._infos = self._read_infos()

    def _read_infos(self) -> dict[str, TensorInfo]:
        infos = {}
        for name in self._handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            view = self._handle.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
            if dtype is None:
                raise CheckpointError(f"unsupported dtype {view.get_dtype()}", file=self.path, tensor=name)
            infos[name] = TensorInfo(self.path, tuple(view.get_shape()), dtype)
        return infos

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def metadata(self) -> dict[str, str]:
        return self._handle.metadata() or {}

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle.get_tensor(name)

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        if _raw_readable(destination, self._infos[name].dtype):
            buffer = destination.view(torch.uint8).reshape(-1).numpy()
            _read_exactly(self._file, self._offsets[name], memoryview(buffer))
        elif sys.byteorder == "little" and self._infos[name].nbytes:
            _read_converting(self._file, self._offsets[name], self._infos[name], destination)
        else:
            destination.copy_(self.tensor(name))


class _PickleFile:
    """One `pytorch_model*.bin`, loaded with `weights_only=True` and memory-mapped when the format allows it."""

    def __init__(self, path: Path, stack: ExitStack):
        self.path = path
        self._tensors = self._load(path)

    @staticmethod
    def _load(path: Path) -> dict[str, torch.Tensor]:
        try:
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (pre-zip) files cannot be memory-mapped
                loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # torch.load raises many kinds (UnpicklingError, EOFError, RuntimeError, ...)
            raise CheckpointError(f"unreadable pickle checkpoint: {error}", file=path) from error
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise CheckpointError("pickle checkpoint is not a flat {name: tensor} state dict", file=path)
        return loaded

    def infos(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo(self.path, tuple(t.shape), t.dtype) for name, t in self._tensors.items()}

    def metadata(self) -> dict[str, str]:
        return {}

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        destination.copy_(self._tensors[name])


def _merge_infos(files: Sequence, listed: Mapping[str, Path] | None, index: Path | None) -> dict[str, TensorInfo]:
    """All tensors of all files; each must live in exactly one file, and agree with the index if there is one."""
    infos: dict[str, TensorInfo] = {}
    for opened in files:
        for name, info in opened.infos().items():
            if name in infos:
                raise CheckpointError(
                    f"stored in two shards: {infos[name].file.name} and {info.file.name}", file=info.file, tensor=name
                )
            infos[name] = info
    for name, path in (listed or {}).items():
        if name not in infos or infos[name].file != path:
            raise CheckpointError(
                f"the index places it in {path.name}, which does not hold it", file=index, tensor=name
            )
    for name, info in infos.items():
        if listed is not None and name not in listed:
            raise CheckpointError(f"held by {info.file.name} but not listed in the index", file=index, tensor=name)
    return infos


def _layout_of(files: Sequence) -> tuple[str, dict[str, tuple[str, ...]] | None]:
    """The layout all files agree on (from header metadata), and the stacked mapping a fused checkpoint was made with."""
    layouts = {opened.path: opened.metadata().get(LAYOUT_KEY, CANONICAL) for opened in files}
    for path, layout in layouts.items():
        if layout not in (CANONICAL, FUSED):
            raise CheckpointError(f"unknown {LAYOUT_KEY} {layout!r} in the header metadata", file=path)
        if layout != layouts[files[0].path]:
            raise CheckpointError(f"layout {layout!r} differs from {files[0].path.name}'s; mixed shards", file=path)
    layout = layouts[files[0].path]
    raw = files[0].metadata().get(STACKED_KEY) if layout == FUSED else None
    try:
        stacked = normalise_stacked(json.loads(raw)) if raw else None
    except (json.JSONDecodeError, AttributeError, TypeError, IndexError) as error:
        raise CheckpointError(f"unreadable {STACKED_KEY} metadata: {error}", file=files[0].path) from error
    return layout, stacked


@dataclass
class Checkpoint:
    """An opened checkpoint: every header read and cross-checked, no tensor data read. Close it (or use `with`)."""

    root: Path
    layout: str
    index: Path | None
    files: tuple[Path, ...]
    infos: dict[str, TensorInfo]
    stacked: dict[str, tuple[str, ...]] | None
    _opened: dict[Path, object] = field(repr=False)
    _stack: ExitStack = field(repr=False)

    @property
    def where(self) -> Path:
        """The file to cite for checkpoint-wide problems (a missing tensor has no file of its own)."""
        return self.index or self.files[0]

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor into new memory."""
        return self._opened[self.infos[name].file].tensor(name)

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        """Copy one tensor into `destination` (same shape), converting dtype if needed."""
        self._opened[self.infos[name].file].read_into(name, destination)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_checkpoint(
    path: str | os.PathLike, *, allow_pickle: bool = False, allowed_roots: Iterable[str | os.PathLike] = ()
) -> Checkpoint:
    """Find, open and validate a checkpoint directory's weight files, reading headers only.

    `allowed_roots`: extra directories that symlinked weight files may resolve into (the hub cache keeps snapshots as
    symlinks into `../../blobs/`); by default everything read must resolve inside `path`.
    """
    root = Path(path)
    roots = [root.resolve(), *(Path(extra).resolve() for extra in allowed_roots)]
    found = _find_files(root, allow_pickle=allow_pickle, roots=roots)
    opener = _SafetensorsFile if found.kind == "safetensors" else _PickleFile
    stack = ExitStack()
    try:
        opened = {file: opener(file, stack) for file in found.files}
        infos = _merge_infos(list(opened.values()), found.listed, found.index)
        layout, stacked = _layout_of(list(opened.values()))
    except BaseException:
        stack.close()
        raise
    return Checkpoint(root, layout, found.index, found.files, infos, stacked, opened, stack)
