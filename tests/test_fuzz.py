"""CI's share of the fuzzers: `fusegen/tools/fuzz.py` (python bench/fuzz.py: 200 random forwards built and run
against the original, 0 miscompiles) and `fusegen/tools/fuzz_families.py` (python bench/fuzz_families.py: issue 24's
families, a hazard and its safe twin per draw, each built with validation off and on and judged by running)."""

import pytest

from fusegen.tools import fuzz_families
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


def assert_families_sound(figures: fuzz_families.FamilyFigures, pairs: int) -> None:
    """0 miscompiles and crashes, no case the original cannot run, every safe twin fused whole; and the run reached
    each family's hazards (some refused, some fused soundly: a fuzzer whose hazards all fuse judges no rule)."""
    report = figures.report()
    print(report)  # the figures docs/analysis.md quotes (pytest -s)
    assert figures.pairs == pairs, report
    assert not figures.failures, "\n\n".join(figures.failures[:3])
    assert not figures.invalid, "\n\n".join(figures.invalid[:3])
    assert not figures.twins_refused, "\n\n".join(figures.twins_refused[:3])
    for family in fuzz_families.FAMILY_NAMES:
        judged = figures.count(family, "hazard") + figures.count(family, "twin")
        assert judged == 4 * pairs // len(fuzz_families.FAMILY_NAMES), report
        assert figures.count(family, "twin", outcome="sound") == judged // 2, report


def test_family_fuzzing_one_pair_per_family(tmp_path):
    pairs = len(fuzz_families.FAMILY_NAMES)
    figures = fuzz_families.run(pairs, seed=0, workdir=tmp_path)
    assert_families_sound(figures, pairs)
    assert figures.count(role="hazard", outcome="refused") >= 2, figures.report()


@pytest.mark.slow  # 120 pairs, 480 builds, each fused one run in 8 modes
def test_family_fuzzing_120_pairs(tmp_path):
    figures = fuzz_families.run(120, seed=1, workdir=tmp_path)
    assert_families_sound(figures, 120)
    for family in ("context", "alias", "identity", "implicit"):
        assert figures.count(family, "hazard", outcome="refused") > 0, figures.report()
