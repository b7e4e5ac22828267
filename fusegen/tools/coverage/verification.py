"""Verification: the fused model computes what the original computes, on a tiny random model, under every construction
variant (each config checked with `from_pretrained` of the original's checkpoint, then logits and greedy tokens)."""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fusegen.compiler.inputs import SEED
from fusegen.compiler.modal_inputs import forward_inputs
from fusegen.compiler.validate import executed as _executed
from fusegen.errors import first_line as _first_line
from fusegen.errors import short_error as _short
from fusegen.testkit import (  # the one kit (fusegen/testkit.py)
    extra_inputs,
    input_rows,
    logits_tolerance,
    model_config,
    random_input,
    random_model,
)
from fusegen.tools.coverage.rows import BATCH, LENGTH, NEW_TOKENS, Verification


@dataclass
class ConfigCheck:
    """Outcome of the equivalence check under one config of a model type."""

    config: str
    """`tiny`, or the construction variant (`attention_bias=True`)."""
    status: str
    """`verified`, `mismatch`, `failed` or `skipped` (as `Verification.status`)."""
    max_abs_diff: float | None = None
    greedy: str = ""
    reason: str = ""
    exercised: list[str] = field(default_factory=list)
    """Fused classes holding a merged linear whose original the model under this config contains."""


def verify(model_type: str, text: str, variants: int | None = None, head: str | None = None) -> dict:
    """Equivalence of the fused causal LM (loaded from the original's checkpoint) and the original; plain data.

    Checked under the tiny config and under every construction variant of it (`fusegen.compiler.validate.
    construction_variants`, all fields probed, at most `variants` of them if given): the type is verified only
    when every config that the original runs is verified (see `_combined`). `head`: the class the text was built
    around (`resolve`'s; None: the type's default).
    """
    import torch

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"fusegen-coverage-{model_type}-") as tmp:
        result = _verify_in(Path(tmp), model_type, text, torch, variants, head)
    result.seconds = time.perf_counter() - start
    return asdict(result)


def _verify_in(
    tmp: Path, model_type: str, text: str, torch, variants: int | None = None, head: str | None = None
) -> Verification:
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import ShrinkError, shrunk_config

    target = resolve(model_type, head)
    try:
        fused_class = import_causal_lm(tmp, model_type, text, target.causal_lm.__name__)
    except Exception as error:  # noqa: BLE001
        return Verification("failed", reason=f"generated module: {_short(error)}")
    try:
        config = model_config(target, shrunk_config(target.config_class))
    except ShrinkError as error:
        return Verification("skipped", reason=f"no tiny config: {_first_line(error)}")
    tiny = _verify_config(tmp / "tiny", "tiny", target, fused_class, config, torch)
    if tiny.status != "verified":
        return _combined([tiny], [], _merging_in(text))
    configs, left_out = config_variants(target, config, variants)
    checks = [tiny]
    for index, (label, variant) in enumerate(configs):
        checks.append(_verify_config(tmp / f"variant{index}", label, target, fused_class, variant, torch))
    return _combined(checks, left_out, _merging_in(text))


def _merging_in(text: str) -> set[str]:
    """Names of the generated classes that construct a merged linear, read off the generated text."""
    from fusegen.compiler.validate import merging_classes_in_text

    return merging_classes_in_text(text)


def config_variants(target, config, limit: int | None) -> tuple[list[tuple[str, object]], list[str]]:
    """The construction variants to verify (every field probed, see `construction_variants`), and the labels of
    those left out by `limit`. A failure to probe is no variant (the tiny config was verified already)."""
    from fusegen.compiler.validate import construction_variants

    try:
        found = construction_variants(target, config, limit=None, max_probes=None, every_field=True)
    except Exception:  # noqa: BLE001 - upstream code the probe builds; the tiny config's check stands
        found = []
    kept = found if limit is None else found[:limit]
    return kept, [label for label, _ in found[len(kept) :]]


