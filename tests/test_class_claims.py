"""What `isinstance` says of a caller's object, trusted only under `class_is_honest` (`rules.Claim`).

`isinstance(cache, C)` reads `cache.__class__` when the type is not a subclass, and the caller's class can answer
that with code of its own (a property, `__getattribute__`). A region that relies on the answer (a narrowed
`cache.layers`, or the test itself) is fused only where the generated forward can test `class_is_honest(cache)`
and compute each projection at its own place when it fails (`rewrite_cross`); elsewhere it is refused
(`class-claim`).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import DynamicCache

from fusegen.compiler.build import build
from fusegen.errors import InputError
from fusegen.runtime import MergedColumnLinear, class_is_honest, linear_piece
from fusegen.testkit import TOLERANCE, import_file
from tests.test_cross_attention import rewrite_refusal, write_switched_case
from tests.test_hazards import outcome

# --- the runtime test ------------------------------------------------------------------------------------------------


class Liar:
    """Says it is a `DynamicCache`; reading `layers` doubles the tensor it holds (the caller's input)."""

    def __init__(self, t):
        self.t = t

    @property
    def __class__(self):
        return DynamicCache

    @property
    def layers(self):
        self.t.mul_(2.0)
        return []


class Intercepting:
    def __getattribute__(self, name):
        return object.__getattribute__(self, name)


class InterceptingStr(str):
    def __getattribute__(self, name):
        return DynamicCache if name == "__class__" else str.__getattribute__(self, name)


class Loud(type):
    def __getattribute__(cls, name):
        raise AssertionError(f"the metaclass ran for {name}")


class QuietlyMade(metaclass=Loud):
    pass


class OwnCache(DynamicCache):
    pass


class WithGetattr:
    def __getattr__(self, name):
        raise AssertionError(f"__getattr__ ran for {name}")


def test_honest_objects():
    honest = [None, 1, 2.5, "s", (1,), {}, [], torch.zeros(1), torch.Size([2]), DynamicCache(), OwnCache()]
    assert class_is_honest(*honest)
    assert class_is_honest(QuietlyMade())  # the metaclass's `__getattribute__` is never asked
    assert class_is_honest(WithGetattr())  # `__class__` is always found, so `__getattr__` never runs


class NoneClass:
    """A `__class__` that is no descriptor: the instance's `__dict__` answers (set below to claim `DynamicCache`)."""

    __class__ = None


def _none_class_claiming_a_cache():
    obj = NoneClass()
    obj.__dict__["__class__"] = DynamicCache
    return obj


HELD = Liar(torch.zeros(1))
LIARS = {
    "property": HELD,
    "getattribute": Intercepting(),
    "getattribute_of_str": InterceptingStr("s"),
    "weak_proxy": weakref.proxy(HELD),  # a C type that hands the read to the object behind it
    "none_class": _none_class_claiming_a_cache(),
}


@pytest.mark.parametrize("name", sorted(LIARS))
def test_objects_that_may_lie(name):
    liar = LIARS[name]
    assert not class_is_honest(liar)
    assert not class_is_honest(None, liar)


def test_the_liars_fool_isinstance():
    """The premise: without the runtime test, `isinstance` believes them."""
    lying = [liar for name, liar in LIARS.items() if name != "getattribute"]  # that one only may lie
    assert all(isinstance(liar, DynamicCache) for liar in lying)


# --- the analysis ----------------------------------------------------------------------------------------------------

EXTRA = "from transformers import DynamicCache\n"
NARROWED = "        if isinstance(cache, DynamicCache):\n            layers = cache.layers\n            n = 2.0\n"
SAME_INPUT = (
    "        n = 1.0\n"
    "        q = self.q_proj(x)\n" + NARROWED + "        k = self.k_proj(x)\n"
    "        v = self.v_proj(x)\n"
    "        return q * n + torch.cat([k, v], dim=-1)\n"
)
SWITCHED_CLAIM = (
    "        n = 1.0\n"
    "        is_cross = kv is not None\n"
    "        q = self.q_proj(x)\n" + NARROWED + "        current = kv if is_cross else x\n"
    "        k = self.k_proj(current)\n"
    "        v = self.v_proj(current)\n"
    "        return q * n + torch.cat([k, v], dim=-1)\n"
)


def _case(case_path, name, forward, params=", kv=None, cache=None", extra=EXTRA):
    return write_switched_case(case_path, name, forward, params, extra)


def test_a_forward_that_sets_the_class_makes_no_claim(case_path):
    """The merge flag is tested once, so the forward must not change the claimed parameter's class after it."""
    spellings = {
        "store": "cache.__class__ = DynamicCache",
        "setattr": "setattr(cache, '__class__', DynamicCache)",
        "dunder": "cache.__setattr__('__class__', DynamicCache)",
    }
    refusals = {}
    for name, spelling in spellings.items():
        forward = SAME_INPUT.replace("            n = 2.0\n", f"            n = 2.0\n            {spelling}\n")
        refusals[name] = rewrite_refusal(_case(case_path, f"sets_class_{name}", forward, ", cache=None"))
    # without a claim the store writes an object the caller handed, and `setattr` is a call the rules do not trust
    assert refusals == {"store": "caller-alias", "setattr": "region-call", "dunder": "region-call"}


def test_a_shadowed_isinstance_narrows_nothing(case_path):
    """A module's own `isinstance` says nothing of the class: `cache.layers` is then a read of an unknown object."""
    extra = EXTRA + "\n\ndef isinstance(obj, cls):\n    return obj is not None\n"
    assert (
        rewrite_refusal(_case(case_path, "shadowed_isinstance", SAME_INPUT, ", cache=None", extra)) == "implicit-call"
    )


def test_a_module_reading_its_own_runtime_name_is_bad_input(case_path):
    """A class reading the module's own `linear_piece` would get fusegen's from the generated file's imports."""
    extra = EXTRA + "\n\ndef linear_piece(t):\n    return t\n"
    forward = SAME_INPUT.replace(NARROWED, "").replace(
        "        v = self.v_proj(x)\n", "        v = linear_piece(self.v_proj(x))\n"
    )
    with pytest.raises(InputError, match="its own 'linear_piece'"):
        build(_case(case_path, "own_runtime_name", forward, ", cache=None", extra))


def test_a_runtime_name_of_the_module_is_a_name_clash(case_path):
    extra = EXTRA + "\n\ndef class_is_honest(obj):\n    return False\n"
    dotted = _case(case_path, "runtime_name_clash", SAME_INPUT, ", cache=None", extra)
    assert rewrite_refusal(dotted) == "name-clash"


def test_isinstance_of_an_unknown_local_is_an_implicit_call(case_path):
    """Only a parameter never bound again can be tested at the merged call; a local bound from a user call cannot."""
    extra = EXTRA + "\n\nclass Box:\n    pass\n\n\ndef make_box():\n    return Box()\n"
    forward = "        held = make_box()\n" + SAME_INPUT.replace(
        NARROWED, "        n = 2.0 if isinstance(held, str) else 1.0\n"
    )
    assert rewrite_refusal(_case(case_path, "unknown_local", forward, "", extra)) == "implicit-call"


def test_a_local_named_like_the_class_narrows_nothing(case_path):
    """`DynamicCache = object` in forward: the test around the projections says nothing of the cache's class."""
    forward = (
        "        n = 1.0\n"
        "        DynamicCache = object\n"
        "        if isinstance(cache, DynamicCache):\n"
        "            q = self.q_proj(x)\n"
        "            if cache is not None:\n"
        "                n = 2.0 + cache.get_seq_length()\n"
        "            k = self.k_proj(x)\n"
        "            v = self.v_proj(x)\n"
        "        return q * n + torch.cat([k, v], dim=-1)\n"
    )
    assert rewrite_refusal(_case(case_path, "local_class_name", forward, ", cache=None")) == "region-call"


def test_a_user_metaclass_check_is_an_implicit_call(case_path):
    """A user metaclass's `__instancecheck__`, or `ABCMeta`'s calling a user `__subclasshook__` (of the class, or of a
    subclass of a class of Python's own), runs user code even on a tensor: in `isinstance`, `issubclass` or a `case`
    class pattern."""
    checks = {
        "metaclass": "class Checked(type):\n    def __instancecheck__(cls, obj):\n        return True\n\n"
        "    def __subclasscheck__(cls, other):\n        return True\n\n\nclass Probe(metaclass=Checked):\n    pass\n",
        "abc": "import abc\n\n\nclass Probe(abc.ABC):\n    @classmethod\n    def __subclasshook__(cls, other):\n"
        "        return True\n",
    }
    checks["hooked_subclass_of_a_library_abc"] = (
        "import collections.abc\n\n\nclass Probe(collections.abc.Mapping):\n    @classmethod\n"
        "    def __subclasshook__(cls, other):\n        return True\n\n\nProbe = collections.abc.Mapping\n"
    )
    spellings = {
        "isinstance": "        n = 2.0 if isinstance(x, Probe) else 1.0\n",
        "issubclass": "        n = 2.0 if issubclass(type(x), Probe) else 1.0\n",
        "match": "        match x:\n            case Probe():\n                n = 2.0\n",
    }
    for name, extra in checks.items():
        for spelling, line in spellings.items():
            forward = SAME_INPUT.replace(NARROWED, line)
            dotted = _case(case_path, f"user_{name}_{spelling}", forward, "", EXTRA + "\n\n" + extra)
            assert rewrite_refusal(dotted) == "implicit-call", (name, spelling)


# --- the guarded merge -----------------------------------------------------------------------------------------------


class Doubling:
    """What the liar below hands back: comparing it doubles the input it holds."""

    def __init__(self, t):
        self.t = t

    def __ge__(self, other):
        self.t.mul_(2.0)
        return True


class CountingLiar(Liar):
    """A liar whose narrowed method hands back a `Doubling`: the caller's code runs later, inside k's statement."""

    def get_seq_length(self):
        return Doubling(self.t)


FLOW = SAME_INPUT.replace(
    NARROWED, "        seen = 0\n" + NARROWED.replace("layers = cache.layers", "seen = cache.get_seq_length()")
).replace("        k = self.k_proj(x)\n", "        k = (seen >= 0) * 0.0 + self.k_proj(x)\n")
"""The value a narrowed call returned is used in the statement of k, before k's call: computed at its call, k reads
the input after the comparison doubled it, as in the original."""


def _fused_pair(case_path, dotted, name, monkeypatch, guards):
    """The toy's block and its fused block with the same weights, the fused module's `linear_piece` recording the
    piece each call computes alone; the generated text must hold each of `guards`."""
    block = outcome(dotted)
    assert [(plan.kind, plan.merged) for plan in block.fused] == [("qkv", "qkv_proj")], block.refused
    text = build(dotted).text
    for guard in guards:
        assert guard in text, text
    path = case_path / f"fused_{name}.py"
    path.write_text(text)
    fused_module = import_file(path, f"fused_{name}")
    original_module = __import__(dotted, fromlist=["ToyBlock"])
    config = original_module.ToyConfig()
    torch.manual_seed(0)
    original, fused = original_module.ToyBlock(config), fused_module.FusedToyBlock(config)
    with torch.no_grad():
        weights = [original.q_proj.weight, original.k_proj.weight, original.v_proj.weight]
        fused.qkv_proj.weight.copy_(torch.cat(weights))
    assert isinstance(fused.qkv_proj, MergedColumnLinear)
    alone = []
    monkeypatch.setattr(fused_module, "linear_piece", lambda *args: alone.append(args[-1]) or linear_piece(*args))
    return original, fused, alone


class ProxiedLiar:
    """Makes a weak proxy of a `Liar` holding the input, keeping the liar alive for the call."""

    def __init__(self):
        self.kept = []

    def __call__(self, t):
        self.kept.append(Liar(t))
        return weakref.proxy(self.kept[-1])


CACHES = {"none": lambda t: None, "honest": lambda t: DynamicCache(), "liar": Liar, "proxy": ProxiedLiar()}
"""How each run makes its cache from the input it is handed (the liars hold the input, and double it)."""


def _run(original, fused, alone, x, caches=CACHES, **kv):
    """Each cache against the original, on separate copies of `x` (a liar writes its copy): outputs and the written
    inputs agree; returns the pieces computed alone, per cache. (No gradients: the original's own backward fails
    once a liar has written an input a projection saved.)"""
    computed_alone = {}
    for name, make in caches.items():
        alone.clear()
        mine, theirs = x.clone(), x.clone()
        expected, got = original(mine, cache=make(mine), **kv), fused(theirs, cache=make(theirs), **kv)
        assert (expected - got).abs().max().item() <= TOLERANCE, name
        assert torch.equal(mine, theirs), name
        computed_alone[name] = list(alone)
    return computed_alone


def test_one_input_guards_the_merged_call(case_path, monkeypatch):
    """With a liar each projection is computed at its own call (q, then k and v after its `layers` read doubled the
    input), so every output and gradient matches; with an honest cache or none the one merged GEMM runs."""
    dotted = _case(case_path, "claim_same_input", SAME_INPUT, ", cache=None")
    guards = ["merge_qkv_proj = class_is_honest(cache)", "if merge_qkv_proj:", "q_proj_out if merge_qkv_proj else"]
    original, fused, alone = _fused_pair(case_path, dotted, "claim_same_input", monkeypatch, guards)
    computed_alone = _run(original, fused, alone, torch.randn(2, 5, 16))
    assert computed_alone == {"none": [], "honest": [], "liar": [0, 1, 2], "proxy": [0, 1, 2]}


def test_a_value_from_the_liar_runs_in_a_piece_statement(case_path, monkeypatch):
    dotted = _case(case_path, "claim_flow", FLOW, ", cache=None")
    original, fused, alone = _fused_pair(case_path, dotted, "claim_flow", monkeypatch, ["if merge_qkv_proj:"])
    caches = {"none": lambda t: None, "liar": CountingLiar}
    assert _run(original, fused, alone, torch.randn(2, 5, 16), caches) == {"none": [], "liar": [0, 1, 2]}


def test_a_switched_attention_guards_the_merged_call(case_path, monkeypatch):
    """The self-or-cross rewrite: the flag also needs the switch; without it every projection is computed at its own
    call (k and v apart, as in the original), with encoder states or a liar."""
    dotted = _case(case_path, "claim_switched", SWITCHED_CLAIM)
    guards = ["merge_qkv_proj = kv is None and class_is_honest(cache)", "if merge_qkv_proj:"]
    original, fused, alone = _fused_pair(case_path, dotted, "claim_switched", monkeypatch, guards)
    x, other = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    merged = _run(original, fused, alone, x, kv=None)
    assert merged == {"none": [], "honest": [], "liar": [0, 1, 2], "proxy": [0, 1, 2]}
    assert _run(original, fused, alone, x, kv=other) == {name: [0, 1, 2] for name in CACHES}
