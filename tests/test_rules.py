"""The rule registry (`fusegen.compiler.rules`): every rule id the code raises is registered and documented."""

import ast
import re
from pathlib import Path

import fusegen.fusions.packed_qkv
import fusegen.fusions.silu  # noqa: F401
from fusegen.compiler.rules import DOC, declared, describe
from fusegen.core.plan import ClassOutcome, Refusal

ROOT = Path(__file__).resolve().parent.parent
RULE_ID = re.compile(r"[a-z]+(-[a-z]+)*")
REFUSALS = {"Refused": 0, "Veto": 0, "Refusal": 1}
"""The constructors that carry a rule id, and the position of the id among their arguments."""


def _constants(node: ast.AST | None) -> set[str]:
    """The rule ids an expression may evaluate to: a string constant, or either branch of a conditional."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and RULE_ID.fullmatch(node.value):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _constants(node.body) | _constants(node.orelse)
    return set()


def _bound(scopes: list[ast.AST], name: str) -> set[str]:
    """The rule ids the local or module-level `name` may be bound to: `rule = "..."`, `rule = "a" if c else "b"`,
    or `for x, rule in (("x", "..."), ...)`."""
    found = set()
    for scope in scopes:
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                if any(isinstance(target, ast.Name) and target.id == name for target in node.targets):
                    found |= _constants(node.value)
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Tuple):
                names = [getattr(element, "id", None) for element in node.target.elts]
                if name in names and isinstance(node.iter, (ast.Tuple, ast.List)):
                    for item in node.iter.elts:
                        if isinstance(item, ast.Tuple):
                            found |= _constants(item.elts[names.index(name)])
    return found


def raised_rule_ids() -> dict[str, set[str]]:
    """Every rule id a `Refused`, `Veto` or `Refusal` in fusegen/ is constructed with, by file; a rule id handed in
    as a parameter (`leaf.compare_exact(..., rule)`) is looked for at that parameter of every call of the function."""
    found = _raised_rule_ids(passed := {})
    for path in sorted((ROOT / "fusegen").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = ast.Module([s for s in tree.body if isinstance(s, ast.Assign)], [])
        for node in ast.walk(tree):
            name = getattr(node, "func", None) and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
            if name not in passed:
                continue
            index, parameter = passed[name]
            arguments = [*node.args[index : index + 1], *(k.value for k in node.keywords if k.arg == parameter)]
            ids = set().union(*map(_constants, arguments))
            ids |= {i for a in arguments if isinstance(a, ast.Name) for i in _bound([constants], a.id)}  # `RULE`
            for rule_id in ids:
                found.setdefault(rule_id, set()).add(str(path.relative_to(ROOT)))
    return found


def _raised_rule_ids(passed: dict) -> dict[str, set[str]]:
    """`raised_rule_ids` but for parameters, which it records in `passed`: `{function: (index, parameter)}`."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "fusegen").rglob("*.py")):
        tree = ast.parse(path.read_text())
        functions = {}
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    functions.setdefault(id(node), function)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name not in REFUSALS or len(node.args) <= REFUSALS[name]:
                continue
            argument = node.args[REFUSALS[name]]
            ids = _constants(argument)
            if isinstance(argument, ast.Name):
                scopes = [functions[id(node)]] if id(node) in functions else []
                parameters = [a.arg for a in scopes[0].args.args] if scopes else []
                if argument.id in parameters:
                    passed[scopes[0].name] = (parameters.index(argument.id), argument.id)
                ids |= _bound(
                    scopes + [ast.Module([s for s in tree.body if isinstance(s, ast.Assign)], [])], argument.id
                )
            if isinstance(argument, ast.Attribute) and isinstance(argument.value, ast.Name):
                ids |= _module_constant(argument.value.id, argument.attr)  # `validate.RULE`
            for rule_id in ids:
                found.setdefault(rule_id, set()).add(str(path.relative_to(ROOT)))
    return found


