"""Stage 7, its first step: a generated class is its original source text with the rewrite's edits spliced in.

The rewrite stages (rewrite_init, rewrite_forward, propagate, the added methods) work on a copy of the
class's AST. This module compares that rewritten AST with the original class statement, statement by
statement, and writes the original text wherever the two agree:

- a statement the rewrite left alone keeps its original text, comments and blank lines included;
- a statement that differs only in names (a class renamed `LlamaMLP` -> `FusedLlamaMLP`, a string
  `"LlamaDecoderLayer"`, an aliased import) keeps its text with those tokens replaced in place, at the
  positions the AST and the tokenizer give (pyupgrade's way of editing source);
- a compound statement (`def`, `if`, `for`, `with`, `try`, ...) whose header is unchanged keeps its header
  text, and its blocks are compared the same way, recursively;
- every other statement (changed, added or removed) is replaced: the new statements are unparsed and
  black-formatted alone, nested at the block's depth (so black sees the real indentation), and spliced in
  as whole lines.

Comments inside a replaced statement's span (an own-line comment between its lines, or a comment at the
end of one of its lines) are kept: each is moved, in source order, onto its own line at the block's
indentation just before the replacement text. A removed statement's comments stay in the same way, where
the statement was. So every comment of the original class survives; only those inside replaced statements
move, and the diff shows them next to the new code.

Soundness: the spliced text must mean exactly what the rewritten AST means, since that is what the rest of
the build (imports, validation) reasons about. `class_text` re-parses its result and raises if the parse
differs from the rewritten AST; a splicing bug is then an internal error, never a silently different file.
A statement this module cannot splice safely (one sharing a line with another, `a; b`, or an `if x: y` on
one line) is replaced whole, together with its parent if need be: a comment may then move, never vanish.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import inspect
import io
import linecache
import tokenize
from dataclasses import dataclass
from types import ModuleType

import black

from fusegen.compiler.render import MODE
from fusegen.core import astutil

BLOCK_FIELDS = ("body", "orelse", "finalbody")
"""Fields of a compound statement that hold statement lists (handlers and match cases are nested nodes)."""
NESTED_FIELDS = ("handlers", "cases")
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class SpliceError(RuntimeError):
    """The spliced text does not parse to the rewritten AST: a fusegen bug."""


@dataclass(frozen=True)
class Edit:
    """Replace the characters `start` to `end` of the file's text (offsets into `Source.text`) with `text`."""

    start: int
    end: int
    text: str


class Source:
    """One source file's text, with offsets for AST positions (UTF-8 byte columns) and its comment tokens."""

    def __init__(self, filename: str):
        self.lines = linecache.getlines(filename)
        self.text = "".join(self.lines)
        self.line_starts = [0]
        for line in self.lines:
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.tokens = list(tokenize.generate_tokens(io.StringIO(self.text).readline))
        self.comments = [token for token in self.tokens if token.type == tokenize.COMMENT]
        self.strings = {token.start: token for token in self.tokens if token.type == tokenize.STRING}

    def offset(self, lineno: int, col_bytes: int) -> int:
        """Character offset of an AST position (1-based line, UTF-8 byte column)."""
        line = self.lines[lineno - 1]
        return self.line_starts[lineno - 1] + len(line.encode()[:col_bytes].decode(errors="replace"))

    def column(self, lineno: int, col_bytes: int) -> int:
        """Character column of an AST position."""
        return self.offset(lineno, col_bytes) - self.line_starts[lineno - 1]

    def line_offset(self, lineno: int) -> int:
        """Offset of the start of line `lineno` (one past the last line gives the end of the text)."""
        return self.line_starts[lineno - 1]


@functools.lru_cache(maxsize=64)
def _source(filename: str) -> Source:
    return Source(filename)


def first_line(node: ast.stmt) -> int:
    """The first line of a statement, its decorators included."""
    return min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])


def original_statement(module: ModuleType, name: str) -> tuple[Source, ast.stmt]:
    """The module-level statement defining `name` in `module`'s source file: its class, or its table's assignment.

    Read from the module's file through linecache, exactly as the interpreter loaded it.
    """
    filename = inspect.getsourcefile(module)
    for stmt in astutil.module_tree(filename).body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return _source(filename), stmt
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return _source(filename), stmt
    raise SpliceError(f"{name} is not defined at the top of {filename}")


