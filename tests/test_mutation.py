"""Each safety rule is needed: switched off alone, it lets a miscompile through.

For every rule a small fixed forward is refused by that rule (and by no other
check that would fire on it); with the rule switched off (`rules.DISABLED`)
the same forward is fused and the fused layer's output differs from the
original's. So no rule is dead weight, and the differential check is strong
enough to see what each one prevents.
"""

from dataclasses import dataclass

import pytest

from fusegen.fusions.merged import pieces, rules
from fusegen.tools import oracle
from fusegen.tools.fuzz import SETUPS, Case, Harness
from fusegen.tools.oracle import Toy

pytestmark = pytest.mark.slow  # every rule switched off in turn, each case built and run

Q, K, V = "q = self.q_proj(x)", "k = self.k_proj(x)", "v = self.v_proj(x)"

MUTANTS = {
    "reflection": Case((Q, 'eval("x.mul_(2)")', K, V)),
    # traced in training mode, where `x` stays the same node; run in eval mode, where it is rebound
    "input-rebound": Case((Q, "x = x if self.training else x * 2", K, V)),
    "input-written": Case((Q, "x[0] = 0", K, V)),
    "aliased-augassign": Case((Q, "h = x.view(-1)", "h *= 2", K, V)),
    "input-escapes": Case(("self.kept = x", Q, "self.kept.mul_(2)", K, V)),
    "deferred-capture": Case(("def bump():\n    x.add_(1)", Q, "bump()", K, V)),
    "opaque-alias": Case(("obj = Box(x)", Q, "obj.view()", K, V)),
    "inplace-call": Case((Q, "x.mul_(2)", K, V)),
    "inplace-operator": Case((Q, "operator.iadd(x, 1)", K, V)),
    "dynamic-attribute": Case((Q, 'setattr(x, "data", x * 2)', K, V)),
    "unknown-callee": Case(("op = x.mul_", Q, "op(2.0)", K, V)),
    "impure-call": Case((Q, "scale_in_place(x)", K, V)),
    # the block is handed its own state buffer (a pre-hook on the block), which `reset_state` zeroes
    "state-method-call": Case((Q, "self.reset_state()", K, V), setup="block_state_input"),
    "state-source": Case(
        (
            "self.kept = x * 1",
            "z = self.kept",
            "q = self.q_proj(z)",
            "self.kept.mul_(2)",
            "k = self.k_proj(z)",
            "v = self.v_proj(z)",
        )
    ),
    "frame-access": Case((Q, "poke()", K, V)),
    "global-hook": Case((Q, K, V), setup="global_hook"),
    "projection-hook": Case((Q, K, V), setup="forward_hook"),
    "linear-subclass": Case((Q, K, V), setup="class_swap"),
    "parametrized-projection": Case((Q, K, V), setup="parametrized"),
    # k runs under bf16 autocast in the original; the merged call before the `with` runs it in fp32
    "ambient-context": Case(
        (Q, "with torch.autocast('cpu', dtype=torch.bfloat16):\n    k = self.k_proj(x).float()", V)
    ),
    # the caller hands the block its own buffer as the input (a pre-hook); the item store writes it
    "caller-alias": Case((Q, "self.state[0] = 0.0", K, V), setup="block_state_input"),
    # the caller put the input in a registry (a pre-hook) that a helper handed nothing writes
    "region-call": Case((Q, "bump_registered()", K, V), setup="registry"),
    # fused, `k_proj` no longer exists: the fused layer raises where the original runs
    "projection-identity": Case((Q, "w = getattr(self, 'k' + '_proj').weight", K, V)),
    # `max_norm` renormalises the rows of `x[0]` in place
    "argument-write": Case((Q, "e = F.embedding(torch.tensor([0, 1]), x[0], max_norm=0.1)", K, V)),
    # the caller put the input in a registry; a generator made before the region writes it when `next` advances it
    "implicit-call": Case(
        ("g = (REGISTRY[-1].mul_(2.0) for _ in range(1))", Q, "n = next(g)", K, V), setup="registry"
    ),
}
UNTESTABLE = {
    "dtype-mismatch": "outside autocast no original forward runs with pieces of two dtypes; inside it the merged "
    "GEMM casts alike, so the rule keeps the merged parameter's dtype honest rather than the numbers",
    "device-mismatch": "needs two devices; tests/test_hazards.py checks it on meta vs cpu",
}


