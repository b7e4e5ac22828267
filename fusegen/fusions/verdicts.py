"""Passed execution checks, kept for a class that would run the same check on the same code (issue 24:
`LlamaRMSNorm` and `Qwen2RMSNorm` are one forward in two modules, and `fusegen build llama qwen2` checked it twice).

An execution check of a leaf-forward kind (`rmsnorm.compare_forwards`) is deterministic: its cases come from a seeded
generator, and its verdict is a function of the code it runs, the values that code reads, the instance's state
other than the parameter values the check overwrites, torch's numerics state and the check's own code and tables.
`check_key` turns all of these into one value that is equal for two checks only when each of them is the same, and
`Verdicts.run` skips a check whose key equals that of a check that passed in this process. Only passes are kept: a
refusal always comes from a run, with its own class's message. Whatever the key cannot describe makes it `None`,
and the check runs.

What the key holds:

- **code**: the functions the check runs (the original forward, the rewritten one) and every entry of every class
  of the instance's MRO below `nn.Module` (methods reached through `self` or called by `nn.Module`'s own machinery,
  `__init__`, class constants), each function as its bytecode, constants (nested code recursively; floats by their
  bits, so 0.0 and -0.0 differ; a constant no instruction loads, such as a docstring, is left out), names, argument
  layout, flags, defaults, closure cell values, and the value bound to every name it mentions where that name can
  resolve: its globals, its builtins, and `torch.Tensor` (`x.pow` runs `torch.Tensor.pow`). A module so bound is
  keyed by identity and by the objects bound to the names the code spells in it (`torch.rsqrt` keys `torch` and
  `torch.rsqrt`; `torch.nn.functional` each module on the way); a class of the MRO by its position in it (the
  `__class__` cell of `super()`); torch's functions, other classes and builtins by identity; other Python functions
  by their code, the same way.
- **instance**: `vars(instance)` as values (numbers, strings, containers, hooks as functions) and its parameters and
  buffers by name, class, shape, dtype and `requires_grad` (the check gives them random values of that shape).
- **torch**: version, default dtype, threads, grad and inference mode, autocast, deterministic algorithms, float32
  matmul precision, and whether this thread flushes denormals (measured: torch has no getter for it).
- **the check**: `extra`, the objects the caller's check runs with (its functions by identity, its case tables by
  value), so a check or table replaced in between (a test's monkeypatch) is run again.

What it leaves out is what differs between two copies of one class: the class's name, qualified name and module,
and the code's file, line numbers and qualified names. Those change a check's verdict only through code that can
observe them: a name that reads them (`__name__`, `type(self).__qualname__`, `repr`, `getattr` with a computed
string, `torch.typename`, `sys`, `inspect`), text formatting of an object (`f"{self}"` formats the class name), or
an exception handler (a message, a traceback). So the key is kept only when every code object keyed is free of
all of them: each name it mentions is in `SAFE_NAMES`, or an attribute of the instance or an entry of an MRO class
(whose code is keyed and judged the same way) that names nothing of torch, `torch.Tensor`, builtins or `nn.Module`;
each opcode is in `SAFE_OPCODES` (`%` is not: it formats strings); and it has no exception handler. The one
exemption is a class's `extra_repr`, which may format its own values: only `nn.Module.__repr__` calls it, and nothing
the check runs formats a module. A class defining `__repr__`, `__str__` or `__format__`, or code naming one of them
or `extra_repr`, gets no key.

Not keyed: rebinding a name inside torch, or inside another library whose objects are keyed by identity, between two
checks of one process (beyond the names the keyed code spells, which are keyed). No build does that.
"""

from __future__ import annotations

import builtins
import collections
import dis
import types
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")

SAFE_NAMES = frozenset(
    {
        # torch, its dtypes and functional namespace
        "torch", "nn", "functional", "float32", "bfloat16", "float16", "float64", "rms_norm", "Parameter", "ones",
        "zeros",
        # tensor arithmetic and metadata (derive's vocabulary and the rewrite's guard)
        "dtype", "shape", "to", "float", "type_as", "pow", "mean", "rsqrt",
        # builtins that return no name: `type(self.eps) is float`, `tuple(shape)`, `super().__init__()`
        "type", "tuple", "super", "__init__",
    }
)  # fmt: skip
"""Names whose values reveal no class name, module, file or line number."""

SAFE_OPCODES = frozenset(
    {
        "RESUME", "NOP", "CACHE", "PUSH_NULL", "COPY", "SWAP", "POP_TOP", "RETURN_VALUE", "RETURN_CONST",
        "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "STORE_FAST", "STORE_FAST_STORE_FAST", "LOAD_CONST",
        "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "LOAD_DEREF", "MAKE_CELL", "COPY_FREE_VARS",
        "PRECALL", "CALL", "KW_NAMES", "CALL_KW", "BINARY_OP", "UNARY_NEGATIVE", "BINARY_SUBSCR", "BUILD_SLICE",
        "BUILD_TUPLE", "COMPARE_OP", "IS_OP", "CONTAINS_OP", "TO_BOOL",
        "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_IF_FALSE", "POP_JUMP_IF_TRUE",
        "JUMP_FORWARD", "LOAD_SUPER_ATTR",
    }
)  # fmt: skip
"""Opcodes that format no object as text and handle no exception."""