def original_text(module: ModuleType, name: str) -> str:
    """The original source text of the class (or class table) `name`, decorators included, as Transformers wrote it."""
    source, stmt = original_statement(module, name)
    return source.text[source.line_offset(first_line(stmt)) : source.line_offset(stmt.end_lineno + 1)]


def class_text(name: str, rewritten: ast.ClassDef | ast.Module, module: ModuleType) -> str:
    """The text of the rewritten class (or class table's statements) `name`: the original text with the edits spliced in.

    Raises `SpliceError` if the text would not parse to `rewritten`.
    """
    source, original = original_statement(module, name)
    new = rewritten.body if isinstance(rewritten, ast.Module) else [rewritten]
    start, end = first_line(original), original.end_lineno + 1
    header, against = _added_bases(source, original, new)
    edits = _block(source, [original], against, "")
    if header and edits is not None and any(_covers(edit, insert.start) for edit in edits for insert in header):
        # the class statement itself was replaced (its text formatted from `against`, the class without the added
        # bases): the insertion has no header text left to go into, so splice against the full rewritten class
        header, edits = [], _block(source, [original], new, "")
    if edits is None:
        header, edits = [], [_replace(source, [original], new, "", start, end)]
    edits += header
    text = _apply(source, edits, source.line_offset(start), source.line_offset(end))
    expected = [_dump(stmt) for stmt in new]
    try:
        parsed = [_dump(stmt) for stmt in ast.parse(text).body]
    except SyntaxError as error:
        raise SpliceError(f"spliced text of {name} does not parse: {error}") from error
    if parsed != expected:
        raise SpliceError(
            f"spliced text of {name} does not parse to the rewritten class:\n{_first_difference(text, new)}"
        )
    return text


def _added_bases(source: Source, original: ast.stmt, new: list[ast.stmt]) -> tuple[list[Edit], list[ast.stmt]]:
    """A class the build gives extra leading bases (the runtime mixin of a pretrained base): one insertion before
    its first original base, and the rewritten class without those bases to splice the rest against.

    Without this the changed header would make the whole class one replaced statement, losing its layout.
    The final re-parse in `class_text` still checks the result against the full rewritten class.
    """
    if len(new) != 1 or not isinstance(original, ast.ClassDef) or not isinstance(new[0], ast.ClassDef):
        return [], new
    extra = len(new[0].bases) - len(original.bases)
    if extra <= 0 or not original.bases:
        return [], new
    trimmed = copy.copy(new[0])
    trimmed.bases = new[0].bases[extra:]
    first = original.bases[0]
    at = source.offset(first.lineno, first.col_offset)
    return [Edit(at, at, "".join(f"{ast.unparse(base)}, " for base in new[0].bases[:extra]))], [trimmed]


def _covers(edit: Edit, offset: int) -> bool:
    """`edit` replaces text around `offset`, so an insertion there would land inside (or across) its replacement."""
    return edit.start < edit.end and edit.start <= offset <= edit.end


def _dump(stmt: ast.stmt) -> str:
    """`ast.dump` with each docstring's lines stripped: black re-indents docstrings, which changes nothing else."""
    stmt = astutil.copy_tree(stmt)
    for node in astutil.walk(stmt):
        body = getattr(node, "body", None)
        if isinstance(node, DEFINITIONS) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                value.value = "\n".join(line.strip() for line in value.value.strip().splitlines())
    return ast.dump(stmt, include_attributes=False)


def _first_difference(text: str, new: list[ast.stmt]) -> str:
    """Where the spliced text's unparse first differs from the rewritten AST's (for the error message)."""
    got = ast.unparse(ast.parse(text)).splitlines()
    want = ast.unparse(ast.Module(new, [])).splitlines()
    return "\n".join(list(difflib.unified_diff(want, got, "rewritten", "spliced", lineterm=""))[:40])


def _apply(source: Source, edits: list[Edit], start: int, end: int) -> str:
    pieces, position = [], start
    for edit in sorted(edits, key=lambda e: (e.start, e.end)):
        if edit.start < position:
            raise SpliceError("overlapping edits")
        pieces += [source.text[position : edit.start], edit.text]
        position = edit.end
    return "".join(pieces) + source.text[position:end]


# --- comparing statements --------------------------------------------------------------------------


