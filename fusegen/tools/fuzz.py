"""Differential fuzzing of the fusion analysis: random forwards, built and run against the original.

    python -m fusegen.tools.fuzz --examples 1000 [--seed 0]     (or: python bench/fuzz.py ...)

Each example is a toy block (`fusegen.testkit.toy_source`, the hazard tests' module) whose forward interleaves its q/k/v
projection calls with statements drawn from hazard families (views written in place, rebinding,
computed callees, augmented assignment on aliases, reflection, in-place `operator` functions and
dunders, closures, escapes, frame access) and from safe ones (metadata, pure torch calls, read-only
`detach`), under a setup drawn from hooks, subclassed and parametrized projections. It is compiled
with `fusegen.compiler.build.build`; when anything is fused, the original and the fused `ToyLayer` run on one
input with the same weights (drawn by `fusegen.testkit.randomise`, copied in memory, merged pieces concatenated, no checkpoint files) and
must agree. Prints the examples, how many fused, the refusals by rule, the miscompiles (must be 0)
and the seconds taken; outputs must agree within `fusegen.testkit.TOLERANCE` (or 1e-6 relative). tests/test_properties.py drives the same generator through Hypothesis, and
tests/test_fuzz.py runs this loop on 200 examples.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from fusegen.compiler.build import build
from fusegen.errors import EXIT_DRIFT, EXIT_OK
from fusegen.testkit import TOLERANCE, TOY_HELPERS, TOY_NARROW_LOOP, randomise, toy_source
from fusegen.tools.oracle import forget

CALLS = ("q = self.q_proj(x)", "k = self.k_proj(x)", "v = self.v_proj(x)")
PRELUDE = (
    "h = x * 1", "a = x * 1", "b = x * 1", "y = x * 1", "d = x * 1", "n = 0", "op = y.mul", "fns = [y.add]",
    "obj = Box(y)", "g = iter(())", "def bump():\n    return None",
)  # fmt: skip
RETURN = (
    "return q + torch.cat([k, v], dim=-1) + h.sum() + a.sum() + b.sum() + x.sum() + y.sum() + d.sum() + n"
    " + self.saved.sum()"
)
INIT = (
    "        self.act = nn.Tanh()\n        self.register_buffer('saved', torch.zeros(16))\n"
    "        self.register_buffer('state', torch.ones(2, 5, 16))\n        self.mirror = torch.zeros(2, 5, 16)\n"
)

FAMILIES = {
    "views": ["h = x.view(-1)", "h = x[:, 1:]", "h = x.transpose(1, 2)", "a, b = x.chunk(2, dim=-1)", "h = a",
              "d = x.detach()", "y = x"],
    "writes": ["h.add_(1)", "a.mul_(3)", "x.mul_(2)", "x[0] = 0", "torch.relu_(x)", "torch.add(h, 1, out=h)",
               "d.add_(1)"],
    "rebind": ["x = x + 1", "x, y = y, x"],
    "safe": ["y = torch.sigmoid(x)", "n = x.shape[-1] + x.size(0)", "h = self.act(x)", "h = self.act(h)",
             "n = d.sum()", "h = h * 2", "n = len(x)", "y = operator.add(x, 1)", "n = getattr(x, 'shape')[0]",
             "d = x.detach()", "n = d.mean()", "y = x.__getitem__(slice(None))", "y = torch.cat([x, x], -1)[..., :16]"],
    "callee": ["op = x.mul_", "op = x.mul", "op(2.0)", "(x.mul_ if n >= 0 else x.mul)(2.0)",
               "getattr(x, 'mul_')(2.0)", "fns = [x.add_]", "fns[0](1.0)",
               "y = (torch.sigmoid if n >= 0 else torch.tanh)(x)"],
    "augassign": ["h *= 2", "a += 1", "d += 1", "y -= 1", "n += 1"],
    "reflection": ["eval('x.mul_(2)')", "exec('x.add_(1)')", "locals()['x'].add_(1)", "n = len(vars())"],
    "operator": ["operator.iadd(x, 1)", "x.__imul__(2)", "operator.setitem(x, 0, 0.0)", "h.__iadd__(1)"],
    "deferred": ["def bump():\n    x.add_(1)", "bump()", "g = (t.mul_(2) for t in [x])", "next(g, None)"],
    "escape": ["self.saved = x[0, 0]", "self.saved.mul_(2)", "obj = Box(x)", "obj.view()", "poke()"],
    "state": ["self.reset_state()", "n = self.state.sum()"],
}  # fmt: skip
"""Statements by family; any of them may land before, between or after the projection calls."""

REGISTRY_HELPER = "REGISTRY = []\n\n\ndef bump_registered():\n    if REGISTRY:\n        REGISTRY[-1].add_(1.0)\n"
"""Module-level lines of every case: a registry a caller-side hook may fill (setup `registry`), and a helper that
writes what it holds without being handed anything."""

SETUPS = {
    "none": ("", ""),
    "forward_hook": ("", TOY_NARROW_LOOP + "                module.register_forward_hook(lambda m, i, o: o * 2)"),
    "pre_hook": ("", TOY_NARROW_LOOP + "                module.register_forward_pre_hook(lambda m, i: (i[0] * 2,))"),
    "unrelated_hook": ("", "        self.block.act.register_forward_hook(lambda m, i, o: o * 2)"),
    "global_hook": (
        (
            "_HOOKS = [torch.nn.modules.module.register_module_forward_hook("
            "lambda m, i, o: o * 2 if type(m) is nn.Linear else None)]"
        ),
        "",
    ),
    "subclass": ("", "        self.block.k_proj = Scaled(16, 8, bias=False)"),
    "class_swap": ("", TOY_NARROW_LOOP + "                module.__class__ = Scaled"),
    "block_state_input": ("", "        self.block.register_forward_pre_hook(lambda m, args: (m.state,))"),
    "registry": ("", "        self.block.register_forward_pre_hook(lambda m, args: REGISTRY.append(args[0]))"),
    "mirror_input": (
        "",
        "        self.block.register_forward_pre_hook(lambda m, args: setattr(m, 'mirror', args[0]))",
    ),
    "parametrized": (
        "",
        TOY_NARROW_LOOP
        + "                torch.nn.utils.parametrize.register_parametrization(module, 'weight', Double())",
    ),
}
"""Module-level and `ToyLayer.__init__` lines: hooks, a subclassed or parametrized projection."""

SETUP_CHOICES = ["none"] * 6 + sorted(set(SETUPS) - {"none"})
"""(`registry` and `mirror_input` hand the block's input to the caller-side aliases `bump_registered()` and
`self.mirror` reach; without them those read a registry or buffer of their own.)"""
STATEMENTS = [statement for family in FAMILIES.values() for statement in family]


@dataclass(frozen=True)
class Case:
    body: tuple[str, ...]
    setup: str = "none"
    init: str = INIT

    def forward(self) -> str:
        lines = [*PRELUDE, *self.body, RETURN]
        return "\n".join("        " + line for statement in lines for line in statement.split("\n"))

    def describe(self) -> str:
        return f"setup={self.setup}\n{self.forward()}"


def draw_case(choose, integer) -> Case:
    """A random case from `choose(options)` and `integer(low, high)` (Hypothesis or `random`)."""
    statements = [choose(STATEMENTS) for _ in range(integer(0, 6))]
    calls = list(CALLS)
    for index in range(len(calls) - 1, 0, -1):  # a permutation, drawn the same way by either driver
        other = integer(0, index)
        calls[index], calls[other] = calls[other], calls[index]
    for call in calls:
        statements.insert(integer(0, len(statements)), call)
    return Case(tuple(statements), choose(SETUP_CHOICES))


@dataclass
class Result:
    fused: bool
    rules: tuple[str, ...] = ()
    miscompile: str | None = None
    invalid: str | None = None


@dataclass
class Figures:
    examples: int = 0
    fused: int = 0
    invalid: int = 0
    refusals: Counter = field(default_factory=Counter)
    miscompiles: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, case: Case, result: Result) -> None:
        self.examples += 1
        self.fused += result.fused
        self.invalid += result.invalid is not None
        self.refusals.update(set(result.rules))
        if result.miscompile:
            self.miscompiles.append(f"{result.miscompile}\n{case.describe()}")

    @property
    def fused_share(self) -> float:
        return self.fused / max(self.examples, 1)

    def report(self) -> str:
        lines = [
            f"examples: {self.examples}",
            f"fused: {self.fused} ({self.fused_share:.1%})",
            f"refused (no fusion in ToyBlock): {self.examples - self.fused}",
            f"invalid (the original itself raises): {self.invalid}",
            "refusals by rule (examples where the rule fired):",
            *(f"  {rule}: {count}" for rule, count in sorted(self.refusals.items(), key=lambda item: -item[1])),
            f"miscompiles: {len(self.miscompiles)}",
            f"seconds: {self.seconds:.1f}",
        ]
        return "\n".join(lines)


class Harness:
    """Writes cases as modules under `workdir`, builds them and compares fused with original."""

    def __init__(self, workdir: Path, package: str = "fuzz_cases"):
        self.package = package
        self.workdir = str(workdir)
        self.root = Path(workdir) / package
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "__init__.py").touch()
        sys.path.insert(0, self.workdir)
        self.counter = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        sys.path.remove(self.workdir)

    def check(self, case: Case) -> Result:
        self.counter += 1
        name = f"case_{self.counter}"
        (self.root / f"{name}.py").write_text(
            toy_source(
                name,
                case.init,
                case.forward(),
                TOY_HELPERS + "\n" + REGISTRY_HELPER + "\n" + SETUPS[case.setup][0],
                SETUPS[case.setup][1],
            )
        )
        try:
            return self._check(name)
        finally:
            forget(self.package)

    def _check(self, name: str) -> Result:
        dotted = f"{self.package}.{name}"
        result = build(dotted, validate=False)  # the analysis alone: validation would hide its misses
        (block,) = [outcome for outcome in result.outcomes if outcome.class_name == "ToyBlock"]
        rules = tuple(refusal.rule for refusal in block.refused)
        if result.text is None or not block.fused:
            return Result(False, rules)
        (self.root / f"fused_{name}.py").write_text(result.text)
        original_module = importlib.import_module(dotted)
        fused_module = importlib.import_module(f"{self.package}.fused_{name}")
        return compare_layers(original_module, fused_module, block.fused, rules)


def compare_layers(original_module, fused_module, plans, rules) -> Result:
    """Run `ToyLayer` and `FusedToyLayer` with the same weights on the same input; they must agree."""
    config = original_module.ToyConfig()
    torch.manual_seed(0)
    try:
        original = original_module.ToyLayer(config).eval()
    except Exception as exc:  # noqa: BLE001 - the case's own setup code
        return Result(True, rules, invalid=f"original does not build: {exc!r}")
    randomise(original)
    try:
        fused = fused_module.FusedToyLayer(config).eval()
        fused.load_state_dict(fused_state(original, fused, plans))
    except Exception as exc:  # noqa: BLE001 - a fused class that does not build where the original does
        return Result(True, rules, miscompile=f"fused does not build: {exc!r}")
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        try:
            expected = original(x.clone())
        except Exception as exc:  # noqa: BLE001 - generated forwards may raise on their own
            return Result(True, rules, invalid=f"original raises: {exc!r}")
        try:
            actual = fused(x.clone())
        except Exception as exc:  # noqa: BLE001
            return Result(True, rules, miscompile=f"fused raises where the original does not: {exc!r}")
    if expected.shape != actual.shape or not torch.allclose(
        expected, actual, atol=TOLERANCE, rtol=1e-6, equal_nan=True
    ):
        difference = (expected - actual).abs().nan_to_num().max().item() if expected.shape == actual.shape else "shape"
        return Result(True, rules, miscompile=f"fused output differs (max |diff| {difference})")
    return Result(True, rules)


def fused_state(original: torch.nn.Module, fused: torch.nn.Module, plans) -> dict[str, torch.Tensor]:
    """The fused layer's state: the original's tensors, with each merged one concatenated from its pieces.

    A parametrized piece contributes its stored (unparametrized) tensor, as a checkpoint would.
    """
    source = {
        key.replace(".parametrizations.", ".").replace(".original", ""): value
        for key, value in original.state_dict().items()
    }
    merged = {plan.merged: plan.projections for plan in plans}
    state = {}
    for key in fused.state_dict():
        if key in source:
            state[key] = source[key]
            continue
        prefix, attribute, parameter = key.rsplit(".", 2)
        pieces = merged[attribute]
        state[key] = torch.cat([source[f"{prefix}.{piece}.{parameter}"] for piece in pieces], dim=0)
    return state


def run(examples: int, seed: int = 0, workdir: Path | None = None) -> Figures:
    """Draw `examples` cases with `random.Random(seed)` and check each; returns the figures."""
    rng = random.Random(seed)
    figures = Figures()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, Harness(Path(workdir or scratch)) as harness:
        for _ in range(examples):
            case = draw_case(rng.choice, rng.randint)
            figures.add(case, harness.check(case))
    figures.seconds = time.perf_counter() - start
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    figures = run(args.examples, args.seed)
    print(figures.report())
    for miscompile in figures.miscompiles[:5]:
        print("\nMISCOMPILE:", miscompile)
    return EXIT_DRIFT if figures.miscompiles else EXIT_OK  # 1: something computes other numbers (fusegen.errors)


if __name__ == "__main__":
    sys.exit(main())
