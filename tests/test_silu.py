"""The `silu` kind: a second leaf-forward kind, built on `fusegen.fusions.leaf` (guard, execution, exact compare)."""

from __future__ import annotations

import ast

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fusegen import fusions
from fusegen.core import astutil
from fusegen.core.plan import Refused
from fusegen.fusions import silu


class Swish(nn.Module):
    def forward(self, x):
        """x * sigmoid(x)"""
        return x * torch.sigmoid(x)


class SwishFlipped(nn.Module):
    def forward(self, hidden):
        return hidden.sigmoid() * hidden


class SwishFunctional(nn.Module):
    def forward(self, input):
        return input * F.sigmoid(input)


class NotSwish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(2 * x)


class TwoStatements(nn.Module):
    def forward(self, x):
        y = torch.sigmoid(x)
        return x * y


@pytest.mark.parametrize(("cls", "name"), [(Swish, "x"), (SwishFlipped, "hidden"), (SwishFunctional, "input")])
def test_each_spelling_is_derived(cls, name):
    assert silu.derive(cls) == silu.SiluPlan("silu", "forward", input_name=name)


@pytest.mark.parametrize("cls", [NotSwish, TwoStatements])
def test_other_forwards_are_refused_with_the_form_rule(cls):
    with pytest.raises(Refused) as refusal:
        silu.derive(cls)
    assert refusal.value.rule == "silu-form"


def test_the_rewrite_guards_the_kernel_and_keeps_the_original_below():
    classdef = astutil.parse_class(Swish)
    forward = astutil.method(classdef, "forward")
    silu.rewrite_forward(forward, silu.derive(Swish))
    _docstring, guard, original = forward.body
    assert isinstance(guard, ast.If) and ast.unparse(guard.body[0]) == "return torch.nn.functional.silu(x)"
    assert "x.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)" == ast.unparse(guard.test)
    assert ast.unparse(original) == "return x * torch.sigmoid(x)"


def test_the_check_accepts_an_exact_rewrite_and_refuses_an_inexact_one(monkeypatch):
    """With a kernel spelled as the original computation the check passes every case; with one that differs it
    refuses as `silu-inexact`, naming the case."""
    monkeypatch.setattr(silu, "KERNEL", "(lambda t: t * torch.sigmoid(t))")
    cases = silu.check_exact(Swish, Swish(), silu.derive(Swish))
    assert cases == len(silu.SHAPES) * len(silu.SCALES) * len(silu.DTYPES)
    monkeypatch.setattr(silu, "KERNEL", "(lambda t: t * torch.sigmoid(t) * 1.0001)")
    with pytest.raises(Refused, match="Swish: output differs on input") as refusal:
        silu.check_exact(Swish, Swish(), silu.derive(Swish))
    assert refusal.value.rule == "silu-inexact"


def test_the_real_kernel_is_judged_by_execution():
    """torch's SiLU kernel is refused exactly when it rounds otherwise than `x * sigmoid(x)` on the check's first
    case (float32), computed here independently."""
    x = torch.randn(silu.SHAPES[0], generator=torch.Generator().manual_seed(0)) * silu.SCALES[0]
    first_case_equal = torch.equal(F.silu(x), x * torch.sigmoid(x))
    try:
        silu.check_exact(Swish, Swish(), silu.derive(Swish))
    except Refused as refusal:
        assert refusal.rule == "silu-inexact"
    else:
        assert first_case_equal, "the check accepted a kernel that differs on its own first case"


def test_the_kind_is_a_skeleton_and_not_registered():
    kind = silu.SiluKind()
    assert kind.candidate(Swish()) and not kind.candidate(nn.SiLU())
    assert kind.match(None, Swish()) == [silu.derive(Swish)] and kind.match(None, NotSwish()) == []
    assert "silu" not in [registered.name for registered in fusions.kinds()]