def _shape(node, skip: tuple[str, ...] = ()) -> object:
    """A hashable picture of `node` with the renameable leaves (names, strings) blanked; `skip` drops fields."""
    if isinstance(node, list):
        return tuple(_shape(item) for item in node)
    if not isinstance(node, ast.AST):
        return (type(node).__name__, node)
    fields = []
    for field in node._fields:
        if field in skip:
            continue
        value = getattr(node, field, None)
        renameable = (isinstance(node, ast.Name) and field == "id") or (
            isinstance(node, ast.ClassDef) and field == "name"
        )
        if renameable or (isinstance(node, ast.Constant) and isinstance(value, str)):
            value = "*"
        fields.append((field, _shape(value)))
    return (type(node).__name__, tuple(fields))


def _header_shape(node: ast.AST) -> object:
    return _shape(node, BLOCK_FIELDS + NESTED_FIELDS)


def _is_compound(node: ast.AST) -> bool:
    return any(isinstance(getattr(node, field, None), list) for field in BLOCK_FIELDS + NESTED_FIELDS) and not (
        isinstance(node, (ast.Module, ast.expr))
    )


def _leaf_edits(source: Source, old, new, skip: tuple[str, ...] = ()) -> list[Edit] | None:
    """Token edits that turn `old`'s text into `new`'s, when the two differ only in names and strings; else None."""
    if type(old) is not type(new):
        return None
    if isinstance(old, list):
        if len(old) != len(new):
            return None
        edits = []
        for a, b in zip(old, new):
            found = _leaf_edits(source, a, b)
            if found is None:
                return None
            edits += found
        return edits
    if not isinstance(old, ast.AST):
        return [] if old == new else None
    edits = []
    for field in old._fields:
        if field in skip:
            continue
        a, b = getattr(old, field, None), getattr(new, field, None)
        if isinstance(old, ast.Name) and field == "id" and a != b:
            edit = _name_edit(source, old, b)
        elif isinstance(old, ast.ClassDef) and field == "name" and a != b:
            edit = _class_name_edit(source, old, b)
        elif (
            isinstance(old, ast.Constant) and field == "value" and isinstance(a, str) and isinstance(b, str) and a != b
        ):
            edit = _string_edit(source, old, b)
        else:
            found = _leaf_edits(source, a, b)
            if found is None:
                return None
            edits += found
            continue
        if edit is None:
            return None
        edits.append(edit)
    return edits


def _name_edit(source: Source, node: ast.Name, new: str) -> Edit | None:
    start = source.offset(node.lineno, node.col_offset)
    end = source.offset(node.end_lineno, node.end_col_offset)
    return Edit(start, end, new) if source.text[start:end] == node.id else None


def _class_name_edit(source: Source, node: ast.ClassDef, new: str) -> Edit | None:
    """The NAME token after the `class` keyword of `node`."""
    tokens = source.tokens
    for index, token in enumerate(tokens):
        if token.start[0] == node.lineno and token.type == tokenize.NAME and token.string == "class":
            name = tokens[index + 1]
            if name.string != node.name:
                return None
            start = source.line_offset(name.start[0]) + name.start[1]
            return Edit(start, start + len(name.string), new)
    return None


def _string_edit(source: Source, node: ast.Constant, new: str) -> Edit | None:
    """A plain one-token string literal (`"LlamaDecoderLayer"`, `r"BartEncoderLayer"`) gets the new value in its own
    quotes and prefix; else None.

    A raw (`r`) or `u` prefix changes nothing for a value without quotes, backslashes or newlines, so the literal
    keeps it and still means `new`.
    """
    token = source.strings.get((node.lineno, source.column(node.lineno, node.col_offset)))
    if token is None or token.end != (node.end_lineno, source.column(node.end_lineno, node.end_col_offset)):
        return None
    prefix = token.string[: len(token.string) - len(token.string.lstrip("rRuU"))]
    body = token.string[len(prefix) :]
    quote = body[:1]
    if (
        len(prefix) > 1
        or quote not in ("'", '"')
        or body[:3] == quote * 3
        or any(c in new for c in (quote, "\\", "\n"))
    ):
        return None
    start = source.line_offset(token.start[0]) + token.start[1]
    return Edit(start, start + len(token.string), f"{prefix}{quote}{new}{quote}")


# --- splicing blocks ---------------------------------------------------------------------------------


