"""Passed execution checks kept for identical classes (fusegen/fusions/verdicts.py, used by `rmsnorm.check_exact`):
one check for norm classes that run the same code on the same state, a new check for a class that differs in
anything the check's verdict depends on, and a refusal for a wrong class even after a sound one was kept."""

import importlib.util
import sys
import textwrap
import types

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from fusegen.core import astutil
from fusegen.core.plan import Refused
from fusegen.fusions import rmsnorm, verdicts

NORM = """
import torch
from torch import nn

SCALE = 1.0


class Norm(nn.Module):
    def __init__(self, hidden_size, eps=EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = VARIANCE
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
"""
SOUND = "hidden_states.pow(2).mean(-1, keepdim=True)"
SOURCE = {"eps": "1e-6", "variance": SOUND}


@pytest.fixture
def kept(monkeypatch):
    """A fresh store of verdicts, and a smaller size table so that each check takes a tenth of a second (the table
    is part of the key, so the store sees the same table throughout a test)."""
    store = verdicts.Verdicts()
    monkeypatch.setattr(rmsnorm, "VERDICTS", store)
    monkeypatch.setattr(rmsnorm, "SIZES", (3,))
    return store


def _module(tmp_path, monkeypatch, name: str, eps: str = "1e-6", variance: str = SOUND) -> types.ModuleType:
    """A module of its own, from `NORM` with its placeholders filled in, loaded from a file (the kind reads the
    class's source) and registered under `name`."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(NORM).replace("EPS", eps).replace("VARIANCE", variance))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


def _check(cls, instance, plan=None):
    return rmsnorm.check_exact(cls, instance, plan or rmsnorm.derive(cls, instance))


def test_llama_and_qwen2_norms_are_checked_once(kept):
    """The case of `fusegen build llama qwen2`: the same forward in two modules, one check."""
    first = _check(LlamaRMSNorm, _meta(LlamaRMSNorm, 16))
    assert (kept.runs, kept.hits) == (1, 0)
    assert _check(Qwen2RMSNorm, _meta(Qwen2RMSNorm, 16)) == first > 100
    assert (kept.runs, kept.hits) == (1, 1)


def test_the_same_source_text_with_another_global_binding_is_checked_again(tmp_path, monkeypatch, kept):
    sound = _module(tmp_path, monkeypatch, "fusegen_test_norm_a")
    _check(sound.Norm, _meta(sound.Norm, 16))
    same = _module(tmp_path, monkeypatch, "fusegen_test_norm_b")
    _check(same.Norm, _meta(same.Norm, 16))
    assert (kept.runs, kept.hits) == (1, 1)  # the same text in another module: kept

    # `torch` bound to another module that computes the same: checked again, and passes
    copy = types.ModuleType("torch")
    copy.__dict__.update(vars(torch))
    other = _module(tmp_path, monkeypatch, "fusegen_test_norm_c")
    plan = rmsnorm.derive(sound.Norm, _meta(sound.Norm, 16))
    other.torch = copy
    _check(other.Norm, _meta(other.Norm, 16), plan)
    assert (kept.runs, kept.hits) == (2, 1)

    # `torch.rsqrt` one ulp-ish off under the same text: checked again, and refused
    off = types.ModuleType("torch")
    off.__dict__.update(vars(torch))
    off.rsqrt = lambda t: torch.rsqrt(t) * (1 + 2**-12)
    wrong = _module(tmp_path, monkeypatch, "fusegen_test_norm_d")
    wrong.torch = off
    with pytest.raises(Refused) as refusal:
        _check(wrong.Norm, _meta(wrong.Norm, 16), plan)
    assert refusal.value.rule == "norm-inexact"
    assert (kept.runs, kept.hits) == (3, 1)


def test_a_mutated_forward_is_refused_after_a_sound_one_was_kept(tmp_path, monkeypatch, kept):
    sound = _module(tmp_path, monkeypatch, "fusegen_test_norm_e")
    plan = rmsnorm.derive(sound.Norm, _meta(sound.Norm, 16))
    _check(sound.Norm, _meta(sound.Norm, 16), plan)
    in_input_dtype = "hidden_states.to(input_dtype).pow(2).mean(-1, keepdim=True).to(torch.float32)"
    mutated = _module(tmp_path, monkeypatch, "fusegen_test_norm_f", variance=in_input_dtype)
    with pytest.raises(Refused) as refusal:
        _check(mutated.Norm, _meta(mutated.Norm, 16), plan)  # the sound class's plan, as if derive had missed it
    assert refusal.value.rule == "norm-inexact"
    assert "bfloat16" in refusal.value.reason or "float16" in refusal.value.reason
    assert kept.runs == 2 and kept.hits == 0

    # the class itself mutated in place after its sound check was kept
    monkeypatch.setattr(sound.Norm, "forward", mutated.Norm.forward)
    with pytest.raises(Refused):
        _check(sound.Norm, _meta(sound.Norm, 16), plan)
    assert kept.hits == 0


def test_another_eps_is_checked_again(tmp_path, monkeypatch, kept):
    sound = _module(tmp_path, monkeypatch, "fusegen_test_norm_g")
    _check(sound.Norm, _meta(sound.Norm, 16))
    _check(sound.Norm, _meta(sound.Norm, 16, 1e-5))  # another constructor argument (the config's eps)
    other_default = _module(tmp_path, monkeypatch, "fusegen_test_norm_h", eps="1e-5")
    _check(other_default.Norm, _meta(other_default.Norm, 16, 1e-6))  # another default, the same value passed
    _check(sound.Norm, _meta(sound.Norm, 32))  # another size
    assert (kept.runs, kept.hits) == (4, 0)
    _check(sound.Norm, _meta(sound.Norm, 16, 1e-5))
    assert (kept.runs, kept.hits) == (4, 1)


def test_a_replaced_case_table_is_checked_again(monkeypatch, kept):
    _check(LlamaRMSNorm, _meta(LlamaRMSNorm, 16))
    monkeypatch.setattr(rmsnorm, "SCALES", (1.0,))
    _check(LlamaRMSNorm, _meta(LlamaRMSNorm, 16))
    assert (kept.runs, kept.hits) == (2, 0)


# --- the key itself -------------------------------------------------------------------------------------------------


def _key(forward, instance=None, extra=()):
    return verdicts.check_key([forward], instance if instance is not None else _meta(LlamaRMSNorm, 8), extra)


def _closure(value):
    def forward(self, x):
        return x * value

    return forward


def _with_default(value):
    def forward(self, x, scale=value):
        return x * scale

    return forward


def test_the_key_sees_closure_cells_defaults_and_float_bits():
    assert _key(_closure(2.0)) == _key(_closure(2.0)) is not None
    assert _key(_closure(2.0)) != _key(_closure(3.0))
    assert _key(_closure(0.0)) != _key(_closure(-0.0))
    assert _key(_closure(1)) != _key(_closure(1.0)) != _key(_closure(True))
    assert _key(_with_default(2.0)) != _key(_with_default(2.5))


def test_the_key_sees_globals_torch_state_and_the_instance(monkeypatch):
    forward = LlamaRMSNorm.forward
    before = _key(forward)
    monkeypatch.setattr(torch, "rsqrt", lambda t: t)  # a name the forward spells, rebound inside torch
    assert _key(forward) != before
    monkeypatch.undo()
    assert _key(forward) == before
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "pow", lambda self, n: self)  # a tensor method the forward spells
        assert _key(forward) != before
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _key(forward) != before
    finally:
        torch.set_default_dtype(previous)
    instance = _meta(LlamaRMSNorm, 8)
    instance.variance_epsilon = 1e-5
    assert _key(forward, instance) != before
    instance = _meta(LlamaRMSNorm, 8)
    instance.register_forward_hook(lambda module, args, out: out)
    assert _key(forward, instance) != before
    assert _key(forward, extra=(1,)) != _key(forward, extra=(2,))


class _Introspects(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))


def _names_its_class(self, x):
    return x * len(type(self).__name__)


def _formats_itself(self, x):
    return x * len(f"{self}")


def _formats_with_percent(self, x):
    return x * len("%s" % (self,))  # noqa: UP031 - the `%` opcode is the point


def _calls_repr(self, x):
    return x * len(repr(self))


def _handles_an_exception(self, x):
    try:
        return x * self.weight
    except RuntimeError:
        return x


def _reads_a_module_global(self, x):
    return x * len(sys.argv)


@pytest.mark.parametrize(
    "forward",
    [
        _names_its_class,
        _formats_itself,
        _formats_with_percent,
        _calls_repr,
        _handles_an_exception,
        _reads_a_module_global,
    ],
    ids=lambda f: f.__name__,
)
def test_code_that_can_observe_a_class_name_gets_no_key(forward):
    """The key leaves the class's name and the code's line numbers out, so code that could read them is never
    keyed: its check always runs."""
    assert verdicts.check_key([forward], _Introspects(), ()) is None


def test_a_class_defining_its_own_repr_gets_no_key():
    class Shown(_Introspects):
        def __repr__(self):
            return "shown"

    def plain(self, x):
        return x * self.weight

    assert verdicts.check_key([plain], _Introspects(), ()) is not None
    assert verdicts.check_key([plain], Shown(), ()) is None


def test_a_docstring_is_not_part_of_the_key():
    def documented(self, x):
        """One text."""
        return x * self.weight

    def other(self, x):
        """Another text."""
        return x * self.weight

    assert verdicts.check_key([documented], _Introspects(), ()) == verdicts.check_key([other], _Introspects(), ())


def test_which_keyword_gets_which_value_is_part_of_the_key():
    # Same bytecode, same values: only the keyword-name tuple KW_NAMES reads from the constants differs.
    def first(self, x):
        return x.to(dtype=torch.float32, copy=True)

    def second(self, x):
        return x.to(copy=torch.float32, dtype=True)

    assert first.__code__.co_code == second.__code__.co_code
    keys = [verdicts.check_key([forward], _Introspects(), ()) for forward in (first, second)]
    assert None not in keys and keys[0] != keys[1]


def test_rewritten_forwards_of_identical_classes_have_equal_keys():
    """What the build compares: each class's own forward and the forward compiled from its own rewritten source."""
    keys = []
    for cls in (LlamaRMSNorm, Qwen2RMSNorm):
        instance = _meta(cls, 64)
        plan = rmsnorm.derive(cls, instance)
        rewritten = rmsnorm.compile_forward(cls, astutil.method(rmsnorm.rewritten_class(cls, plan), "forward"))
        keys.append(verdicts.check_key([cls.forward, rewritten], instance, ()))
    assert keys[0] is not None and keys[0] == keys[1]
