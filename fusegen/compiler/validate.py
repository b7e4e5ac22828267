"""Stage 8: translation validation. Before a generated file is written, run it against its original.

The analysis argues that each fusion is sound; this stage checks the result by executing it. The generated text is
imported in memory, and its fused causal LM is compared with the original causal LM:

- on a tiny config (`fusegen/compiler/shrink.py`) and on up to `MAX_VARIANTS` *construction variants* of it: configs with
  one field changed that change what `__init__` builds (found generically by `construction_variants`);
- with every parameter of the original randomised (biases and norms too, so a mis-sliced bias shows) and mapped
  into the fused model in memory through the file's own `STACKED_PARAMS_MAPPING` (pieces concatenated in row order),
  so a wrong row order or a wrong piece shows as a mismatch rather than hiding behind the runtime's loader;
- in eval mode (logits) and in train mode (logits, and every parameter's gradient: a merged weight's gradient must
  equal its pieces' gradients concatenated), with dropout seeded identically (and, on request, once more with
  gradient checkpointing: `validate(..., checkpointing=True)`; the build leaves it to tests/test_training.py);
  variants get one train step;
- in fp64 where the original runs in fp64, else in fp32 (see `_compare_in`), on random token ids (2 x 12); the tiny
  config also in fp32 (eval) and under bf16 autocast (a train step: logits and gradients), since CPU autocast leaves
  fp64 alone (`NUMERICS`);
- on up to `MAX_FORWARD_VARIANTS` *forward-only variants*: a boolean or optional field that changes no module but a
  value `forward` reads (`forward_variants`), each with one train step like a variant and with the tiny config's
  fp32 numerics (`NUMERICS`: a flag can guard an autocast region). fp32 gradients alone are too coarse to hold to
  `GRAD_TOLERANCE`: rounding, amplified by a model's norms, reached 2.2e-4 of the largest gradient on dory in fp32,
  0.0 in fp64.

Logits must agree within `TOLERANCE` and gradients within `GRAD_TOLERANCE`; anything else (a difference, a fused
model that fails where the original runs, a tensor that maps nowhere) is a `validation-mismatch` with the figure.
A config the ORIGINAL cannot build or run is skipped and recorded, never counted as a pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import math
import random
import re
import sys
import types
import typing
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fusegen.compiler.inputs import SEED, model_config, random_input, random_model
from fusegen.compiler.modal_inputs import forward_inputs, image_features
from fusegen.compiler.propagate import PREFIX
from fusegen.compiler.shrink import ShrinkError, rule_for, shrunk_config
from fusegen.errors import first_line as _first_line
from fusegen.errors import short_error as _short

TOLERANCE = 1e-5
"""Max |logit difference| (fp32, logits of order 1), the one tolerance the build, the tests, coverage and the benches
share. Validation holds logits to it times their scale when that exceeds 1, since rounding is relative.

