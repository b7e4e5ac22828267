"""Stage 7: render a generated file from its template, then format it with black."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import black
import jinja2

LINE_LENGTH = 119
"""Transformers' own line length, so a generated class diffs cleanly against its source."""

TEMPLATE = "fused_model.py.j2"


def template_dir() -> Path:
    """`templates/` of a source checkout, else the copy packaged as `fusegen.templates`."""
    checkout = Path(__file__).resolve().parent.parent / "templates"
    if (checkout / TEMPLATE).is_file():
        return checkout
    return Path(str(resources.files("fusegen.templates")))


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