def _block(source: Source, old: list[ast.stmt], new: list[ast.stmt], indent: str) -> list[Edit] | None:
    """Edits turning the statement list `old` (original, with positions) into `new`; None if it cannot be spliced.

    Statements are paired by shape (names and strings blanked), then, among the rest, compound statements
    by header; what stays unpaired is replaced in runs.
    """
    edits: list[Edit] = []
    previous: ast.stmt | None = None  # the last original statement handled, for insertions after it
    runs: list[tuple[list[ast.stmt], list[ast.stmt], ast.stmt | None]] = []
    pairs = difflib.SequenceMatcher(None, [_shape(s) for s in old], [_shape(s) for s in new], autojunk=False)
    for tag, i1, i2, j1, j2 in pairs.get_opcodes():
        if tag == "equal":
            for a, b in zip(old[i1:i2], new[j1:j2]):
                found = _leaf_edits(source, a, b)
                if found is None and _is_compound(a):  # a rename its tokens cannot take: splice its blocks
                    found = _compound(source, a, b)
                if found is None:
                    runs.append(([a], [b], previous))
                else:
                    edits += found
                previous = a
            continue
        inner = difflib.SequenceMatcher(
            None,
            [_header_shape(s) if _is_compound(s) else id(s) for s in old[i1:i2]],
            [_header_shape(s) if _is_compound(s) else -1 for s in new[j1:j2]],
            autojunk=False,
        )
        for tag2, k1, k2, l1, l2 in inner.get_opcodes():
            olds, news = old[i1 + k1 : i1 + k2], new[j1 + l1 : j1 + l2]
            if tag2 == "equal":
                for a, b in zip(olds, news):
                    found = _compound(source, a, b)
                    if found is None:
                        runs.append(([a], [b], previous))
                    else:
                        edits += found
                    previous = a
            else:
                runs.append((olds, news, previous))
                previous = olds[-1] if olds else previous
    for olds, news, after in runs:
        edit = _run(source, old, olds, news, after, indent)
        if edit is None:
            return None
        edits.append(edit)
    return edits


def _compound(source: Source, old: ast.AST, new: ast.AST) -> list[Edit] | None:
    """Edits for a compound statement (or handler, match case) whose header shape is unchanged."""
    edits = _leaf_edits(source, old, new, skip=BLOCK_FIELDS + NESTED_FIELDS)
    if edits is None:
        return None
    for field in BLOCK_FIELDS:
        a, b = getattr(old, field, None) or [], getattr(new, field, None) or []
        if not a and not b:
            continue
        if _is_elif(source, old, field):  # the `elif` line belongs to no block: only its parts can change
            same = len(b) == 1 and isinstance(b[0], ast.If) and _header_shape(a[0]) == _header_shape(b[0])
            found = _compound(source, a[0], b[0]) if same else None
        elif a and b:
            found = _block(source, a, b, _indent(source, a[0]))
        else:
            found = None  # an `else:` added or removed
        if found is None:
            return None
        edits += found
    for field in NESTED_FIELDS:
        a, b = getattr(old, field, None) or [], getattr(new, field, None) or []
        if len(a) != len(b):
            return None
        for x, y in zip(a, b):
            found = _compound(source, x, y) if _header_shape(x) == _header_shape(y) else None
            if found is None:
                return None
            edits += found
    return edits


def _is_elif(source: Source, node: ast.AST, field: str) -> bool:
    """`node.orelse` is an `elif` chain: one `If` whose text starts with `elif` (it cannot be replaced as lines)."""
    block = getattr(node, field, None) or []
    if field != "orelse" or len(block) != 1 or not isinstance(block[0], ast.If):
        return False
    return source.text.startswith("elif", source.offset(block[0].lineno, block[0].col_offset))


def _indent(source: Source, stmt: ast.stmt) -> str:
    line = source.lines[first_line(stmt) - 1]
    return line[: len(line) - len(line.lstrip())]


def _starts_line(source: Source, stmt: ast.stmt) -> bool:
    """Nothing but indentation precedes the statement (or its first decorator) on its first line."""
    line = first_line(stmt)
    node = stmt if line == stmt.lineno else min(stmt.decorator_list, key=lambda d: (d.lineno, d.col_offset))
    column = source.column(node.lineno, node.col_offset) - (1 if node is not stmt else 0)  # the "@"
    return source.lines[line - 1][:column].strip() == ""


def _ends_line(source: Source, stmt: ast.stmt) -> bool:
    """Nothing but a comment follows the statement on its last line."""
    rest = source.lines[stmt.end_lineno - 1][source.column(stmt.end_lineno, stmt.end_col_offset) :].strip()
    return rest == "" or rest.startswith("#")


