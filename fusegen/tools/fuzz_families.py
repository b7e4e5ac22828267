"""Differential fuzzing of issue 24's families: random hazardous forwards, each with a safe twin, judged by running.

    python -m fusegen.tools.fuzz_families --pairs 315 [--seed 0]    (or: python bench/fuzz_families.py ...)

Each draw (`draw_pair`) is one family's hazard and its safe twin, toy blocks (`fusegen.tools.oracle.Toy`) whose q/k/v
calls come in a random order, with safe filler statements at random places and the hazard in one spelling of the
family's catalog (`run` takes them in turn, so `--pairs 5 * CATALOG_SIZE` draws every one; the rest is random):

- `context`: a `with` around some projections but not all (grad modes, autocast in several spellings, an `ExitStack`
  it is entered through, saved-tensor hooks, a torch function or dispatch mode), or a state switch inside the
  region, by call (`set_grad_enabled(False)`, `mode.__enter__()`, ...) or by code that runs with no state call
  spelled (`HIDDEN_SWITCHES`: a decorator or decorator factory applied, a class body, metaclass or
  `__init_subclass__`, a generator advanced by `next`, `send`, `islice` or through `yield from`, a generator
  expression, a lazy `map`/`filter`/`zip`/`iter(f, sentinel)` advanced by `next`, a key function of `sorted`/`max`).
  Twin: every projection in the same `with`; a restoring context closed around a non-projection statement; a
  profiler label; the switch (both steps) outside.
- `alias`: the caller (a pre-hook on the block) hands the block's input under a second name: another parameter,
  `*args`, `**kwargs`, a list or dict, a nested list, a dataclass field, a namedtuple field, the block's own buffer,
  an attribute it primes, a global registry or record; the region writes that name in place (method, `+=`, item
  store, `out=`, `operator`, `inplace=` by keyword or by position, `torch.nn.init`, `.data`, a loop variable); or
  code the region runs writes it with no write spelled (`ALIAS_STATEMENTS`: a generator handed it, advanced by
  `next`, `yield from` or a loop; a lazy `map` or `iter(partial, sentinel)`; a key function; a closure cell; a
  record's method). Twin: the same write before the first or after the last projection, or a read or a fresh copy
  of a tensor-typed parameter.
- `identity`: the projections reached other than as `self.<proj>` (`_modules`, `getattr` with a computed name,
  `attrgetter`, a helper handed `self`, a property, `get_submodule` also unbound on `nn.Module`, `parameters()`,
  `state_dict()`, `hasattr`, `vars`, `self` carried in a record, a global hook registered in forward), anywhere in
  forward. Twin: the same spellings reaching a plain attribute, a property or helper that names no projection,
  outside the region.
- `implicit`: the caller hands the block an object whose special methods switch grad mode (`Toggle`, `Meddler(None)`)
  or write the input it holds (`Sly`, `Meddler(x)`), and the region runs one of them though no special method is
  spelled: a truth test, `not`, `and`, `assert`, `len`, `int`, an f-string, `==`, `<`, a comprehension filter, `+=`,
  an item store or read, `+` either side, unary `-`, iteration, unpacking, `*obj`, `in`, use as an index, a dict
  key, an attribute read, a `match` subject, an `operator` function; or hands a `Pretender`, whose `__class__` lies,
  to `isinstance`, also narrowing on it. Twin: the same spelling in the region on a
  number, shape or fresh tensor the forward made (`x.shape[0]`, `x.shape`).
- `pieces`: a piece that escapes (stored on self, alone or in a dataclass, a namedtuple in a list, a nested dict, a
  global record, a closure cell, a lambda's or function's default, a generator, through a walrus; then written by a
  hook or later; handed to user functions and modules, written in place through a list, returned and written by
  the caller) or is flattened across rows with `.view()` (also through the class) or has its layout or identity
  observed (`stride`, `is_contiguous` also through the class or `.mT.mT`, `storage_offset`, `is`, `id`). Both are
  expected fused (escaping pieces are copied), the twin without copies: `.reshape` (also through the class), `.view`
  by heads, pure torch functions and modules, a product with `.mT`, a local namedtuple, a piece cloned before it is
  written.

Every case is built with validation off and on (`fusegen.compiler.build.build`) and judged by
`fusegen.tools.oracle.verdict` (logits and gradients; eval and train; with and without bf16 autocast; each value of
the forward-only `flag`). A hazard must be refused or sound, a twin must be fused and sound; `report` prints the
figures by family, the twins refused and every miscompile or crash (must be 0). tests/test_fuzz.py runs it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import transformers

from fusegen.errors import EXIT_DRIFT, EXIT_OK
from fusegen.tools.oracle import FOURTH_HELPERS, Toy, forget, importable, judge, write_toy

CALLS = {"q": "q = self.q_proj(x)", "k": "k = self.k_proj(x)", "v": "v = self.v_proj(x)"}
FILLERS = (
    "f0 = x.shape[-1] + x.size(0)",
    "f1 = torch.sigmoid(x)",
    "f2 = x.detach().mean()",
    "f3 = torch.cat([x, x], -1)[..., :16]",
)
"""Safe statements (the fuzzer's `safe` family) dropped at random places, in every case alike."""
FLOAT_RETURN = "return q.float() + torch.cat([k.float(), v.float()], dim=-1)"
W_RETURN = "return q * w + torch.cat([k, v], dim=-1)"
LAYER = "        "

FUZZ_HELPERS = '''
import itertools

from transformers import DynamicCache


class Meddler:
    """A caller's object: each special method below flips grad mode (`_flip`) when it holds nothing, else doubles
    the tensor it holds in place."""

    def __init__(self, held):
        self.held = held

    def _act(self):
        if self.held is None:
            _flip()
        else:
            self.held.mul_(2.0)

    def __bool__(self):
        self._act()
        return True

    def __len__(self):
        self._act()
        return 2

    def __format__(self, spec):
        self._act()
        return "m"

    def __eq__(self, other):
        self._act()
        return False

    def __lt__(self, other):
        self._act()
        return True

    def __hash__(self):
        self._act()
        return 7

    def __iadd__(self, other):
        self._act()
        return self

    def __setitem__(self, key, value):
        self._act()

    def __getitem__(self, key):
        self._act()
        return 1

    def __add__(self, other):
        self._act()
        return 1

    def __radd__(self, other):
        self._act()
        return 1

    def __neg__(self):
        self._act()
        return -1

    def __iter__(self):
        self._act()
        return iter((1, 2))

    def __contains__(self, item):
        self._act()
        return False

    def __index__(self):
        self._act()
        return 1

    def __int__(self):
        self._act()
        return 1

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._act()
        return 1


class Pretender:
    """A caller's object that says it is a `DynamicCache` (its `__class__`, which `isinstance` reads), and doubles the
    tensor it holds in place whenever its class or its `layers` is read."""

    def __init__(self, held):
        self.held = held

    @property
    def __class__(self):
        self.held.mul_(2.0)
        return DynamicCache

    @property
    def layers(self):
        self.held.mul_(2.0)
        return []


@dataclasses.dataclass
class Carry:
    t: object
    n: int = 0

    def scale(self):
        self.t.mul_(2.0)


Couple = collections.namedtuple("Couple", "first second")


class Stash:
    piece = None


STASH = Stash()


def flip_each_step():
    while True:
        _flip()
        yield 0


def bump_each_step(t):
    while True:
        t.add_(1.0)
        yield t


def relay(steps):
    yield from steps


def grad_flipper(thing):
    _flip()
    return thing


def flipping_with(n):
    def apply(thing):
        _flip()
        return thing

    return apply


class FlipMeta(type):
    def __new__(mcs, name, bases, namespace):
        _flip()
        return super().__new__(mcs, name, bases, namespace)


class FlipBase:
    def __init_subclass__(cls, **kwargs):
        _flip()
        super().__init_subclass__(**kwargs)


def flip_key(value):
    _flip()
    return value


def double_key(t):
    t.mul_(2.0)
    return 0
'''
EXTRA = FOURTH_HELPERS + FUZZ_HELPERS
"""Module-level code of every case (`Toy.extra`): `oracle.FOURTH_HELPERS` (`_flip`, `Toggle`, `Sly`) and the
fuzzer's own: `Meddler` (a caller's object whose special methods flip grad mode or write what it holds), records
(`Carry`, a dataclass; `Couple`, a namedtuple; `STASH`, a global one), generators that flip grad mode or write what
they were handed when advanced (`flip_each_step`, `bump_each_step`, `relay` by `yield from`), a decorator, a
decorator factory, a metaclass and an `__init_subclass__` that flip grad mode when applied, and key functions."""

# --- context --------------------------------------------------------------------------------------------------------

CONTEXTS = {
    "no_grad": "torch.no_grad()",
    "inference_mode": "torch.inference_mode()",
    "enable_grad": "torch.enable_grad()",
    "set_grad_enabled": "torch.set_grad_enabled(False)",
    "grad_by_flag": "torch.set_grad_enabled(not self.flag)",
    "autocast": 'torch.autocast("cpu", dtype=torch.bfloat16)',
    "autocast_keywords": 'torch.autocast(device_type="cpu", dtype=torch.bfloat16)',
    "amp_autocast": 'torch.amp.autocast("cpu", dtype=torch.bfloat16)',
    "autocast_by_flag": 'torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.flag)',
    "autocast_off": 'torch.autocast("cpu", enabled=False)',
    "saved_tensor_hooks": "torch.autograd.graph.saved_tensors_hooks(keep, halve)",
    "function_mode": "Doubling()",
    "dispatch_mode": "Rounding()",
}
"""`with` items that change numerics or autograd (`Doubling`, `Rounding`, `keep`, `halve`: `oracle.HELPERS`)."""
RESTORING = tuple(name for name in CONTEXTS if not name.endswith("_mode") or name == "inference_mode")
"""The torch contexts that restore what they switched on exit (a closed one around no projection is harmless)."""
SWITCHES = {
    "set_grad_enabled_call": ("was = torch.is_grad_enabled()\ntorch.set_grad_enabled(False)", "torch.set_grad_enabled(was)"),
    "no_grad_entered": ("ctx = torch.no_grad()\nctx.__enter__()", "ctx.__exit__(None, None, None)"),
    "autocast_entered": (
        'ac = torch.autocast("cpu", dtype=torch.bfloat16)\nac.__enter__()', "ac.__exit__(None, None, None)"
    ),
    "mode_entered": ("mode = Doubling()\nmode.__enter__()", "mode.__exit__(None, None, None)"),
    "exit_stack_opened": (
        'stack = contextlib.ExitStack()\nstack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))',
        "stack.close()",
    ),
}  # fmt: skip
"""State switches by call: (switch on, switch back)."""
LABELS = ('torch.profiler.record_function("piece")', "contextlib.nullcontext()")
HIDDEN_SWITCHES = {
    "decorated_function": ("", "@grad_flipper\ndef tagged():\n    return 1"),
    "decorator_factory": ("", "@flipping_with(1)\ndef tagged():\n    return 1"),
    "decorated_class": ("", "@grad_flipper\nclass Tagged:\n    pass"),
    "class_body": ("", "class Tagged:\n    mark = flip_key(1)"),
    "metaclass": ("", "class Tagged(metaclass=FlipMeta):\n    pass"),
    "init_subclass": ("", "class Tagged(FlipBase):\n    pass"),
    "generator_next": ("ticks = flip_each_step()", "next(ticks)"),
    "generator_yield_from": ("ticks = relay(flip_each_step())", "next(ticks)"),
    "generator_send": ("ticks = flip_each_step()", "ticks.send(None)"),
    "generator_islice": ("ticks = flip_each_step()", "for _ in itertools.islice(ticks, 1):\n    pass"),
    "genexp_next": ("ticks = (flip_key(i) for i in range(8))", "next(ticks)"),
    "map_next": ("ticks = map(flip_key, range(8))", "next(ticks)"),
    "filter_next": ("ticks = filter(flip_key, range(1, 9))", "next(ticks)"),
    "iter_sentinel": ("ticks = iter(_flip, 1)", "next(ticks)"),
    "zip_of_generator": ("ticks = zip(flip_each_step(), range(8))", "next(ticks)"),
    "sorted_key": ("", "order = sorted([1], key=flip_key)"),
    "max_key": ("", "top = max([1], key=flip_key)"),
}  # fmt: skip
"""State switches with no state-switching name in the region: (made before the region, a step that flips grad mode
when it runs: a decorator applied, a class statement, a generator or lazy iterator advanced, a key function called
by a builtin). The hazard runs the step once inside the region and once anywhere after; the twin runs both steps
with a filler between them on one side of the region."""

# --- alias ----------------------------------------------------------------------------------------------------------

ALIASES = {
    "second_parameter": ("x, y", "lambda m, args: (args[0], args[0])", "y"),
    "varargs": ("x, *rest", "lambda m, args: (args[0], args[0])", "rest[0]"),
    "list_parameter": ("x, states", "lambda m, args: (args[0], [args[0]])", "states[0]"),
    "dict_parameter": ("x, bag", "lambda m, args: (args[0], {'h': args[0]})", 'bag["h"]'),
    "kwargs": ("x, **extra", "lambda m, args, kwargs: (args, {'mirror': args[0]})", 'extra["mirror"]'),
    "own_buffer": ("x", "lambda m, args: (m.state,)", "self.state"),
    "primed_attribute": ("x", "lambda m, args: setattr(m, 'mirror', args[0])", "self.mirror"),
    "global_registry": ("x", "lambda m, args: REGISTRY.append(args[0])", "REGISTRY[-1]"),
    "dataclass_field": ("x, box", "lambda m, args: (args[0], Carry(args[0]))", "box.t"),
    "namedtuple_field": ("x, pair", "lambda m, args: (args[0], Couple(args[0], None))", "pair.first"),
    "nested_list": ("x, nest", "lambda m, args: (args[0], [[args[0]]])", "nest[0][0]"),
    "global_record": ("x", "lambda m, args: setattr(STASH, 'piece', args[0])", "STASH.piece"),
}
"""(signature, the block's pre-hook the caller installs, the second name the input arrives under)."""
WRITES = (
    "{a}.mul_(2.0)",
    "{a} += 1.0",
    "{a}[..., 0] = 0.0",
    "torch.mul({a}, 2.0, out={a})",
    "operator.imul({a}, 2.0)",
    "{a}.copy_({a} * 3.0)",
    "F.relu({a}, inplace=True)",
    "{a}.clamp_(min=0.0)",
    "torch.nn.init.zeros_({a})",
    "F.leaky_relu({a}, 0.2, True)",
    "F.relu6({a}, True)",
    "F.elu({a}, 1.0, True)",
    "F.threshold({a}, 0.25, -2.0, True)",
    "for t in [{a}]:\n    t.mul_(2.0)",
    "{a}.data.mul_(2.0)",
)
ALIAS_INIT = (
    "        self.register_buffer('state', torch.ones(2, 5, 16))\n        self.mirror = torch.zeros(2, 5, 16)\n"
)
TYPED_READS = (
    "n = y.sum()",
    "n = y.abs().amax()",
    "t = y.clone()\nt.mul_(2.0)",
    "buf = torch.empty_like(y)\nbuf.fill_(0.5)",
    "n = F.leaky_relu(y, 0.2, False).sum()",
    "buf = torch.zeros_like(y)\nF.relu6(buf, True)",
)
PAIR_HOOK = "lambda m, args: (args[0], args[0])"
ALIAS_STATEMENTS = {
    "generator_writes": ("x, y", PAIR_HOOK, "steps = bump_each_step(y)", "next(steps)"),
    "generator_yield_from": ("x, y", PAIR_HOOK, "steps = relay(bump_each_step(y))", "next(steps)"),
    "generator_drained": ("x, y", PAIR_HOOK, "steps = bump_each_step(y)", "for _ in zip(steps, range(1)):\n    pass"),
    "map_writes": ("x, y", PAIR_HOOK, "steps = map(double_key, [y, y, y])", "next(steps)"),
    "iter_sentinel": ("x, y", PAIR_HOOK, "steps = iter(functools.partial(y.add_, 1.0), None)", "next(steps)"),
    "sorted_key": ("x, y", PAIR_HOOK, "", "order = sorted([y], key=double_key)"),
    "closure_cell": ("x", "lambda m, args: put_in_cell(args[0])", "", "scale_cell()"),
    "record_method": ("x, box", "lambda m, args: (args[0], Carry(args[0]))", "", "box.scale()"),
}  # fmt: skip
"""Writes of the caller's alias by code the region runs with no write spelled: (signature, the caller's pre-hook,
made before the region, the statement). The twin runs the statement before the first or after the last projection."""

# --- identity -------------------------------------------------------------------------------------------------------

REACHES = {
    "modules_dict": 'w = self._modules["{p}_proj"].weight.sum()',
    "getattr_computed": 'w = getattr(self, "{p}" + "_proj").weight.sum()',
    "getattr_name": 'name = "{p}_proj"\nw = getattr(self, name).weight.sum()',
    "attrgetter": 'w = operator.attrgetter("{p}_proj.weight")(self).sum()',
    "helper_handed_self": "w = peek(self)",
    "property": "w = self.v_rows",
    "get_submodule": 'w = self.get_submodule("{p}_proj").weight.sum()',
    "first_parameter": "w = next(self.parameters()).shape[0]",
    "named_children": "w = len(dict(self.named_children()))",
    "state_dict": 'w = self.state_dict()["{p}_proj.weight"].sum()',
    "hasattr": 'w = 1.0 if hasattr(self, "{p}_proj") else 2.0',
    "vars": 'w = vars(self)["_modules"]["{p}_proj"].weight.sum()',
    "hook_in_forward": "w = 1.0\nhandle = torch.nn.modules.module.register_module_forward_hook(double_plain_linears)",
    "unbound_get_submodule": 'w = nn.Module.get_submodule(self, "{p}_proj").weight.sum()',
    "self_in_a_record": "me = Carry(self)\nw = me.t.{p}_proj.weight.sum()",
}
"""Each binds `w`; `hook_in_forward` is removed again after the last projection."""
PLAIN_REACHES = {
    "getattr_plain": ('w = getattr(self, "hidden_size") / 16', False),
    "property_plain": ("w = self.width", False),
    "helper_plain": ("w = block_width(self)", True),
    "flag": ("w = 2.0 if self.flag else 1.0", False),
}
"""(statement, whether it must stand outside the region: a callee handed `self` in the region is refused)."""
V_ROWS = "    @property\n    def v_rows(self):\n        return self.v_proj.out_features\n"
WIDTH = "    @property\n    def width(self):\n        return self.hidden_size / 16\n"
"""The block's properties, each only in the cases that read it (a method naming a projection is refused anyway:
`escaping-reference`)."""

# --- pieces ---------------------------------------------------------------------------------------------------------


def _hook(write: str) -> str:
    """A `ToyLayer.__init__` line: the block's forward hook runs `write` (an expression of `m`) after forward."""
    return f"self.block.register_forward_hook(lambda m, a, out: [{write}] and None)"


ESCAPES = {
    "stored_written_by_hook": ("self.seen = {p}", "self.block.register_forward_hook(lambda m, a, out: [m.seen.mul_(2.0)] and None)"),
    "stored_then_written": ("self.seen = {p}\nself.seen.mul_(2.0)", ""),
    "user_function": ("{p} = scale_in_place({p})", ""),
    "user_module_keeps": ("{p} = self.keeper({p})\nself.keeper.kept.add_(1.0)", ""),
    "inplace_activation": ("{p} = self.act_ip({p})", ""),
    "user_module_writes": ("{p} = self.mut({p})", ""),
    "listed_then_written": ("held = [{p}]\nheld[0].mul_(2.0)", ""),
    "view_flat": ("{p} = {p}.view(-1).view_as({p})", ""),
    "view_rows": ("{p} = {p}.view({p}.shape[0], -1).view_as({p})", ""),
    "view_fixed_rows": ("{p} = {p}.view(10, -1).view_as({p})", ""),
    "contiguity_observed": ("w = 2.0 if {p}.is_contiguous() else 1.0", ""),
    "stride_observed": ("w = float({p}.stride(0))", ""),
    "dataclass_stored": ("self.seen = Carry({p})", _hook("m.seen.t.mul_(2.0)")),
    "record_in_list_stored": ("self.seen = [Couple({p}, None)]", _hook("m.seen[0].first.mul_(2.0)")),
    "nested_dict_stored": ("self.seen = {{'outer': {{'inner': {p}}}}}", _hook("m.seen['outer']['inner'].mul_(2.0)")),
    "global_record": ("STASH.piece = {p}", _hook("STASH.piece.mul_(2.0)")),
    "closure_cell": ("put_in_cell({p})", _hook("scale_cell()")),
    "lambda_default": ("self.later = lambda t={p}: t", _hook("m.later().mul_(2.0)")),
    "def_default": ("def later(t={p}):\n    return t\nself.later = later", _hook("m.later().mul_(2.0)")),
    "generator_held": ("self.later = (t for t in [{p}])", _hook("next(m.later).mul_(2.0)")),
    "walrus_stored": ("self.seen = (held := {p})", _hook("m.seen.mul_(2.0)")),
    "identity_by_id": ("w = 2.0 if id({p}.contiguous()) == id({p}) else 1.0", ""),
    "identity_reversed": ("w = 2.0 if {p} is {p}.contiguous() else 1.0", ""),
    "contiguity_on_class": ("w = 2.0 if torch.Tensor.is_contiguous({p}) else 1.0", ""),
    "contiguity_through_mT": ("w = 2.0 if {p}.mT.mT.is_contiguous() else 1.0", ""),
    "offset_on_class": ("w = 1.0 + torch.Tensor.storage_offset({p})", ""),
    "view_on_class": ("{p} = torch.Tensor.view({p}, -1).reshape({p}.shape)", ""),
}  # fmt: skip
"""(statements after the piece's projection, a `ToyLayer.__init__` line)."""
RETURNED = "self.block.register_forward_hook(lambda m, a, out: out.mul_(2.0))"
"""`returned_written_by_caller`: the block returns the q piece itself, and the caller's hook writes it in place."""
PLAIN_PIECES = (
    "{p} = {p}.reshape(-1).view_as({p})",
    "{p} = {p}.view(x.shape[0], x.shape[1], 2, -1).flatten(2)",
    "{p} = torch.sigmoid({p})",
    "{p} = F.silu({p}) * 2.0",
    "{p} = self.act({p})",
    "{p} = {p}.clone()\n{p}.mul_(2.0)",
    "w = torch.matmul({p}, {p}.mT).mean()",
    "{p} = torch.Tensor.reshape({p}, -1).reshape({p}.shape)",
    "w = 2.0 if {p}.mT.shape[-1] == 5 else 1.0",
    "pair = Couple({p}, None)\n{p} = pair.first",
)
"""Twins: pure code on the piece and, after the last projection (`LAST_ONLY`), a record that stays local."""
LAST_ONLY = ("pair = Couple(",)
PIECE_INIT = (
    "        self.keeper = Keeper()\n        self.act_ip = nn.ReLU(inplace=True)\n        self.mut = Mutator()\n"
    "        self.act = nn.Tanh()\n"
)


@dataclass(frozen=True)
class Pair:
    family: str
    spelling: str
    hazard: Toy
    twin: Toy


FAMILY_NAMES = ("context", "alias", "identity", "pieces", "implicit")


class Draw:
    """The random choices of one pair, from `choose(options)` and `integer(low, high)` (as `fuzz.draw_case`); with a
    `turn`, the family's spelling is the turn-th of its catalog (`spelling`), so that a run sweeps every spelling."""

    def __init__(self, choose, integer, turn: int | None = None):
        self.choose, self.integer, self.turn = choose, integer, turn

    def spelling(self, options):
        """The `turn`-th of `options` (cyclically), or a random one when the draw has no turn."""
        options = list(options)
        return self.choose(options) if self.turn is None else options[self.turn % len(options)]

    def order(self) -> list[str]:
        names = ["q", "k", "v"]
        for index in range(2, 0, -1):
            other = self.integer(0, index)
            names[index], names[other] = names[other], names[index]
        return names

    def body(self, slots: list[list[str]], order: list[str]) -> tuple[str, ...]:
        """The calls in `order` with `slots[i]` before call i (`slots[3]` after the last), fillers sprinkled in."""
        for _ in range(self.integer(0, 2)):
            self.choose(slots).insert(0, self.choose(FILLERS))
        lines = []
        for index, name in enumerate(order):
            lines += [*slots[index], CALLS[name]]
        return tuple(lines + slots[3])


def draw_pair(choose, integer, family: str | None = None, turn: int | None = None) -> Pair:
    """A hazard of `family` (drawn when None) and its safe twin; the spelling is the `turn`-th of the family's catalog
    when `turn` is given, else random."""
    draw = Draw(choose, integer, turn)
    family = family or choose(FAMILY_NAMES)
    families = {"context": _context, "alias": _alias, "identity": _identity, "pieces": _pieces, "implicit": _implicit}
    return families[family](draw)


def _wrapped(item: str, calls: list[str], stack: bool, after: list[str]) -> str:
    inner = [f"stack.enter_context({item})", *calls] if stack else calls
    head = "with contextlib.ExitStack() as stack:" if stack else f"with {item}:"
    return "\n".join([head, *("    " + line for call in inner for line in call.split("\n")), *after])


CONTEXT_CATALOG = (
    [("call", name) for name in sorted(SWITCHES)]
    + [("hidden", name) for name in sorted(HIDDEN_SWITCHES)]
    + [("with", name) for name in sorted(CONTEXTS)]
)
ALIAS_CATALOG = [("statement", name) for name in sorted(ALIAS_STATEMENTS)] + [
    ("alias", name) for name in sorted(ALIASES)
]


def _context(draw: Draw) -> Pair:
    order = draw.order()
    kind, spelling = draw.spelling(CONTEXT_CATALOG)
    if kind != "with":  # a state switch by call, or by code that runs with no state call spelled
        setup = ""
        if kind == "call":
            on, off = SWITCHES[spelling]
        else:
            setup, on = HIDDEN_SWITCHES[spelling]
            off = on
        start = draw.integer(0, 2)
        end = draw.integer(max(start, 1), 3) if start else draw.integer(1, 2)  # one of them inside the region
        slots = [[], [], [], []]
        slots[start].append(on)
        slots[end].append(off)
        hazard = Toy(draw.body(slots, order), ret=FLOAT_RETURN, extra=EXTRA)
        if setup:
            hazard = Toy((setup, *hazard.body), ret=FLOAT_RETURN, extra=EXTRA)
        side = draw.choose((0, 3))
        twin_slots = [[], [], [], []]
        twin_slots[side] += [*([setup] if setup else []), on, draw.choose(FILLERS), off]
        return Pair("context", spelling, hazard, Toy(draw.body(twin_slots, order), ret=FLOAT_RETURN, extra=EXTRA))
    name = spelling
    item, stack = CONTEXTS[name], draw.integer(0, 3) == 0
    first = draw.integer(0, 2)
    count = draw.integer(1, 2 if first < 2 else 1)
    if first == 0 and count == 2 and draw.integer(0, 1):
        first = 1  # also wrap the last two calls
    wrapped = [CALLS[p] for p in order[first : first + count]]
    clones = [f"{p} = {p}.clone()" for p in order[first : first + count]] if name == "inference_mode" else []
    lines = [CALLS[p] for p in order]
    body = [*lines[:first], _wrapped(item, wrapped, stack, clones), *lines[first + count :]]
    hazard = Toy(tuple(body), ret=FLOAT_RETURN)
    spelling = ("exit_stack_" if stack else "with_") + name
    kind = draw.integer(0, 2)
    if kind == 0:  # every projection under the one context
        clones = [f"{p} = {p}.clone()" for p in order] if name == "inference_mode" else []
        twin_body = (_wrapped(item, lines, stack, clones),)
    elif kind == 1:  # a restoring context closed around something else, in the region
        closed = _wrapped(CONTEXTS[draw.choose(RESTORING)], [draw.choose(FILLERS)], False, [])
        twin_body = tuple(lines[:1] + [closed] + lines[1:])
    else:  # a profiler label or a null context around one projection
        twin_body = tuple(lines[:first] + [_wrapped(draw.choose(LABELS), lines[first : first + 1], False, [])])
        twin_body += tuple(lines[first + 1 :])
    return Pair("context", spelling, hazard, Toy(twin_body, ret=FLOAT_RETURN))


def _pre_hook(hook: str) -> str:
    keywords = ", with_kwargs=True" if "kwargs" in hook else ""
    return f"{LAYER}self.block.register_forward_pre_hook({hook}{keywords})"


def _alias(draw: Draw) -> Pair:
    order = draw.order()
    kind, spelling = draw.spelling(ALIAS_CATALOG)
    if kind == "statement":  # a write by code the region runs
        signature, hook, setup, statement = ALIAS_STATEMENTS[spelling]
        toys = []
        for slot in (draw.integer(1, 2), draw.choose((0, 3))):
            slots = [[], [], [], []]
            slots[slot].append(statement)
            body = draw.body(slots, order)
            toys.append(
                Toy((setup, *body) if setup else body, layer=_pre_hook(hook), signature=signature, extra=EXTRA)
            )
        return Pair("alias", spelling, *toys)
    signature, hook, name = ALIASES[spelling]
    write = draw.spelling(WRITES).format(a=name)
    slots = [[], [], [], []]
    slots[draw.integer(1, 2)].append(write)
    hazard = Toy(draw.body(slots, order), init=ALIAS_INIT, layer=_pre_hook(hook), signature=signature, extra=EXTRA)
    if draw.integer(0, 1):  # the caller's second name of the input typed as a tensor, only read or copied
        slots = [[], [], [], []]
        slots[draw.integer(1, 2)].append(draw.spelling(TYPED_READS))
        twin = Toy(
            draw.body(slots, order),
            init=ALIAS_INIT,
            layer=_pre_hook(PAIR_HOOK),
            signature="x, y: torch.Tensor",
            extra=EXTRA,
        )
        return Pair("alias", f"{spelling}: {write}", hazard, twin)
    slots = [[], [], [], []]
    slots[draw.choose((0, 3))].append(write)
    twin = Toy(draw.body(slots, order), init=ALIAS_INIT, layer=_pre_hook(hook), signature=signature, extra=EXTRA)
    return Pair("alias", f"{spelling}: {write}", hazard, twin)


# --- implicit calls ---------------------------------------------------------------------------------------------

CALLER_OBJECTS = {
    "toggle": "Toggle()",
    "sly": "Sly(args[0])",
    "flipper": "Meddler(None)",
    "writer": "Meddler(args[0])",
    "pretender": "Pretender(args[0])",
}
"""What the caller hands as `obj`: `oracle.FOURTH_HELPERS`' `Toggle` and `Sly`, and the fuzzer's `Meddler` (special
methods that flip grad mode, or that double the input the object holds in place), and its `Pretender` (a class
that lies to `isinstance`, doubling the input as it does)."""
IMPLICIT = {
    "truth": ("if {o}:\n    w = 2.0", "x.shape[0]"),
    "negation": ("w = 2.0 if not {o} else 1.0", "x.shape[0]"),
    "length": ("w = float(len({o}))", "x.shape"),
    "format": ('w = float(len(f"{{{o}}}"))', "x.shape[0]"),
    "equality": ("w = 2.0 if {o} == 0 else 1.0", "x.shape[0]"),
    "filter": ("w = float(len([1 for _ in range(2) if {o}]))", "x.shape[0]"),
    "augmented": ("{o} += 1", "n"),
    "item_store": ("{o}[0] = 1.0", "buf"),
    "item_read": ("z = {o}[0]", "x.shape"),
    "operator": ("z = {o} + 1", "x.shape[0]"),
    "reflected_operator": ("z = 1 + {o}", "x.shape[0]"),
    "negative": ("z = -{o}", "x.shape[0]"),
    "order": ("w = 2.0 if {o} < 3 else 1.0", "x.shape[0]"),
    "iteration": ("for _ in {o}:\n    pass", "x.shape"),
    "unpacking": ("a, b = {o}", "x.shape[:2]"),
    "starred": ("w = float(len([*{o}]))", "x.shape"),
    "membership": ("w = 2.0 if 3 in {o} else 1.0", "x.shape"),
    "as_index": ("z = x[..., {o}]", "x.shape[0] % 2"),
    "int_builtin": ("w = float(int({o}))", "x.shape[0]"),
    "hashed_key": ("w = float(len({{{o}: 1}}))", "x.shape[0]"),
    "attribute": ("z = {o}.real", "x.shape[0]"),
    "operator_function": ("z = operator.add({o}, 1)", "x.shape[0]"),
    "operator_truth": ("z = operator.truth({o})", "x.shape[0]"),
    "boolean_and": ("w = ({o} and 2.0) or 1.0", "x.shape[0]"),
    "assertion": ("assert {o}", "x.shape[0]"),
    "match_subject": ("match {o}:\n    case 1:\n        w = 2.0", "x.shape[0]"),
    "class_test": ("w = 2.0 if isinstance({o}, torch.Tensor) else 1.0", "x.shape[0]"),
    "narrowed": ("if isinstance({o}, DynamicCache):\n    z = {o}.layers\n    w = 2.0", "x.shape[0]"),
}
"""Operations that run `{o}`'s special methods with no special method spelled (some set `w`, which the result
reads; those binding `z` keep the build's tracer going, which stops at a proxy's truth or `float`), each with the
operand of its twin: a number or shape the forward made (`n`, `buf`: `TWIN_SETUP`)."""
TWIN_SETUP = {"n": "n = x.shape[0]", "buf": "buf = torch.zeros(3)"}
OLD_SPELLINGS = ("truth", "negation", "length", "format", "equality", "filter")
CLASS_SPELLINGS = ("class_test", "narrowed")
IMPLICIT_SUPPORTED = {
    "toggle": OLD_SPELLINGS,
    "sly": ("truth", "negation", "length", "format", "filter"),
    "flipper": tuple(name for name in IMPLICIT if name not in CLASS_SPELLINGS),
    "writer": tuple(name for name in IMPLICIT if name not in CLASS_SPELLINGS),
    "pretender": CLASS_SPELLINGS,
}
"""The spellings each object's class implements (`Sly` has no `__eq__`: its `==` is identity; only `Pretender` lies
about its class)."""

IMPLICIT_CATALOG = [(name, holder) for name in sorted(IMPLICIT) for holder in sorted(CALLER_OBJECTS)
                    if name in IMPLICIT_SUPPORTED[holder]]  # fmt: skip


def _implicit(draw: Draw) -> Pair:
    order = draw.order()
    spelling, holder = draw.spelling(IMPLICIT_CATALOG)
    template, number = IMPLICIT[spelling]
    layer = _pre_hook(f"lambda m, args: (args[0], {CALLER_OBJECTS[holder]})")
    slots = [["w = 1.0"], [], [], []]
    slots[draw.integer(1, 2)].append(template.format(o="obj"))
    hazard = Toy(draw.body(slots, order), layer=layer, signature="x, obj", ret=W_RETURN, extra=EXTRA)
    slots = [["w = 1.0", *([TWIN_SETUP[number]] if number in TWIN_SETUP else [])], [], [], []]
    # the caller's object outside the region would leak its grad flip or write into later runs: a number here
    slots[draw.integer(1, 2)].append(template.format(o=number))
    twin = Toy(draw.body(slots, order), layer=layer, signature="x, obj", ret=W_RETURN, extra=EXTRA)
    return Pair("implicit", f"{holder}: {spelling}", hazard, twin)


def _identity(draw: Draw) -> Pair:
    order = draw.order()
    spelling = draw.spelling(sorted(REACHES))
    reach = REACHES[spelling].format(p=draw.choose(("q", "k", "v")))
    slots = [[], [], [], []]
    slots[draw.integer(0, 3)].append(reach)
    if spelling == "hook_in_forward":
        slots[3].append("handle.remove()")
    hazard = Toy(draw.body(slots, order), members=V_ROWS if spelling == "property" else "", ret=W_RETURN, extra=EXTRA)
    plain = draw.choose(sorted(PLAIN_REACHES))
    statement, outside = PLAIN_REACHES[plain]
    slots = [[], [], [], []]
    slots[draw.choose((0, 3)) if outside else draw.integer(0, 3)].append(statement)
    twin = Toy(draw.body(slots, order), members=WIDTH if plain == "property_plain" else "", ret=W_RETURN, extra=EXTRA)
    return Pair("identity", spelling, hazard, twin)


def _after(draw: Draw, order: list[str], piece: str, lines: str) -> list[list[str]]:
    """Slots with `lines` somewhere after `piece`'s call (after the last call for `LAST_ONLY` lines: a call of a
    class in the region is `region-call`'s)."""
    slots = [[], [], [], []]
    last = any(lines.startswith(head) for head in LAST_ONLY)
    slots[3 if last else draw.integer(order.index(piece) + 1, 3)].append(lines)
    slots[0].insert(0, "w = 1.0")
    return slots


def _pieces(draw: Draw) -> Pair:
    order = draw.order()
    piece = draw.choose(("q", "k", "v"))
    spelling = draw.spelling(sorted([*ESCAPES, "returned_written_by_caller"]))
    if spelling == "returned_written_by_caller":
        slots = [["w = 1.0"], [], [], []]
        hazard = Toy(draw.body(slots, order), init=PIECE_INIT, layer=LAYER + RETURNED, ret="return q * w", extra=EXTRA)
    else:
        lines, layer = ESCAPES[spelling]
        slots = _after(draw, order, piece, lines.format(p=piece))
        layer = LAYER + layer if layer else ""
        hazard = Toy(draw.body(slots, order), init=PIECE_INIT, layer=layer, ret=W_RETURN, extra=EXTRA)
    slots = _after(draw, order, piece, draw.choose(PLAIN_PIECES).format(p=piece))
    twin = Toy(draw.body(slots, order), init=PIECE_INIT, ret=W_RETURN, extra=EXTRA)
    return Pair("pieces", f"{spelling} ({piece})", hazard, twin)


CATALOG_SIZE = max(len(CONTEXT_CATALOG), len(ALIAS_CATALOG), len(REACHES), len(ESCAPES) + 1, len(IMPLICIT_CATALOG))
"""The longest family catalog (`Draw.spelling`)."""


# --- running --------------------------------------------------------------------------------------------------------


@dataclass
class FamilyFigures:
    pairs: int = 0
    outcomes: Counter = field(default_factory=Counter)
    """(family, role, validation, outcome) -> count; outcome is refused, sound, invalid, miscompile or crash."""
    failures: list[str] = field(default_factory=list)
    """Every miscompile and crash, with its case."""
    twins_refused: list[str] = field(default_factory=list)
    refusals: Counter = field(default_factory=Counter)
    """(family, role, rule) -> how many refused cases the rule fired in (either validation mode)."""
    invalid: list[str] = field(default_factory=list)
    spellings: set = field(default_factory=set)
    """(family, spelling) of every pair drawn (the piece left out)."""
    seconds: float = 0.0

    def add(self, pair: Pair, role: str, validate: bool, toy: Toy, result: str, rules=()) -> None:
        mode = "validation on" if validate else "validation off"
        outcome = result.split(" ", 1)[0].rstrip(":")
        self.outcomes[(pair.family, role, mode, outcome)] += 1
        if outcome == "refused":
            self.refusals.update((pair.family, role, rule) for rule in rules)
        where = f"[{pair.family} {role} {pair.spelling}, {mode}] {result} {list(rules)}\n{toy.describe()}"
        if outcome in ("miscompile", "crash"):
            self.failures.append(where)
        elif outcome == "invalid":
            self.invalid.append(where)
        elif role == "twin" and (outcome == "refused" or rules):  # refused, or some of its projections are
            self.twins_refused.append(where)

    def count(self, family=None, role=None, mode=None, outcome=None) -> int:
        wanted = (family, role, mode, outcome)
        return sum(n for key, n in self.outcomes.items() if all(w is None or w == k for w, k in zip(wanted, key)))

    def report(self) -> str:
        lines = [f"pairs: {self.pairs} (a hazard and its safe twin each, built with validation off and on)"]
        drawn = Counter(family for family, _ in self.spellings)
        lines.append("distinct spellings drawn: " + ", ".join(f"{f} {drawn[f]}" for f in FAMILY_NAMES))
        for family in FAMILY_NAMES:
            for role in ("hazard", "twin"):
                for mode in ("validation off", "validation on"):
                    figures = ", ".join(
                        f"{outcome} {self.count(family, role, mode, outcome)}"
                        for outcome in ("refused", "sound", "miscompile", "crash", "invalid")
                    )
                    lines.append(f"  {family:8} {role:6} {mode:14}: {figures}")
        lines.append("refusals by rule (family role: rule count):")
        lines += [f"  {f} {r}: {rule} {n}" for (f, r, rule), n in sorted(self.refusals.items())]
        lines += [
            f"miscompiles and crashes: {len(self.failures)}",
            f"safe twins refused: {len(self.twins_refused)} of {self.count(role='twin')}",
            f"invalid (the original runs in no mode): {len(self.invalid)}",
            f"seconds: {self.seconds:.1f}",
        ]
        return "\n".join(lines)


def check_pair(root: Path, package: str, index: int, pair: Pair, figures: FamilyFigures, modes=(False, True)):
    """Write, build and judge the pair's two cases under each validation mode in `modes`, into `figures`."""
    try:
        for role, toy in (("hazard", pair.hazard), ("twin", pair.twin)):
            dotted = write_toy(root, package, f"case_{index}_{role}", toy)
            for validate in modes:
                fused_name = f"fused_{index}_{role}_{'v' if validate else 'a'}"
                figures.add(pair, role, validate, toy, *judge(dotted, fused_name, validate))
    finally:
        forget(package)


def run(pairs: int, seed: int = 0, workdir: Path | None = None, modes=(False, True)) -> FamilyFigures:
    """`pairs` pairs drawn with `random.Random(seed)`, the families in turn, each family's spellings in turn (pair i
    of a family draws the i-th spelling of its catalog; order, placement, fillers and twin at random); returns the
    figures. A run of `5 * CATALOG_SIZE` pairs draws every spelling of every family."""
    import random

    rng = random.Random(seed)
    figures = FamilyFigures()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, importable(workdir or scratch) as root:
        for index in range(pairs):
            family, turn = FAMILY_NAMES[index % len(FAMILY_NAMES)], index // len(FAMILY_NAMES)
            pair = draw_pair(rng.choice, rng.randint, family, turn)
            check_pair(root, "family_cases", index, pair, figures, modes)
            figures.spellings.add((family, pair.spelling.split(" (")[0]))
            figures.pairs += 1
    figures.seconds = time.perf_counter() - start
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    figures = run(args.pairs, args.seed)
    print(figures.report())
    for failure in figures.failures[:5]:
        print("\nFAILURE:", failure)
    for refused in figures.twins_refused:
        print("\nTWIN REFUSED:", refused)
    return EXIT_DRIFT if figures.failures else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
