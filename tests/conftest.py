"""Fixtures only; the shared helpers (random model, small config, load pair, the tolerance) are in fusegen/testkit.py."""

import sys

import pytest

from fusegen.testkit import save_random


@pytest.fixture
def checkpoint(tmp_path):
    """Save a random original-class model (`fusegen.testkit.save_random`); returns (path, model)."""

    def make(model_class, config, **save_kwargs):
        path = tmp_path / "original"
        return path, save_random(model_class, config, path, **save_kwargs)

    return make


@pytest.fixture
def case_path(tmp_path, monkeypatch):
    """A directory on sys.path for toy-model cases (`tests/test_hazards.write_case`); the cases' modules and any
    global hooks they registered are removed afterwards, so no case outlives its test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("hazard_cases")]:
        for handle in getattr(sys.modules[name], "_HOOKS", []):
            handle.remove()
        del sys.modules[name]


@pytest.fixture
def reload_module():
    """`reload_module(name)` re-executes an imported module, as a process may (a re-import, `importlib.reload`); each
    module's first namespace is put back afterwards, so no later test sees the reloaded classes. fusegen.runtime.tp
    is imported first: importing it while the reloaded classes are in place would bind it to them for good."""
    import importlib

    importlib.import_module("fusegen.runtime.tp")
    saved = []

    def reload(name):
        module = sys.modules[name]
        saved.append((module, dict(module.__dict__)))
        return importlib.reload(module)

    yield reload
    for module, namespace in reversed(saved):
        module.__dict__.clear()
        module.__dict__.update(namespace)


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` need the vLLM venv (.ci/vllm.sh); they run only when `-m` names the marker (`-m vllm`).

    Everywhere else they are deselected, not skipped, so a run without vLLM never counts them as passed, and a run
    with `-m vllm` where vLLM does not import fails on the import instead of skipping.
    """
    if "vllm" in (config.option.markexpr or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("vllm") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("vllm") is None]
