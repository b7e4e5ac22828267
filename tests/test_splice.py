"""fusegen.compiler.splice on small hand-written classes: what is kept, what is replaced, where comments go."""

from __future__ import annotations

import ast
import sys
import textwrap

import pytest

from fusegen.compiler.render import format_source
from fusegen.compiler.splice import class_text, original_text
from fusegen.testkit import import_file

SOURCE = '''\
import torch
from torch import nn


class Block(nn.Module):
    r"""A block.   Odd  spacing\\n kept."""

    _no_split_modules = ["Block"]  # a trailing comment

    def __init__(self, config):
        super().__init__()

        # the projections
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)  # query
        self.k_proj = nn.Linear(
            config.hidden_size,  # a comment inside a statement
            config.hidden_size,
        )
        self.scaling = config.head_dim ** (-0.5)


        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x):
        if x is None:
            return (x, x)
        elif x.dim() == 2:
            y = self.q_proj(x)
        else:
            y = self.k_proj(x)
        return (y, Block)
'''


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "splice_sample.py"
    path.write_text(SOURCE)
    loaded = import_file(path, f"splice_sample_{id(tmp_path)}")
    yield loaded
    del sys.modules[loaded.__name__]


def original(module) -> ast.ClassDef:
    return ast.parse(original_text(module, "Block")).body[0]


def test_an_unchanged_class_is_its_original_text(module):
    assert class_text("Block", original(module), module) == original_text(module, "Block")
    assert "** (-0.5)" in original_text(module, "Block")  # not normalised as ast.unparse would


def test_renames_are_token_edits_and_the_rest_stays_byte_identical(module):
    classdef = original(module)
    for node in ast.walk(classdef):
        if isinstance(node, ast.Name) and node.id == "Block":
            node.id = "FusedBlock"
        if isinstance(node, ast.Constant) and node.value == "Block":
            node.value = "FusedBlock"
    classdef.name = "FusedBlock"
    expected = original_text(module, "Block").replace("class Block", "class FusedBlock")
    expected = expected.replace('["Block"]', '["FusedBlock"]').replace("(y, Block)", "(y, FusedBlock)")
    assert class_text("Block", classdef, module) == expected


def test_a_replaced_statement_keeps_its_comments_on_their_own_lines_before_it(module):
    classdef = original(module)
    init = classdef.body[2]
    replacement = ast.parse("self.qk_proj = Merged(config.hidden_size, [config.hidden_size, config.hidden_size])")
    init.body[1:3] = replacement.body  # q_proj and k_proj become one statement
    text = class_text("Block", classdef, module)
    assert (
        "        # the projections\n"
        "        # query\n"
        "        # a comment inside a statement\n"
        "        self.qk_proj = Merged(config.hidden_size, [config.hidden_size, config.hidden_size])\n"
        "        self.scaling = config.head_dim ** (-0.5)\n"
        "\n\n"
        "        self.o_proj"
    ) in text
    assert format_source(text) == format_source(format_source(text))


def test_an_added_method_is_black_formatted_after_a_blank_line(module):
    classdef = original(module)
    classdef.body.append(ast.parse("def load_weights(self, weights):\n    return stream(self,weights)").body[0])
    text = class_text("Block", classdef, module)
    assert text.endswith(
        "        return (y, Block)\n\n    def load_weights(self, weights):\n        return stream(self, weights)\n"
    )


def test_a_change_inside_an_elif_branch_keeps_the_chain(module):
    classdef = original(module)
    forward = classdef.body[3]
    forward.body[0].orelse[0].body = ast.parse("y = self.qk_proj(x)").body
    text = class_text("Block", classdef, module)
    assert "        elif x.dim() == 2:\n            y = self.qk_proj(x)\n        else:\n" in text
    assert "            return (x, x)\n" in text


def test_a_statement_sharing_its_line_is_replaced_with_its_parent(module, tmp_path):
    path = tmp_path / "one_line.py"
    path.write_text("class Block:\n    def f(self, x):\n        if x: return 1  # why\n        return 2\n")
    loaded = import_file(path, "splice_one_line")
    classdef = ast.parse(path.read_text()).body[0]
    classdef.body[0].body[0].body = ast.parse("return 3").body
    text = class_text("Block", classdef, loaded)
    assert text == textwrap.dedent("""\
        class Block:
            def f(self, x):
                # why
                if x:
                    return 3
                return 2
        """)


