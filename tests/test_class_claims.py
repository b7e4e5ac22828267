"""What `isinstance` says of a caller's object, trusted only under `class_is_honest` (`rules.Claim`).

`isinstance(cache, C)` reads `cache.__class__` when the type is not a subclass, and the caller's class can answer
that with code of its own (a property, `__getattribute__`). A region that relies on the answer (a narrowed
`cache.layers`, or the test itself) is fused only where the generated forward can test `class_is_honest(cache)`
and compute each projection at its own place when it fails (`rewrite_cross`); elsewhere it is refused
(`class-claim`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from fusegen.compiler.build import build
from fusegen.runtime import MergedColumnLinear, class_is_honest, linear_pieces
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


@pytest.mark.parametrize("liar", [Liar(torch.zeros(1)), Intercepting(), InterceptingStr("s")], ids=type)
def test_objects_that_may_lie(liar):
    assert not class_is_honest(liar)
    assert not class_is_honest(None, liar)


def test_the_liar_fools_isinstance():
    """The premise: without the runtime test, `isinstance` believes it."""
    assert isinstance(Liar(torch.zeros(1)), DynamicCache) and isinstance(InterceptingStr("s"), DynamicCache)


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


def test_a_claimed_name_in_a_piece_statement_is_refused_in_one_input(case_path):
    forward = SAME_INPUT.replace("        k = self.k_proj(x)\n", "        k = self.k_proj(x) * (cache is None)\n")
    assert rewrite_refusal(_case(case_path, "claim_in_k_statement", forward, ", cache=None")) == "class-claim"


def test_isinstance_of_an_unknown_local_is_an_implicit_call(case_path):
    """Only a parameter never bound again can be tested at the merged call; a local bound from a user call cannot."""
    extra = EXTRA + "\n\nclass Box:\n    pass\n\n\ndef make_box():\n    return Box()\n"
    forward = "        held = make_box()\n" + SAME_INPUT.replace(
        NARROWED, "        n = 2.0 if isinstance(held, str) else 1.0\n"
    )
    assert rewrite_refusal(_case(case_path, "unknown_local", forward, "", extra)) == "implicit-call"


def test_a_user_metaclass_check_is_an_implicit_call(case_path):
    extra = EXTRA + (
        "\n\nclass Checked(type):\n    def __instancecheck__(cls, obj):\n        return True\n\n\n"
        "class Probe(metaclass=Checked):\n    pass\n"
    )
    forward = SAME_INPUT.replace(NARROWED, "        n = 2.0 if isinstance(x, Probe) else 1.0\n")
    assert rewrite_refusal(_case(case_path, "user_metaclass", forward, "", extra)) == "implicit-call"


def test_a_claim_between_k_and_v_is_refused(case_path):
    """k and v are computed together at the k site whatever the guard says, so no claim may sit between them."""
    forward = SWITCHED_CLAIM.replace(NARROWED, "").replace(
        "        v = self.v_proj(current)\n", NARROWED + "        v = self.v_proj(current)\n"
    )
    assert rewrite_refusal(_case(case_path, "claim_between_k_and_v", forward)) == "class-claim"


def test_a_claimed_name_in_a_piece_statement_is_refused(case_path):
    forward = SWITCHED_CLAIM.replace("        q = self.q_proj(x)\n", "        q = self.q_proj(x) * (cache is None)\n")
    assert rewrite_refusal(_case(case_path, "claim_in_q_statement", forward)) == "class-claim"


# --- the guarded merge -----------------------------------------------------------------------------------------------


def _fused_pair(case_path, dotted, name, monkeypatch, guards):
    """The toy's block and its fused block with the same weights, the fused module's `linear_pieces` recording the
    rows each call computes apart; the generated text must hold each of `guards`."""
    block = outcome(dotted)
    assert [(plan.kind, plan.merged) for plan in block.fused] == [("qkv", "qkv_proj")], block.refused
    text = build(dotted).text
    for guard in ["honest_classes = class_is_honest(cache)", *guards]:
        assert guard in text
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
    apart = []
    monkeypatch.setattr(fused_module, "linear_pieces", lambda *args: apart.append(args[-1]) or linear_pieces(*args))
    return original, fused, apart


CACHES = {"none": lambda t: None, "honest": lambda t: DynamicCache(), "liar": Liar}
"""How each run makes its cache from the input it is handed (the liar holds the input, and doubles it)."""


def _run(original, fused, apart, x, **kv):
    """Each cache against the original, on separate copies of `x` (the liar writes its copy): outputs and the
    written inputs agree; returns the rows `linear_pieces` computed apart, per cache."""
    computed_apart = {}
    for name, make in CACHES.items():
        apart.clear()
        mine, theirs = x.clone(), x.clone()
        expected, got = original(mine, cache=make(mine), **kv), fused(theirs, cache=make(theirs), **kv)
        assert (expected - got).abs().max().item() <= TOLERANCE, name
        assert torch.equal(mine, theirs), name
        computed_apart[name] = list(apart)
    return computed_apart


def test_one_input_guards_the_merged_call(case_path, monkeypatch):
    """With the liar each projection is computed at its own place (q, then k and v after its `layers` read doubled
    the input), so every output matches; with an honest cache or none the one merged GEMM runs."""
    dotted = _case(case_path, "claim_same_input", SAME_INPUT, ", cache=None")
    guards = ["if honest_classes:", "if not honest_classes:"]
    original, fused, apart = _fused_pair(case_path, dotted, "claim_same_input", monkeypatch, guards)
    computed_apart = _run(original, fused, apart, torch.randn(2, 5, 16))
    assert computed_apart == {"none": [], "honest": [], "liar": [(0,), (1,), (2,)]}


def test_a_switched_attention_guards_the_merged_call(case_path, monkeypatch):
    """The self-or-cross rewrite: with the liar the pieces are computed apart as for cross-attention (q, then k/v
    after the `layers` read doubled the input), so every output matches; with an honest cache or none, and no
    encoder states, the one merged GEMM runs."""
    dotted = _case(case_path, "claim_switched", SWITCHED_CLAIM)
    guards = ["if kv is None and honest_classes:", "if kv is not None or not honest_classes:"]
    original, fused, apart = _fused_pair(case_path, dotted, "claim_switched", monkeypatch, guards)
    x, other = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    assert _run(original, fused, apart, x, kv=None) == {"none": [], "honest": [], "liar": [(0,), (1, 2)]}
    assert _run(original, fused, apart, x, kv=other) == {name: [(0,), (1, 2)] for name in CACHES}
