"""False alarms of the input-stability rules that the Transformers MLA and hybrid attentions hit, and the hazards
next to each that must stay refused.

Each precision added to `fusegen.fusions.merged` (hoist, dataflow) gets a pair of cases built through the fuzzer's harness
(`fusegen.tools.fuzz.Harness`: the toy block compiled by the real pipeline, original and fused layers run on the
same weights and input): the false alarm now fuses and computes the same, and a hazard that differs only in the
fact the precision relies on is still refused; with that fact no longer checked (the guard loosened by a
monkeypatch) the hazard fuses and computes something else, so the guard is what keeps it out.
"""

import ast

import pytest
from torch import nn

from fusegen.core.astutil import parent_map, self_attr
from fusegen.fusions.merged import dataflow, hoist, region_rules, rules
from fusegen.tools import fuzz
from fusegen.tools.fuzz import INIT, Case, Harness

Q, K, V = "q = self.q_proj(x)", "k = self.k_proj(x)", "v = self.v_proj(x)"

HELPERS = '''
class Writer:
    """Not a tensor: its `view_as` writes what it is handed, its `expand_as` hands it back."""

    def view_as(self, t):
        t.mul_(2)
        return t

    def expand_as(self, t):
        return t


class Maker(nn.Module):
    """A user module whose output is a `Writer`."""

    def forward(self, n):
        return Writer()
'''

OUT_INIT = INIT + "        self.o = nn.Linear(16, 16, bias=False)\n        self.maker = Maker()\n"
WRITER_HOOK = "        self.block.o.register_forward_hook(lambda m, i, o: Writer())"


@pytest.fixture
def harness(tmp_path, monkeypatch):
    monkeypatch.setitem(fuzz.SETUPS, "writers", (HELPERS, ""))
    monkeypatch.setitem(fuzz.SETUPS, "writer_hook", (HELPERS, WRITER_HOOK))
    with Harness(tmp_path, "escape_cases") as harness:
        yield harness


def assert_fused_and_same(result):
    assert result.fused, f"still refused: {result.rules}"
    assert result.invalid is None and result.miscompile is None, result


def assert_refused_then_miscompiled(harness, monkeypatch, case, rule, loosened):
    """`case` is refused by `rule`; with `dataflow.linear_output` replaced by `loosened` it fuses and differs."""
    kept = harness.check(case)
    assert not kept.fused and rule in kept.rules, kept
    assert kept.invalid is None, kept
    monkeypatch.setattr(dataflow, "linear_output", loosened)
    loose = harness.check(case)
    assert loose.fused, f"with the guard loosened the case is still refused: {loose}"
    assert loose.miscompile, f"with the guard loosened the fused case still computes the same: {loose}"


# --- a pure tensor method of a plain linear's output (MLA: `self.q_b_proj(q_resid).view(query_shape)`) ---


def test_pure_method_of_a_linear_output_handed_an_alias_fuses(harness):
    # the receiver is new storage from a plain nn.Linear: `view_as(x)` reads x's shape and keeps nothing
    assert_fused_and_same(harness.check(Case((Q, "q = q + self.o(q).view_as(x)", K, V), "writers", OUT_INIT)))


def test_view_of_a_linear_output_is_not_an_alias(harness):
    # `w` is a view of the linear's new storage, not of x (the shape argument is not aliased): writing it is safe
    case = Case((Q, "w = self.o(q).view_as(x)", "w.mul_(2)", "q = q + w", K, V), "writers", OUT_INIT)
    assert_fused_and_same(harness.check(case))


def _any_submodule_call(expr, module):
    return isinstance(expr, ast.Call) and self_attr(expr.func)


def _any_exact_linear_call(expr, module):
    return (
        isinstance(expr, ast.Call)
        and self_attr(expr.func)
        and type(getattr(module, expr.func.attr, None)) is nn.Linear
    )


def test_method_of_a_user_module_output_is_still_refused(harness, monkeypatch):
    # `Maker`'s output is not a tensor: its `view_as` writes x between the projections
    case = Case((Q, "self.maker(0).view_as(x)", K, V), "writers", OUT_INIT)
    assert_refused_then_miscompiled(harness, monkeypatch, case, "input-escapes", _any_submodule_call)


