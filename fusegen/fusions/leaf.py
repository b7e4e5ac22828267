"""What leaf-forward kinds share: the guard that keeps the original statements, execution of a rewritten forward,
and the bit-exact comparison of two forwards.

A leaf-forward kind rewrites only `forward` of a module without children (a norm, a router, an activation) and
keeps its `__init__`, parameters and checkpoint names. Its soundness argument has two halves, and each is one
function here:

- **the guard** (`guard_forward`): the new computation runs under a condition that names what was executed, and the
  original statements stay below it for everything else, so an input the check never saw runs the original code;
- **the execution check** (`compile_forward`, `compare_exact`): the original and the rewritten forward run side by
  side on one module with the same state, and the output, the input gradient and every parameter gradient must be
  bit-identical (`torch.equal`, same dtype). Any difference, or a rewrite that raises where the original runs, is a
  refusal with the kind's rule id and the case that showed it.
"""

from __future__ import annotations

import ast
import copy
import sys

import torch
from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import Refused


def is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def guard_forward(forward: ast.FunctionDef, condition: str, fast: str, reason: str) -> None:
    """Put `if <condition>: return <fast>` at the top of `forward` (after its docstring), in place; the original
    statements stay below it and run whenever the condition is false. `reason` (one line: why the guard admits only
    what it admits) goes into the generated file as a comment above the guard (`astutil.with_reason`)."""
    guard = astutil.with_reason(ast.parse(f"if {condition}:\n    return {fast}").body[0], reason)
    docstring = forward.body[:1] if is_docstring(forward.body[0]) else []
    forward.body = docstring + [guard] + forward.body[len(docstring) :]
    ast.fix_missing_locations(forward)


def compile_forward(cls: type, forward: ast.FunctionDef, namespace: dict | None = None, label: str = "rewrite"):
    """The function `forward` defines, executed in the namespace of `cls`'s module (or `namespace`)."""
    namespace = dict(namespace if namespace is not None else vars(sys.modules[cls.__module__]))
    module = ast.Module([copy.deepcopy(forward)], [])
    ast.fix_missing_locations(module)
    exec(compile(module, f"<fusegen {label} {cls.__name__}>", "exec"), namespace)  # noqa: S102 - our own rewrite
    return namespace[forward.name]


def compare_exact(module: nn.Module, state: dict, original, rewritten, x, where: str, name: str, rule: str) -> None:
    """Raise `Refused(rule)` unless `original(module, x)` and `rewritten(module, x)`, each from fresh copies of `state`,
    give equal outputs and equal gradients (input and every parameter) for one random cotangent."""
    runs = []
    for forward in (original, rewritten):
        params = fresh_state(module, state)
        inputs = x.clone().requires_grad_(True)
        try:
            runs.append((inputs, params, forward(module, inputs)))
        except Exception as error:  # noqa: BLE001 - a rewrite that fails where the original runs is a refusal
            raise Refused(rule, f"{name}: the rewrite fails on {where}: {error!r}"[:400]) from None
    (_, _, expected), (_, _, actual) = runs
    if expected.dtype != actual.dtype or not torch.equal(expected, actual):
        raise Refused(rule, f"{name}: output differs on {where}{describe_diff(expected, actual)}")
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(len(where))).to(expected.dtype)
    gradients = []
    for inputs, params, out in runs:
        gradients.append(torch.autograd.grad(out, [inputs, *params], cotangent, allow_unused=True))
    for index, (a, b) in enumerate(zip(*gradients)):
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            what = "input" if index == 0 else "parameter"
            raise Refused(rule, f"{name}: {what} gradient differs on {where}{describe_diff(a, b)}")


def fresh_state(module: nn.Module, state: dict) -> list[nn.Parameter]:
    """Set `module`'s parameters and buffers to fresh copies of `state`; the new parameters, in order."""
    params = []
    for name, value in state.items():
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(value.clone())
            params.append(module._parameters[name])
        else:
            module._buffers[name] = value.clone()
    return params


def describe_diff(expected: torch.Tensor, actual: torch.Tensor) -> str:
    """` (dtype shape vs dtype shape)` or ` (max |diff| d)`, for a refusal's reason."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return f" ({expected.dtype}{tuple(expected.shape)} vs {actual.dtype}{tuple(actual.shape)})"
    return f" (max |diff| {(expected.double() - actual.double()).abs().max().item():.3g})"
