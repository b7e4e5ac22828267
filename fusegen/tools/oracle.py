"""The differential oracle for toy cases: build one, run the fused causal LM against the original in every mode.

A case (`Toy`) is a toy block's forward (`fusegen.testkit.toy_source`) with the extras issue 24's families need: a
signature with more parameters than `x`, class-level members (properties), `ToyLayer.__init__` lines (hooks that
hand the block aliases of its input) and the module-level helpers of `HELPERS` (modes, a registry, a closure cell,
a helper handed `self`). `verdict` builds it (`fusegen.compiler.build.build`, validation off or on) and, when the
block is fused, runs both models with the same weights under each value of the forward-only `flag`, in eval and
train mode (logits and every gradient), with and without bf16 autocast. It judges by running, never by the build's
own validation: a fused model that raises where the original runs, or computes other logits or gradients, is
reported, whatever the analysis or the validation said. tests/test_hazards.py (third batch) and the family fuzzer
(`fusegen.tools.fuzz_families`) both judge with it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fusegen.compiler.build import build
from fusegen.testkit import TOY_HELPERS, randomise, toy_source

HELPERS = '''
import contextlib
import ctypes

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

REGISTRY = []


class Doubling(TorchFunctionMode):
    """Doubles what `F.linear` returns while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


class Rounding(TorchDispatchMode):
    """Rounds every floating result to bf16 precision while it is active."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out.to(torch.bfloat16).to(out.dtype)
        return out


def keep(t):
    return t


def halve(t):
    return t * 0.5


def double_plain_linears(module, args, output):
    return output * 2 if type(module) is nn.Linear else None


def bump_registered():
    REGISTRY[-1].add_(1.0)


def _cell():
    held = []

    def put(t):
        held[:] = [t]

    def scale():
        held[0].mul_(3.0)

    return put, scale


put_in_cell, scale_cell = _cell()


def clear_at(address):
    """Zero 16 bytes at `address` (not on the meta tensors or proxies the build traces with: no address there)."""
    if type(address) is int and address:
        ctypes.memset(address, 0, 16)


def peek(block):
    return block.v_proj.weight.sum()


def block_width(block):
    return block.hidden_size / 16
'''
"""Module-level helpers of every `Toy` case, besides `fusegen.testkit.TOY_HELPERS`: a torch function mode and a
dispatch mode that change numbers, saved-tensor hook functions, a registry and a closure cell a caller-side hook
may fill, a helper that writes through an address, helpers handed the block (`peek` names a projection,
`block_width` does not)."""


FOURTH_HELPERS = '''
import collections
import dataclasses
import functools

_SAVED = []
LAST = [None]
SLOTS = [None]
watch_linears = torch.nn.modules.module.register_module_forward_hook
KV = collections.namedtuple("KV", "k v")


@dataclasses.dataclass
class Out:
    total: torch.Tensor
    k: torch.Tensor


def _flip():
    """Switch grad mode off the first time, back to what it was the second (and so on)."""
    if _SAVED:
        torch.set_grad_enabled(_SAVED.pop())
    else:
        _SAVED.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)


class Toggle:
    """Every special method flips grad mode (`_flip`)."""

    def __bool__(self):
        _flip()
        return True

    def __len__(self):
        _flip()
        return 1

    def __format__(self, spec):
        _flip()
        return "t"

    def __eq__(self, other):
        _flip()
        return False

    __hash__ = object.__hash__

    @property
    def state(self):
        _flip()
        return 0


class Sly:
    """Holds a tensor; every special method doubles it in place."""

    def __init__(self, t):
        self.t = t

    def _bump(self):
        self.t.mul_(2.0)

    def __len__(self):
        self._bump()
        return 1

    def __bool__(self):
        self._bump()
        return True

    def __add__(self, other):
        self._bump()
        return other

    def __getitem__(self, i):
        self._bump()
        return 0

    def __iter__(self):
        self._bump()
        return iter(())

    def __contains__(self, item):
        self._bump()
        return False

    def __format__(self, spec):
        self._bump()
        return "s"

    @property
    def held(self):
        self._bump()
        return 0


def flip_on_decoration(thing):
    _flip()
    return thing


def grad_off_then_back():
    """A generator: its first step switches grad mode off, its second switches it back."""
    was = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    yield 1
    torch.set_grad_enabled(was)
    yield 2


def doubling_steps(t):
    """A generator: each step doubles `t` in place."""
    while True:
        t.mul_(2.0)
        yield t


def hushed():
    """Looks like `contextlib.nullcontext`, is `no_grad`."""
    return torch.no_grad()


def watch_all():
    return watch_linears(double_plain_linears)


class EightRows(torch.Tensor):
    """A tensor subclass whose `F.linear` doubles the output of any weight with 8 rows (the toy's k and v)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is F.linear and args[1].shape[0] == 8:
            return out * 2
        return out
'''
"""Module-level code of the fourth hazard batch (`Toy.extra`; tests/test_hazards.py, tests/test_mutation.py): a
`Toggle` whose special methods flip grad mode and a `Sly` whose special methods write what it holds, a decorator and
generators that switch state when applied or advanced, torch's global-hook registration under another name, a tensor
subclass whose `F.linear` depends on the weight's rows, and records (a namedtuple, a dataclass) and global slots that
carry a piece out of forward."""


@dataclass(frozen=True)
class Toy:
    """One case: the block's forward `body` lines and `ret`; `signature` replaces `x` in `forward(self, x)`;
    `members` are class-level lines of the block (properties); `init`, `layer` as for `toy_source`; `extra` is
    module-level source of the case's own, after `HELPERS`."""

    body: tuple[str, ...]
    init: str = ""
    layer: str = ""
    signature: str = "x"
    members: str = ""
    ret: str = "return q + torch.cat([k, v], dim=-1)"
    extra: str = ""

    def forward(self) -> str:
        return "".join(
            "        " + line + "\n" for statement in (*self.body, self.ret) for line in statement.split("\n")
        )

    def describe(self) -> str:
        parts = [f"signature: ({self.signature})", *(f"{key}:\n{value}" for key, value in self.extras() if value)]
        return "\n".join([*parts, "forward:", self.forward()])

    def extras(self):
        return (("init", self.init), ("layer", self.layer), ("members", self.members), ("extra", self.extra))


def write_toy(root: Path, package: str, name: str, toy: Toy) -> str:
    """Write `toy` as module `<package>.<name>` under `root` (which must be on `sys.path`); returns its dotted name."""
    source = toy_source(name, toy.init, toy.forward(), TOY_HELPERS + HELPERS + toy.extra, toy.layer)
    head, tail = source.split("class ToyBlock(nn.Module):", 1)
    tail = tail.replace("    def forward(self, x):\n", f"{toy.members}\n    def forward(self, {toy.signature}):\n", 1)
    directory = Path(root) / package
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "__init__.py").touch()
    (directory / f"{name}.py").write_text(head + "class ToyBlock(nn.Module):" + tail)
    return f"{package}.{name}"


@contextlib.contextmanager
def importable(root: Path):
    """`root` first on `sys.path` inside the block, so the cases written under it import; removed on exit."""
    sys.path.insert(0, str(root))
    try:
        yield Path(root)
    finally:
        sys.path.remove(str(root))


def forget(package: str) -> None:
    """Drop `package`'s modules from `sys.modules` and remove the global module hooks they left registered (a case's
    `_HOOKS`, and any a fused forward that raised half-way left behind), so no case outlives its check."""
    for name in [m for m in sys.modules if m.split(".")[0] == package]:
        for handle in getattr(sys.modules[name], "_HOOKS", []):
            handle.remove()
        del sys.modules[name]


@contextlib.contextmanager
def global_hooks_restored():
    """Whatever global module forward hooks the code inside registers and leaves registered are removed on exit (a
    fused forward that raised between `register_module_forward_hook` and `handle.remove()`). torch keeps them in
    `torch.nn.modules.module._global_forward_hooks`, which the live checks read too."""
    hooks = torch.nn.modules.module._global_forward_hooks
    before = set(hooks)
    try:
        yield
    finally:
        for key in set(hooks) - before:
            del hooks[key]


def verdict(dotted: str, fused_name: str, validate: bool) -> str:
    """`refused`, `sound`, `invalid: ...` (the original runs in no mode), or what went wrong when the fused model ran
    (`miscompile: ...`, `crash: ...`). The fused module is written beside `dotted`, as module `fused_name`."""
    return judge(dotted, fused_name, validate)[0]


def judge(dotted: str, fused_name: str, validate: bool) -> tuple[str, tuple[str, ...]]:
    """`verdict`'s answer, and the rule ids of the block's refusals (a fused block may have some: a sibling group)."""
    result = build(dotted, validate=validate)
    (block,) = [o for o in result.outcomes if o.class_name == "ToyBlock"]
    rules = tuple(sorted({refusal.rule for refusal in block.refused}))
    if result.text is None or not block.fused:
        return "refused", rules
    return run_both(dotted, fused_name, result.text, block.fused), rules


def run_both(dotted: str, fused_name: str, text: str, plans) -> str:
    """Write the fused module `text` beside `dotted` as `fused_name`, run both in every mode (`verdict`)."""
    package = dotted.rsplit(".", 1)[0]
    original_module = importlib.import_module(dotted)
    (Path(original_module.__file__).parent / f"{fused_name}.py").write_text(text)
    fused_module = importlib.import_module(f"{package}.{fused_name}")
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    toy_text = inspect.getsource(original_module.ToyBlock)
    ran = False
    for flag, train, autocast in itertools.product((True, False), (False, True), (False, True)):
        where = f"flag={flag} train={train} autocast={autocast}"
        config = original_module.ToyConfig(flag=flag)
        torch.manual_seed(0)
        original = randomise(original_module.ToyForCausalLM(config))
        fused = fused_module.FusedToyForCausalLM(config)
        fused.load_state_dict(fused_weights(original, fused, plans))
        try:
            with global_hooks_restored():
                expected, expected_grads = run_step(original, ids, train, autocast)
        except Exception:  # noqa: BLE001, S112 - the original cannot run this step: nothing to hold the fused to
            continue
        ran = True
        try:
            with global_hooks_restored():
                actual, actual_grads = run_step(fused, ids, train, autocast)
        except Exception as error:  # noqa: BLE001
            return f"crash ({where}): {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        scale = max(1.0, expected.abs().max().item())
        # Under autocast a merged GEMM's backward sums the pieces' bf16 products in one GEMM where the original
        # adds three bf16-rounded ones: gradients differ at bf16's resolution (2**-8), logits not at all.
        grad_tolerance = 3e-2 if autocast or "autocast" in toy_text else 1e-4
        if expected.shape != actual.shape or not torch.allclose(
            expected, actual, atol=1e-5 * scale, rtol=0, equal_nan=True
        ):
            difference = (expected - actual).abs().max().item() if expected.shape == actual.shape else "shape"
            return f"miscompile ({where}): logits differ by {difference:.3g}"
        for key, grad in actual_grads.items():
            reference = mapped_grad(key, expected_grads, plans)
            if not torch.allclose(
                reference, grad, atol=grad_tolerance * max(1.0, reference.abs().max().item()), rtol=0, equal_nan=True
            ):
                return f"miscompile ({where}): the gradient of {key} differs"
    return "sound" if ran else "invalid: the original runs in no mode"


def fused_weights(original, fused, plans) -> dict:
    """The fused model's state from the original's: merged tensors concatenated from their pieces in plan order."""
    source = original.state_dict()
    merged = {plan.merged: plan.projections for plan in plans}
    state = {}
    for key in fused.state_dict():
        if key in source:
            state[key] = source[key]
            continue
        prefix, attribute, parameter = key.rsplit(".", 2)
        state[key] = torch.cat([source[f"{prefix}.{piece}.{parameter}"] for piece in merged[attribute]], dim=0)
    return state


def run_step(model, ids, train: bool, autocast: bool):
    """Logits (and every gradient, in train mode) of one step."""
    model.train(train)
    model.zero_grad(set_to_none=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context, torch.set_grad_enabled(train):
        logits = model(ids).logits.float()
    if not train:
        return logits, {}
    logits.mul(torch.linspace(-1, 1, logits.numel()).view(logits.shape)).sum().backward()
    return logits.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}


def mapped_grad(key: str, grads: dict, plans) -> torch.Tensor:
    """The original's gradient for fused parameter `key` (pieces concatenated; a missing gradient is zero)."""
    if key in grads:
        return grads[key]
    prefix, attribute, parameter = key.rsplit(".", 2)
    pieces = next(plan.projections for plan in plans if plan.merged == attribute)
    return torch.cat([grads[f"{prefix}.{piece}.{parameter}"] for piece in pieces], dim=0)