def test_method_of_a_hooked_linear_output_is_still_refused(harness, monkeypatch):
    # a forward hook on `o` replaces its output with a `Writer`
    case = Case((Q, "self.o(q).view_as(x)", K, V), "writer_hook", OUT_INIT)
    assert_refused_then_miscompiled(harness, monkeypatch, case, "impure-call", _any_exact_linear_call)


def test_alias_through_a_user_module_output_is_still_tracked(harness, monkeypatch):
    # `Writer.expand_as` hands x back: `w` is x, and `w.mul_(2)` writes it
    case = Case((Q, "w = self.maker(0).expand_as(x)", "w.mul_(2)", K, V), "writers", OUT_INIT)
    assert_refused_then_miscompiled(harness, monkeypatch, case, "input-escapes", _any_submodule_call)


# --- an opaque alias read before it becomes one (kimi: `h = apply_mask_to_padding_states(h, attention_mask)`) ---

OPAQUE_HELPERS = '''
def mask_padding(t, mask):
    """Stands for Transformers' `apply_mask_to_padding_states`: a function the rules cannot see into."""
    return t if mask is None else t * mask


GEN = None


def advance():
    return next(GEN)
'''


@pytest.fixture
def opaque_harness(tmp_path, monkeypatch):
    monkeypatch.setitem(fuzz.SETUPS, "mask_padding", (OPAQUE_HELPERS, ""))
    with Harness(tmp_path, "opaque_cases") as harness:
        yield harness


def test_name_read_only_as_the_operand_that_makes_it_opaque_fuses(opaque_harness):
    # `m` may hold x only after `mask_padding` ran, and it is never read again
    case = Case(("m = None", "x = mask_padding(x, m)", Q, K, V), "mask_padding")
    assert_fused_and_same(opaque_harness.check(case))


def test_name_made_opaque_after_the_projections_fuses(opaque_harness):
    # `s` is handed to `mask_padding` with x only after the last projection: the region reads the int
    case = Case(("s = x.shape[0]", Q, "q = q * s", K, V, "n = mask_padding(x, s)"), "mask_padding")
    assert_fused_and_same(opaque_harness.check(case))


def test_opaque_alias_read_after_it_is_made_is_still_refused(opaque_harness, monkeypatch):
    # `obj` holds x inside a `Box`, whose `view` writes it, from its binding on: the read in the region comes later
    case = Case(("obj = Box(x)", Q, "obj.view()", K, V), "mask_padding")
    kept = opaque_harness.check(case)
    assert not kept.fused and "opaque-alias" in kept.rules, kept
    monkeypatch.setattr(hoist, "_read_first", lambda read, maker, funcdef, parent_of: True)
    loose = opaque_harness.check(case)
    assert loose.fused and loose.miscompile, loose


def test_read_before_its_maker_in_a_loop_is_still_refused(opaque_harness, monkeypatch):
    # the second iteration's `u = t` reads the `Box` the first one made, though it stands on an earlier line
    loop = "t = None\nfor _ in range(2):\n    u = t\n    t = Box(x)"
    case = Case((loop, Q, "u.view()", K, V), "mask_padding")
    kept = opaque_harness.check(case)
    assert not kept.fused and "opaque-alias" in kept.rules, kept
    monkeypatch.setattr(hoist, "enclosing_loop_or_scope", lambda funcdef, node, parent_of=None: None)
    loose = opaque_harness.check(case)
    assert loose.fused and loose.miscompile, loose


# --- the projections called before a refused statement still merge (Dots, Bailing: `g_proj` after the cache) ---


def test_projections_called_before_the_refused_statement_still_merge(opaque_harness):
    # the block is handed its own state buffer, which `reset_state` zeroes: v must read it after, q and k before
    result = opaque_harness.check(Case((Q, K, "self.reset_state()", V), "block_state_input"))
    assert result.fused and "state-method-call" in result.rules, result
    assert result.invalid is None and result.miscompile is None, result


# --- checkpoint names shared with a projection another fused class keeps (kimi_linear's hybrid layers) ---


class _FullAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)


class _LinearAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.gate_proj, self.up_proj = nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(4, 6)


class _Hybrid(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_FullAttention(), _LinearAttention()])


