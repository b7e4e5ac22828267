"""Stage 7: render a generated file from its template, then format it with black."""

from __future__ import annotations

from pathlib import Path

import black
import jinja2

LINE_LENGTH = 119
"""Transformers' own line length, so a generated class diffs cleanly against its source."""

TEMPLATE = "fused_model.py.j2"


def template_dir() -> Path:
    """`templates/` of a source checkout, else the copy a wheel installs as `fusegen/templates`."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package.parent / "templates", package / "templates"):
        if (candidate / TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(f"{TEMPLATE} is in neither {package.parent / 'templates'} nor {package / 'templates'}")


def render(**context) -> str:
    """The generated module's text: template filled in, black-formatted."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir()),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )
    text = environment.get_template(TEMPLATE).render(**context)
    return format_source(text)


def format_source(text: str) -> str:
    mode = black.Mode(line_length=LINE_LENGTH, target_versions={black.TargetVersion.PY310})
    return black.format_str(text, mode=mode)
