"""fusegen.tools.transformers_tests: the harness that runs Transformers' own model tests against the fused classes.

The end-to-end tests use a tiny stand-in checkout written here (our own test module in Transformers' layout), so they
need neither Transformers' test files nor the network: one test that passes with either class, one that fails with
the fused class only (it checks the class it got is the original), one that fails with both.
"""

from __future__ import annotations

import textwrap

import pytest

from fusegen.tools.transformers_tests import FAILED, PASSED, SKIPPED, Comparison, main, read_junit, render

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_a" />
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_b">{b}</testcase>
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_c">{c}</testcase>
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_d">{d}</testcase>
</testsuite></testsuites>
"""
FAIL = '<failure message="AssertionError: boom">trace</failure>'
ERROR = '<error message="RuntimeError: bad">trace</error>'
SKIP = '<skipped message="needs a GPU" />'


def junit(tmp_path, name, **outcomes):
    path = tmp_path / name
    path.write_text(JUNIT.format(**{key: outcomes.get(key, "") for key in "bcd"}))
    return read_junit(path)


def test_junit_outcomes_and_the_fused_only_difference(tmp_path):
    original = junit(tmp_path, "original.xml", b=SKIP, c=FAIL)
    fused = junit(tmp_path, "fused.xml", b=ERROR, c=FAIL, d=FAIL)
    assert original.outcomes == {
        "LlamaModelTest::test_a": PASSED,
        "LlamaModelTest::test_b": SKIPPED,
        "LlamaModelTest::test_c": FAILED,
        "LlamaModelTest::test_d": PASSED,
    }
    comparison = Comparison(original, fused, {"LlamaModel": "m.FusedLlamaModel"})
    assert comparison.fused_only == ["LlamaModelTest::test_b", "LlamaModelTest::test_d"]
    assert comparison.both == ["LlamaModelTest::test_c"]
    assert comparison.original_only == [] and comparison.one_sided == []
    text = render(comparison)
    assert "failed on fused only: 2" in text and "LlamaModelTest::test_b  -- RuntimeError: bad" in text
    skipped = Comparison(junit(tmp_path, "o.xml"), junit(tmp_path, "f.xml", d=SKIP), {})
    assert skipped.skipped_fused_only == ["LlamaModelTest::test_d"] and not skipped.fused_only
    assert "skipped on fused only (passed on original): 1\n  LlamaModelTest::test_d  -- needs a GPU" in render(skipped)


def test_a_test_only_one_run_has_is_listed(tmp_path):
    original = junit(tmp_path, "original.xml", c=FAIL)
    fused = junit(tmp_path, "fused.xml")
    del fused.outcomes["LlamaModelTest::test_d"]
    comparison = Comparison(original, fused, {})
    assert comparison.original_only == ["LlamaModelTest::test_c"]
    assert comparison.one_sided == ["LlamaModelTest::test_d"]


STAND_IN = """
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny():
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)


class StandInModelTest(unittest.TestCase):
    all_model_classes = (LlamaForCausalLM,)

    def test_forward_runs(self):
        model = LlamaForCausalLM(tiny()).eval()
        self.assertEqual(model(torch.tensor([[1, 2, 3]])).logits.shape, (1, 3, 64))

    def test_the_class_is_the_original(self):
        self.assertEqual(LlamaForCausalLM.__name__, "LlamaForCausalLM")

    def test_fails_everywhere(self):
        self.fail("fails with either class")
"""


def stand_in_checkout(root, module_text):
    tests = root / "tests"
    (tests / "models" / "llama").mkdir(parents=True)
    for package in (tests, tests / "models", tests / "models" / "llama"):
        (package / "__init__.py").write_text("")
    (tests / "test_modeling_common.py").write_text("# a stand-in: the harness only checks that it is there\n")
    (tests / "models" / "llama" / "test_modeling_llama.py").write_text(textwrap.dedent(module_text))
    return root


@pytest.mark.slow
def test_a_failure_with_the_fused_class_only_is_reported_and_exits_1(tmp_path, capsys):
    checkout = stand_in_checkout(tmp_path / "checkout", STAND_IN)
    code = main([str(checkout), "tests/models/llama/test_modeling_llama.py", "--model", "llama"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "StandInModelTest.all_model_classes, fused: FusedLlamaForCausalLM" in out
    assert "original: 3 run: 2 passed, 1 failed, 0 skipped" in out
    assert "fused:    3 run: 1 passed, 2 failed, 0 skipped" in out
    fused_only = out.split("failed on fused only: 1\n")[1].split("\n")[0]
    assert fused_only.startswith("  StandInModelTest::test_the_class_is_the_original")
    assert "failed on both: 1\n  StandInModelTest::test_fails_everywhere" in out


@pytest.mark.slow
def test_a_run_that_tests_no_fused_class_is_refused(tmp_path, capsys):
    """A test module whose classes list no model class cannot show a fused-only failure: exit 2, not a clean pass."""
    text = "import unittest\n\n\nclass NothingTest(unittest.TestCase):\n    def test_x(self):\n        pass\n"
    checkout = stand_in_checkout(tmp_path / "checkout", text)
    code = main([str(checkout), "tests/models/llama/test_modeling_llama.py", "--model", "llama"])
    assert code == 2
    assert "tested no generated class" in capsys.readouterr().err


def test_bad_input_exits_2(tmp_path, capsys):
    assert main([str(tmp_path), "tests/x.py", "--model", "llama"]) == 2
    assert "not a Transformers checkout" in capsys.readouterr().err
    checkout = stand_in_checkout(tmp_path / "checkout", STAND_IN)
    assert main([str(checkout), "tests/models/llama/missing.py", "--model", "llama"]) == 2
    assert "no test file" in capsys.readouterr().err