FORMATTING_OPCODES = frozenset({"FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CONVERT_VALUE", "BUILD_STRING"})
"""Allowed in `extra_repr` only (see the module docstring)."""

REVEALING = frozenset({"extra_repr", "__repr__", "__str__", "__format__"})

NOT_STATE = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__firstlineno__"})
"""Class entries that are the class's names and documentation, not what its code reads."""

MAX_DEPTH = 6
"""Python functions reached through other functions' globals are keyed to this depth; deeper, no key."""


class Unkeyable(Exception):
    """A value the key cannot describe: the check runs."""


class Verdicts:
    """The passed checks of this process, by key; `hits` and `runs` count what `run` did."""

    def __init__(self) -> None:
        self.passed: dict[tuple, object] = {}
        self.hits = 0
        self.runs = 0

    def run(self, key: tuple | None, check: Callable[[], T]) -> T:
        """`check()`'s result: kept from an earlier pass under an equal key, or from running it now (a raise is
        not kept)."""
        if key is not None and key in self.passed:
            self.hits += 1
            return self.passed[key]
        self.runs += 1
        result = check()
        if key is not None:
            self.passed[key] = result
        return result

    def clear(self) -> None:
        self.passed.clear()


def check_key(functions: list[Callable], instance: nn.Module, extra: tuple) -> tuple | None:
    """The key of an execution check that runs `functions` on copies of `instance` (see the module docstring), or
    None where it cannot be given."""
    try:
        keyer = _Keyer(instance)
        classes = keyer.classes()
        key = (
            ("check", extra),
            ("torch", torch_state()),
            ("functions", tuple(keyer.value(f) for f in functions)),
            ("classes", classes),
            ("instance", keyer.instance()),
        )
        hash(key)
    except (Unkeyable, TypeError, RecursionError):
        return None
    return key if keyer.name_blind() else None


def torch_state() -> tuple:
    """torch's process and thread state that can change what a kernel computes."""
    return (
        torch.__version__,
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
        bool(torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() == 0.0),  # denormals flushed
    )