def _conflicts(linear_attention_plan):
    from fusegen.compiler.vetoes import checkpoint_conflicts
    from fusegen.core.plan import ClassOutcome, FusionPlan

    qkv = FusionPlan("qkv", "qkv_proj", (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)))
    outcomes = [ClassOutcome("_FullAttention", [qkv]), ClassOutcome("_LinearAttention", [linear_attention_plan])]
    return checkpoint_conflicts(_Hybrid(), outcomes)


def test_a_projection_kept_by_a_class_with_other_fusions_vetoes_the_merge():
    # the linear attention fuses gate/up but keeps `q_proj`, at the path where the full attention merges its own
    from fusegen.core.plan import FusionPlan

    vetoes = _conflicts(FusionPlan("glu", "gate_up_proj", (("gate_proj", 0), ("up_proj", 1))))
    veto = vetoes["_FullAttention"]["qkv_proj"]
    assert veto.rule == "ambiguous-checkpoint-names"
    assert "layers.1.q_proj" in veto.reason and "qkv_proj" in veto.reason, veto.reason


def test_a_projection_merged_away_by_its_own_class_vetoes_nothing():
    from fusegen.core.plan import FusionPlan

    assert _conflicts(FusionPlan("merged_column", "q_gate_proj", (("q_proj", 0), ("gate_proj", 1)))) == {}


def test_a_piece_a_conditional_merge_keeps_still_vetoes():
    # where the merged linear is not built (`FusionPlan.kept`), the piece holds an unfused tensor at its path
    from fusegen.core.plan import FusionPlan

    plan = FusionPlan("merged_column", "q_gate_proj", (("q_proj", 0), ("gate_proj", 1)), kept=("q_proj",))
    assert "qkv_proj" in _conflicts(plan)["_FullAttention"]


# --- a generator or closure first used after the projections (Qwen4-Exp: `position_embeddings = (... for x in ...)`) ---


def test_generator_advanced_only_after_the_projections_fuses(opaque_harness):
    case = Case(("pe = (t[:, -x.shape[1] :, :] * 2 for t in [x])", Q, K, V, "(s,) = pe", "q = q + s"), "mask_padding")
    assert_fused_and_same(opaque_harness.check(case))


def test_closure_called_only_after_the_projections_fuses(opaque_harness):
    case = Case(("def bump():\n    x.add_(1)", Q, K, V, "bump()"), "mask_padding")
    assert_fused_and_same(opaque_harness.check(case))


@pytest.mark.parametrize(
    "body",
    [
        ("gen = (t.mul_(2) for t in [x])", Q, "next(gen)", K, V),  # advanced in the region
        ("gen = (t.mul_(2) for t in [x])", "again = gen", Q, "next(again)", K, V),  # through another name
        ("def bump():\n    x.add_(1)", Q, "bump()", K, V),  # called in the region
        ("def bump():\n    x.add_(1)", "def later():\n    bump()", Q, "later()", K, V),  # called by a closure
        ("global GEN", "GEN = (t.mul_(2) for t in [x])", Q, "advance()", K, V),  # a global, advanced by a function
    ],
    ids=["generator", "renamed_generator", "closure", "closure_through_closure", "global_generator"],
)
def test_generator_or_closure_used_in_the_region_is_still_refused(opaque_harness, monkeypatch, body):
    case = Case(body, "mask_padding")
    kept = opaque_harness.check(case)
    assert not kept.fused and "deferred-capture" in kept.rules, kept
    monkeypatch.setattr(hoist, "_unreachable_until", lambda scope, end, funcdef, parent_of: True)
    # `region-call` refuses the call of a local closure in the region too (defence in depth): off, to show what
    # `deferred-capture` alone prevents
    monkeypatch.setattr(rules, "DISABLED", frozenset({"region-call"}))
    loose = opaque_harness.check(case)
    assert loose.fused and loose.miscompile, loose


