"""How tensor bytes get from a checkpoint file into a merged parameter: once, in place, without touching the mmap.

Transformers' `from_pretrained` memory-maps each safetensors file and hands every checkpoint tensor on as a zero-copy
view of that mapping. A plain parameter simply keeps its view (nothing is copied; pages are read on first use). A
merged parameter cannot: its pieces (q, k, v) are separate tensors in the file, so they must be copied into new memory.
`torch.cat` does that through a concatenated temporary built by page-faulting the mapping, after which the pieces'
file pages stay mapped (and counted in RSS) next to the merged copy for as long as the file is open.

`PreallocatedConcatenate` (the base of `MergedColumnConcatenate`) does the same job differently:

- it allocates the merged tensor ONCE and copies each piece into its slice (`narrow`), so no concatenated temporary
  ever exists;
- when a piece is an untouched view of a file mapping (what Transformers hands on when no dtype conversion is
  needed), its bytes are read from the file with `pread` straight into the slice (`fill_from_file`). The mapping is
  never touched, so none of the pieces' pages become resident in this process, and a file cut short after it was
  validated yields a short read, reported as `CheckpointError`, instead of a SIGBUS;
- otherwise (a converted or device-resident piece, another OS) it falls back to `slice.copy_(piece)`, converting dtype
  per tensor.

Soundness of the file read: the piece is identified by ADDRESS, not by name. `/proc/self/maps` says which file (device
and inode) and file offset back the piece's memory; the file is opened by path and its device and inode compared, so a
file replaced under the same name is not read. The bytes read are then exactly the bytes the view would show, unless
someone wrote into the private mapping (copy-on-write); nothing between Transformers' materialisation and this op
writes into a checkpoint view. A wrong guess here costs nothing but speed: every check that fails falls back to
`copy_`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers.core_model_loading import Concatenate

from .files import CheckpointError

_MAPS = "/proc/self/maps"


@dataclass(frozen=True)
class FileRegion:
    """A file-backed memory mapping: `[start, end)` in this process shows the file from byte `offset` on."""

    start: int
    end: int
    offset: int
    device: tuple[int, int]
    inode: int
    path: str


def file_region(address: int) -> FileRegion | None:
    """The file mapping that holds `address`, read from /proc/self/maps; None when anonymous or not on Linux.

    Reading the maps file costs about a millisecond (the kernel formats it), so `reading_session` caches the
    regions it has seen, pinned by a tensor so that the range cannot be unmapped and reused while cached.
    """
    try:
        with open(_MAPS, "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    for line in text.split(b"\n"):
        span, _, rest = line.partition(b" ")
        low, _, high = span.partition(b"-")
        if not high or not int(low, 16) <= address < int(high, 16):
            continue
        fields = rest.split(None, 4)  # perms offset dev inode [path]
        if len(fields) < 5 or int(fields[3]) == 0 or not fields[4].startswith(b"/"):
            return None
        major, _, minor = fields[2].partition(b":")
        path = os.fsdecode(fields[4].rstrip())
        return FileRegion(
            int(low, 16), int(high, 16), int(fields[1], 16), (int(major, 16), int(minor, 16)), int(fields[3]), path
        )
    return None


@dataclass
class _Session:
    """Per-load caches: regions seen (each pinned by a tensor inside it) and open file descriptors."""

    regions: list[tuple[FileRegion, torch.Tensor]] = field(default_factory=list)
    files: dict[tuple[tuple[int, int], int], int] = field(default_factory=dict)

    def close(self) -> None:
        for descriptor in self.files.values():
            os.close(descriptor)
        self.files.clear()
        self.regions.clear()


_SESSION: ContextVar[_Session | None] = ContextVar("fusegen_reading_session", default=None)


@contextmanager
def reading_session() -> Iterator[None]:
    """Cache file regions and descriptors for the duration of one load (see `file_region`); everything is released
    on exit, so no mapping is kept alive and no descriptor leaks. Nested sessions reuse the outer one."""
    if _SESSION.get() is not None:
        yield
        return
    session = _Session()
    token = _SESSION.set(session)
    try:
        yield
    finally:
        _SESSION.reset(token)
        session.close()


def _region_of(tensor: torch.Tensor) -> FileRegion | None:
    address = tensor.data_ptr()
    session = _SESSION.get()
    if session is not None:
        for region, _ in session.regions:
            if region.start <= address < region.end:
                return region
    region = file_region(address)
    if region is not None and session is not None:
        session.regions.append((region, tensor))  # the pin: the range stays this file's while cached
    return region


def _open_region_file(region: FileRegion) -> tuple[int, bool]:
    """(descriptor, whether the caller must close it) of the file behind `region`, or (-1, False) if the file at
    that path is no longer the mapped one (replaced or deleted)."""
    session = _SESSION.get()
    key = (region.device, region.inode)
    if session is not None and key in session.files:
        return session.files[key], False
    try:
        descriptor = os.open(region.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1, False
    status = os.fstat(descriptor)
    if (os.major(status.st_dev), os.minor(status.st_dev), status.st_ino) != (*region.device, region.inode):
        os.close(descriptor)
        return -1, False
    if session is not None:
        session.files[key] = descriptor
        return descriptor, False
    return descriptor, True


def _preadable(destination: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether `source`'s bytes can go verbatim into `destination`: same dtype and shape, both plain contiguous CPU
    tensors, little-endian host (safetensors stores little-endian)."""
    return (
        type(source) in (torch.Tensor, torch.nn.Parameter)
        and source.device.type == "cpu"
        and destination.device.type == "cpu"
        and source.dtype == destination.dtype
        and source.shape == destination.shape
        and source.numel() > 0
        and source.is_contiguous()
        and destination.is_contiguous()
        and sys.byteorder == "little"
        and sys.platform.startswith("linux")
    )


