"""The stage numbers the compiler's module docstrings give are the driver's (`fusegen/compiler/build.py`)."""

import ast
import re
from pathlib import Path

COMPILER = Path(__file__).resolve().parents[1] / "fusegen" / "compiler"


def driver_stages() -> dict[str, str]:
    """`{module: stage}` from the driver's docstring: each `N.` or `N-M.` and the modules named up to the next one."""
    text = ast.get_docstring(ast.parse((COMPILER / "build.py").read_text()))
    parts = re.split(r"(?:^|[;\s])(\d+(?:-\d+)?)\. ", text)
    stages = {}
    for number, body in zip(parts[1::2], parts[2::2]):
        for module in re.findall(r"`(\w+)`", body):
            if (COMPILER / f"{module}.py").exists():
                stages.setdefault(module, number)
    return stages


def test_the_driver_names_a_stage_for_every_stage_module():
    stages = driver_stages()
    assert stages["resolve"] == "1" and stages["analyse"] == "3-5" and stages["writer"] == "9", stages
    assert stages["reachable"] == "3-5" and stages["runtime_base"] == "6" and stages["splice"] == "7", stages
    claiming = {
        path.stem
        for path in COMPILER.glob("*.py")
        if (ast.get_docstring(ast.parse(path.read_text())) or "").startswith("Stage")
    }
    assert claiming <= set(stages), sorted(claiming - set(stages))


def test_each_module_docstring_gives_its_driver_stage():
    wrong = []
    for module, number in driver_stages().items():
        doc = ast.get_docstring(ast.parse((COMPILER / f"{module}.py").read_text())) or ""
        claimed = re.match(r"Stages? (\d+(?:-\d+)?)(\w*)", doc)
        if claimed is None:
            continue  # a helper the driver names in passing (`safety`), no stage of its own
        first, last = (int(n) for n in (number.split("-") * 2)[:2]) if "-" in number else (int(number), int(number))
        stage = claimed.group(1)
        inside = all(first <= int(n) <= last for n in stage.split("-"))
        if claimed.group(2) or not inside:
            wrong.append(f"{module}: docstring says stage {claimed.group(0)}, the driver {number}")
    assert not wrong, wrong