def _combined(checks: list[ConfigCheck], left_out: list[str], merging: set[str]) -> Verification:
    """One verdict from the per-config checks: the first config that is not verified (mismatch or failure first)
    decides it; a variant the original cannot run is `skipped` and named, never counted as a pass, but it does not
    fail a type whose every other config is verified.

    The figure is the largest logit difference over all configs; greedy is `same` only if it was the same under each.
    """
    data = [asdict(check) for check in checks]
    bad = next((c for c in checks if c.status in ("mismatch", "failed")), None)
    if bad is None and checks[0].status != "verified":
        bad = checks[0]
    diffs = [c.max_abs_diff for c in checks if c.max_abs_diff is not None]
    worst = max(diffs) if diffs else None
    if bad is not None:
        where = "" if bad is checks[0] and len(checks) == 1 else f"under {bad.config}: "
        return Verification(bad.status, worst, bad.greedy, where + bad.reason, checks=data, left_out=left_out)
    verified = [c for c in checks if c.status == "verified"]
    same = [c for c in verified if c.greedy == "same"]
    others = [f"{c.config}: {c.greedy}" for c in verified if c.greedy != "same"]
    greedy = "same" if not others else f"same under {len(same)} of {len(verified)} configs ({others[0]})"
    notes = list(dict.fromkeys(c.reason for c in verified if c.reason))
    skipped = [f"{c.config} ({c.reason})" for c in checks if c.status == "skipped"]
    if skipped:
        notes.append(f"skipped, the original does not run: {'; '.join(skipped)}")
    exercised = {name for c in checks for name in c.exercised}
    missing = sorted(merging - exercised)
    if missing:
        notes.append(f"in none of the configs: {', '.join(missing)}")
    return Verification("verified", worst, greedy, "; ".join(notes), checks=data, left_out=left_out)