def test_one_piece_name_merged_into_two_linears_vetoes_both():
    # Kimi Linear: the linear attention merges `q_proj` into `qkv_proj`, the MLA attention at the same path into
    # `q_proj_kv_a_proj_with_mqa`; `layers.N.self_attn.q_proj.weight` cannot feed both
    from fusegen.compiler.vetoes import pieces_merged_apart
    from fusegen.core.plan import ClassOutcome, FusionPlan

    qkv = FusionPlan("qkv", "qkv_proj", (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)))
    q_gate = FusionPlan("merged_column", "q_gate_proj", (("q_proj", 0), ("gate_proj", 1)))
    outcomes = [ClassOutcome("_FullAttention", [qkv]), ClassOutcome("_LinearAttention", [q_gate])]
    vetoes = pieces_merged_apart(_Hybrid(), outcomes)
    assert set(vetoes) == {"_FullAttention", "_LinearAttention"}, vetoes
    veto = vetoes["_FullAttention"]["qkv_proj"]
    assert veto.rule == "ambiguous-checkpoint-names" and vetoes["_LinearAttention"]["q_gate_proj"] == veto
    assert "layers.0.q_proj" in veto.reason and "layers.1.q_proj" in veto.reason, veto.reason
    same = FusionPlan("qkv", "qkv_proj", (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)))
    assert pieces_merged_apart(_Hybrid(), [ClassOutcome("_FullAttention", [qkv]), ClassOutcome("_B", [same])]) == {}


# --- the Transformers types themselves ---


def _outcomes(model_type):
    from fusegen.compiler.build import analyse

    return {outcome.class_name: outcome for outcome in analyse(model_type).outcomes}


@pytest.mark.slow  # instantiates and analyses the real model types
@pytest.mark.parametrize(
    "model_type, class_name",
    [
        ("glm_moe_dsa", "GlmMoeDsaAttention"),
        ("deepseek_v32", "DeepseekV32Attention"),
        ("dots3_note:causal-lm", "Dots3NoteTextAttention"),
        ("axk2", "AXK2Attention"),
    ],
)
def test_mla_kin_merge_their_latent_projections(model_type, class_name):
    outcome = _outcomes(model_type)[class_name]
    merged = {plan.merged: plan.projections for plan in outcome.fused}
    assert merged.get("fused_qkv_a_proj") == ("q_a_proj", "kv_a_proj_with_mqa"), (merged, outcome.refused)


@pytest.mark.slow
def test_kimi_linear_hybrid_names_the_tensors_it_cannot_map():
    outcomes = _outcomes("kimi_linear")
    for class_name in ("KimiLinearDeltaAttention", "KimiLinearAttention"):
        reasons = [r.reason for r in outcomes[class_name].refused if "q_proj" in r.projections]
        assert any("self_attn.q_proj (KimiLinearDeltaAttention) merges into qkv_proj" in r for r in reasons), reasons


# --- `match` captures bind aliases of the subject (a miss found on the way: they were not tracked) ---


@pytest.mark.parametrize(
    "body",
    [
        ("match x:\n    case w:\n        pass", Q, "w.mul_(2)", K, V),
        ("match [x]:\n    case [w]:\n        pass", Q, "w.mul_(2)", K, V),
        ("match {'t': x}:\n    case {**rest}:\n        pass", Q, "rest['t'].mul_(2)", K, V),
    ],
    ids=["capture", "sequence", "mapping_rest"],
)
def test_match_capture_of_the_input_is_refused(harness, body):
    result = harness.check(Case(body))
    assert not result.fused and "inplace-call" in result.rules, result


@pytest.mark.parametrize(
    "binding",
    [
        "cache = other",
        "for cache in other: pass",
        "with other as cache: pass",
        "try:\n        pass\n    except ValueError as cache:\n        pass",
        "match other:\n        case [cache]:\n            pass",
        "match other:\n        case {**cache}:\n            pass",
        "import cache",
        "def cache(): pass",
        "global cache",
        "del cache",
        "(cache := other)",
    ],
)
def test_every_binding_form_ends_an_isinstance_narrowing(binding):
    """`isinstance` narrowing (`region_rules._narrowed`) holds only for a name the function never rebinds: each
    binding form counts, `except ... as` and `match` captures included."""
    funcdef = ast.parse(f"def forward(self, cache, other):\n    {binding}\n    use = cache\n").body[0]
    use = funcdef.body[-1].value
    assert region_rules._rebound("cache", use, parent_map(funcdef))
    plain = ast.parse("def forward(self, cache, other):\n    use = cache\n").body[0]
    assert not region_rules._rebound("cache", plain.body[-1].value, parent_map(plain))
