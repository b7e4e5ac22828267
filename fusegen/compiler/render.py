"""Stage 7: render a generated file from its template; black formats what fusegen wrote, not Transformers' text.

The classes arrive as text spliced from the original source (`fusegen.compiler.splice`), their generated
statements already black-formatted. The template is rendered with a placeholder class in each class's slot
and black-formatted; then each placeholder is replaced by its class's text, untouched. If black would still
change the assembled file (an original line black itself would reflow), black's output is returned, so the
file always passes `black --check`; the faithful-emission test then sees the reflowed lines.
"""

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


def render(classes: list[str], **context) -> str:
    """The generated module's text: template filled in, black-formatted, with each class's text in its slot."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir()),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )
    slots = [f"class _FusegenSlot{index}:\n    pass\n" for index in range(len(classes))]
    text = format_source(environment.get_template(TEMPLATE).render(classes=slots, **context))
    for slot, source in zip(slots, classes):
        if text.count(slot) != 1:
            raise RuntimeError(f"template slot {slot.splitlines()[0]!r} not found once in the rendered file")
        text = text.replace(slot, source if source.endswith("\n") else source + "\n")
    return format_source(text)


MODE = black.Mode(line_length=LINE_LENGTH, target_versions={black.TargetVersion.PY310})


def format_source(text: str) -> str:
    return black.format_str(text, mode=MODE)
