"""Stage 9: put a generated file on disk atomically, or compare it with disk."""

from __future__ import annotations

import difflib
import hashlib
import inspect
import os
import re
import tempfile
from pathlib import Path
from types import ModuleType

TARGET_LINE = re.compile(r"^# fusegen-target: (\S+)$", re.MULTILINE)
FINGERPRINT_LINE = re.compile(r"^# fusegen-source-sha256: ([0-9a-f]+)$", re.MULTILINE)


def source_fingerprint(module: ModuleType) -> str:
    """The SHA-256 of `module`'s source, as a generated file's header records it (`fusegen-source-sha256`)."""
    return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()


def recorded_fingerprint(text: str) -> str | None:
    """The source fingerprint a generated file's header records, or None if it has none."""
    match = FINGERPRINT_LINE.search(text)
    return match.group(1) if match else None


def output_path(directory: Path, model_type: str) -> Path:
    return directory / f"fused_{model_type}.py"


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: readers see the old file or the new one.

    The text goes to a temporary file in the same directory first, so a crash
    or a full disk never leaves a half-written file in place of a good one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def drift(path: Path, text: str) -> str | None:
    """A unified diff from what is on disk to `text`, or None if they match."""
    # A file that is not UTF-8 is stale, not a crash: undecodable bytes show as U+FFFD in the diff.
    current = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    if current == text:
        return None
    return "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=f"{path} (on disk)",
            tofile=f"{path} (fresh build)",
        )
    )


def recorded_targets(directory: Path) -> dict[Path, str | None]:
    """Each `fused_*.py` in `directory` and the target its header says it was built from."""
    found = {}
    for path in sorted(directory.glob("fused_*.py")):
        match = TARGET_LINE.search(path.read_text(encoding="utf-8", errors="replace"))
        found[path] = match.group(1) if match else None
    return found
