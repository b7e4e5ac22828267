"""CI's share of the fuzzer (fusegen/tools/fuzz.py; python bench/fuzz.py runs it too): 200 random forwards built and
run against the original, 0 miscompiles."""

import pytest

from fusegen.tools.fuzz import run

FUSED_FLOOR = 0.2
"""Measured with seed 0: 54 of 200 examples (27.0%) fuse; a compiler that refuses everything fails."""


@pytest.mark.slow
def test_fuzzing_200_examples_finds_no_miscompile(tmp_path):
    figures = run(200, seed=0, workdir=tmp_path)
    assert figures.examples == 200, figures.report()
    assert not figures.miscompiles, "\n\n".join(figures.miscompiles[:3])
    assert figures.invalid == 0, figures.report()
    assert figures.fused_share >= FUSED_FLOOR, figures.report()
