"""The checked-in generated files: fresh, formatted, lint-clean and light to import."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from fusegen.compiler.build import build
from fusegen.compiler.render import format_source
from fusegen.compiler.resolve import resolve

pytestmark = pytest.mark.slow  # rebuilds every checked-in file

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"
TARGETS = sorted(path.name.removeprefix("fused_").removesuffix(".py") for path in GENERATED.glob("fused_*.py"))


@pytest.fixture(scope="module")
def fresh():
    return {target: build(target).text for target in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_checked_in_file_equals_a_fresh_build(fresh, target):
    on_disk = (GENERATED / f"fused_{target}.py").read_text()
    assert on_disk == fresh[target], f"generated/fused_{target}.py is stale: run `fusegen build {target}`"


@pytest.mark.parametrize("target", TARGETS)
def test_checked_in_file_is_black_formatted(target):
    text = (GENERATED / f"fused_{target}.py").read_text()
    assert format_source(text) == text


def test_checked_in_files_pass_ruff():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(GENERATED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("target", TARGETS)
def test_header_names_versions_source_and_fingerprint(target):
    import transformers

    import fusegen

    head = (GENERATED / f"fused_{target}.py").read_text().splitlines()[:5]
    assert f"fusegen {fusegen.__version__}" in head[0]
    assert f"transformers {transformers.__version__}" in head[0]
    assert resolve(target).module.__name__ in head[0]
    assert "Do not edit" in head[1] and f"fusegen build {target}" in head[1]
    assert head[2] == f"# fusegen-target: {target}"
    assert head[3].startswith("# fusegen-source-sha256: ") and len(head[3].split()[-1]) == 64


@pytest.mark.parametrize("target", TARGETS)
def test_generated_file_imports_only_torch_transformers_and_the_runtime(target):
    tree = ast.parse((GENERATED / f"fused_{target}.py").read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module)
    roots = {module.partition(".")[0] for module in modules} - set(
        sys.stdlib_module_names
    )  # `math` adds no dependency
    assert roots <= {"torch", "transformers", "fusegen", "numpy"}  # numpy: a dependency of transformers itself
    assert {module for module in modules if module.startswith("fusegen")} == {"fusegen.runtime"}


def test_the_expected_files_are_checked_in():
    assert {"llama", "qwen2", "mistral", "qwen3", "gemma3_text", "olmo2", "granite", "starcoder2", "cohere"} | {
        "mixtral",
        "qwen3_moe",
        "deepseek_v3",
        "gemma4_text",
    } | {"qwen2_5_vl", "gemma3", "bert"} <= set(TARGETS)


def test_importing_a_generated_file_loads_no_compiler_machinery():
    # transformers itself imports jinja2 (chat templates), so compare against a plain transformers import.
    probe = (
        "import sys, transformers, transformers.models.llama.modeling_llama, transformers.models.qwen2.modeling_qwen2\n"
        "before = set(sys.modules)\n"
        "import generated.fused_llama, generated.fused_qwen2\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    new = set(result.stdout.split())
    assert not {name for name in new if name.partition(".")[0] in ("black", "jinja2", "blib2to3")}
    assert {name for name in new if name.startswith("fusegen")} <= {
        "fusegen",
        "fusegen.runtime",
        "fusegen.runtime.auto",
        "fusegen.runtime.checkpoint",
        "fusegen.runtime.claims",  # imports nothing: `class_is_honest`, the test a guarded merged call makes
        "fusegen.runtime.linear",
        "fusegen.runtime.files",
        "fusegen.runtime.loading",
        "fusegen.runtime.merged",
        "fusegen.runtime.plan",
        "fusegen.runtime.renames",  # Transformers' key renames for load_checkpoint; imports nothing at load time
        "fusegen.runtime.pretrained",
        "fusegen.runtime.saving",
        "fusegen.runtime.strict",
        "fusegen.runtime.peft",  # imports PEFT only inside its functions, see tests/test_ecosystem.py
        "fusegen.runtime.quant",  # torch only: quantizer support, imported by checkpoint.py
        "fusegen.runtime.registry",  # which conversions a model registers; register_stacked_checkpoint
        "fusegen.runtime.version",  # stdlib only: the source check at the top of every generated file
        "fusegen.runtime.streaming",
        "fusegen.runtime.layout",  # torch only: the merged linears' row layout
        "fusegen.runtime.quantized",  # torch only: quantized merged linears, built split and composed after loading
        "fusegen.runtime.format_composers",  # torch only at import: compressed-tensors/FP8 composers register here
    }


@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_stacked_mapping_is_data(target):
    module = __import__(f"generated.fused_{target}", fromlist=["STACKED_PARAMS_MAPPING"])
    assert module.STACKED_PARAMS_MAPPING == {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    assert module.packed_modules_mapping == {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }


@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_the_common_path_makes_no_piece_copies(target):
    """llama and qwen2 write no piece in place, store none and view none across rows: their fused forward splits
    the merged output and nothing more (the copies of issue 24 stay off the common path; bench/piece_copies.py)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from piece_copies import piece_copies
    finally:
        sys.path.remove(str(ROOT / "bench"))
    text = (GENERATED / f"fused_{target}.py").read_text()
    assert ".split(" in text, "no merged split found: the check would see nothing"
    assert piece_copies(text) == []
    assert piece_copies("a, b = self.qkv(x).split(s, dim=-1)\nb = b.clone()\n") == ["b = b.clone()"]
