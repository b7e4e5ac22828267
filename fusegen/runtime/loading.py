"""Serving-grade checkpoint loading and saving for fused models, without going through `from_pretrained`.

Why a second loader: `from_pretrained` is general (device maps, quantizers, conversion ops that gather the q/k/v pieces
and concatenate them) and reports a bad checkpoint as a warning table while returning a partly random model. A server
wants the opposite: refuse anything doubtful, and do it before a single byte is copied. So loading is split in three
steps with no data read until the last one:

1. `open_checkpoint` finds the weight files, checks every path stays inside the checkpoint directory, and reads the
   safetensors headers (names, shapes, dtypes, layout metadata) -- no tensor data.
2. `plan_load` matches every checkpoint tensor to its destination: a whole parameter, or a row slice of a merged
   (`MergedColumnLinear`) parameter found through `output_sizes` and the generated file's `STACKED_PARAMS_MAPPING`.
   Missing, unexpected and wrongly shaped tensors fail here, all at once.
3. The copy: each tensor's bytes are read from the file (positioned reads, never the memory map) straight into its
   destination's memory, or, when a dtype conversion or a GPU is involved, through a reusable 16 MiB buffer and
   `copy_`; no state dict, no per-tensor temporary and no second copy of the model ever exists.

The model must already be materialised (e.g. `FusedLlamaForCausalLM(config)`); a `meta` model is refused because
copying into meta tensors silently does nothing, and `to_empty` would leave non-persistent buffers (rotary `inv_freq`)
uninitialised.

Two on-disk layouts are understood. The canonical one is Transformers' own (`q_proj`/`k_proj`/`v_proj` tensors in
`model*.safetensors`). The fused one (written by `fusegen convert`) stores merged tensors as such in
`fused*.safetensors`, with `fusegen_layout: fused` in every header; see `fusegen/tools/convert.py` for why its file names
differ.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .linear import absent_bias_pieces

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


# --------------------------------------------------------------------------------------------------------------------
# Step 1: find and open the weight files (headers only)
# --------------------------------------------------------------------------------------------------------------------


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


def _candidates(root: Path) -> list[tuple[str, Path, Path]]:
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
    found = _candidates(root)
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


# --------------------------------------------------------------------------------------------------------------------
# Step 2: match checkpoint tensors to model tensors
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Destination:
    """Where one checkpoint tensor goes: rows `[start, start + shape[0])` of `tensor`, or all of it when `whole`."""

    param: str  # the model's state-dict name of the destination (first name, if tied)
    tensor: torch.Tensor
    start: int
    shape: tuple[int, ...]
    whole: bool

    def view(self) -> torch.Tensor:
        data = self.tensor.detach()
        return data if self.whole else data.narrow(0, self.start, self.shape[0])


@dataclass(frozen=True)
class _Targets:
    """Every checkpoint name a model accepts, and which names must be present (any one name of each group)."""

    by_name: dict[str, Destination]
    groups: tuple[tuple[str, ...], ...]


def stacked_mapping(model: torch.nn.Module, stacked: Mapping | None = None) -> dict[str, tuple[str, ...]]:
    """Merged linear attribute name -> canonical piece names in row order.

    Taken from `stacked` if given, else from the `STACKED_PARAMS_MAPPING` of the module that defines the model's class
    (every generated file has one), so the generated file need not be imported by name. Pieces may be vLLM-style
    `(name, shard_id)` tuples or bare names.
    """
    if stacked is None:
        stacked = getattr(sys.modules.get(type(model).__module__), "STACKED_PARAMS_MAPPING", None) or {}
    return normalise_stacked(stacked)


def normalise_stacked(stacked: Mapping) -> dict[str, tuple[str, ...]]:
    """Drop vLLM shard ids: only the piece names and their order matter for loading."""
    return {
        merged: tuple(piece[0] if isinstance(piece, (tuple, list)) else piece for piece in pieces)
        for merged, pieces in stacked.items()
    }


def _merged_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules holding merged rows, found by duck typing on `output_sizes` (survives an importlib.reload)."""
    return {
        path: module for path, module in model.named_modules() if getattr(module, "output_sizes", None) is not None
    }


