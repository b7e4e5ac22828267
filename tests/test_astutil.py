"""`fusegen.core.astutil.copy_tree`: the syntax-tree copy the rewrite stages take instead of `copy.deepcopy`."""

import ast
import copy
import inspect

from transformers.models.llama import modeling_llama

from fusegen.core import astutil


def nodes(tree):
    return list(ast.walk(tree if isinstance(tree, ast.AST) else ast.Module(tree, [])))


def test_copy_tree_equals_deepcopy_on_a_real_module_and_shares_no_node():
    tree = astutil.module_tree(inspect.getsourcefile(modeling_llama))
    copied = astutil.copy_tree(tree)
    assert ast.dump(copied, include_attributes=True) == ast.dump(copy.deepcopy(tree), include_attributes=True)
    assert not {id(node) for node in nodes(tree)} & {id(node) for node in nodes(copied)}
    assert all(type(a) is type(b) for a, b in zip(nodes(tree), nodes(copied), strict=True))


def test_copy_tree_keeps_marks_copies_lists_and_keeps_sharing():
    statement = ast.parse("x = f(y, [1, 2])").body[0]
    astutil.with_reason(statement, "why")
    statement.table = {"key": ["mutable"]}  # a mark that is not an atom is deep-copied
    shared = ast.Name("z", ast.Load())
    statement.value.args.append(shared)
    statement.value.keywords.append(ast.keyword("k", shared))  # one node met twice
    copied = astutil.copy_tree([statement])[0]
    assert getattr(copied, astutil.REASON) == "why"
    assert copied.table == statement.table and copied.table is not statement.table
    assert copied.table["key"] is not statement.table["key"]
    assert copied.value.args is not statement.value.args
    assert copied.value.args[-1] is copied.value.keywords[-1].value is not shared
    copied.value.args[0].id = "changed"
    assert statement.value.args[0].id == "y"


def test_walk_visits_what_ast_walk_visits_in_the_same_order():
    tree = astutil.module_tree(inspect.getsourcefile(modeling_llama))
    assert [id(node) for node in astutil.walk(tree)] == [id(node) for node in ast.walk(tree)]
    statement = ast.parse("global a, b\nx = f(y)[0]").body  # a list field of strings is no child
    assert [type(n) for n in astutil.walk(ast.Module(statement, []))] == [
        type(n) for n in ast.walk(ast.Module(statement, []))
    ]


def test_walk_queues_a_nodes_children_before_yielding_it():
    call = ast.parse("f(a, b)").body[0].value
    seen = []
    for node in astutil.walk(call):
        seen.append(node)
        if node is call:
            call.args = [ast.Name("c", ast.Load())]  # edited after it was yielded: its old children still come
    assert [n.id for n in seen if isinstance(n, ast.Name)] == ["f", "a", "b"]