def test_an_added_leading_base_is_one_insertion_and_the_body_stays_byte_identical(module):
    classdef = original(module)
    classdef.bases.insert(0, ast.Name("FusedPreTrainedMixin", ast.Load()))
    expected = original_text(module, "Block").replace(
        "class Block(nn.Module)", "class Block(FusedPreTrainedMixin, nn.Module)"
    )
    assert class_text("Block", classdef, module) == expected


def test_a_statement_with_a_reason_gets_it_as_a_comment_on_the_line_above(module):
    """`astutil.with_reason`: an injected guard carries its reason into the file; the text still parses to the AST."""
    from fusegen.core.astutil import with_reason

    classdef = original(module)
    forward = classdef.body[-1]
    guard = ast.parse("if x.dim() == 0:\n    return (x, x)").body[0]
    forward.body.insert(0, with_reason(guard, "fusegen: why\n   this guard is here"))
    lines = class_text("Block", classdef, module).splitlines()
    at = lines.index("        if x.dim() == 0:")
    assert lines[at - 1] == "        # fusegen: why this guard is here"
    assert lines[at - 2] == "    def forward(self, x):"
    assert not any("_fusegen_reason_" in line for line in lines)


def test_a_raw_string_rename_keeps_its_prefix_and_an_added_base_still_splices(tmp_path):
    # BartPreTrainedModel: `_no_split_modules = [r"BartEncoderLayer", ...]` and the runtime base added. The raw
    # literal once failed the token edit, the class was replaced whole from the copy without the added base, and
    # the base's insertion overlapped that replacement ("overlapping edits", an internal error).
    path = tmp_path / "raw_names.py"
    path.write_text(
        "from torch import nn\n\n\n"
        "class Block(nn.Module):\n"
        '    _no_split_modules = [r"Layer"]  # kept\n\n'
        "    def f(self):\n"
        "        return  1\n"
    )
    loaded = import_file(path, "splice_raw_names")
    classdef = ast.parse(path.read_text()).body[1]
    classdef.bases.insert(0, ast.Name("FusedPreTrainedMixin", ast.Load()))
    classdef.body[0].value.elts[0].value = "FusedLayer"
    text = class_text("Block", classdef, loaded)
    assert text == (
        "class Block(FusedPreTrainedMixin, nn.Module):\n"
        '    _no_split_modules = [r"FusedLayer"]  # kept\n\n'
        "    def f(self):\n"
        "        return  1\n"
    )


def test_a_renamed_literal_the_tokens_cannot_take_splices_the_class_body_not_the_whole_class(tmp_path):
    # A rename inside a class statement that no token edit can make (a backslash in the new value): the class keeps
    # its header and every untouched statement's text; only the statement holding the literal is replaced.
    path = tmp_path / "odd_names.py"
    path.write_text("class Block:\n    names = ['Layer']  # kept\n\n    def f(self):\n        return  1\n")
    loaded = import_file(path, "splice_odd_names")
    classdef = ast.parse(path.read_text()).body[0]
    classdef.name = "FusedBlock"
    classdef.body[0].value.elts[0].value = "Fused\\Layer"
    text = class_text("Block", classdef, loaded)
    assert (
        text
        == 'class FusedBlock:\n    # kept\n    names = ["Fused\\\\Layer"]\n\n    def f(self):\n        return  1\n'
    )


def test_a_class_replaced_whole_gets_its_added_base_in_the_replacement(tmp_path):
    # When the body cannot be spliced (a changed statement sharing its line, `x = 1; y = 2`), the class is one
    # replaced statement: its text is formatted from the full rewritten class, added base included, and no separate
    # insertion overlaps it.
    path = tmp_path / "one_line_body.py"
    path.write_text("class Block(object):\n    x = 1; y = 2\n")
    loaded = import_file(path, "splice_one_line_body")
    classdef = ast.parse(path.read_text()).body[0]
    classdef.bases.insert(0, ast.Name("Mixin", ast.Load()))
    classdef.body[0] = ast.parse("x = 3").body[0]
    assert class_text("Block", classdef, loaded) == "class Block(Mixin, object):\n    x = 3\n    y = 2\n"