def _module_constant(module: str, name: str) -> set[str]:
    """The rule ids the module-level `name` of the fusegen module `module` (by its last dotted part) is bound to."""
    found = set()
    for path in (ROOT / "fusegen").rglob(f"{module}.py"):
        tree = ast.parse(path.read_text())
        found |= _bound([ast.Module([s for s in tree.body if isinstance(s, ast.Assign)], [])], name)
    return found


def _sections(text: str) -> dict[str, str]:
    """The body of each `###` section of the doc, by title (a title's parenthesised tail left off)."""
    parts = re.split(r"^### (.+)$", text, flags=re.MULTILINE)
    return {
        re.sub(r" \(.*\)$", "", title).strip(): body.split("\n## ")[0] for title, body in zip(parts[1::2], parts[2::2])
    }


def test_the_scan_finds_the_rules_raised_through_constants_conditionals_and_loops():
    raised = raised_rule_ids()
    assert len(raised) >= 48, sorted(raised)
    for rule_id in (
        "input-rebound",
        "inplace-operator",
        "dtype-mismatch",
        "constructor-inputs-change",
        "norm-inexact",
    ):
        assert rule_id in raised, rule_id  # a constant, a conditional, a loop, a module constant, a kind's rule
    assert "validation-mismatch" in raised  # through an attribute: `Veto(validate.RULE, ...)`


def test_every_rule_id_raised_anywhere_is_registered():
    rules = declared()
    unregistered = {rule_id: files for rule_id, files in raised_rule_ids().items() if rule_id not in rules}
    assert not unregistered, unregistered


def test_every_registered_rule_is_raised_somewhere():
    stale = sorted(set(declared()) - set(raised_rule_ids()))
    assert not stale, stale


def test_every_registered_rule_is_documented_in_its_section_of_the_analysis_doc():
    sections = _sections((ROOT / DOC).read_text())
    missing = []
    for rule in declared().values():
        assert rule.section in sections, f"{rule.id}: no section {rule.section!r} in {DOC}"
        if f"`{rule.id}`" not in sections[rule.section]:
            missing.append(f"{rule.id} (section {rule.section!r})")
    assert not missing, missing


def test_every_rule_the_analysis_doc_tabulates_is_registered():
    text = (ROOT / DOC).read_text()
    tabulated = {
        rule_id
        for row in re.findall(r"^\| (`[^|]+)\|", text, re.MULTILINE)
        for rule_id in re.findall(r"`([a-z-]+)`", row)
    }
    assert tabulated, "no rule table found"
    assert tabulated <= set(declared()), sorted(tabulated - set(declared()))


def test_report_explains_each_rule_that_fired_from_the_registry():
    from types import SimpleNamespace

    from fusegen.tools.report import report_data, report_text

    target = SimpleNamespace(source="toy", model_type="toy", module=SimpleNamespace(__name__="toy.modeling"))
    outcome = ClassOutcome("ToyAttention", [], [Refusal(("q_proj", "k_proj"), "input-rebound", "`x` is rebound", 7)])
    analysis = SimpleNamespace(target=target, outcomes=[outcome])
    text = report_text([analysis])
    assert f"input-rebound: {describe('input-rebound').doc} ({DOC}: {describe('input-rebound').section})" in text
    refusal = report_data([analysis])["targets"][0]["classes"][0]["refused"][0]
    assert refusal["rule_doc"] == describe("input-rebound").doc
    assert refusal["rule_section"] == describe("input-rebound").section
    assert describe("a-rule-of-someone-elses").doc == "(not a registered rule)"


def test_coverage_publishes_only_registered_rule_ids():
    import pytest

    from fusegen.tools import coverage

    def row(rule):
        refused = [{"projections": ["q_proj", "k_proj"], "rule": rule, "reason": "why", "line": None}]
        classes = [{"class": "ToyAttention", "fused": [], "refused": refused, "trace_stopped": None}]
        return coverage.Row("toy", "nothing", {"classes": classes}, "", coverage.Inspection(), None)

    coverage.check_rules_registered([row("input-rebound")])
    with pytest.raises(ValueError, match=r"a-rule-nobody-registered \(toy, ToyAttention\)"):
        coverage.render_markdown([row("input-rebound"), row("a-rule-nobody-registered")])
