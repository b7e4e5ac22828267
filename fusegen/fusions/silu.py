"""Fusion kind `silu` (a skeleton: written to measure what a second leaf-forward kind costs; not registered).

An activation module whose forward is `x * torch.sigmoid(x)` (either operand order, `x.sigmoid()` or
`torch.nn.functional.sigmoid(x)` too) becomes one `torch.nn.functional.silu(x)` call. Everything a leaf-forward
kind needs besides its own derivation comes from `fusegen.fusions.leaf`:

- the rewrite (`rewrite_forward`) puts the kernel under a guard naming what was executed (the floating dtypes of
  `DTYPES`) and keeps the original statement below it for every other input (`leaf.guard_forward`);
- the check (`check_exact`) runs the original and the rewritten forward side by side (`leaf.compile_forward`,
  `leaf.compare_exact`) on several shapes, scales and dtypes; output and input gradient must be bit-identical, or
  the plan is refused as `silu-inexact` with the case that showed it.

On the CPUs measured so far, torch's fused SiLU kernel does not round as `x * sigmoid(x)` does, so the check
refuses every class: that is why the kind is not registered. Registering it is one line (`@fusions.register` on
`SiluKind`); the check then decides, per build, on the machine that builds.
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refused
from fusegen.core.traced import Trace
from fusegen.fusions import leaf
from fusegen.fusions.base import Kind

KIND = "silu"
KERNEL = "torch.nn.functional.silu"
RULE = "silu-inexact"

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The input dtypes the check executes, and so the only ones the guard admits."""
SHAPES = ((7,), (3, 33), (2, 5, 128))
SCALES = (1e-3, 1.0, 20.0)


@dataclass(frozen=True)
class SiluPlan(FusionPlan):
    input_name: str = ""
    """The forward's tensor parameter."""

    def describe(self) -> str:
        return f"forward -> {KERNEL} ({self.kind})"


def derive(cls: type) -> SiluPlan:
    """The plan for `cls`, whose forward must be (a docstring and) `return x * sigmoid(x)`; else `Refused`."""
    forward = astutil.method(astutil.parse_class(cls), "forward")
    if forward is None:
        raise Refused("silu-form", f"{cls.__name__} defines no forward")
    params = [arg.arg for arg in forward.args.args]
    body = forward.body[1:] if forward.body and leaf.is_docstring(forward.body[0]) else forward.body
    if len(params) != 2 or len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        raise Refused("silu-form", f"{cls.__name__}.forward is not one `return` of its one input")
    x = params[1]
    value = body[0].value
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
        raise Refused("silu-form", f"`{ast.unparse(value)}` is not a product", value)
    if not any(
        _is_name(a, x) and _is_sigmoid_of(b, x) for a, b in ((value.left, value.right), (value.right, value.left))
    ):
        raise Refused("silu-form", f"`{ast.unparse(value)}` is not `{x} * sigmoid({x})`", value)
    return SiluPlan(KIND, "forward", input_name=x)


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_sigmoid_of(node: ast.expr, x: str) -> bool:
    """`torch.sigmoid(x)`, `torch.nn.functional.sigmoid(x)`, `F.sigmoid(x)` or `x.sigmoid()` (resolved by spelling:
    the check by execution is what makes a mis-resolved name harmless)."""
    if not isinstance(node, ast.Call) or node.keywords or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr != "sigmoid":
        return False
    if not node.args:
        return _is_name(node.func.value, x)
    return len(node.args) == 1 and _is_name(node.args[0], x) and ast.unparse(node.func.value) in (
        "torch", "torch.nn.functional", "F", "nn.functional",
    )  # fmt: skip


def rewrite_forward(forward: ast.FunctionDef, plan: SiluPlan) -> None:
    """The kernel under a guard admitting the dtypes `check_exact` executed; the original return below it."""
    x = plan.input_name
    dtypes = ", ".join(str(dtype) for dtype in DTYPES)
    leaf.guard_forward(forward, f"{x}.dtype in ({dtypes})", f"{KERNEL}({x})")


def check_exact(cls: type, instance: nn.Module, plan: SiluPlan, namespace: dict | None = None) -> int:
    """The number of cases on which the rewritten forward matched the original bit for bit (output and input
    gradient); `Refused(RULE)` naming the first case that differs."""
    classdef = astutil.parse_class(cls)
    rewrite_forward(astutil.method(classdef, "forward"), plan)
    rewritten = leaf.compile_forward(cls, astutil.method(classdef, "forward"), namespace, KIND)
    generator = torch.Generator().manual_seed(0)
    cases = 0
    for shape in SHAPES:
        for scale in SCALES:
            x = torch.randn(shape, generator=generator) * scale
            for dtype in DTYPES:
                where = f"input {shape} x{scale} {dtype}"
                leaf.compare_exact(instance, {}, cls.forward, rewritten, x.to(dtype), where, cls.__name__, RULE)
                cases += 1
    return cases


class SiluKind(Kind):
    """Not registered (see the module docstring)."""

    name = KIND
    priority = 95

    def candidate(self, module: nn.Module) -> bool:
        """Leaf modules of a class defined outside torch whose forward's source mentions `sigmoid`."""
        cls = type(module)
        if cls.__module__.startswith("torch.") or next(module.children(), None) is not None:
            return False
        return "sigmoid" in _forward_source(cls)

    def match(self, trace: Trace, module: nn.Module) -> list[FusionPlan]:
        try:
            return [derive(type(module))]
        except Refused:
            return []  # not an activation of this form: nothing to report

    def check(self, module: nn.Module, plan: FusionPlan) -> None:
        check_exact(type(module), module, plan)

    def rewrite(
        self, classdef: ast.ClassDef, plan: FusionPlan, module: nn.Module, namespace: dict, fused: list[FusionPlan]
    ) -> None:
        rewrite_forward(astutil.method(classdef, "forward"), plan)


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return ""