SECOND_LAYER = {
    "ambient-context",
    "caller-alias",
    "region-call",
    "projection-identity",
    "argument-write",
    "implicit-call",
}
"""Issue 24's rules refuse every write or call of the region not proven harmless, whoever it may reach, so they also
refuse most mutants of the older, input-specific rules. An older rule is shown needed with these off as well (the
rule set it was written for); each of these is shown needed alone."""


def test_every_rule_has_a_mutant():
    assert set(MUTANTS) | set(UNTESTABLE) == set(rules.RULE_IDS)
    assert set(SETUPS) >= {case.setup for case in MUTANTS.values()}


@pytest.mark.parametrize("rule", sorted(MUTANTS))
def test_switching_a_rule_off_lets_a_miscompile_through(tmp_path, monkeypatch, rule):
    with Harness(tmp_path, "mutant_cases") as harness:
        kept = harness.check(MUTANTS[rule])
        assert not kept.fused and rule in kept.rules, f"with every rule on: {kept}"
        assert kept.invalid is None, kept
        monkeypatch.setattr(rules, "DISABLED", frozenset({rule} | (set() if rule in SECOND_LAYER else SECOND_LAYER)))
        switched_off = harness.check(MUTANTS[rule])
    assert switched_off.fused, f"with {rule} off the case is still refused: {switched_off}"
    assert switched_off.miscompile, f"with {rule} off the fused case still computes the same: {switched_off}"


# --- issue 24's rules, branch by branch, judged by running in every mode ----------------------------------------------
#
# Each rule of the second layer refuses through several checks (`fusegen/fusions/merged/region_rules.py`); one mutant
# above shows the rule needed, these show each of its checks needed: the case is refused by that rule, and with the
# rule off (and `also`, the other rules that catch the same case by design) it is fused and the fused model computes
# something else or raises where the original runs, judged by `fusegen.tools.oracle.verdict` (logits and gradients,
# eval and train, with and without bf16 autocast). The piece copies (`fusegen.fusions.merged.pieces.COPIES`) are
# shown needed the same way.

PAIR = "        self.block.register_forward_pre_hook(lambda m, args: (args[0], args[0]))"
W_RETURN = "return q * w + torch.cat([k, v], dim=-1)"


@dataclass(frozen=True)
class Branch:
    rule: str
    toy: Toy
    also: frozenset = frozenset()


BRANCHES = {
    "context: a with around one projection": Branch("ambient-context", Toy((Q, "with torch.no_grad():\n    " + K, V))),
    "context: a with of the region that stays open": Branch(
        "ambient-context",
        Toy(
            (
                Q,
                "with contextlib.ExitStack() as stack:\n    stack.enter_context(Doubling())\n    held = stack.pop_all()",
                K,
                V,
                "held.close()",
            )
        ),
        also=frozenset({"region-call"}),  # a call in the region not proven write-free, too
    ),
    "context: a grad-mode switch by call": Branch(
        "ambient-context",
        Toy(
            (Q, "was = torch.is_grad_enabled()", "torch.set_grad_enabled(False)", K, "torch.set_grad_enabled(was)", V)
        ),
        also=frozenset({"region-call"}),  # a call in the region not proven write-free, too
    ),
    "context: a mode entered by call": Branch(
        "ambient-context",
        Toy((Q, "mode = Doubling()", "mode.__enter__()", K, "mode.__exit__(None, None, None)", V)),
        also=frozenset({"region-call"}),  # a call in the region not proven write-free, too
    ),
    "caller-alias: a second parameter": Branch(
        "caller-alias",
        Toy((Q, "y.mul_(2.0)", K, V), layer=PAIR, signature="x, y"),
        also=frozenset({"region-call"}),  # a method of an unannotated parameter, too
    ),
    "caller-alias: an item of a list parameter": Branch(
        "caller-alias",
        Toy(
            (Q, "states[0] += 1.0", K, V),
            layer="        self.block.register_forward_pre_hook(lambda m, args: (args[0], [args[0]]))",
            signature="x, states",
        ),
        also=frozenset({"implicit-call"}),  # `+=` on an item of an unknown container, too
    ),
    "region-call: a closure cell": Branch(
        "region-call",
        Toy(
            (Q, "scale_cell()", K, V),
            layer="        self.block.register_forward_pre_hook(lambda m, args: put_in_cell(args[0]))",
        ),
    ),
    "region-call: an address handed to a helper": Branch(
        "region-call",
        Toy((Q, "clear_at(x.data_ptr())", K, V)),
        also=frozenset({"impure-call"}),  # the input handed to a user function, too
    ),
    "identity: _modules": Branch(
        "projection-identity",
        Toy((Q, 'w = self._modules["k_proj"].weight.sum()', K, V), ret=W_RETURN),
        also=frozenset({"region-call", "implicit-call"}),  # a method of an object not known to be a tensor; its item
    ),
    "identity: attrgetter": Branch(
        "projection-identity",
        Toy((Q, 'w = operator.attrgetter("k_proj.weight")(self).sum()', K, V), ret=W_RETURN),
        also=frozenset({"region-call"}),  # an operator callable applied in the region, too
    ),
    "identity: parameters()": Branch(
        "projection-identity",
        Toy((Q, "w = next(self.parameters()).shape[0]", K, V), ret=W_RETURN),
        also=frozenset({"state-method-call", "implicit-call"}),  # a method of the module itself; `next` of a generator
    ),
    "identity: a callee handed self in the region": Branch(
        "projection-identity", Toy((Q, "w = peek(self)", K, V), ret=W_RETURN)
    ),
    "identity: a callee handed self that names a projection": Branch(
        "projection-identity", Toy(("w = peek(self)", Q, K, V), ret=W_RETURN)
    ),
    "identity: a global hook registered in forward": Branch(
        "projection-identity",
        Toy(
            (
                Q,
                "handle = torch.nn.modules.module.register_module_forward_hook(double_plain_linears)",
                K,
                V,
                "handle.remove()",
            )
        ),
        # registering a global hook is a state switch too, and torch's registration is no call proven write-free
        also=frozenset({"ambient-context", "region-call"}),
    ),
    "argument-write: running statistics": Branch(
        "argument-write",
        Toy(
            (Q, "n = F.batch_norm(x.reshape(-1, 16), x[0, 0], x[0, 1], training=True, momentum=0.5)", K, V),
            ret="return q + torch.cat([k, v], dim=-1) + n.sum()",
        ),
    ),
}