def read_exactly(descriptor: int, offset: int, buffer: memoryview, *, path: str, size: int | None = None) -> None:
    """Fill `buffer` from `offset` with positioned reads; a short file raises `CheckpointError` naming `path`.

    `size` (the file's size, if the caller has it) lets a truncated file fail before any byte is read.
    """
    end = offset + len(buffer)
    if size is not None and end > size:
        raise CheckpointError(f"file holds {size} bytes, the tensor data runs to byte {end} (truncated?)", file=path)
    done = 0
    while done < len(buffer):
        count = os.preadv(descriptor, [buffer[done:]], offset + done)
        if not count:
            raise CheckpointError(f"file ended at byte {offset + done}, the tensor data runs to byte {end}", file=path)
        done += count


def fill_from_file(destination: torch.Tensor, source: torch.Tensor) -> bool:
    """Read `source`'s bytes from the file it is a view of straight into `destination`; False if it is not one.

    Returns False (nothing done) whenever the file route does not apply, see the module docstring; the caller then
    copies. Raises `CheckpointError` if the file turns out shorter than the mapping says (cut after validation).
    """
    if not _preadable(destination, source):
        return False
    region = _region_of(source)
    if region is None:
        return False
    nbytes = source.numel() * source.element_size()
    if source.data_ptr() + nbytes > region.end:
        return False
    descriptor, owned = _open_region_file(region)
    if descriptor < 0:
        return False
    try:
        offset = region.offset + source.data_ptr() - region.start
        buffer = memoryview(destination.view(torch.uint8).reshape(-1).numpy())
        read_exactly(descriptor, offset, buffer, path=region.path, size=os.fstat(descriptor).st_size)
    finally:
        if owned:
            os.close(descriptor)
    return True


@torch.no_grad()
def fill(destination: torch.Tensor, source: torch.Tensor) -> None:
    """`destination.copy_(source)`, but from the file when `source` is an untouched view of one (see above)."""
    if not fill_from_file(destination, source):
        destination.copy_(source)


def _is_plain(tensor: object) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


@torch.no_grad()
def concatenate_into_new(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """`torch.cat(tensors, dim)` with one allocation and each piece filled in place (`fill`), no temporary.

    Same result as `torch.cat` (dtype promoted as `cat` promotes, on the first piece's device). Tensor subclasses
    (quantized tensors and the like) may define their own concatenation, so they go through `torch.cat` itself.
    """
    if not tensors:
        raise ValueError("nothing to concatenate")
    if len(tensors) == 1 and _is_plain(tensors[0]):
        return tensors[0]
    if not all(_is_plain(t) for t in tensors) or any(t.device != tensors[0].device for t in tensors):
        return torch.cat(tensors, dim=dim)
    first = tensors[0]
    dim = dim % first.dim() if first.dim() else 0
    dtype = first.dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    for tensor in tensors:
        if tensor.dim() != first.dim() or any(
            a != b for i, (a, b) in enumerate(zip(tensor.shape, first.shape)) if i != dim
        ):
            return torch.cat(tensors, dim=dim)  # let torch raise its own shape error
    merged = torch.empty(shape, dtype=dtype, device=first.device)
    start = 0
    for tensor in tensors:
        fill(merged.narrow(dim, start, tensor.shape[dim]), tensor)
        start += tensor.shape[dim]
    return merged


class PreallocatedConcatenate(Concatenate):
    """Transformers' `Concatenate` (same inputs, same output, same piece order), built with `concatenate_into_new`:
    the merged tensor is allocated once and each piece is read into its slice, from the file where it can be."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs) -> dict[str, torch.Tensor]:
        target = self.get_target_pattern(target_patterns)
        pieces: list[torch.Tensor] = []
        for pattern in source_patterns:  # the patterns' order is the row order; the dict's is not
            if pattern not in input_dict:
                continue
            value = input_dict.pop(pattern)  # drop our reference at once, as Concatenate does
            pieces.extend(value if isinstance(value, (list, tuple)) else [value])
        return {target: concatenate_into_new(pieces, self.dim)}