A merged GEMM computes each output element from the same products as its pieces, only blocked differently by the
BLAS kernel, so fp32 results differ by a few ulps of the partial sums; after a few tiny layers that is ~1e-7..1e-6 on
logits of size ~1. 1e-5 leaves headroom for that and is far below any real miscompile (a swapped or mis-sliced
piece moves logits by 1e-1 and more). Validation itself runs in fp64 where the model allows, where the same
reorderings show at ~1e-16, so its verdicts do not depend on how well a random model is conditioned."""


def logits_tolerance(expected: torch.Tensor) -> float:
    """THE bound on max |logit difference| against the original's logits `expected`: `TOLERANCE` times their scale
    (max |logit|), at least `TOLERANCE`. The build's validation, the tests and the benches all hold figures to it.

    Why scaled: a fused GEMM and its pieces (or PEFT's block-diagonal LoRA on a merged linear and its per-piece LoRAs)
    sum the same fp32 products in a different order, and each reordered sum is off by a few units of its last place
    (unit roundoff 2**-24, 6e-8) relative to its own magnitude. Norms, softmax and the residual stream carry those
    relative errors through the layers, so the logits end up off by a roughly constant fraction of their own size,
    up to ~3e-6 of the largest logit on the tiny random models (qwen2 with an adapter on all seven linears: 1.25e-5
    at max |logit| 4.4, 2.9e-6 of the scale; the same models and adapter in float64 differ by exactly 0, so this is
    fp32 rounding and nothing else). An absolute 1e-5 fits logits of order 1 and is exceeded by that rounding at
    logits of 4.4; 1e-5 of the scale leaves over 3x the largest reordering noise seen, at every scale, and stays four
    orders of magnitude below what a real fault does (a swapped, mis-sliced or dropped piece moves logits by 1e-1 of
    their scale and more). Below a scale of 1 the bound stays 1e-5: the hidden activations are still of order 1
    (norms rescale them), and their rounding, not the logits' size, sets the noise there.
    """
    return TOLERANCE * max(1.0, expected.detach().abs().max().item())


GRAD_TOLERANCE = 1e-4
"""Max |gradient difference| of a parameter, relative to the largest |gradient| (fp32). Validation measures it
against the largest gradient of the whole model (see `_grad_diff`); the training tests, stricter, against each
tensor's own largest.

Backward adds one more source of reordering that forward does not have: the input gradient of a merged linear is one
GEMM over all pieces' rows (`dY_merged @ W_merged`), where the original sums the pieces' GEMMs (`dY_q @ W_q + ...`)
in autograd's order. Each is a sum of the same ~hidden-size products, rounded at fp32 (eps 1.2e-7) in a different
order, then propagated back through the layers: relative differences of ~1e-6, bounded well below 1e-4 at the tiny
configs' widths. A mis-mapped weight gradient differs by O(1) relative."""

MAX_VARIANTS = 3
"""At most this many construction variants per target besides the tiny config, to keep the build fast."""
MAX_PROBES = 20
"""At most this many candidate fields (and tied embeddings) are built to see whether they change the model."""
RULE = "validation-mismatch"


@dataclass
class Check:
    """One config's outcome."""

    config: str
    """`tiny` or the variant, `attention_bias=True`."""
    status: str
    """`passed`, `mismatch` or `skipped` (the original itself cannot build or run this config)."""
    detail: str = ""
    logits_diff: float | None = None
    grad_diff: float | None = None
    """Largest gradient difference relative to its parameter's largest |gradient|."""


@dataclass
class Validation:
    checks: list[Check] = field(default_factory=list)

    @property
    def mismatch(self) -> Check | None:
        return next((check for check in self.checks if check.status == "mismatch"), None)

    def describe(self) -> str:
        return "; ".join(f"{c.config}: {c.status}{f' ({c.detail})' if c.detail else ''}" for c in self.checks)


class _Mismatch(Exception):
    """The fused model disagrees with, or fails where, the original runs."""


class _Skip(Exception):
    """The original itself cannot be built or run under this config."""


# --- entry point -----------------------------------------------------------------------------------------------------


def validate(target, text: str, checkpointing: bool = False) -> Validation:
    """Run the generated module `text` of `target` against its original; see the module docstring."""
    validation = Validation()
    try:
        _validate_into(
            validation, target, text, ("eval", "train", "checkpointing") if checkpointing else ("eval", "train")
        )
    except _Mismatch as mismatch:
        validation.checks.append(Check("tiny", "mismatch", str(mismatch)))
    return validation


def _validate_into(validation: Validation, target, text: str, tiny_steps: tuple[str, ...]) -> None:

    with _quiet(), _isolated(text, target) as module:
        fused_class = getattr(module, "Fused" + target.causal_lm.__name__, None)
        mapping = getattr(module, "STACKED_PARAMS_MAPPING", None)
        if fused_class is None or mapping is None:
            raise _Mismatch("the generated module lacks its causal LM or its STACKED_PARAMS_MAPPING")
        try:
            config = model_config(target, shrunk_config(target.config_class))
        except ShrinkError as error:
            validation.checks.append(Check("tiny", "skipped", f"no tiny config: {_first_line(error)}"))
            return
        merging = merging_classes_in_text(text)
        validation.checks.append(
            check_config("tiny", target.causal_lm, fused_class, config, mapping, merging, tiny_steps)
        )
        numerics = NUMERICS[2:] if target.causal_lm in _FP32_ONLY else NUMERICS  # the tiny check ran in fp32
        checks = [("tiny in fp32 and bf16 autocast", config, numerics)]
        probed: list = []
        checks += [(label, variant, ()) for label, variant in construction_variants(target, config, probed=probed)]
        for label, variant in forward_variants(target, config, probed):  # fp64 like the others, and fp32 numerics
            checks += [(label, variant, ())] + [(f"{label} in fp32 and bf16 autocast", variant, numerics)] * bool(
                numerics
            )
        for label, variant, steps in checks:
            if validation.mismatch is not None:
                break  # one mismatch refuses the target; the rest would only cost time
            mode = "fp32" if steps else None  # the numerics steps run in fp32; the rest in fp64 where it runs
            validation.checks.append(
                check_config(label, target.causal_lm, fused_class, variant, mapping, merging, steps, mode)
            )


def refusal_reason(check: Check) -> str:
    """The reason text of a `validation-mismatch` refusal: which config, what differed, by how much."""
    return f"the fused model does not match the original under the {check.config} config: {check.detail}"


# --- one config ------------------------------------------------------------------------------------------------------


NUMERICS = ("eval", "train-autocast")
"""The steps the tiny config is checked with in fp32, besides its fp64 check (one model pair, `check_config`'s
`mode="fp32"`): eval in fp32, and a train step under `torch.autocast("cpu", dtype=torch.bfloat16)` (logits and
gradients).

fp64 alone misses what depends on the dtype: CPU autocast leaves fp64 tensors alone, so a forward that runs one
projection under `torch.autocast` agrees in fp64 and differs in fp32 (the eval step), and one that runs a projection
outside an autocast its caller entered (`torch.autocast(..., enabled=False)`) differs only under autocast (the train
step, whose logits show it as eval's would; two steps rather than four keep the build's cost down). Under autocast a merged GEMM computes each output element from the same bf16 products in the same order as
its pieces (logits identical on llama, qwen2, qwen3, mistral, gemma3_text: max abs diff 0), so logits are held to
`logits_tolerance`; gradients to `AUTOCAST_GRAD_TOLERANCE` (see there)."""

AUTOCAST_GRAD_TOLERANCE = 1e-1
"""Max |gradient difference| under bf16 autocast, relative to the largest |gradient|. The input gradient of a merged
linear is one bf16 GEMM over all pieces' rows where the original adds one bf16-rounded GEMM per piece, so gradients
differ at bf16's resolution (2**-8 = 3.9e-3) from the first layer back: 4.7e-3 to 7.9e-3 of the largest gradient on
llama, qwen2, qwen3, mistral and gemma3_text. 1e-1 leaves over 10x of that; a gradient that is gone or O(1) off (a
piece computed in another grad mode) is still a mismatch, and fp64 and fp32 hold gradients to `GRAD_TOLERANCE`."""


def check_config(
    label: str,
    original_class,
    fused_class,
    config,
    mapping,
    merging: set[str],
    steps: tuple[str, ...] = (),
    mode: str | None = None,
) -> Check:
    """Original vs fused on `config`: logits and gradients (see `_compare`); `skipped` when the original fails.

    `mode` None compares in fp64 where the original runs in it, else in fp32; `"fp32"` in fp32 (the steps named
    `...-autocast` under bf16 autocast, see `NUMERICS`)."""
    check = Check(label, "passed")
    try:
        if mode is None:
            _compare(check, original_class, fused_class, config, mapping, merging, steps)
        else:
            _compare_in(torch.float32, check, original_class, fused_class, config, mapping, merging, steps)
    except _Skip as skip:
        check.status, check.detail = "skipped", str(skip)
    except _Mismatch as mismatch:
        check.status, check.detail = "mismatch", str(mismatch)
    return check


def _compare(check: Check, original_class, fused_class, config, mapping, merging: set[str], steps) -> None:
    """Run `steps` (`eval`, `train`, `checkpointing`) on both models; with no steps (variants), one train step,
    which gives logits and gradients at once, or eval when the original does not train."""
    if _FP32_ONLY.get(original_class) is None:
        try:
            return _compare_in(torch.float64, check, original_class, fused_class, config, mapping, merging, steps)
        except _Skip as skip:
            _FP32_ONLY[original_class] = str(skip)
    _compare_in(torch.float32, check, original_class, fused_class, config, mapping, merging, steps)
    check.detail = "; ".join(filter(None, [f"in fp32 (fp64: {_FP32_ONLY[original_class]})", check.detail]))


_FP32_ONLY: dict[type, str] = {}
"""Original classes that did not run in fp64, and why: their later configs go straight to fp32."""


def _compare_in(dtype, check: Check, original_class, fused_class, config, mapping, merging: set[str], steps):
    """`_compare` with both models in `dtype`; the steps named `...-autocast` run under bf16 autocast.

    fp64 first: a merged GEMM's reordering then shows at ~1e-16, so the tolerances leave no room for doubt even in
    a model whose random weights amplify rounding chaotically (one shown 4e-4 relative gradient differences in fp32
    and 3e-19 in fp64), while any real fault still moves results by orders of magnitude more. fp32 when the
    original does not run in fp64 (a kernel without a double version), and for `NUMERICS`.
    """

    try:
        original = random_model(original_class, config).to(dtype)
        input_ids = _inputs(original, config, random_input(config))
    except Exception as error:  # noqa: BLE001 - upstream code: the original cannot build this config
        raise _Skip(f"the original does not build: {_short(error)}") from None
    fused = None
    full = bool(steps)
    for step in steps or ("train", "eval"):
        if step == "checkpointing" and not original.supports_gradient_checkpointing:
            continue
        try:
            expected = _step(step, original, input_ids)
        except Exception as error:  # noqa: BLE001 - the original cannot run this step: nothing to hold the fused to
            if step == "eval" or (step == "train" and not full):
                if step == "eval":
                    raise _Skip(f"the original does not run: {_short(error)}") from None
                continue  # variants fall back to eval
            check.detail = f"{_WHERE[step]} not compared: the original fails ({_short(error)})"
            return
        _check_finite(expected[0], step, dtype)
        if fused is None:
            fused = _fused_copy(original, fused_class, config, mapping, merging, dtype)
        with executed(fused, merging) as ran:
            actual = _run(_WHERE[step], _step, step, fused, input_ids, expected[2])
        _never_executed(ran, step)
        tolerance = AUTOCAST_GRAD_TOLERANCE if step.endswith("-autocast") else GRAD_TOLERANCE
        _agree(check, expected, actual, mapping, _WHERE[step], tolerance)
        if not full:
            return


def _check_finite(logits: torch.Tensor, step: str, dtype: torch.dtype) -> None:
    """Skip a dtype in which the original's own logits hold NaN or inf: no fused result can be held to them.

    ProphetNet in fp64 with an all-ones attention mask is one; in fp32 it is finite (its softmax casts to float32,
    where scores masked with `finfo(float64).min` become -inf, and a row of them gives NaN). `_compare` then retries
    in fp32, and a config whose original is not finite in fp32 either is skipped, never passed.
    """
    if not torch.isfinite(logits).all():
        raise _Skip(f"the original's {_WHERE[step]} logits are not finite in {str(dtype).removeprefix('torch.')}")


_WHERE = {
    "eval": "eval",
    "train": "train mode",
    "checkpointing": "train mode with gradient checkpointing",
    "eval-autocast": "eval under bf16 autocast",
    "train-autocast": "train mode under bf16 autocast",
}


def _step(step: str, model, input_ids, kwargs: dict | None = None) -> tuple:
    """`(logits, gradients or None, eval arguments or None)` of one eval step or one train step (`...-autocast`: under
    bf16 autocast on the CPU)."""
    if step.endswith("-autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(step.removesuffix("-autocast"), model, input_ids, kwargs)
    if step == "eval":
        values, used = _eval_logits(model, input_ids, kwargs)
        return values, None, used, _image_features(model, input_ids)
    values, grads = _train_step(model, input_ids, checkpointing=step == "checkpointing")
    return values, grads, None, None


def _fused_copy(original, fused_class, config, mapping, merging: set[str], dtype):
    """The fused causal LM built from `config` and holding the original's weights (through `mapping`)."""
    try:
        fused = fused_class(config).to(dtype)
    except Exception as error:  # noqa: BLE001
        raise _Mismatch(f"the fused class does not build: {_short(error)}") from None
    try:
        fused.load_state_dict(map_state(original, fused, mapping), strict=True)
    except RuntimeError as error:  # a mapped tensor of the wrong shape
        raise _Mismatch(f"the original's weights do not fit the fused model: {_first_line(error)}") from None
    unused = _unused(original, fused, merging)
    if unused:
        raise _Mismatch(f"the fused model never builds {', '.join(unused)}, though the original builds its original")
    return fused


def _agree(check: Check, expected, actual, mapping, where: str, grad_tolerance: float = GRAD_TOLERANCE) -> None:
    """Record the differences of one step, or raise `_Mismatch` when they exceed the tolerances."""
    expected_logits, expected_grads, _, expected_features = expected
    actual_logits, actual_grads, _, actual_features = actual
    diff = _logits_diff(expected_logits, actual_logits, where)
    if expected_features is not None:
        diff = max(diff, _logits_diff(expected_features, actual_features, f"{where} image features"))
    check.logits_diff = diff if check.logits_diff is None else max(check.logits_diff, diff)
    if expected_grads is not None:
        grad = _grad_diff(expected_grads, actual_grads, mapping, where, grad_tolerance)
        check.grad_diff = grad if check.grad_diff is None else max(check.grad_diff, grad)


def merging_classes_in_text(text: str) -> set[str]:
    """Names of the generated classes that construct a merged linear (read off the text, no `inspect`)."""
    chunks = re.split(r"^class (\w+)\b", text, flags=re.MULTILINE)
    return {name for name, body in zip(chunks[1::2], chunks[2::2]) if "MergedColumnLinear(" in body}


def _unused(original: nn.Module, fused: nn.Module, merging: set[str]) -> list[str]:
    """Merging fused classes the fused model never builds although the original builds their original.

    Logits cannot show this fault: the fused model would silently run the original class there.
    """

    built = {type(module).__name__ for module in fused.modules()}
    originals = {type(module).__name__ for module in original.modules()}
    return sorted(name for name in merging if name.removeprefix(PREFIX) in originals and name not in built)


def _run(where: str, function, *args):
    """`function(*args)` on the fused model; its failure is a mismatch, since the original ran the same step."""
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - the original ran this; the fused model must too
        raise _Mismatch(f"fused {where} fails where the original runs: {_short(error)}") from None


def _eval_logits(model, input_ids, kwargs: dict | None = None) -> tuple:
    """`(logits, kwargs)` in eval mode. With `kwargs` None (the original): with the model's cache, else once without
    it when only the cache set-up fails; the fused model is then run with exactly the arguments the original took."""
    with torch.no_grad():
        if kwargs is not None:
            return logits_of(_call(model.eval(), input_ids, **kwargs)).double(), kwargs
        try:
            return logits_of(_call(model.eval(), input_ids)).double(), {}
        except Exception as error:  # noqa: BLE001 - some models fail only in their cache set-up; try once without
            try:
                output = _call(model, input_ids, use_cache=False)
            except Exception:  # noqa: BLE001 - the first failure is the one worth reporting
                raise error from None
            return logits_of(output).double(), {"use_cache": False}


def _train_step(model, input_ids, checkpointing: bool):
    """Logits and `{parameter name: gradient}` of one train-mode step, dropout seeded the same for every model.

    Seeded the same too: NumPy's and Python's generators, which train-mode augmentation draws from (SpeechT5's and
    wav2vec2-style SpecAugment pick the masked frames with `np.random`), restored afterwards. Without it, the
    original and the fused model mask different frames and differ by far more than any tolerance.

    The loss is the logits against a fixed random cotangent, so every logit contributes a gradient and no label
    handling (which some models lack) is involved.
    """
    model.train()
    model.zero_grad(set_to_none=True)
    if checkpointing:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    try:
        with torch.random.fork_rng(devices=[]), _seeded_host_rngs(SEED + 2):
            torch.manual_seed(SEED + 2)
            output = _call(model, input_ids, use_cache=False)
        values = logits_of(output).double()
        cotangent = torch.randn(values.shape, generator=torch.Generator().manual_seed(SEED + 3), dtype=values.dtype)
        (values * cotangent).sum().backward()
    finally:
        if checkpointing:
            getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
        model.eval()
    grads = {
        name: p.grad if p.grad is not None else torch.zeros_like(p)
        for name, p in model.named_parameters(remove_duplicate=False)
    }
    return values.detach(), grads


@contextlib.contextmanager
def _seeded_host_rngs(seed: int):
    """NumPy's and Python's global generators seeded with `seed` in the block, their states restored after it."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    np.random.seed(seed)
    random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def _inputs(original, config, input_ids: torch.Tensor):
    """What both models are run on: `input_ids` alone for a model whose forward reads only text (a causal LM), else
    the whole batch its forward takes, images, audio and decoder tokens included
    (`fusegen.compiler.modal_inputs.forward_inputs`), so a vision tower or an encoder is run, and compared, too."""
    inputs = forward_inputs(original, config, input_ids)
    return input_ids if set(inputs) == {"input_ids", "attention_mask"} else inputs


def _call(model, inputs, **options):
    """`model` run on `inputs`: token ids with an all-ones mask, or a whole batch (`_inputs`)."""
    if isinstance(inputs, dict):
        return model(**inputs, **options)
    return model(input_ids=inputs, attention_mask=torch.ones_like(inputs), **options)


def _image_features(model, inputs):
    """The vision path's output on the batch's images, flattened (compared like logits: a fused vision tower whose
    result the language model happens to dampen still shows), or None without images."""
    if not isinstance(inputs, dict) or "pixel_values" not in inputs:
        return None
    with torch.no_grad():
        features = image_features(model.eval(), inputs)
    if features is None:
        return None
    flat = [features] if isinstance(features, torch.Tensor) else list(features)
    return torch.cat([tensor.reshape(-1) for tensor in flat]).double()


class executed:
    """Record which merging fused classes (`merging_classes_in_text`) run in the block: `ran[name]` is True once an
    instance ran, False while none has (classes the model does not build are absent)."""

    def __init__(self, model, merging: set[str]):
        self.instances = [module for module in model.modules() if type(module).__name__ in merging]
        self.ran: dict[str, bool] = {type(module).__name__: False for module in self.instances}

    def __enter__(self) -> dict[str, bool]:
        def hook(module, args):
            self.ran[type(module).__name__] = True

        self.handles = [module.register_forward_pre_hook(hook) for module in self.instances]
        return self.ran

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def _never_executed(ran: dict[str, bool], step: str) -> None:
    """A fused class that the model builds but the step never ran was not verified: a mismatch, never a pass (its
    merged linear may be wrong, and the logits could not show it)."""
    idle = sorted(name for name, done in ran.items() if not done)
    if idle and step == "eval":
        raise _Mismatch(
            f"{', '.join(idle)} fused but never executed on the validation inputs, so not verified (the model "
            "builds it; its forward never ran)"
        )


def logits(model, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The logits of one eval-mode forward of `model` on `input_ids` (and `kwargs`), without gradients.

    The one logits helper: validation, the coverage tool and the tests (through `fusegen.testkit`) all read logits
    this way, so every comparison sees the same forward."""
    with torch.no_grad():
        return logits_of(model.eval()(input_ids=input_ids, **kwargs))


def logits_of(output) -> torch.Tensor:
    """A model output's logits: `output.logits`, or the first element of a model that returns a tuple."""
    return output.logits if hasattr(output, "logits") else output[0]


def _logits_diff(expected, actual, where: str) -> float:
    """Max |logit difference|; it must stay within `TOLERANCE` times the logits' scale (at least 1), since
    rounding is relative: logits of order 1, the usual case, are held to `TOLERANCE` itself."""
    if expected.shape != actual.shape:
        raise _Mismatch(f"{where} logits have shape {tuple(actual.shape)}, the original's {tuple(expected.shape)}")
    diff = (expected - actual).abs().max().item()
    allowed = logits_tolerance(expected)
    if math.isnan(diff) or diff > allowed:
        raise _Mismatch(f"{where} max abs logit diff {diff:.3g} > {allowed:.3g}")
    return diff


def _grad_diff(expected: dict, actual: dict, mapping: dict, where: str, tolerance: float = GRAD_TOLERANCE) -> float:
    """Largest gradient difference over the fused model's parameters (merged ones against their pieces), relative
    to the largest |gradient| of any parameter of the original; see `GRAD_TOLERANCE`.

    Measured against the model-wide scale rather than each tensor's own: a router's or a norm's gradient can cancel
    to almost nothing (1e-8 where others are 1e-2), and its rounding noise is relative to the terms that cancelled,
    not to the result. A gradient that vanishes altogether in the fused model where the original's does not (a
    path autograd no longer sees) is a mismatch at any size.
    """
    references = {name: _mapped(name, expected, mapping) for name in actual}
    scale = max((r.abs().max().item() for r in references.values() if r is not None and r.numel()), default=0.0)
    worst = 0.0
    for name, grad in actual.items():
        reference = references[name]
        if reference is None or grad.shape != reference.shape:
            raise _Mismatch(f"{where}: the gradient of {name} has no counterpart of its shape in the original")
        if not grad.numel():
            continue
        diff = (grad - reference).abs().max().item()
        relative = diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0)
        if math.isnan(diff) or relative > tolerance:
            raise _Mismatch(
                f"{where}: gradient of {name} differs by {diff:.3g} ({relative:.3g} of the largest gradient "
                f"> {tolerance:g})"
            )
        if not grad.any() and reference.any():
            raise _Mismatch(
                f"{where}: {name} gets no gradient in the fused model, {reference.abs().max():.3g} in the original"
            )
        worst = max(worst, relative)
    return worst


# --- weights through the stacked mapping ------------------------------------------------------------------------------


def map_state(original: nn.Module, fused: nn.Module, mapping: dict) -> dict[str, torch.Tensor]:
    """The fused model's state dict filled from the original's: same names copied, merged ones concatenated.

    Raises `_Mismatch` naming the tensor when a fused tensor has no source or an original tensor is left unused.
    """
    source = original.state_dict()
    used: set[str] = set()
    state = {}
    for name in fused.state_dict():
        state[name] = _mapped(name, source, mapping, used)
        if state[name] is None:
            raise _Mismatch(f"fused tensor {name} has no counterpart in the original")
    left = sorted(set(source) - used)
    if left:
        raise _Mismatch(f"original tensors map nowhere in the fused model: {', '.join(left[:4])}")
    return state


def _mapped(name: str, source: dict, mapping: dict, used: set | None = None):
    """`source[name]`, or for `<path>.<merged>.<tensor>` its pieces' tensors concatenated in mapping order."""
    if name in source:
        if used is not None:
            used.add(name)
        return source[name]
    path, _, tensor = name.rpartition(".")
    parent, _, merged = path.rpartition(".")
    if merged not in mapping:
        return None
    prefix = f"{parent}." if parent else ""
    names = [f"{prefix}{piece}.{tensor}" for piece, _ in mapping[merged]]
    pieces = [source.get(piece) for piece in names]
    if tensor == "bias" and any(piece is not None for piece in pieces):
        # A projection without a bias (Whisper's k_proj) is a zero piece of the merged bias: as wide as its weight.
        weights = [source.get(f"{prefix}{piece}.weight") for piece, _ in mapping[merged]]
        pieces = [
            piece if piece is not None or weight is None else weight.new_zeros(weight.shape[0])
            for piece, weight in zip(pieces, weights)
        ]
    if any(piece is None for piece in pieces):
        return None
    if used is not None:
        used.update(piece for piece in names if piece in source)
    return torch.cat(pieces, dim=0)


# --- construction variants -------------------------------------------------------------------------------------------


def construction_variants(
    target,
    config,
    limit: int | None = MAX_VARIANTS,
    max_probes: int | None = MAX_PROBES,
    every_field: bool = False,
    probed: list | None = None,
) -> list[tuple[str, object]]:
    """Up to `limit` configs, each `config` with one field changed, that build a differently structured model.

    Candidates (`candidate_changes`) are booleans flipped, optional fields set to None or to a small value,
    per-layer kind lists made uniform, layer index lists emptied or filled, layer-structure counters moved,
    and MQA for the kv-head count. Each is built (uninitialised) and kept only if its module tree differs from the
    tiny config's and from every variant kept so far (module types and paths, parameter names and shapes, tying);
    one whose config or model does not build is dropped. A false alarm costs one more check, a miss one less.

    The build keeps its cost down: at most `limit` variants from at most `max_probes` probes, of fields the modeling
    module names. The coverage tool passes None for both and `every_field=True`, since a field the modeling code
    never names can still decide the structure through the config (Jamba's `attn_layer_offset` makes
    `layers_block_type`). `probed`, if given, receives `(None, None, config, model)` and then `(field, value,
    variant, model)` for every probed single-field change that builds `config`'s structure (`forward_variants`).
    """

    base = _built_model(target, config)
    structure = _structure_of(base)
    seen = {structure}
    if probed is not None:
        probed.append((None, None, config, base))
    variants = []
    read = _EVERYTHING if every_field else _source_words(target)
    reshrinks = _reshrinks_to_itself(target, config)
    probes = 0
    for name, value in candidate_changes(config):
        if limit is not None and len(variants) >= limit:
            break
        if max_probes is not None and probes >= max_probes and name != "tie_word_embeddings":
            continue
        if name not in read and name != "tie_word_embeddings":
            continue  # the modeling module never names it (one read only elsewhere is a missed variant, no more)
        probes += 1
        try:
            if reshrinks:
                variant = model_config(target, shrunk_config(config, **{name: value}))
            else:
                variant = dataclasses.replace(config, **{name: value})
            if getattr(variant, name, value) != value and not isinstance(value, list):
                continue  # the config re-derived the field: not the variant asked for
            model = _built_model(target, variant)
        except Exception:  # noqa: BLE001, S112 - a variant the config or the model rejects is not a variant
            continue
        changed = _structure_of(model)
        if changed not in seen:
            seen.add(changed)
            variants.append((f"{name}={_short_value(value)}", variant))
        elif changed == structure and probed is not None:
            probed.append((name, value, variant, model))
    more = dependent_variants(target, config, read, reshrinks, every_field) if _below(limit, variants) else []
    for label, variant in more:
        if not _below(limit, variants):
            break
        try:
            structure = _structure(target, variant)
        except Exception:  # noqa: BLE001, S112 - as above
            continue
        if structure not in seen:
            seen.add(structure)
            variants.append((label, variant))
    return variants


MAX_FORWARD_VARIANTS = 1
"""At most this many forward-only variants per target (`forward_variants`), each checked with one fp32 train step."""


def forward_variants(target, config, probed: list, limit: int = MAX_FORWARD_VARIANTS) -> list[tuple[str, object]]:
    """Up to `limit` configs, each `config` with one boolean or optional field changed, that build the same module
    tree but may run a different forward: a flag read only in `forward` (`if self.config.flag:`, or stored by
    `__init__` as `self.flag` and read there) decides which code runs, possibly whether a hazard is live, and
    `construction_variants` never keeps it, since the model it builds looks the same.

    `probed` is what `construction_variants` built and found to have `config`'s structure: `(field, value, variant,
    model)`, the base model first. A boolean or optional field counts when it changes a plain attribute of some
    module (a number, string, flag or None `__init__` stored for `forward` to read), or when the source of a
    `forward` of the modeling module names it; those a forward names come first. No model is built here, so the
    build pays only for the checks; a miss is one variant less, never a pass.
    """
    if not probed:
        return []
    in_forward = _forward_words(target)
    (_, _, _, base), candidates = probed[0], probed[1:]
    behaviour = _behaviour(base)
    found = [
        (name, value, variant)
        for name, value, variant, model in candidates
        if (isinstance(value, bool) or value is None or getattr(config, name, 0) is None)
        and name not in _FIXED_BY_STEPS
        and (name in in_forward or _behaviour(model) != behaviour)
    ]
    found.sort(key=lambda item: item[0] not in in_forward)  # stable: fields a forward names first
    return [(f"{name}={_short_value(value)} (forward only)", variant) for name, value, variant in found[:limit]]


_FIXED_BY_STEPS = frozenset({"tie_word_embeddings", "use_cache"})
"""Fields a forward-only variant would not vary: tying changes the structure (`construction_variants` takes it), and
every check's train step passes `use_cache=False` whatever the config says."""


def _forward_words(target) -> set[str]:
    """Every identifier in the source of a `forward` defined by a class of the modeling module."""
    import inspect

    words: set[str] = set()
    for cls in vars(target.module).values():
        forward = vars(cls).get("forward") if isinstance(cls, type) else None
        if forward is None:
            continue
        try:
            words |= set(re.findall(r"\w+", inspect.getsource(forward)))
        except (OSError, TypeError):
            continue
    return words


def _behaviour(model: nn.Module) -> tuple:
    """The plain attributes (numbers, strings, flags, None) each module of `model` holds: what `__init__` stored for
    `forward` to read."""
    plain = (bool, int, float, str, type(None))
    return tuple(
        (path, key, value)
        for path, module in model.named_modules()
        for key, value in sorted(vars(module).items())
        if not key.startswith("_") and key != "training" and isinstance(value, plain)
    )


def _below(limit: int | None, variants: list) -> bool:
    return limit is None or len(variants) < limit


def dependent_variants(target, config, read, reshrinks: bool, sub_configs: bool = True) -> list[tuple[str, object]]:
    """Configs changing a field whose effect depends on another one, which single-field changes cannot reach, and
    the fields of a composite config's sub-configs (Gemma 4's `text_config`).

    Three generic cases (Gemma 4 has each): a feature flag that builds only with its optional sizes set
    (`enable_moe_block` with `num_experts`, `top_k_experts`, `moe_intermediate_size`); a layer counter that needs
    more layers than the tiny config has (`num_kv_shared_layers`: the shared layers must find a producer of each
    layer kind before them), tried on the config with its layers repeated (`_repeated_layers`); and a flag that
    changes nothing alone but does once such a counter is set (`use_double_wide_mlp` widens only kv-shared
    layers), tried on top of each counter variant. A sub-config gets the single-field changes and these, its
    label prefixed with the field (`text_config.attention_k_eq_v=True`; only with `sub_configs`, which the coverage
    tool's exhaustive search sets and the build's capped one does not). Every result is built and kept only if
    its structure is new (`construction_variants`); a false alarm costs one probe, a miss one variant less.
    """
    if not reshrinks:
        return []

    found = _dependent_on(
        target, config, config, read, lambda changes: model_config(target, shrunk_config(config, **changes))
    )
    for part, sub in _sub_configs(config) if sub_configs else []:

        def make(changes, part=part, sub=sub):
            return model_config(target, shrunk_config(config, **{part: shrunk_config(sub, **changes)}))

        singles = [(f"{n}={_short_value(v)}", {n: v}) for n, v in candidate_changes(sub) if n in read]
        for label, changes in singles:
            variant = _built(target, make, changes)
            if variant is not None:
                found.append((f"{part}.{label}", variant))
        found += [(f"{part}.{label}", variant) for label, variant in _dependent_on(target, config, sub, read, make)]
    return found


def _sub_configs(config) -> list[tuple[str, object]]:
    """`(field, sub-config)` of a composite config: its fields holding a config (`text_config`)."""
    from transformers import PreTrainedConfig

    names = [f.name for f in dataclasses.fields(type(config))] if dataclasses.is_dataclass(config) else []
    found = []
    for name in names:
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001, S112 - a field its config refuses to read globally
            continue
        if isinstance(value, PreTrainedConfig):
            found.append((name, value))
    return found


def _built(target, make, changes: dict):
    """`make(changes)` if that config and its model build, else None (a config the model rejects is no variant)."""
    try:
        variant = make(changes)
        _structure(target, variant)
    except Exception:  # noqa: BLE001 - a config or model that does not build is no variant
        return None
    return variant


def _dependent_on(target, config, part, read, make) -> list[tuple[str, object]]:
    """The three dependent cases of `dependent_variants` for the fields of `part` (`config` or a sub-config of
    it); `make(changes)` builds the whole config with `part` so changed."""
    base = _structure(target, config)

    def no_effect(name, value):
        alone = _built(target, make, {name: value})
        return alone is not None and _structure(target, alone) == base

    changes = [(n, v) for n, v in candidate_changes(part) if n in read]
    optional = {name: value for name, value in changes if getattr(part, name, 0) is None and value is not None}
    flags = [(name, value) for name, value in changes if isinstance(value, bool) and name != "tie_word_embeddings"]
    found = []
    for name, value in flags:
        if optional and _built(target, make, {name: value}) is None:
            variant = _built(target, make, {name: value, **optional})
            if variant is not None:
                found.append((f"{name}={value} (with {', '.join(optional)} set)", variant))
    repeated = _repeated_layers(part)
    layers = getattr(part, "num_hidden_layers", 0)
    for name in [n for n in _layer_counter_fields(part) if n in read] if repeated else []:
        for count in range(1, 2 * layers):
            variant = _built(target, make, {**repeated, name: count})
            if variant is None:
                continue
            found.append((f"{name}={count} ({2 * layers} layers)", variant))
            for flag, value in [(flag, value) for flag, value in flags if no_effect(flag, value)]:
                combined = _built(target, make, {**repeated, name: count, flag: value})
                if combined is not None:
                    found.append((f"{name}={count}, {flag}={value} ({2 * layers} layers)", combined))
            break
    return found


_SHARED_LAYERS = re.compile(r"^num_\w*shared_layers$")
"""Integer fields counting layers that reuse another layer's state (Gemma 3n / Gemma 4 `num_kv_shared_layers`)."""


def _layer_counter_fields(config) -> list[str]:
    """Integer fields, 0 in `config`, that count layers of a kind (`_SHARED_LAYERS`)."""
    names = [f.name for f in dataclasses.fields(type(config))] if dataclasses.is_dataclass(config) else []
    return [name for name in names if _SHARED_LAYERS.match(name) and getattr(config, name, None) == 0]


def _repeated_layers(config) -> dict:
    """Overrides giving `config` twice its layers: every per-layer list repeated, every per-layer dict (keyed by
    layer index) extended with the same entries for the repeated layers. Empty if there is no layer count."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return {}
    overrides: dict = {"num_hidden_layers": 2 * layers}
    for item in dataclasses.fields(type(config)) if dataclasses.is_dataclass(config) else []:
        try:
            value = getattr(config, item.name)
        except Exception:  # noqa: BLE001, S112 - per-layer values a config refuses to read globally
            continue
        if isinstance(value, list) and len(value) == layers:
            overrides[item.name] = value * 2
    per_layer = config.to_dict().get("per_layer_config")
    if isinstance(per_layer, dict):
        entries = {int(index): values for index, values in per_layer.items()}
        overrides["per_layer_config"] = {**entries, **{index + layers: values for index, values in entries.items()}}
    return overrides


def _reshrinks_to_itself(target, config) -> bool:
    """Whether shrinking `config` again, changing nothing, gives `config` back.

    A variant is normally the tiny config shrunk again with one field changed, so that fields derived from it (a
    layer-kind list from a counter) are derived again. Where shrinking is not idempotent (Zamba derives
    `attention_hidden_size` as twice the hidden size, and shrinking caps it again, so the original no longer runs),
    each variant is instead `config` itself with the field replaced, derived fields as they were: a derived field
    left stale can only make a variant that builds the tiny model again, which is then dropped (a missed variant).
    """

    try:
        return _construction_dict(model_config(target, shrunk_config(config))) == _construction_dict(config)
    except Exception:  # noqa: BLE001 - a config that does not shrink again
        return False


_METADATA = frozenset({"architectures", "_name_or_path", "transformers_version"})
"""Config entries a save or load writes (the coverage tool's tiny run sets `architectures`) that build nothing."""


def _construction_dict(config) -> dict:
    """`config.to_dict()` without `_METADATA`: what `_reshrinks_to_itself` compares. Without this, a tiny config
    that was saved once (`architectures` set) no longer shrank to itself, and Gemma 4's variants, replaced field by
    field instead, all failed on its per-layer attributes (coverage showed "tiny + 0 variants")."""
    return {key: value for key, value in config.to_dict().items() if key not in _METADATA}


_COUNTERS = re.compile(
    r"^(first_k_dense_replace|num_dense_layers|moe_layer_start_index|decoder_sparse_step|moe_layer_interval"
    r"|interleave_moe_layer_step|expert_layer_period|expert_layer_offset|attn_layer_period|attn_layer_offset"
    r"|sliding_window_pattern|global_attn_every_n_layers|no_rope_layer_interval)$"
)
"""Integer fields that say which layers are of which kind (dense/MoE, sliding/full): moved within the layer count."""
_KV_HEADS = re.compile(r"^(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num|num_query_groups)$")


def candidate_changes(config) -> list[tuple[str, object]]:
    """`(field, new value)` pairs worth probing, those likeliest to change a merged linear first (booleans such as
    bias flags, optional sizes, layer kinds, MQA), tied embeddings last; see `construction_variants`."""
    from transformers import PreTrainedConfig

    base = {f.name for f in dataclasses.fields(PreTrainedConfig)} - {"tie_word_embeddings"}
    hints = _type_hints(type(config))
    layers = getattr(config, "num_hidden_layers", None)
    booleans, optional, lists, counters = [], [], [], []
    for item in dataclasses.fields(type(config)) if dataclasses.is_dataclass(config) else []:
        name = item.name
        if name in base or name.startswith("_"):
            continue
        try:
            value, hint = getattr(config, name), hints.get(name, "")
        except Exception:  # noqa: BLE001, S112 - a field its config refuses to read globally (per-layer values)
            continue
        if isinstance(value, bool):
            booleans.append((name, not value))
        elif value is None and "int" in hint:
            optional.append((name, _small_int(name)))
        elif value is None and "bool" in hint:
            optional.append((name, True))
        elif value is not None and "None" in hint and not isinstance(value, (dict, str, float)):
            optional.append((name, None))
        if isinstance(value, (list, tuple)) and value and isinstance(layers, int) and len(value) == layers:
            kinds = list(dict.fromkeys(v for v in value if isinstance(v, str)))
            if len(kinds) > 1:
                lists += [(name, [kind] * layers) for kind in kinds]
        elif (
            isinstance(value, (list, tuple))
            and name.endswith("layers")
            and isinstance(layers, int)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            lists.append((name, [] if value else [0]))
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(layers, int):
            if _COUNTERS.match(name):
                counters += [(name, new) for new in range(min(layers, 2) + 1) if new != value]
            elif _KV_HEADS.match(name) and value > 1:
                counters.append((name, 1))
    tied = [change for change in booleans if change[0] == "tie_word_embeddings"]
    booleans = [change for change in booleans if change[0] != "tie_word_embeddings"]
    return booleans + optional + lists + counters + tied  # tying touches no merged linear: last


def _type_hints(cls) -> dict[str, str]:
    """Each field's annotation as text (`int | None`); unresolvable annotations count as unknown."""
    try:
        return {name: str(hint) for name, hint in typing.get_type_hints(cls).items()}
    except Exception:  # noqa: BLE001 - forward references a config module never imports
        return {name: str(hint) for name, hint in getattr(cls, "__annotations__", {}).items()}


def _small_int(name: str) -> int:
    """A value for an unset integer field: what `fusegen.compiler.shrink` would make of a large one, else 2."""

    rule = rule_for(name)
    return rule(1 << 20) if callable(rule) else 2


def _source_words(target) -> set[str]:
    """Every identifier and string in the modeling module's source: the config fields it can read by name."""
    import inspect

    try:
        source = inspect.getsource(target.module)
    except (OSError, TypeError):
        return _EVERYTHING
    return set(re.findall(r"\w+", source))


class _Everything(set):
    def __contains__(self, item) -> bool:
        return True


_EVERYTHING = _Everything()


def _structure(target, config) -> tuple:
    """What `__init__` built: module paths and types, parameter names and shapes (tied ones once).

    Built on the CPU without weight initialisation, then tied as `post_init` would: at tiny sizes that is half the
    cost of `meta`, whose device mode intercepts every tensor call, and the values are never read.
    """
    return _structure_of(_built_model(target, config))


def _built_model(target, config) -> nn.Module:
    """`target`'s causal LM built from `config` without weight initialisation, tied as `post_init` would tie it."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = target.causal_lm(config)
    model.tie_weights()
    return model


def _structure_of(model: nn.Module) -> tuple:
    """`_structure` of a built model."""
    modules = tuple((name, type(module).__name__) for name, module in model.named_modules())
    return modules + tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def _short_value(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- running the generated text --------------------------------------------------------------------------------------


class _isolated:
    """Import `text` as a module for the duration of the block, then undo every trace of it.

    Undone: the module's `sys.modules` entry and its source in `linecache`, the checkpoint conversions it registers
    in Transformers at import time and fusegen's record of its merges (`fusegen.runtime.registry.restored_registry`;
    so a build never changes how later loads behave), the RNG state, and the thread count (one thread: tiny models
    run faster without the pool, and the machine is shared).
    """

    def __init__(self, text: str, target):
        self.text = text
        self.model_type = target.model_type
        self.name = f"fusegen_validating_{target.model_type}_{id(self):x}"

    def __enter__(self) -> types.ModuleType:
        from fusegen.runtime.registry import restored_registry

        self.registry = restored_registry()
        self.registry.__enter__()
        self.rng = torch.random.get_rng_state()
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        filename = f"<fusegen-validation>/{self.name}/fused_{self.model_type}.py"
        linecache.cache[filename] = (len(self.text), None, self.text.splitlines(keepends=True), filename)
        module = types.ModuleType(self.name)
        module.__file__ = filename
        sys.modules[self.name] = module
        self.filename = filename
        try:
            exec(compile(self.text, filename, "exec"), module.__dict__)  # noqa: S102 - the text we just generated
        except BaseException as error:  # noqa: BLE001 - any failure to import is the verdict, after cleaning up
            self.__exit__(None, None, None)
            raise _Mismatch(f"the generated module does not import: {_short(error)}") from None
        return module

    def __exit__(self, *exc) -> None:
        self.registry.__exit__(None, None, None)
        sys.modules.pop(self.name, None)
        linecache.cache.pop(self.filename, None)
        torch.random.set_rng_state(self.rng)
        torch.set_num_threads(self.threads)


class _quiet:
    """Transformers' warnings off while validating (train mode on tiny models triggers several)."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self.level)
