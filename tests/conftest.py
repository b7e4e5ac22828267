"""Fixtures only; the shared helpers (random model, small config, load pair, the tolerance) are in fusegen/testkit.py."""

import pytest

from fusegen.testkit import save_random


@pytest.fixture
def checkpoint(tmp_path):
    """Save a random original-class model (`fusegen.testkit.save_random`); returns (path, model)."""

    def make(model_class, config, **save_kwargs):
        path = tmp_path / "original"
        return path, save_random(model_class, config, path, **save_kwargs)

    return make