def _pieces_for(path: str, module: torch.nn.Module, mapping: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The canonical names of a merged module's pieces, checked against its `output_sizes`."""
    attribute = path.rpartition(".")[2]
    pieces = mapping.get(attribute)
    if pieces is None:
        raise ValueError(
            f"{path} is a merged linear but {attribute!r} is not in the stacked mapping {sorted(mapping)}; "
            "pass stacked= or define STACKED_PARAMS_MAPPING in the model's module"
        )
    if len(pieces) != len(module.output_sizes):
        raise ValueError(f"{path}: mapping lists {pieces} but output_sizes is {module.output_sizes}")
    return pieces


def _piece_destinations(
    names: Sequence[str],
    tensor: torch.Tensor,
    pieces: Sequence[str],
    sizes: Sequence[int],
    absent: Container[int] = (),
) -> tuple[dict[str, Destination], list[tuple[str, ...]]]:
    """Canonical names for each row block of a merged tensor (for every alias of it), and one group per block.

    Blocks in `absent` (bias rows of a projection that has no bias, see `MergedColumnLinear`) have no canonical
    tensor: no name, nothing required on load, nothing written on save; loading sets them to zero.
    """
    by_name, groups, start = {}, [], 0
    for index, (piece, size) in enumerate(zip(pieces, sizes)):
        if index in absent:
            start += size
            continue
        shape = (size, *tensor.shape[1:])
        group = []
        for name in names:
            module_path, _, leaf = name.rpartition(".")
            parent = module_path.rpartition(".")[0]
            piece_name = f"{parent}.{piece}.{leaf}" if parent else f"{piece}.{leaf}"
            by_name[piece_name] = Destination(names[0], tensor, start, shape, whole=False)
            group.append(piece_name)
        groups.append(tuple(group))
        start += size
    return by_name, groups


def _targets(model: torch.nn.Module, mapping: Mapping[str, tuple[str, ...]], layout: str) -> _Targets:
    """Map each name the checkpoint may use to its destination in `model`.

    Tied tensors (the same Parameter under several state-dict names, e.g. `lm_head.weight` and
    `model.embed_tokens.weight`) form one group: any one of their names satisfies it, the first name is preferred, so
    a checkpoint that omits `lm_head.weight` (as Transformers saves tied models) is complete.
    """
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    merged = _merged_modules(model) if layout == CANONICAL else {}
    by_name: dict[str, Destination] = {}
    groups: list[tuple[str, ...]] = []
    for key, names in aliases.items():
        tensor = tensors[key]
        module_path = names[0].rpartition(".")[0]
        if module_path in merged:
            module = merged[module_path]
            pieces = _pieces_for(module_path, module, mapping)
            absent = absent_bias_pieces(module) if names[0].endswith(".bias") else []
            piece_names, piece_groups = _piece_destinations(names, tensor, pieces, module.output_sizes, absent)
            by_name.update(piece_names)
            groups.extend(piece_groups)
        else:
            for name in names:
                by_name[name] = Destination(names[0], tensor, 0, tuple(tensor.shape), whole=True)
            groups.append(tuple(names))
    return _Targets(by_name, tuple(groups))


def _listing(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_stacked(model: torch.nn.Module, checkpoint: Checkpoint, mapping: Mapping[str, tuple[str, ...]]) -> None:
    """A fused checkpoint's row order must be the model's: same total size with q/k/v swapped would load silently."""
    if checkpoint.layout != FUSED or checkpoint.stacked is None:
        return
    for path in _merged_modules(model):
        attribute = path.rpartition(".")[2]
        theirs = checkpoint.stacked.get(attribute)
        if theirs is not None and tuple(theirs) != tuple(mapping.get(attribute, ())):
            raise CheckpointError(
                f"merged rows are {list(theirs)} in the checkpoint but {list(mapping.get(attribute, ()))} in the model",
                file=checkpoint.files[0],
                tensor=f"{path}.weight",
            )


@dataclass(frozen=True)
class Copy:
    """One planned copy: checkpoint tensor `name` (described by `source`) into `destination`."""

    name: str
    source: TensorInfo
    destination: Destination


@dataclass(frozen=True)
class Plan:
    copies: tuple[Copy, ...]
    unexpected: tuple[str, ...]


def plan_load(
    model: torch.nn.Module, checkpoint: Checkpoint, *, strict: bool = True, stacked: Mapping | None = None
) -> Plan:
    """Decide every copy, or raise: missing tensors (always), unexpected ones (if strict), wrong shapes, float vs int.

    Non-strict mode only tolerates unexpected tensors (one warning lists them); a missing tensor always fails, since
    it would leave part of the model at its random initialisation.
    """
    mapping = stacked_mapping(model, stacked)
    targets = _targets(model, mapping, checkpoint.layout)
    _check_stacked(model, checkpoint, mapping)
    missing = [group[0] for group in targets.groups if not any(name in checkpoint.infos for name in group)]
    unexpected = sorted(set(checkpoint.infos) - set(targets.by_name))
    if missing:
        hint = f" (the checkpoint has unexpected {_listing(unexpected)}; wrong layout or model?)" if unexpected else ""
        raise CheckpointError(
            f"missing from the {checkpoint.layout} checkpoint: {_listing(missing)}{hint}",
            file=checkpoint.where,
            tensor=missing[0],
        )
    if unexpected:
        described = _listing([f"{name} ({checkpoint.infos[name].file.name})" for name in unexpected])
        if strict:
            raise CheckpointError(
                f"unexpected tensors not in the model: {described}", file=checkpoint.where, tensor=unexpected[0]
            )
        warnings.warn(f"{checkpoint.root}: ignoring {len(unexpected)} unexpected tensors: {described}", stacklevel=3)
    copies = []
    for group in targets.groups:
        name = next(name for name in group if name in checkpoint.infos)
        source, destination = checkpoint.infos[name], targets.by_name[name]
        _check_compatible(name, source, destination)
        copies.append(Copy(name, source, destination))
    return Plan(tuple(copies), tuple(unexpected))


def _check_compatible(name: str, source: TensorInfo, destination: Destination) -> None:
    """Shapes must match exactly; dtypes may differ (copy_ converts) but not across float / non-float."""
    if source.shape != destination.shape:
        raise CheckpointError(
            f"shape {list(source.shape)} in the checkpoint, {list(destination.shape)} expected by the model "
            f"({destination.param})",
            file=source.file,
            tensor=name,
        )
    if source.dtype.is_floating_point != destination.tensor.is_floating_point():
        raise CheckpointError(
            f"dtype {source.dtype} in the checkpoint cannot fill {destination.tensor.dtype} ({destination.param})",
            file=source.file,
            tensor=name,
        )


# --------------------------------------------------------------------------------------------------------------------
# Step 3: copy
# --------------------------------------------------------------------------------------------------------------------


def _require_materialised(model: torch.nn.Module) -> None:
    """Copying into meta tensors is a silent no-op, so refuse up front rather than 'load' nothing."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_meta:
            raise ValueError(f"{name} is on the meta device; build the model with real tensors before loading")


@torch.no_grad()
def _execute(plan: Plan, checkpoint: Checkpoint) -> None:
    """Stream each tensor into place, file by file, in file order."""
    order = {file: position for position, file in enumerate(checkpoint.files)}
    for copy in sorted(plan.copies, key=lambda c: order[c.source.file]):
        try:
            checkpoint.read_into(copy.name, copy.destination.view())
        except Exception as error:  # only I/O after validation lands here (file changed under us, disk error)
            raise CheckpointError(
                f"read failed after validation ({error}); the model is partially loaded, discard it",
                file=copy.source.file,
                tensor=copy.name,
            ) from error


@dataclass(frozen=True)
class LoadReport:
    layout: str
    files: tuple[Path, ...]
    copied: int
    unexpected: tuple[str, ...]


def load_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    stacked: Mapping | None = None,
    allowed_roots: Iterable[str | os.PathLike] = (),
) -> LoadReport:
    """Load a canonical or fused checkpoint directory into an already materialised `model`, in place.

    Everything (paths, names, shapes, dtype kinds) is validated from headers before any data is copied, so a bad
    checkpoint raises `CheckpointError` and leaves the model untouched. `stacked` overrides the
    `STACKED_PARAMS_MAPPING` found in the model's module; `allowed_roots`: see `open_checkpoint`.
    """
    _require_materialised(model)
    with open_checkpoint(path, allow_pickle=allow_pickle, allowed_roots=allowed_roots) as checkpoint:
        plan = plan_load(model, checkpoint, strict=strict, stacked=stacked)
        _execute(plan, checkpoint)
        _zero_absent_bias(model)
        return LoadReport(checkpoint.layout, checkpoint.files, len(plan.copies), plan.unexpected)


@torch.no_grad()
def load_weights(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *, stacked: Mapping | None = None
) -> set[str]:
    """vLLM-style streaming load: copy each `(name, tensor)` into place and return the model names that were filled.

    Accepts canonical names (q/k/v pieces go to their rows of the merged tensor) and fused names alike. Unlike
    `load_checkpoint` nothing can be validated ahead (the iterable is consumed once), so an unknown name or a wrong
    shape raises mid-way; compare the returned set with `model.state_dict()` keys to detect missing tensors.
    """
    mapping = stacked_mapping(model, stacked)
    targets = {**_targets(model, mapping, FUSED).by_name, **_targets(model, mapping, CANONICAL).by_name}
    loaded: set[str] = set()
    for name, tensor in weights:
        destination = targets.get(name)
        if destination is None:
            raise CheckpointError("not a tensor of the model", file="<weights iterable>", tensor=name)
        _check_compatible(name, TensorInfo(Path("<weights iterable>"), tuple(tensor.shape), tensor.dtype), destination)
        destination.view().copy_(tensor)
        loaded.add(destination.param)
    _zero_absent_bias(model)
    return loaded


def _zero_absent_bias(model: torch.nn.Module) -> None:
    """Zero the bias rows of merged pieces without a bias: no checkpoint fills them (see `_piece_destinations`)."""
    for module in _merged_modules(model).values():
        if absent_bias_pieces(module) and hasattr(module, "zero_absent_bias"):
            module.zero_absent_bias()


# --------------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------------

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
    targets = _targets(model, stacked_mapping(model, stacked), CANONICAL)
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
