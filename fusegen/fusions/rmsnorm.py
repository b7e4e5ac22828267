"""Fusion kind `rmsnorm`: an RMS norm's forward becomes one `torch.nn.functional.rms_norm` call.

Not a merge of linears: the class keeps its `__init__`, parameters and checkpoint names; only `forward` changes,
and only where two arguments agree.

1. **Derivation from the source** (`derive`). The forward is read as a term over its input `x`: locals are
   substituted, `self._norm(...)`-style helper methods of the class are inlined, and each expression must be one
   of a small vocabulary (`.to(torch.float32)`, `.float()`, `.to(x.dtype)`, `.type_as(x)`, `.pow(2)`, `** 2`,
   `.mean(-1, keepdim=True)`, `torch.rsqrt`, `+`, `*`, a parameter, a number attribute, a number). The term must
   contain the float32 RMS normalisation

       N = h * rsqrt(mean(h ** 2, -1, keepdim) + self.<eps>)      with h = x.to(torch.float32)

   and use `x` nowhere else. `N` is then replaced by the kernel, and everything around it (the weight, `1 + weight`,
   casts) is emitted as the same operations in the same order, so it rounds exactly as before:
   - `x.to(x.dtype)`-cast `N` (Llama: `self.weight * N.to(input_dtype)`) becomes `F.rms_norm(x, ...)` on the input's
     own dtype, guarded to float32/bfloat16/float16 inputs (for which the kernel computes in float32 and rounds once,
     as `N.to(input_dtype)` does); any other dtype (float64, where the kernel would compute in float64) runs the
     original statements, kept below the guard;
   - a bare `N` (Gemma: `(N * (1.0 + self.weight.float())).type_as(x)`, OLMo 2: `(self.weight * N).to(input_dtype)`)
     becomes `F.rms_norm(x.to(torch.float32), ...)`, exact for every input dtype since the input is float32.
   The kernel is always called without a weight and over `x.shape[-1:]`: the weight is applied the way the original
   applies it (its dtype, its broadcasting, before or after the cast), and the reduction is the original's last
   dimension whatever the weight's shape. Anything outside the vocabulary or the form is refused with a rule id:
   a false alarm costs a fusion, a miss returns wrong numbers.

   eps is the one value whose meaning the rewrite changes (the original adds it, the kernel takes it as an
   argument), and it comes from the config, so the kernel runs only while `self.<eps>` is a Python float; for any
   other value (`None`, on which the original raises and the kernel would use its own default, an int, a tensor)
   the original statements, always kept below the guard, run. Every other attribute the term reads (weights,
   numbers such as an offset) is emitted as the same operation on the same attribute, so whatever a config puts
   there does to the rewrite exactly what it does to the original.
2. **Validation by execution** (`check_exact`). The kernel identities above are facts about the installed torch on
   this CPU, so they are checked, not assumed: the original and the rewritten forward run on one instance with
   random parameters, several norm sizes (odd ones too), batch shapes (incl. per-head 4-d inputs and a strided
   view), input scales and eps values, in float32, bfloat16, float16, float64 and float32 weights with bfloat16
   input; outputs and the gradients of the input and of every parameter must be `torch.equal`. Any difference is
   the refusal `norm-inexact`, with the case that showed it. A pass is kept for the process (`VERDICTS`,
   `fusegen.fusions.verdicts`): a class whose check would run the same code on the same state and cases (Qwen2's
   norm after Llama's: the same forward in another module) reuses it instead of running the 510 cases again.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import sys
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from fusegen import fusions
from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refusal, Refused
from fusegen.core.rules import rules as section_rules
from fusegen.core.traced import Trace
from fusegen.fusions import leaf, verdicts
from fusegen.fusions.base import Kind
from fusegen.fusions.leaf import guard_forward

KIND = "rmsnorm"
KERNEL = "torch.nn.functional.rms_norm"
"""Spelled out in full: the modeling modules bind `torch`, not `F`, and a generated file imports what they bind."""
HALF_EXACT_DTYPES = ("float32", "bfloat16", "float16")
"""Input dtypes for which the kernel computes in float32 and rounds once to the input dtype (its `opmath` type)."""
MAX_INLINE_DEPTH = 3

RULES = {
    "norm-signature": "forward takes something other than one tensor argument",
    "norm-statement": "forward has a statement other than assignments to locals and one final return",
    "norm-expression": "an expression outside the recognised vocabulary",
    "norm-attribute": "an attribute read that is not a parameter, buffer or number set on the instance",
    "norm-not-rms": "the computation is not the float32 RMS normalisation the kernel computes",
    "norm-inexact": "the rewritten forward differs from the original when executed",
    "norm-subclassed": "another class of its module subclasses the norm and would inherit the rewrite",
}
"""Rule ids of this kind's refusals, with what each one means: the kind's `rules`, in the rule registry."""


# --- terms -----------------------------------------------------------------------------------------------------------


class Term:
    """A node of the forward's computation: `op` applied to `args` (terms, or names/values for leaves).

    Two terms are equal when they compute the same thing up to the order of `+` and `*` operands (IEEE addition
    and multiplication are commutative bit for bit, type promotion too); `args` keep the source's order, so the
    rewrite spells the operations as the original did.
    """

    def __init__(self, op: str, args: tuple = (), node: ast.AST | None = None):
        self.op, self.args, self.node = op, args, node
        keys = tuple(a.key if isinstance(a, Term) else repr(a) for a in args)
        self.key = (op, tuple(sorted(keys)) if op in COMMUTATIVE else keys)

    def __eq__(self, other) -> bool:
        return isinstance(other, Term) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Term{self.key!r}"


COMMUTATIVE = {"add", "mul"}


def _term(op: str, *args, node=None) -> Term:
    if op == "f32" and args[0].op == "f32":
        return args[0]  # `.float().float()`: the second cast is the identity
    return Term(op, args, node)


def _h() -> Term:
    return _term("f32", _term("x"))


def normalised(eps: str) -> Term:
    """N: the float32 RMS normalisation of the input, eps read from `self.<eps>`."""
    h = _h()
    return _term("mul", h, _term("rsqrt", _term("add", _term("mean", _term("sq", h)), _term("attr", eps))))


class _Reader:
    """Reads a forward (and the helper methods it calls) into a `Term`; raises `Refused` on anything else."""

    def __init__(self, cls: type, instance: nn.Module, namespace: dict):
        self.cls, self.instance, self.namespace = cls, instance, namespace

    def function(self, function: ast.FunctionDef, arguments: list[Term], depth: int = 0) -> Term:
        params = function.args
        if params.vararg or params.kwarg or params.kwonlyargs or params.posonlyargs or params.defaults:
            raise Refused(
                "norm-signature", f"{function.name} takes other arguments than self and one tensor", function
            )
        names = [a.arg for a in params.args]
        if len(names) != len(arguments) + 1:
            raise Refused("norm-signature", f"{function.name} takes {len(names) - 1} arguments, not 1", function)
        if function.decorator_list:
            raise Refused("norm-signature", f"{function.name} is decorated", function)
        env = dict(zip(names[1:], arguments))
        body = function.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring
        for stmt in body[:-1]:
            if not (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None):
                raise Refused("norm-statement", f"{function.name}: `{ast.unparse(stmt)}`", stmt)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if len(targets) != 1 or not isinstance(targets[0], ast.Name):
                raise Refused(
                    "norm-statement", f"{function.name}: `{ast.unparse(stmt)}` assigns other than a local", stmt
                )
            env[targets[0].id] = self.expr(stmt.value, env, depth)
        if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
            raise Refused("norm-statement", f"{function.name} does not end in `return <expression>`", function)
        return self.expr(body[-1].value, env, depth)

    def expr(self, node: ast.expr, env: dict, depth: int) -> Term:
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            raise Refused("norm-expression", f"`{node.id}` is not a local of the forward", node)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _term("const", node.value, node=node)
        if isinstance(node, ast.BinOp):
            return self.binop(node, env, depth)
        if isinstance(node, ast.Attribute):
            return self.attribute(node, env, depth)
        if isinstance(node, ast.Call):
            return self.call(node, env, depth)
        raise Refused("norm-expression", f"`{ast.unparse(node)}`", node)

    def binop(self, node: ast.BinOp, env: dict, depth: int) -> Term:
        left, right = self.expr(node.left, env, depth), self.expr(node.right, env, depth)
        if isinstance(node.op, ast.Pow):
            if right == Term("const", (2,)) and type(node.right.value) is int:
                return _term("sq", left, node=node)
            raise Refused("norm-expression", f"`{ast.unparse(node)}`: only `** 2` is recognised", node)
        ops = {ast.Add: "add", ast.Mult: "mul", ast.Sub: "sub", ast.Div: "div"}
        if type(node.op) not in ops:
            raise Refused("norm-expression", f"`{ast.unparse(node)}`", node)
        return _term(ops[type(node.op)], left, right, node=node)

    def attribute(self, node: ast.Attribute, env: dict, depth: int) -> Term:
        if astutil.self_attr(node):
            return self.self_attribute(node)
        if node.attr == "dtype":
            base = self.expr(node.value, env, depth)
            if base.op == "x":
                return _term("dtype_x", node=node)
        raise Refused("norm-expression", f"`{ast.unparse(node)}`", node)

    def self_attribute(self, node: ast.Attribute) -> Term:
        name, instance = node.attr, self.instance
        if isinstance(inspect.getattr_static(type(instance), name, None), (property, types.MemberDescriptorType)):
            raise Refused("norm-attribute", f"self.{name} is a descriptor of the class", node)
        if instance._parameters.get(name) is not None or instance._buffers.get(name) is not None:
            return _term("param", name, node=node)
        value = instance.__dict__.get(name)
        if type(value) in (int, float):
            return _term("attr", name, node=node)
        raise Refused(
            "norm-attribute", f"self.{name} is not a parameter, buffer or number ({type(value).__name__})", node
        )

    def call(self, node: ast.Call, env: dict, depth: int) -> Term:
        func = node.func
        if not isinstance(func, ast.Attribute):
            raise Refused("norm-expression", f"`{ast.unparse(node)}`", node)
        if isinstance(func.value, ast.Name) and func.value.id == "self":
            return self.method_call(node, env, depth)
        if self.is_torch(func.value):
            return self.torch_call(node, env, depth)
        receiver = self.expr(func.value, env, depth)
        return self.tensor_method(node, receiver, env, depth)

    def method_call(self, node: ast.Call, env: dict, depth: int) -> Term:
        """`self.<helper>(t)`: the helper's own single-argument body, read with `t` for its parameter."""
        func = node.func
        if node.keywords or depth >= MAX_INLINE_DEPTH:
            raise Refused("norm-expression", f"`{ast.unparse(node)}`", node)
        helper = inspect.getattr_static(type(self.instance), func.attr, None)
        if not isinstance(helper, types.FunctionType) or func.attr in self.instance.__dict__:
            raise Refused("norm-expression", f"`{ast.unparse(node)}`: self.{func.attr} is not a plain method", node)
        owner = next(c for c in type(self.instance).__mro__ if func.attr in vars(c))
        definition = astutil.method(astutil.parse_class(owner), func.attr)
        if definition is None or owner.__module__ != self.cls.__module__:
            raise Refused(
                "norm-expression", f"`{ast.unparse(node)}`: the source of self.{func.attr} is elsewhere", node
            )
        return self.function(definition, [self.expr(a, env, depth) for a in node.args], depth + 1)

    def is_torch(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and self.namespace.get(node.id) is torch

    def is_float32(self, node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and self.is_torch(node.value)
            and getattr(torch, node.attr, None) is torch.float32
        )

    def torch_call(self, node: ast.Call, env: dict, depth: int) -> Term:
        name = node.func.attr
        if name == "rsqrt" and len(node.args) == 1 and not node.keywords:
            return _term("rsqrt", self.expr(node.args[0], env, depth), node=node)
        if name == "pow" and len(node.args) == 2 and not node.keywords:
            base = self.expr(node.args[0], env, depth)
            return self.tensor_method(
                ast.Call(ast.Attribute(node.args[0], "pow"), node.args[1:], []), base, env, depth
            )
        if name == "mean" and node.args:
            base = self.expr(node.args[0], env, depth)
            return self.tensor_method(
                ast.Call(ast.Attribute(node.args[0], "mean"), node.args[1:], node.keywords), base, env, depth
            )
        raise Refused("norm-expression", f"`{ast.unparse(node)}`", node)

    def tensor_method(self, node: ast.Call, receiver: Term, env: dict, depth: int) -> Term:
        name, args, keywords = node.func.attr, node.args, {k.arg: k.value for k in node.keywords}
        if name == "float" and not args and not keywords:
            return _term("f32", receiver, node=node)
        if name == "to" and not keywords and len(args) == 1:
            if self.is_float32(args[0]):
                return _term("f32", receiver, node=node)
            if self.expr(args[0], env, depth).op == "dtype_x":
                return _term("cast_x", receiver, node=node)
        if name == "to" and not args and set(keywords) == {"dtype"} and self.is_float32(keywords["dtype"]):
            return _term("f32", receiver, node=node)
        if name == "type_as" and len(args) == 1 and not keywords and self.expr(args[0], env, depth).op == "x":
            return _term("cast_x", receiver, node=node)
        if name == "pow" and len(args) == 1 and not keywords and _is_constant(args[0], 2):
            return _term("sq", receiver, node=node)
        if name == "rsqrt" and not args and not keywords:
            return _term("rsqrt", receiver, node=node)
        if name == "mean" and _last_dim_keepdim(args, keywords):
            return _term("mean", receiver, node=node)
        raise Refused("norm-expression", f"`{ast.unparse(node)}`", node)


def _last_dim_keepdim(args: list, keywords: dict) -> bool:
    """`.mean(-1, keepdim=True)` / `.mean(dim=-1, keepdim=True)` (also with `keepdim` positional)."""
    dims = args[:1] or [keywords.get("dim")]
    keep = args[1:2] or [keywords.get("keepdim")]
    if len(args) > 2 or set(keywords) - {"dim", "keepdim"} or len(args) + len(keywords) != 2:
        return False
    return _is_constant(dims[0], -1) and _is_constant(keep[0], True)


def _is_constant(node, value) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return type(value) is int and type(node.operand.value) is int and -node.operand.value == value
    return isinstance(node, ast.Constant) and type(node.value) is type(value) and node.value == value


# --- the plan: what was derived --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormPlan(FusionPlan):
    """An RMS norm class whose forward becomes one kernel call (`merged` is "forward", what the rewrite replaces).
    A norm class the derivation refuses gets no plan: `RMSNormKind.match` returns the refusal itself."""

    class_name: str = ""
    input_name: str = ""
    """The forward's tensor parameter (`hidden_states`)."""
    eps: str = ""
    """The attribute eps is read from (`variance_epsilon`)."""
    term: Term | None = field(default=None, compare=False)
    """The original forward as a term (see `derive`)."""
    style: str = ""
    """`cast-then-weight` (Llama), `weight-then-cast` (OLMo 2, Gemma), `no-cast`: where N is cast back, if at all."""

    def describe(self) -> str:
        return f"forward -> {KERNEL} ({self.kind}, {self.style}, eps=self.{self.eps})"


def _plan(class_name: str, input_name: str, eps: str, term: Term, style: str) -> NormPlan:
    return NormPlan(KIND, "forward", class_name=class_name, input_name=input_name, eps=eps, term=term, style=style)


def derive(cls: type, instance: nn.Module, namespace: dict | None = None) -> NormPlan:
    """The plan for norm class `cls` (with `instance` built from it), or `Refused` naming the rule.

    Soundness: the term is what the forward computes, given that the names it reads are what the reader checked
    (`torch` is torch, `self.<p>` a parameter or buffer, `self.<eps>` a number in the instance's `__dict__`, no
    property in between); the only operation replaced is N (see the module docstring), and the kernel's identity
    with N is checked by `check_exact` before the plan is used.
    """
    namespace = namespace if namespace is not None else vars(sys.modules[cls.__module__])
    if list(instance.children()):
        raise Refused("norm-statement", f"{cls.__name__} has child modules")
    classdef = astutil.parse_class(cls)
    forward = astutil.method(classdef, "forward")
    if forward is None:
        raise Refused("inherited-method", f"{cls.__name__} inherits forward instead of defining it")
    if inspect.unwrap(cls.forward).__code__.co_freevars:
        raise Refused("closure", f"{cls.__name__}.forward is a closure")
    reader = _Reader(cls, instance, namespace)
    term = reader.function(forward, [_term("x")])
    input_name = forward.args.args[1].arg
    eps = _eps_of(term)
    if eps is None:
        raise Refused(
            "norm-not-rms", f"{cls.__name__}.forward computes no `x * rsqrt(mean(x ** 2) + self.eps)` in float32"
        )
    n = normalised(eps)
    if _uses_input_outside(term, n):
        raise Refused("norm-not-rms", f"{cls.__name__}.forward uses its input outside the RMS normalisation")
    if _contains(term, _term("cast_x", n)):
        style = "cast-then-weight"
    elif _contains_under(term, n, "cast_x"):
        style = "weight-then-cast"
    else:
        style = "no-cast"
    return _plan(cls.__name__, input_name, eps, term, style)


def _eps_of(term: Term) -> str | None:
    """The eps attribute of the first N in `term`, if it contains one."""
    for sub in _subterms(term):
        if sub.op == "attr" and _contains(term, normalised(sub.args[0])):
            return sub.args[0]
    return None


def _subterms(term: Term):
    yield term
    for arg in term.args:
        if isinstance(arg, Term):
            yield from _subterms(arg)


def _contains(term: Term, sub: Term) -> bool:
    return any(t == sub for t in _subterms(term))


def _contains_under(term: Term, sub: Term, op: str) -> bool:
    return any(t.op == op and _contains(t, sub) for t in _subterms(term))


def _uses_input_outside(term: Term, n: Term) -> bool:
    """Whether `term` reads the input anywhere but inside N and in `cast_x` (which reads only its dtype)."""
    if term == n:
        return False
    if term.op in ("x", "dtype_x"):
        return True
    return any(isinstance(a, Term) and _uses_input_outside(a, n) for a in term.args)


# --- the rewrite -----------------------------------------------------------------------------------------------------


def rewrite_forward(forward: ast.FunctionDef, plan: NormPlan) -> None:
    """Rewrite `forward` (the class's own statement, in place) to call the kernel under a guard, keeping the
    original statements below it for whatever the guard does not admit; see the module docstring.

    The guard admits a float eps only (`type(self.<eps>) is float`): eps comes from the config, and the kernel gives
    a value the original does not for the others. `eps=None` (a config without `rms_norm_eps`) makes the original
    raise a TypeError where the kernel would silently use its own default eps (the dtype's machine epsilon); an int,
    a bool, a numpy scalar or a tensor are not what `check_exact` executed (a float eps is: the instance's own,
    1e-6 and 0.5, with the int 1 to run the fallback). The guard costs one type check per call.
    """
    x, n = plan.input_name, normalised(plan.eps)
    kwargs = f"{x}.shape[-1:], eps=self.{plan.eps}"
    condition = f"type(self.{plan.eps}) is float"
    reason = "fusegen: rms_norm equals the statements below for a float eps only; any other eps runs them"
    if plan.style == "cast-then-weight":
        fast = _emit(plan.term, {_term("cast_x", n): f"{KERNEL}({x}, {kwargs})"}, x)
        dtypes = ", ".join(f"torch.{name}" for name in HALF_EXACT_DTYPES)
        condition = f"{condition} and {x}.dtype in ({dtypes})"
        reason = f"fusegen: rms_norm equals the statements below for a float eps and a {'/'.join(HALF_EXACT_DTYPES)} input only"
    else:
        fast = _emit(plan.term, {n: f"{KERNEL}({x}.to(torch.float32), {kwargs})"}, x)
    guard_forward(forward, condition, fast, reason)


def _emit(term: Term, replaced: dict[Term, str], x: str) -> str:
    """Source text computing `term`, with each subterm in `replaced` spelled as given (the kernel call)."""
    if term in replaced:
        return replaced[term]
    op, args = term.op, term.args
    if op == "param" or op == "attr":
        return f"self.{args[0]}"
    if op == "const":
        return repr(args[0])
    if op == "x":
        return x
    inner = [_emit(a, replaced, x) for a in args]
    if op == "f32":
        return f"({inner[0]}).to(torch.float32)"
    if op == "cast_x":
        return f"({inner[0]}).to({x}.dtype)"
    if op in ("add", "mul", "sub", "div"):
        symbol = {"add": "+", "mul": "*", "sub": "-", "div": "/"}[op]
        return f"({inner[0]} {symbol} {inner[1]})"
    if op == "sq":
        return f"({inner[0]}).pow(2)"
    if op == "mean":
        return f"({inner[0]}).mean(-1, keepdim=True)"
    if op == "rsqrt":
        return f"torch.rsqrt({inner[0]})"
    raise AssertionError(f"no emission for {op}")


def rewritten_class(cls: type, plan: NormPlan) -> ast.ClassDef:
    """The class statement of `cls` with its forward rewritten (a fresh copy; line numbers kept)."""
    classdef = astutil.parse_class(cls)
    rewrite_forward(astutil.method(classdef, "forward"), plan)
    return classdef


# --- validation by execution -----------------------------------------------------------------------------------------

SIZES = (1, 7, 33, 128, 2048)
"""Norm sizes tried besides the instance's own: odd ones, a head dim, a hidden size."""
BATCH_SHAPES = ((), (3,), (2, 5), (2, 3, 4))
"""Leading shapes of the input: a vector, tokens, batch x tokens, batch x tokens x heads (per-head q/k norms)."""
SCALES = (1e-3, 1.0, 50.0)
"""Input magnitudes: near eps, unit, large; each tried with every `EPS_VALUES` on one batch shape."""
EPS_VALUES = (None, 1e-6, 0.5, 1)
"""The instance's eps, a typical one, a large one (an eps added in the wrong place shows at 0.5) and an int one (which
the rewrite's guard hands to the original statements)."""
DTYPES = (
    ("float32", torch.float32, torch.float32),
    ("bfloat16", torch.bfloat16, torch.bfloat16),
    ("float16", torch.float16, torch.float16),
    ("float64", torch.float64, torch.float64),
    ("float32 weight, bfloat16 input", torch.float32, torch.bfloat16),
)
"""(label, parameter dtype, input dtype)."""


def _cases(norm_shape: tuple, generator: torch.Generator):
    """(input, eps or None for the instance's own, description) for one norm size, in float32."""
    for batch in BATCH_SHAPES:
        yield torch.randn((*batch, *norm_shape), generator=generator), None, f"input {(*batch, *norm_shape)}"
    for scale in SCALES:
        for eps in EPS_VALUES:
            x = torch.randn((2, 5, *norm_shape), generator=generator) * scale
            yield x, eps, f"input (2, 5, {norm_shape}) x{scale}, eps {'own' if eps is None else repr(eps)}"
    wide = torch.randn((2, 3, 3 * norm_shape[-1]), generator=generator)
    yield wide[..., norm_shape[-1] : 2 * norm_shape[-1]], None, "a strided view (a split merged projection)"


def compile_forward(cls: type, forward: ast.FunctionDef, namespace: dict | None = None):
    """The function `forward` defines, executed in the namespace of `cls`'s module (`fusegen.fusions.leaf`)."""
    return leaf.compile_forward(cls, forward, namespace, KIND)


VERDICTS = verdicts.Verdicts()
"""The checks passed in this process (`fusegen.fusions.verdicts`): a norm class whose check would run the same code on
the same state as one that passed (LlamaRMSNorm and Qwen2RMSNorm) is not checked again."""


def check_exact(cls: type, instance: nn.Module, plan: NormPlan, namespace: dict | None = None) -> int:
    """Run the original and the rewritten forward side by side; the number of cases, or `Refused("norm-inexact")`.

    A pass is kept under `verdicts.check_key` of the two forwards, `instance`, the eps attribute and what
    `compare_forwards` runs with (its functions and case tables, read now as it will read them), so an equal key
    means the same cases run on the same code and state: the verdict would be the same, and is reused."""
    classdef = rewritten_class(cls, plan)
    rewritten = compile_forward(cls, astutil.method(classdef, "forward"), namespace)
    check = (
        compare_forwards, _cases, _resize, leaf.compare_exact, leaf.fresh_state, leaf.describe_diff,
        SIZES, BATCH_SHAPES, SCALES, EPS_VALUES, DTYPES, plan.eps,
    )  # fmt: skip
    key = verdicts.check_key([cls.forward, rewritten], instance, check)
    return VERDICTS.run(key, lambda: compare_forwards(instance, cls.forward, rewritten, plan.eps, plan.class_name))


def compare_forwards(instance: nn.Module, original, rewritten, eps: str, name: str, seed: int = 0) -> int:
    """The number of cases on which `rewritten` matched `original` bit for bit; `Refused("norm-inexact")` otherwise.

    Both run on one materialised copy of `instance` (the rewrite leaves `__init__` alone, so the state is the same),
    with random parameters, for every norm size (`SIZES` and the instance's own, when all parameters are vectors),
    every case of `_cases` and every entry of `DTYPES`. Output, input gradient and every parameter gradient must be
    bit-identical (`torch.equal`, and the same dtype).
    """
    module = copy.deepcopy(instance).to_empty(device="cpu")
    vectors = all(p.dim() == 1 for p in module.parameters()) and all(b.dim() == 1 for b in module.buffers())
    own = next((p.shape for p in module.parameters()), None)
    norm_shapes = [(size,) for size in (tuple(own[-1:]) if own else ()) + SIZES] if vectors or own is None else [own]
    generator = torch.Generator().manual_seed(seed)
    cases = 0
    own_eps = getattr(module, eps)
    try:
        for norm_shape in dict.fromkeys(tuple(s) for s in norm_shapes):
            _resize(module, norm_shape, generator)
            for x, value, what in _cases(norm_shape, generator):
                for label, param_dtype, input_dtype in DTYPES:
                    setattr(module, eps, own_eps if value is None else value)
                    state = {k: v.to(param_dtype) for k, v in module.state_dict().items()}
                    leaf.compare_exact(
                        module, state, original, rewritten, x.to(input_dtype), f"{label}, {what}", name, "norm-inexact"
                    )
                    cases += 1
    finally:
        setattr(module, eps, own_eps)
    return cases


def _resize(module: nn.Module, shape: tuple, generator: torch.Generator) -> None:
    """Give every parameter and buffer of `module` a random value of `shape` (weights near 1 and near 0 both)."""
    for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        value = torch.randn(shape, generator=generator, dtype=torch.float32)
        if isinstance(tensor, nn.Parameter):
            module._parameters[name] = nn.Parameter(value)
        else:
            module._buffers[name] = value


# --- the kind in the pipeline ----------------------------------------------------------------------------------------


@fusions.register
class RMSNormKind(Kind):
    """The `rmsnorm` kind: asked after the linear kinds; its classes are leaf modules, so it never meets them."""

    name = KIND
    priority = 90
    summary = f"forward computed by one {KERNEL} call"
    rules = section_rules("RMS norms become one kernel call", *RULES.items())

    def candidate(self, module: nn.Module) -> bool:
        """Leaf modules (no children) of a class defined outside torch, named as a norm or whose forward's source
        calls `rsqrt` (every RMS normalisation `derive` accepts does).

        torch's own modules (`nn.LayerNorm`, `nn.RMSNorm`) have no source to rewrite. Positional embeddings,
        experts and routers are leaf modules with parameters too, and tracing them costs build time and reports
        trace stops that concern no fusion. A norm neither named as one nor spelled with `rsqrt` is missed: that
        costs a fusion, not numbers.
        """
        cls = type(module)
        if cls.__module__.startswith("torch.") or next(module.children(), None) is not None:
            return False
        return reported(cls) or "rsqrt" in _forward_source(cls)

    def match(self, trace: Trace, module: nn.Module) -> list[FusionPlan | Refusal]:
        """The derived plan; for a class named as a norm that the derivation refuses, the refusal (so the report
        names the class and the rule); nothing for any other leaf class."""
        cls = type(module)
        try:
            return [derive(cls, module)]
        except Refused as refusal:
            return [Refusal(("forward",), refusal.rule, refusal.reason, refusal.line)] if reported(cls) else []

    def check(self, module: nn.Module, plan: FusionPlan) -> None:
        """`norm-subclassed`; then validation by execution (`check_exact`)."""
        cls = type(module)
        heirs = sorted(c.__name__ for c in _subclasses(cls) if c.__module__ == cls.__module__)
        if heirs:
            raise Refused(
                "norm-subclassed", f"{', '.join(heirs)} subclass {cls.__name__} and would inherit the rewrite"
            )
        check_exact(cls, module, plan)

    def rewrite(
        self, classdef: ast.ClassDef, plan: FusionPlan, module: nn.Module, namespace: dict, fused: list[FusionPlan]
    ) -> None:
        rewrite_forward(astutil.method(classdef, "forward"), plan)


def _subclasses(cls: type) -> list[type]:
    """Every class that inherits from `cls`, directly or not, among the classes loaded so far."""
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


@functools.cache
def _forward_source(cls: type) -> str:
    """The source of `cls.forward`, or "" where there is none to read (read once per class: `candidates` asks for
    every module instance of a class it has not taken)."""
    try:
        return inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return ""


def reported(cls: type) -> bool:
    """Whether a refusal of `cls` is worth a report line: only classes named as norms (a scaled embedding is a leaf
    module with a parameter too, and is not a norm the kind failed to fuse)."""
    return "norm" in cls.__name__.lower()