def _run(source, block, olds, news, after, indent) -> Edit | None:
    """One edit replacing the run `olds` of `block` (whole lines) by `news`, or inserting `news` after `after`.

    None when the run cannot be cut out as whole lines, or the block is not indented by four spaces a level
    (generated text is nested that way); the enclosing statement is then replaced instead.
    """
    if indent != " " * len(indent) or len(indent) % 4:
        return None
    if olds:
        if not (_starts_line(source, olds[0]) and _ends_line(source, olds[-1])):
            return None
        return _replace(source, olds, news, indent, first_line(olds[0]), olds[-1].end_lineno + 1)
    if after is not None:
        if not _ends_line(source, after):
            return None
        line = after.end_lineno + 1
    else:
        if not _starts_line(source, block[0]):
            return None
        line = first_line(block[0])
    text = _format(news, indent)
    if after is not None and any(isinstance(s, DEFINITIONS) for s in news[:1]) and indent:
        text = "\n" + text  # black's one blank line before a nested definition
    if after is None and any(isinstance(s, DEFINITIONS) for s in block[:1]):
        text = text + "\n"
    offset = source.line_offset(line)
    return Edit(offset, offset, text)


def _replace(source: Source, olds: list[ast.stmt], news: list[ast.stmt], indent: str, start: int, end: int) -> Edit:
    """Lines `start` to `end` (exclusive) become the comments found there, each on its own line, then `news`."""
    comments = [token.string for token in source.comments if start <= token.start[0] < end]
    text = "".join(f"{indent}{comment}\n" for comment in comments) + (_format(news, indent) if news else "")
    return Edit(source.line_offset(start), source.line_offset(end), text)


def _format(statements: list[ast.stmt], indent: str) -> str:
    """`statements` unparsed and black-formatted at the depth `indent` (4 spaces a level), as indented lines.

    The statements are nested in as many dummy blocks as the depth (`class _:`, then `def _():`, then `if _:`),
    so black formats them with the line length and the blank-line rules they will have in the file.
    """
    if len(indent) % 4 or indent.strip():
        raise SpliceError(f"indentation {indent!r} is not a multiple of four spaces")
    depth = len(indent) // 4
    body: list[ast.stmt] = astutil.copy_tree(list(statements))  # reasons become marker statements in the copy
    for level in reversed(range(depth)):
        if level == 0:
            body = [ast.ClassDef(name="_", bases=[], keywords=[], body=body, decorator_list=[])]
        elif level == 1:
            arguments = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
            body = [ast.FunctionDef(name="_", args=arguments, body=body, decorator_list=[], returns=None)]
        else:
            body = [ast.If(ast.Name("_", ast.Load()), body, [])]
    module = ast.fix_missing_locations(ast.Module(body, []))
    reasons = _mark_reasons(module)
    text = _reasons_as_comments(black.format_str(ast.unparse(module), mode=MODE), reasons)
    lines = text.splitlines(keepends=True)
    headers = ["class _:\n", "    def _():\n"] + [f"{'    ' * level}if _:\n" for level in range(2, depth)]
    for header in headers[:depth]:
        while lines and not lines[0].strip():
            lines.pop(0)
        if not lines or lines.pop(0) != header:
            raise SpliceError(f"black did not keep the nesting {header.strip()!r} around a generated fragment")
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "".join(lines)


REASON_MARKER = "_fusegen_reason_"


def _mark_reasons(tree: ast.AST) -> list[str]:
    """Put a marker statement (`_fusegen_reason_<i>`) before each statement of `tree` carrying a reason
    (`astutil.with_reason`), in place; the reasons, by marker index."""
    reasons: list[str] = []
    for node in astutil.walk(tree):
        for name in BLOCK_FIELDS:
            block = getattr(node, name, None)
            if not isinstance(block, list):
                continue
            marked = []
            for stmt in block:
                reason = getattr(stmt, astutil.REASON, None)
                if reason is not None:
                    marker = ast.Expr(ast.Name(f"{REASON_MARKER}{len(reasons)}", ast.Load()))
                    marked.append(ast.copy_location(marker, stmt))
                    reasons.append(reason)
                marked.append(stmt)
            block[:] = marked
    return reasons


def _reasons_as_comments(text: str, reasons: list[str]) -> str:
    """Each marker line of `text` becomes its reason as a comment at the marker's indentation (and black's blank
    line between a marker and a definition goes, so the comment sits on the line above its statement)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pending = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(REASON_MARKER) and stripped[len(REASON_MARKER) :].isdigit():
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# {reasons[int(stripped[len(REASON_MARKER) :])]}\n")
            pending = True
            continue
        if pending and not stripped:
            continue
        pending = False
        out.append(line)
    return "".join(out)