_F = oracle.FOURTH_HELPERS
_SLY = "        self.block.register_forward_pre_hook(lambda m, args: (args[0], Sly(args[0])))"
BRANCHES.update(
    {
        # the fourth hazard batch's holes, each closed by a check of its own
        "context: a torch state switch under another name": Branch(
            "ambient-context",
            Toy((Q, "handle = watch_linears(double_plain_linears)", K, V, "handle.remove()"), extra=_F),
            also=frozenset({"region-call", "projection-identity"}),  # unproven call; a global hook registered, too
        ),
        "caller-alias: inplace passed by position": Branch(
            "caller-alias",
            Toy((Q, "F.hardtanh(y, -0.1, 0.1, True)", K, V), layer=PAIR, signature="x, y", extra=_F),
            also=frozenset({"implicit-call"}),  # torch is handed `y`, not known to be a tensor, too
        ),
        "projection-identity: a class's method handed self": Branch(
            "projection-identity",
            Toy((Q, K, V, 'w = nn.Module.__getattr__(self, "v_proj").weight.sum()'), ret=W_RETURN, extra=_F),
        ),
        "implicit-call: a special method of the caller's object": Branch(
            "implicit-call", Toy((Q, "n = len(cache)", K, V), layer=_SLY, signature="x, cache", extra=_F)
        ),
        "implicit-call: a generator advanced by next": Branch(
            "implicit-call",
            Toy(("steps = grad_off_then_back()", Q, "n = next(steps)", K, "n = next(steps)", V), extra=_F),
        ),
        "implicit-call: a truth test": Branch(
            "implicit-call", Toy(("sw = Toggle()", Q, "if sw:\n    pass", K, "assert sw", V), extra=_F)
        ),
        "implicit-call: a decorator applied": Branch(
            "implicit-call",
            Toy(
                (
                    Q,
                    "@flip_on_decoration\ndef marker():\n    return 0",
                    K,
                    "@flip_on_decoration\ndef marker2():\n    return 0",
                    V,
                ),
                extra=_F,
            ),
        ),
        # the family fuzzer's holes (issue 24, item 8)
        "implicit-call: a key function a builtin calls": Branch(
            "implicit-call",
            Toy(
                (Q, "top = max((3,), key=flip_on_decoration)", K, "top = max((3,), key=flip_on_decoration)", V),
                extra=_F,
            ),
        ),
        "implicit-call: an operator function on the caller's object": Branch(
            "implicit-call", Toy((Q, "z = operator.add(cache, 1.0)", K, V), layer=_SLY, signature="x, cache", extra=_F)
        ),
        "implicit-call: a lazy builtin made from a flip": Branch(
            "implicit-call",
            Toy(("ticks = map(flip_on_decoration, (1, 2))", Q, "n = next(ticks)", K, "n = next(ticks)", V), extra=_F),
        ),
    }
)


