"""The coverage run (`python -m fusegen.tools.coverage`, `docs/coverage.md`): one module per job.

- `run`: the command line and the whole run (sweep, then inspect and verify each type in worker processes);
- `workers`: one forked process per task, killed at its timeout;
- `original`: what the original model holds (`inspect_original`);
- `verification`: fused == original on a tiny random model, under every construction variant (`verify`);
- `rows`: the table's data (`Row`, `Inspection`, `Verification`) and the run's constants;
- `analysis`: counts, parts and the inherent cases; `markdown`: the page.

The names below are the package's public API (the tests and `fusegen.cli` use them).
"""

from fusegen.tools.coverage.analysis import (
    INHERENT_ERROR_NOTES,
    INHERENT_SKIPS,
    INHERENT_STOPS,
    PARTS,
    fused_kind,
    has_kind,
    inherent_cases,
    is_verified,
    kind_counts,
    part_of,
    summary_counts,
    trace_stops,
)
from fusegen.tools.coverage.markdown import check_rules_registered, part_cell, render_markdown
from fusegen.tools.coverage.original import inspect_original
from fusegen.tools.coverage.rows import Inspection, Row, Verification
from fusegen.tools.coverage.run import collect, main
from fusegen.tools.coverage.verification import (
    ConfigCheck,
    compare_greedy,
    config_variants,
    import_causal_lm,
    merging_fused_classes,
    unused_fused_classes,
    verify,
)
from fusegen.tools.coverage.workers import run_isolated

__all__ = [
    "INHERENT_ERROR_NOTES",
    "INHERENT_SKIPS",
    "INHERENT_STOPS",
    "PARTS",
    "ConfigCheck",
    "Inspection",
    "Row",
    "Verification",
    "check_rules_registered",
    "collect",
    "compare_greedy",
    "config_variants",
    "fused_kind",
    "has_kind",
    "import_causal_lm",
    "inherent_cases",
    "inspect_original",
    "is_verified",
    "kind_counts",
    "main",
    "merging_fused_classes",
    "part_cell",
    "part_of",
    "render_markdown",
    "run_isolated",
    "summary_counts",
    "trace_stops",
    "unused_fused_classes",
    "verify",
]
