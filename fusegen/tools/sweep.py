"""`fusegen build --all`: every model type of the universe (or of one mapping), in worker processes.

One model's failure never stops the sweep: each build runs in isolation and
comes back as plain data (its text, its outcomes, or its error).
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field


@dataclass
class SweepEntry:
    model_type: str
    """The target built: a model type, or `TYPE:HEAD` for a head other than its default."""
    status: str
    """`fused`, `nothing` (no sibling group, or all refused), `error` (a reasoned input error) or `crash`."""
    seconds: float
    text: str | None = None
    summary: str = ""
    report: dict = field(default_factory=dict)
    error: str = ""
    file_stem: str = ""
    """`fused_<file_stem>.py` when a file was made (`Target.file_stem`)."""


def build_one(model_type: str) -> SweepEntry:
    """Build one target (a model type, or `TYPE:HEAD`), turning every failure into data."""
    from fusegen.compiler.build import build
    from fusegen.errors import FusegenError
    from fusegen.tools.report import outcome_data

    start = time.perf_counter()
    try:
        result = build(model_type)
    except FusegenError as error:
        return SweepEntry(model_type, "error", time.perf_counter() - start, error=str(error))
    except Exception:  # noqa: BLE001 - a sweep reports crashes instead of stopping at one
        return SweepEntry(model_type, "crash", time.perf_counter() - start, error=traceback.format_exc())
    return SweepEntry(
        model_type,
        "fused" if result.text else "nothing",
        time.perf_counter() - start,
        text=result.text,
        summary=summarise(result.outcomes),
        report={"classes": [outcome_data(outcome) for outcome in result.outcomes]},
        file_stem=result.target.file_stem,
    )


def summarise(outcomes) -> str:
    fused = [f"{o.class_name}.{plan.merged}" for o in outcomes for plan in o.fused]
    refused = sum(len(o.refused) for o in outcomes)
    parts = [f"fused {', '.join(fused)}" if fused else "fused nothing"]
    if refused:
        parts.append(f"{refused} refused")
    return "; ".join(parts)


def sweep(model_types: list[str], jobs: int) -> Iterator[SweepEntry]:
    """Entries in completion order; `jobs` worker processes (1: in this process)."""
    if jobs <= 1:
        for model_type in model_types:
            yield build_one(model_type)
        return
    # fork shares the already-imported torch and transformers with the workers
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(method)) as pool:
        futures = {pool.submit(build_one, model_type): model_type for model_type in model_types}
        for future in as_completed(futures):
            try:
                yield future.result()
            except Exception:  # noqa: BLE001 - a worker that died (segfault, OOM) is one crashed model
                yield SweepEntry(futures[future], "crash", 0.0, error=traceback.format_exc())