class _Keyer:
    """One key's walk: the instance's MRO below `nn.Module`, the functions being keyed (to cut cycles), and every
    code object keyed, with whether it is an `extra_repr` (for `name_blind`)."""

    def __init__(self, instance: nn.Module):
        self.instance_ = instance
        mro = type(instance).__mro__
        if nn.Module not in mro:
            raise Unkeyable("not an nn.Module")
        self.mro = list(mro[: mro.index(nn.Module)])
        self.stack: list[types.FunctionType] = []
        self.codes: list[tuple[types.CodeType, bool]] = []
        own = set(vars(instance)) | set(instance._parameters) | set(instance._buffers)
        own |= {name for cls in self.mro for name in vars(cls) if name not in NOT_STATE}
        self.attributes = {name for name in own if not any(hasattr(space, name) for space in _ELSEWHERE)}
        """The instance's own attribute names, where they do not also name something of torch, builtins or
        `nn.Module` (a name is only a string: `torch.<it>` would read that instead)."""

    # --- the parts ----------------------------------------------------------------------------------------------

    def classes(self) -> tuple:
        own = tuple(
            tuple(
                (name, self.value(value, repr_ok=name == "extra_repr"))
                for name, value in vars(cls).items()
                if name not in NOT_STATE
            )
            for cls in self.mro
        )
        cls = type(self.instance_)
        return own, cls.__mro__[len(self.mro) :], type(cls)  # nn.Module and above, and the metaclass, by identity

    def instance(self) -> tuple:
        entries = []
        for name, value in vars(self.instance_).items():
            if name in ("_parameters", "_buffers"):
                entries.append((name, tuple((key, _tensor_meta(t)) for key, t in value.items())))
            else:
                entries.append((name, self.value(value)))
        return tuple(entries)

    # --- values -------------------------------------------------------------------------------------------------

    def value(self, value, names: frozenset = frozenset(), repr_ok: bool = False, depth: int = 0):
        kind = type(value)
        if value is None or value is Ellipsis or kind in (bool, int, str, bytes):
            return (kind, value)
        if kind is float:
            return (float, value.hex())
        if kind is complex:
            return (complex, value.real.hex(), value.imag.hex())
        if kind in (torch.dtype, torch.device, torch.layout, torch.memory_format):
            return (kind, str(value))
        if kind in (tuple, list, torch.Size):
            return (kind, tuple(self.value(item, names, depth=depth) for item in value))
        if kind in (dict, collections.OrderedDict):
            return (kind, tuple((self.value(k), self.value(v, names, depth=depth)) for k, v in value.items()))
        if kind in (set, frozenset):
            return (kind, frozenset(self.value(item) for item in value))
        if kind is types.ModuleType:
            return self.module(value, names, set())
        if kind is types.FunctionType:
            return self.function(value, repr_ok, depth)
        if kind in (staticmethod, classmethod):
            return (kind, self.value(value.__func__, depth=depth))
        if kind is property:
            return (kind, *(self.value(f, depth=depth) for f in (value.fget, value.fset, value.fdel)))
        if isinstance(value, type):
            return ("mro", self.mro.index(value)) if value in self.mro else ("id", value)
        if kind in _BUILTIN_CALLABLES:
            return ("id", value)
        raise Unkeyable(f"a {kind.__name__}")

    def module(self, module: types.ModuleType, names: frozenset, seen: set) -> tuple:
        """Identity, and the objects bound in it to `names` (modules among them the same way)."""
        seen.add(module)
        namespace = vars(module)
        bound = []
        for name in sorted(names):
            if name in namespace:
                found = namespace[name]
                if type(found) is types.ModuleType:
                    bound.append((name, ("module", found) if found in seen else self.module(found, names, seen)))
                else:
                    bound.append((name, ("id", found)))
            elif "__getattr__" in namespace:
                bound.append((name, ("getattr", namespace["__getattr__"])))
        return ("module", module, tuple(bound))

    def function(self, function: types.FunctionType, repr_ok: bool = False, depth: int = 0) -> tuple:
        if function in self.stack:
            return ("cycle", self.stack.index(function))
        if (function.__module__ or "").split(".")[0] == "torch":
            return ("id", function)
        if depth > MAX_DEPTH:
            raise Unkeyable(f"{function.__qualname__} is deeper than {MAX_DEPTH} calls")
        self.stack.append(function)
        try:
            code = self.code(function.__code__, repr_ok)
            names = _names(function.__code__)
            spaces = function.__globals__, function.__builtins__
            resolved = tuple(
                (name, self._resolve(name, names, spaces, depth), ("id", getattr(torch.Tensor, name, None)))
                for name in sorted(names)
            )
            cells = tuple(_cell(self, cell, depth) for cell in function.__closure__ or ())
            return (
                "function",
                code,
                resolved,
                self.value(function.__defaults__, depth=depth),
                self.value(function.__kwdefaults__, depth=depth),
                cells,
            )
        finally:
            self.stack.pop()

    def _resolve(self, name: str, names: frozenset, spaces: tuple[dict, dict], depth: int) -> tuple:
        globals_, builtins_ = spaces
        if name in globals_:
            return ("global", self.value(globals_[name], names, depth=depth + 1))
        if name in builtins_:
            return ("builtin", builtins_[name])
        return ("absent",)

    def code(self, code: types.CodeType, repr_ok: bool = False) -> tuple:
        """The code's meaning without its names, file and line numbers (see the module docstring)."""
        self.codes.append((code, repr_ok))
        # every instruction whose argument indexes the constants reads one (LOAD_CONST, RETURN_CONST, and KW_NAMES:
        # which keyword gets which value), so only a constant no instruction names (the docstring) is left out
        loaded = {i.arg for i in dis.get_instructions(code) if i.opcode in dis.hasconst}
        return (
            code.co_code,
            code.co_argcount,
            code.co_posonlyargcount,
            code.co_kwonlyargcount,
            code.co_flags,
            code.co_nlocals,
            code.co_names,
            code.co_varnames,
            code.co_freevars,
            code.co_cellvars,
            tuple(self._constant(c, repr_ok) if i in loaded else ("unread",) for i, c in enumerate(code.co_consts)),
            getattr(code, "co_exceptiontable", b""),
        )

    def _constant(self, constant, repr_ok: bool):
        if isinstance(constant, types.CodeType):
            return self.code(constant, repr_ok)
        if type(constant) in (tuple, frozenset):
            return (type(constant), tuple(self._constant(c, repr_ok) for c in constant))
        return self.value(constant)

    # --- the gate -----------------------------------------------------------------------------------------------

    def name_blind(self) -> bool:
        """Whether no keyed code can observe a name, file or line number (see the module docstring)."""
        allowed = SAFE_NAMES | self.attributes
        for code, repr_ok in self.codes:
            if getattr(code, "co_exceptiontable", b""):
                return False
            if not set(code.co_names) <= allowed:
                return False
            if not repr_ok and REVEALING & set(code.co_names):
                return False
            for instruction in dis.get_instructions(code):
                if instruction.opname == "BINARY_OP" and "%" in instruction.argrepr:  # `%`, `%=`: format strings
                    return False
                if instruction.opname not in SAFE_OPCODES and not (
                    repr_ok and instruction.opname in FORMATTING_OPCODES
                ):
                    return False
        return not any(name in vars(cls) for cls in self.mro for name in REVEALING - {"extra_repr"})


_ELSEWHERE = (torch, torch.nn, torch.nn.functional, torch.Tensor, builtins, nn.Module)

_BUILTIN_CALLABLES = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
)


def _names(code: types.CodeType) -> frozenset:
    """Every name `code` and the code nested in it mention."""
    found = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            found |= _names(constant)
    return frozenset(found)


def _cell(keyer: _Keyer, cell, depth: int):
    try:
        contents = cell.cell_contents
    except ValueError:
        return ("empty",)
    return keyer.value(contents, depth=depth)


def _tensor_meta(tensor) -> tuple:
    if tensor is None:
        return (None,)
    return (type(tensor), tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