@pytest.mark.parametrize("name", sorted(BRANCHES))
def test_switching_a_rule_off_lets_each_of_its_checks_miscompile(tmp_path, monkeypatch, name):
    branch = BRANCHES[name]
    monkeypatch.syspath_prepend(str(tmp_path))
    slug = "".join(c if c.isalnum() else "_" for c in name)
    dotted = oracle.write_toy(tmp_path, "branch_cases", f"case_{slug}", branch.toy)
    try:
        assert oracle.verdict(dotted, "fused_all", validate=False) == "refused"
        monkeypatch.setattr(rules, "DISABLED", branch.also)
        kept, rules_fired = oracle.judge(dotted, "fused_on", validate=False)
        assert kept == "refused" and branch.rule in rules_fired, (
            f"with {sorted(branch.also)} off: {kept} {rules_fired}"
        )
        monkeypatch.setattr(rules, "DISABLED", frozenset({branch.rule} | branch.also))
        switched_off = oracle.verdict(dotted, "fused_off", validate=False)
    finally:
        oracle.forget("branch_cases")
    assert switched_off.startswith(("miscompile", "crash")), f"with {branch.rule} off: {switched_off}"


PIECES = {
    "a piece stored on self and written by the caller's hook": Toy(
        (Q, K, V, "self.seen = k"),
        layer="        self.block.register_forward_hook(lambda m, args, out: [m.seen.mul_(2.0)] and None)",
    ),
    "a piece handed to a user function that writes it": Toy((Q, K, "k = scale_in_place(k)", V)),
    "a piece viewed across rows": Toy(
        (Q, "k = self.k_proj(x).view(-1)", V), ret="return q + torch.cat([k.view(v.shape), v], dim=-1)"
    ),
    "a piece whose layout is read": Toy(
        (Q, K, V, "w = 2.0 if k.is_contiguous() else 1.0"), ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
    "a piece kept by a lambda's default value": Toy(
        (Q, K, V, "self.later = lambda held=k: held"),
        layer="        self.block.register_forward_hook(lambda m, args, out: [m.later().mul_(2.0)] and None)",
    ),
    "a piece whose identity is compared through id": Toy(
        (Q, K, V, "w = 2.0 if id(v) == id(v.contiguous()) else 1.0"), ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
    "a piece in a dict stored on self and written by the caller's hook": Toy(
        (Q, K, V, 'self.seen = {"k": k}'),
        layer='        self.block.register_forward_hook(lambda m, args, out: [m.seen["k"].mul_(2.0)] and None)',
    ),
    "a piece captured by a lambda the caller's hook calls": Toy(
        (Q, K, V, "self.later = lambda: k"),
        layer="        self.block.register_forward_hook(lambda m, args, out: [m.later().mul_(2.0)] and None)",
    ),
    "a piece appended to a global list": Toy(
        (Q, K, V, "CACHE.append(k)"),
        layer="        self.block.register_forward_hook(lambda m, args, out: [CACHE[-1].mul_(2.0)] and None)",
    ),
    "a piece whose stride is read through mT": Toy(
        (Q, K, V, "w = float(k.mT.stride()[-1])"), ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
    "a piece compared by identity with its contiguous self": Toy(
        (Q, K, V, "w = 2.0 if k.contiguous() is k else 1.0"), ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
}


@pytest.mark.parametrize("name", sorted(PIECES))
def test_pieces_without_their_copies_fail(tmp_path, monkeypatch, name):
    monkeypatch.syspath_prepend(str(tmp_path))
    slug = "".join(c if c.isalnum() else "_" for c in name)
    dotted = oracle.write_toy(tmp_path, "piece_cases", f"case_{slug}", PIECES[name])
    try:
        kept = oracle.verdict(dotted, "fused_on", validate=False)
        assert kept == "sound", f"with the copies: {kept}"
        monkeypatch.setattr(pieces, "COPIES", False)
        without = oracle.verdict(dotted, "fused_off", validate=False)
    finally:
        oracle.forget("piece_cases")
    assert without.startswith(("miscompile", "crash")), f"without the copies: {without}"
