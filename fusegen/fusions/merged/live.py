"""Live checks: what the instantiated module's children are, judged on the objects, never on the source text.

A projection must be exactly a hook-free, unparametrized `nn.Linear` (`projection_findings`): the merged linear
reproduces `F.linear(x, W, b)` for each piece and nothing else. A child module the forward calls between the
projections is trusted not to write its input only if it and everything inside it is a torch or Transformers
activation class without hooks or in-place configuration (`pure_module`).
"""

from __future__ import annotations

from torch import nn

from fusegen.core.plan import Refused
from fusegen.fusions.merged.rules import claims_unless_refused


def plain_linear(child: object) -> bool:
    """An exact, hook-free `nn.Linear` without an instance-level `forward`: its output is new storage."""
    if type(child) is not nn.Linear or module_hooks(child) or global_hooks():
        return False
    return "forward" not in vars(child) and "__call__" not in vars(child)


def pure_module(child: object) -> bool:
    """Is `child` a module that never writes its input?

    Judged on the instantiated module and every module inside it (an
    `nn.Sequential` holds whatever it was given): only classes of torch and
    of Transformers' activation library are trusted, never when configured
    to work in place, and never with a hook, which runs arbitrary code.
    """
    if not isinstance(child, nn.Module) or global_hooks():
        return False
    for inner in child.modules():
        origin = type(inner).__module__
        if getattr(inner, "inplace", False) or module_hooks(inner):
            return False
        if not (origin.startswith("torch.nn.modules") or origin == "transformers.activations"):
            return False
        if "forward" in vars(inner):
            return False  # an instance attribute replaces the class's forward
    return True


_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


def module_hooks(module: nn.Module) -> list[str]:
    """The names of the hook tables of `module` that are not empty."""
    return [name for name in _HOOK_DICTS if getattr(module, name, None)]


def global_hooks() -> list[str]:
    """The names of `torch.nn.modules.module`'s global hook tables that run in a call and are not empty.

    Registration hooks (`_global_module_registration_hooks`, ...) run when `__init__` assigns a submodule,
    parameter or buffer, never inside a forward or backward, so they cannot change what a projection reads or
    returns; what they build is judged on the instantiated model like anything else (`fusegen.runtime.quant`
    registers one to carry `output_sizes` onto a quantizer's replacement module).
    """
    from torch.nn.modules import module as module_module

    tables = [
        name
        for name in dir(module_module)
        if name.startswith("_global_") and name.endswith("hooks") and "registration" not in name
    ]
    return [name for name in tables if getattr(module_module, name)]


def projection_findings(module: nn.Module, names: tuple[str, ...]):
    """Refuse unless every projection is exactly what the rewrite assumes: a plain `nn.Linear`.

    The merged linear reproduces `F.linear(x, W, b)` for each piece and
    nothing else, so a subclass (its own `forward`, or any behaviour its
    class adds), a hook, a parametrization (the weight is computed on each
    access), an instance-level `forward`, or pieces of different dtype or
    device (one concatenated weight has one of each) would all change what
    runs. Every subclass is refused, with or without its own `forward`: a
    subclass may change `__call__`, `_conv_forward`-like helpers or the
    weight's meaning, and a false alarm costs only a fusion.
    """
    from torch.nn.utils import parametrize

    hooks = global_hooks()
    if hooks:
        yield Refused("global-hook", f"a global module hook is registered ({', '.join(hooks)})")
    pieces = []
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module) and parametrize.is_parametrized(child):
            yield Refused("parametrized-projection", f"{name} is parametrized: its weight is computed on access")
        elif isinstance(child, nn.Linear) and type(child) is not nn.Linear:
            yield Refused("linear-subclass", f"{name} is a {type(child).__qualname__}, not exactly nn.Linear")
        if not isinstance(child, nn.Linear):
            yield Refused("linear-subclass", f"{name} is a {type(child).__qualname__}, not an nn.Linear")
            continue
        if module_hooks(child):
            yield Refused("projection-hook", f"{name} has hooks ({', '.join(module_hooks(child))})")
        if "forward" in vars(child) or "__call__" in vars(child):
            yield Refused("projection-hook", f"{name} has an instance-level forward")
        pieces.append((name, child))
    for attribute, rule in (("dtype", "dtype-mismatch"), ("device", "device-mismatch")):
        values = {
            getattr(tensor, attribute)
            for _, child in pieces
            for tensor in (child.weight, child.bias)
            if tensor is not None
        }
        if len(values) > 1:
            spelled = ", ".join(f"{name}: {getattr(child.weight, attribute)}" for name, child in pieces)
            yield Refused(rule, f"the projections differ in {attribute} ({spelled})")


def check_projections(module: nn.Module, names: tuple[str, ...]) -> None:
    """Raise the first `projection_findings` refusal for the projections `names` of `module`."""
    claims_unless_refused(projection_findings(module, names))
