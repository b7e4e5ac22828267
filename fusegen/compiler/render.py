"""Stage 7: render a generated file from its template; black formats what fusegen wrote, not Transformers' text.

The classes arrive as text spliced from the original source (`fusegen.compiler.splice`), their generated
statements already black-formatted. The template is rendered with a placeholder class in each class's slot
and black-formatted; then each placeholder is replaced by its class's text, untouched. When black leaves that file
as it is, it is the output (one black pass over the whole file, the common case).

Transformers' own text is not always black's: black pulls the string of a multi-line
`@auto_docstring(custom_intro=...)` call up onto the decorator's line, for one. Such a class (one black would change
on its own) is written between `# fmt: off` and `# fmt: on`, which black leaves alone, so the file passes
`black --check` and still holds the original text verbatim. The class text is never run through black here: its
generated statements were formatted where they were made (`splice`), the rest is Transformers' as written.
"""

from __future__ import annotations

import functools
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


@functools.cache
def _template() -> jinja2.Template:
    """The template, compiled once per process (a build of several targets renders it once each)."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir()),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )
    return environment.get_template(TEMPLATE)


def render(classes: list[str], **context) -> str:
    """The generated module's text: template filled in, black-formatted, with each class's text in its slot."""
    slots = [f"class _FusegenSlot{index}:\n    pass\n" for index in range(len(classes))]
    frame = format_source(_template().render(classes=slots, **context))
    return with_classes(frame, slots, [source if source.endswith("\n") else source + "\n" for source in classes])


def with_classes(frame: str, slots: list[str], sources: list[str]) -> str:
    """`frame` (black's output) with each slot replaced by its class's text, as written; a class black would change
    on its own between `# fmt: off` and `# fmt: on`."""
    text = _filled(frame, slots, sources)
    if format_source(text) == text:  # black changes no class: each is written as it is
        return text
    kept = [source if format_source(source) == source else f"{FMT_OFF}{source}{FMT_ON}" for source in sources]
    return format_source(_filled(frame, slots, kept))


def _filled(frame: str, slots: list[str], sources: list[str]) -> str:
    """`frame` with each slot replaced by its class's text."""
    for slot, source in zip(slots, sources):
        if frame.count(slot) != 1:
            raise RuntimeError(f"template slot {slot.splitlines()[0]!r} not found once in the rendered file")
        frame = frame.replace(slot, source)
    return frame


FMT_OFF, FMT_ON = "# fmt: off\n", "# fmt: on\n"
"""Around a class whose original text black would reflow (see the module docstring)."""


MODE = black.Mode(line_length=LINE_LENGTH, target_versions={black.TargetVersion.PY310})


def format_source(text: str) -> str:
    return black.format_str(text, mode=MODE)
