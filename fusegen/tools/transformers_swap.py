"""A pytest plugin that puts fusegen's generated classes where Transformers' own model tests import the originals.

`python -m fusegen.tools.transformers_tests` (the driver) runs a Transformers test module twice; the second run loads
this plugin (`-p fusegen.tools.transformers_swap`) with `FUSEGEN_SWAP_FILES` naming the generated files to use
(separated by `os.pathsep`). Before pytest collects a test module, `pytest_configure` imports each file and, for every
generated class `FusedX` whose original `X` is a model class Transformers exports at the top level:

- `transformers.X` becomes `FusedX`, so the test module's `from transformers import X` (its `all_model_classes`, its
  tester's base and causal-LM classes, its pipeline mapping) gets the fused class;
- the fused class name is listed next to the original's in the name tables of `transformers.models.auto.modeling_auto`
  (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, ...), under a model-type key no config has (`<type>:fusegen`). The common
  tests decide by class NAME which inputs and labels a class gets and whether it is a base model; without the alias a
  fused class would be tested as some other kind of model, and the comparison with the original run would measure
  its name, not its behaviour. The Auto classes resolve a config through its model type, which the alias key is not,
  so `AutoModel*.from_config` still builds the originals.

What is NOT swapped: Transformers' own heads without a generated class (a generic `LlamaForSequenceClassification`
builds its inner model through `AutoModel`, so it stays the original all through), `*PreTrainedModel` bases, and the
modeling module's own attributes (the generated file imports the unchanged helpers from it). `FUSEGEN_SWAP_REPORT`,
if set, names a JSON file this plugin writes after collection: the swaps (`{"X": "module.FusedX"}`) and, per collected
test class, the generated classes its `all_model_classes` holds, for the driver to print and check.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

FILES_ENV = "FUSEGEN_SWAP_FILES"
REPORT_ENV = "FUSEGEN_SWAP_REPORT"
ALIAS_SUFFIX = ":fusegen"


def swappable(module) -> dict[str, type]:
    """`{original name: generated class}` for the generated module's model classes whose original Transformers
    exports at the top level (see the module docstring for what is left out)."""
    import transformers
    from transformers import PreTrainedModel

    from fusegen.runtime.auto import original_name

    swaps = {}
    for name in getattr(module, "__all__", ()):
        fused = getattr(module, name, None)
        original = original_name(name)
        if original == name or original.endswith("PreTrainedModel"):
            continue
        if not (isinstance(fused, type) and issubclass(fused, PreTrainedModel)):
            continue
        try:
            exported = getattr(transformers, original)
        except (AttributeError, ImportError):
            continue
        if isinstance(exported, type) and issubclass(exported, PreTrainedModel):
            swaps[original] = fused
    return swaps


def alias_names(original: str, fused: str) -> list[str]:
    """List `fused` wherever `original` is a value of a `*_MAPPING_NAMES` table; returns the tables it was added to."""
    from transformers.models.auto import modeling_auto

    tables = []
    for table_name, table in vars(modeling_auto).items():
        if not (table_name.endswith("_MAPPING_NAMES") and isinstance(table, dict)):
            continue
        for model_type, value in list(table.items()):
            if value == original or (isinstance(value, (list, tuple)) and original in value):
                table[f"{model_type}{ALIAS_SUFFIX}"] = fused
                tables.append(table_name)
    return tables


def swap_files(paths: list[str]) -> dict[str, str]:
    """Import each generated file and install its classes (see the module docstring); `{original: module.Fused}`.

    The files are imported first and `transformers` is looked up after: importing a modeling module can replace
    `sys.modules["transformers"]` with a new lazy module (it does the first time after a bare `import transformers`),
    and a class set on the old object would silently not be seen; a later replacement is covered by
    `resolve_swapped`. `pytest_collection_modifyitems` checks the result.
    """
    from fusegen.tools.convert import import_fused_module

    modules = [import_fused_module(Path(path).parent, Path(path).stem.removeprefix("fused_")) for path in paths]
    swaps = {}
    for module in modules:
        for original, fused in swappable(module).items():
            setattr(sys.modules["transformers"], original, fused)
            alias_names(original, fused.__name__)
            swaps[original] = fused
    resolve_swapped(swaps)
    return {original: f"{fused.__module__}.{fused.__name__}" for original, fused in swaps.items()}


def resolve_swapped(swaps: dict[str, type]) -> None:
    """Make every `transformers` module object resolve the swapped names to the generated classes, not only the one
    in `sys.modules` now: Transformers' own test helpers replace it (`tests/test_pipeline_mixin.py` imports the
    checkout's `src/transformers/__init__.py` again through `direct_transformers_import`, which installs a fresh lazy
    module). A fresh lazy module resolves a name through its class's `__getattr__`, so the swapped names are answered
    there first."""
    from transformers.utils import import_utils

    lazy = import_utils._LazyModule
    lookup = lazy.__getattr__

    def swapped_first(module, name):
        if module.__name__ == "transformers" and name in swaps:
            return swaps[name]
        return lookup(module, name)

    lazy.__getattr__ = swapped_first


def fused_model_classes(items) -> dict[str, list[str]]:
    """For each collected test class, the generated classes its `all_model_classes` holds (by name)."""
    from fusegen.runtime.version import source_module

    found: dict[str, list[str]] = {}
    for item in items:
        test_class = getattr(item, "cls", None)
        if test_class is None or test_class.__name__ in found:
            continue
        classes = getattr(test_class, "all_model_classes", None) or ()
        found[test_class.__name__] = [c.__name__ for c in classes if source_module(c.__module__) is not None]
    return found


_INSTALLED: dict[str, str] = {}


def pytest_configure(config) -> None:
    paths = [path for path in os.environ.get(FILES_ENV, "").split(os.pathsep) if path]
    if not paths:
        raise RuntimeError(f"fusegen.tools.transformers_swap loaded without {FILES_ENV}: nothing to swap")
    _INSTALLED.update(swap_files(paths))
    if not _INSTALLED:
        raise RuntimeError(f"none of {paths} defines a class whose original Transformers exports")


def pytest_collection_modifyitems(session, config, items) -> None:
    """Record what the collected test classes really test: a swap that did not reach `all_model_classes` would
    otherwise pass as "0 fused-only failures" while testing the originals twice."""
    report = os.environ.get(REPORT_ENV)
    if report:
        document = {"swapped": _INSTALLED, "tested": fused_model_classes(items)}
        Path(report).write_text(json.dumps(document, indent=1, sort_keys=True), encoding="utf-8")
