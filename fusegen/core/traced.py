"""What the tracer (`fusegen.compiler.trace`) hands the fusion kinds: one class's forward as an fx graph."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx


@dataclass
class Trace:
    graph: fx.Graph
    error: str | None
    """Why the trace stopped early, or None if it reached the end."""