def _verify_config(tmp: Path, label: str, target, fused_class, config, torch) -> ConfigCheck:
    """Save the original under `config`, load it into the fused class, compare logits and greedy tokens."""
    try:
        original = random_model(target.causal_lm, config)
    except Exception as error:  # noqa: BLE001
        return ConfigCheck(label, "skipped", reason=f"original does not build from the config: {_short(error)}")
    checkpoint = tmp / "checkpoint"
    try:
        original.save_pretrained(checkpoint)
    except Exception as error:  # noqa: BLE001
        return ConfigCheck(label, "skipped", reason=f"original cannot save_pretrained: {_short(error)}")
    try:
        fused, info = fused_class.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    except Exception as error:  # noqa: BLE001
        return ConfigCheck(label, "failed", reason=f"fused from_pretrained: {_short(error)}")
    fused.eval()
    problems = {k: sorted(map(str, v))[:4] for k, v in info.items() if v}
    if problems:
        return ConfigCheck(label, "failed", reason=f"fused from_pretrained: {problems}")
    unused, unexercised = unused_fused_classes(original, fused)
    if unused:
        return ConfigCheck(label, "failed", reason=f"fused model never instantiates {', '.join(unused)}")
    exercised = sorted(set(merging_fused_classes(fused).values()) - set(unexercised))
    rows = input_rows(config)
    input_ids = random_input(config, batch=BATCH * rows)
    extra = _extra_inputs(original, torch)
    try:  # images, audio, decoder tokens: what the forward takes besides token ids (token ids with image tokens)
        modal = forward_inputs(original, config, input_ids)
    except Exception:  # noqa: BLE001 - a layout the synthesis does not know: token ids alone, as before
        modal = {}
    if "input_ids" in modal:
        input_ids = modal.pop("input_ids")
        modal.pop("attention_mask", None)
        extra = {**extra, **modal}
    elif modal:  # a forward that reads no token ids (speech, video, Pix2Struct's patches): the batch is all it takes
        input_ids, extra = None, {**extra, **modal}
    notes = []
    try:
        expected, kwargs = _reference_logits(original, input_ids, torch, **extra)
    except Exception as error:  # noqa: BLE001
        try:  # the extra inputs are a guess from the forward's signature: without them, the text path may still run
            expected, kwargs = _reference_logits(original, input_ids, torch)
            extra = {}
        except Exception:  # noqa: BLE001 - the first failure is the one worth reporting
            return ConfigCheck(label, "skipped", reason=f"needs non-text inputs (original forward: {_short(error)})")
    if kwargs:
        notes.append("compared without cache: the original fails with its cache")
    if extra:
        notes.append(f"given {', '.join(sorted(extra))}")
    try:
        with _executed(fused, generated_classes(fused)) as ran:
            actual = _logits(fused, input_ids, torch, **extra, **kwargs)
    except Exception as error:  # noqa: BLE001
        upstream = _loaded_original_fails(target, checkpoint, input_ids, torch, **extra, **kwargs)
        if upstream is not None:
            return ConfigCheck(label, "skipped", reason=upstream)
        return ConfigCheck(label, "failed", reason=f"fused forward: {_short(error)}")
    idle = sorted(name for name, done in ran.items() if not done)
    if idle:  # its merged linear may be wrong and the logits could not show it
        return ConfigCheck(label, "failed", reason=f"{', '.join(idle)} fused but never executed on the inputs")
    if expected.shape != actual.shape:
        return ConfigCheck(label, "mismatch", reason=f"logits shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    diff = (expected - actual).abs().max().item()
    if math.isnan(diff):
        return ConfigCheck(label, "mismatch", reason="fused logits contain NaN (the original's do not)")
    bound = logits_tolerance(expected)
    if diff > bound:
        reloaded = _reloaded_original(target, checkpoint, expected, bound, input_ids, torch, **extra, **kwargs)
        if reloaded is not None:
            original, expected, drift = reloaded
            diff = (expected - actual).abs().max().item()
            notes.append(
                f"compared with the original as its own from_pretrained loads it: the original does not reproduce "
                f"its saved outputs (max abs logit diff {drift:.3g})"
            )
    if input_ids is None:  # generation from the encoder's inputs alone, the decoder starting from its start token
        given = {key: value for key, value in extra.items() if not key.startswith("decoder_")}
        greedy = compare_greedy(original, fused, None, torch, **given)
    else:
        greedy = compare_greedy(original, fused, input_ids[:rows, : LENGTH // 2], torch)
    if diff > bound:
        return ConfigCheck(label, "mismatch", diff, greedy, f"max abs logit diff {diff:.3g} > {bound:.3g}")
    if greedy == "differ" or greedy.startswith("fused generate fails"):
        return ConfigCheck(label, "mismatch", diff, greedy, f"greedy tokens: {greedy}")
    return ConfigCheck(label, "verified", diff, greedy, "; ".join(notes), exercised)


def import_causal_lm(tmp: Path, model_type: str, text: str, original_name: str) -> type:
    """Write the generated text into a package under `tmp`, import it, and return its fused causal-LM class."""
    from fusegen.compiler.propagate import fused_name
    from fusegen.tools.convert import import_fused_module

    package = tmp / "generated"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / f"fused_{model_type}.py").write_text(text, encoding="utf-8")
    module = import_fused_module(package, model_type)
    name = fused_name(original_name)
    if name not in getattr(module, "__all__", ()):
        raise LookupError(f"the generated module does not export {name}")
    return getattr(module, name)


def generated_classes(fused) -> set[str]:
    """The names of the generated classes that hold a fusion of their own: a merged linear (`MergedColumnLinear(`
    in their source) or a rewritten norm (`rms_norm(`). Each must run on the inputs for the type to count as
    verified. Classes that only build fused children are left out: a wrapper whose forward its parent bypasses
    (TrOCR's decoder wrapper) runs nothing of its own, and its children are checked themselves."""
    return {
        name for name, source in _generated_sources(fused) if "MergedColumnLinear(" in source or "rms_norm(" in source
    }


def merging_fused_classes(fused) -> dict[str, str]:
    """`{original class name: fused class name}` for the generated classes that hold a merged linear."""
    from fusegen.compiler.propagate import PREFIX

    return {
        name.removeprefix(PREFIX): name
        for name, source in _generated_sources(fused)
        if "MergedColumnLinear(" in source
    }


def _generated_sources(fused):
    """`(name, source)` of each class the generated module of `fused` defines (the fused classes it writes)."""
    import inspect

    from fusegen.compiler.propagate import PREFIX

    module = sys.modules[type(fused).__module__]
    for name, value in vars(module).items():
        if isinstance(value, type) and name.startswith(PREFIX) and value.__module__ == module.__name__:
            try:
                yield name, inspect.getsource(value)
            except (OSError, TypeError):
                continue


def unused_fused_classes(original, fused) -> tuple[list[str], list[str]]:
    """(fused classes the fused model never builds though the original builds their original, fused classes whose
    original the tiny model does not contain at all).

    The first is a fault that loading and logits cannot show: the fused model silently runs the original class.
    The second only means the tiny config does not exercise that class.
    """
    built = {type(module).__name__ for module in fused.modules()}
    originals = {type(module).__name__ for module in original.modules()}
    unused, unexercised = [], []
    for original_name, fused_name in sorted(merging_fused_classes(fused).items()):
        if original_name not in originals:
            unexercised.append(fused_name)
        elif fused_name not in built:
            unused.append(fused_name)
    return unused, unexercised


def _loaded_original_fails(target, checkpoint: Path, input_ids, torch, **kwargs) -> str | None:
    """Why the ORIGINAL class, loaded from the same checkpoint with its own `from_pretrained`, cannot run either, or
    None if it runs.

    Then the fault is upstream (TrOCR's sinusoidal positions are a plain tensor attribute that `from_pretrained`
    leaves on `meta`), the config is one the original does not run as users load it, and it is skipped, never
    counted. If the loaded original runs, the fused side's failure stands.
    """
    try:
        loaded = target.causal_lm.from_pretrained(checkpoint, dtype=torch.float32).eval()
        _logits(loaded, input_ids, torch, **kwargs)
    except Exception as error:  # noqa: BLE001 - upstream code: its failure is the finding
        return f"upstream: the original fails too after its own from_pretrained: {_short(error)}"
    return None


def _reloaded_original(target, checkpoint: Path, expected, bound: float, input_ids, torch, **kwargs):
    """(the original loaded from `checkpoint` by its own `from_pretrained`, its logits, how far they are from the
    in-memory original's `expected`) when they are further than `bound`; else None.

    A user loads the checkpoint, so the loaded original is the behaviour the fused class must reproduce. It differs
    from the model that saved the checkpoint only when the original's own save and load lose something (Marian's
    sinusoidal positions are recomputed on load, not read back); then that model is no reference for either class.
    When the original round-trips, the in-memory original stays the reference and a fused mismatch stands.
    """
    try:
        loaded = target.causal_lm.from_pretrained(checkpoint, dtype=torch.float32).eval()
        logits = _logits(loaded, input_ids, torch, **kwargs)
    except Exception:  # noqa: BLE001 - the loaded original cannot serve as reference: the mismatch stands
        return None
    if logits.shape != expected.shape:
        return None
    drift = (logits - expected).abs().max().item()
    return (loaded, logits, drift) if drift > bound else None


def _extra_inputs(original, torch) -> dict:
    """The non-text inputs the original needs to run every class it builds (`fusegen.testkit.extra_inputs`), drawn
    from a fixed seed; the same tensors go to the fused model."""
    generator = torch.Generator().manual_seed(SEED + 2)
    return extra_inputs(original, BATCH, LENGTH, lambda *shape: torch.randn(*shape, generator=generator))


def _reference_logits(original, input_ids, torch, **extra):
    """The original's logits, and the extra forward arguments they needed (`use_cache=False` if the cache breaks)."""
    try:
        return _logits(original, input_ids, torch, **extra), {}
    except Exception as error:  # noqa: BLE001 - some models only fail in their cache setup; try once without it
        try:
            return _logits(original, input_ids, torch, use_cache=False, **extra), {"use_cache": False}
        except Exception:  # noqa: BLE001 - the first failure is the one worth reporting
            raise error from None


def _logits(model, input_ids, torch, **kwargs):
    """Logits of `model` on `input_ids` (with an all-ones mask) and `kwargs`; `input_ids` None: `kwargs` alone."""
    if input_ids is not None:
        kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **kwargs}
    with torch.no_grad():
        output = model(**kwargs)
    logits = output.logits if hasattr(output, "logits") else output[0]
    return logits.float()


def compare_greedy(original, fused, prompt, torch, **inputs) -> str:
    """`same`/`differ` over `NEW_TOKENS` greedy tokens from `prompt` (None: from `inputs` alone, an encoder's
    audio features), or why generation was not compared."""
    if not original.can_generate():
        return "not a generation model"
    config = original.generation_config
    prompts = () if prompt is None else (prompt,)  # not `None` positionally: Whisper's first argument is its features
    kwargs = {
        **({} if prompt is None else {"attention_mask": torch.ones_like(prompt)}),
        **inputs,
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "pad_token_id": config.pad_token_id if config.pad_token_id is not None else 0,
    }
    try:
        with torch.no_grad():
            expected = original.generate(*prompts, **kwargs)
    except Exception as error:  # noqa: BLE001
        return f"original generate fails: {_short(error)}"
    try:
        with torch.no_grad():
            actual = fused.generate(*prompts, **kwargs)
    except Exception as error:  # noqa: BLE001
        return f"fused generate fails: {_short(error)}"
    return "same" if torch.equal(expected, actual) else "differ"
