"""`python -m fusegen.tools.coverage`: build every causal LM, verify each fused one on a tiny random model, write the table.

For each model type the sweep (`fusegen.tools.sweep`) says fused, nothing to fuse, or why not. Each fused type is then
checked in its own worker process, with a timeout: the generated module is imported from a temporary directory, the
ORIGINAL causal LM is built from a tiny config (`fusegen.compiler.shrink`) with every parameter randomised (biases too, so a
mis-sliced bias shows), saved with `save_pretrained`, and loaded into the fused class with `from_pretrained`, the path
users take. Any missing, unexpected or mismatched key fails the check; then logits on a fixed random input must agree
within `logits_tolerance` (TOLERANCE times the logits' scale), and a few greedy tokens must be identical.

The result is `docs/coverage.md`, regenerated (never edited) by this command.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fusegen.errors import first_line as _first_line
from fusegen.errors import short_error as _short
from fusegen.testkit import (  # the one kit (fusegen/testkit.py)
    TOLERANCE,
    extra_inputs,
    input_rows,
    logits_tolerance,
    model_config,
    random_input,
    random_model,
)

SEED = 0
BATCH, LENGTH = 2, 12
NEW_TOKENS = 4
TIMEOUT = 600.0
ALREADY_FUSED = re.compile(r"^(qkv_proj|qkv|c_attn|Wqkv|query_key_value|wqkv|in_proj|gate_up_proj|w13|gate_up)$")


@dataclass
class Verification:
    """Outcome of the equivalence check of one fused model type."""

    status: str
    """`verified`, `mismatch` (loaded but computes something else), `failed` (the fused side broke),
    `skipped` (no tiny config, or the original itself cannot run on text) or `timeout`/`crash`."""
    max_abs_diff: float | None = None
    greedy: str = ""
    """`same`, `differ`, or why generation was not compared."""
    reason: str = ""
    seconds: float = 0.0
    checks: list[dict] = field(default_factory=list)
    """One `ConfigCheck` (as data) per config verified: the tiny config first, then each construction variant."""
    left_out: list[str] = field(default_factory=list)
    """Construction variants found but not verified (over the `--variants` limit)."""


@dataclass
class Inspection:
    """What the original model holds, per module class: its linear children and already-merged weights."""

    linears: dict[str, list[str]] = field(default_factory=dict)
    already_fused: dict[str, list[str]] = field(default_factory=dict)
    error: str = ""


@dataclass
class Row:
    model_type: str
    status: str
    report: dict
    error: str
    inspection: Inspection
    verification: Verification | None


# --- worker processes ------------------------------------------------------------------------------------------------


def run_isolated(tasks: list[tuple[str, Callable, tuple]], jobs: int, timeout: float) -> Iterator[tuple[str, object]]:
    """Run `fn(*args)` for each `(key, fn, args)` in a forked process of its own, `jobs` at a time.

    A process per task (not a pool) so that a hung model can be killed at `timeout` and a segfault costs one result,
    and so every generated module registers its checkpoint conversions in a clean Transformers.
    Yields `(key, result)`, where a timeout or a dead worker is a `Verification`-style dict with that status.
    """
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pending = list(tasks)
    running: dict = {}
    while pending or running:
        while pending and len(running) < max(jobs, 1):
            key, fn, args = pending.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(sender, fn, args), daemon=True)
            process.start()
            sender.close()
            running[receiver] = (key, process, time.monotonic())
        for receiver in wait(list(running), timeout=1.0):
            key, process, _ = running.pop(receiver)
            try:
                result = receiver.recv()
            except EOFError:
                result = {"status": "crash", "reason": f"worker died (exit code {process.exitcode})"}
            process.join()
            receiver.close()
            yield key, result
        for receiver, (key, process, started) in list(running.items()):
            if time.monotonic() - started > timeout:
                process.kill()
                process.join()
                receiver.close()
                del running[receiver]
                yield key, {"status": "timeout", "reason": f"no result within {timeout:.0f} s"}


def _child(sender, fn: Callable, args: tuple) -> None:
    """Worker body: one thread (the machine is shared), quiet Transformers logs, the result sent back as data."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        result = fn(*args)
    except BaseException:  # noqa: BLE001 - anything raised is the result
        result = {"status": "crash", "reason": traceback.format_exc(limit=8)}
    sender.send(result)
    sender.close()


# --- inspection: what the original model holds -----------------------------------------------------------------------


def inspect_original(model_type: str) -> dict:
    """Linear children and already-merged weights of each module class of the original model, built on `meta`.

    The default config is what the compiler analysed (its text part when the causal LM takes that); if the model
    cannot be built from it, the tiny config stands in.
    """
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import tiny_config

    target = resolve(model_type)
    model, error = None, None
    for make_config in (target.config_class, lambda: tiny_config(target.config_class)):
        try:
            model = _build_on_meta(target, model_config(target, make_config()))
            break
        except Exception as failure:  # noqa: BLE001 - try the next config, report the first failure
            error = error or failure
    if model is None:
        return asdict(Inspection(error=f"{type(error).__name__}: {_first_line(error)}"))
    inspection = Inspection()
    for module in model.modules():
        name = type(module).__name__
        linears = [child for child, sub in module.named_children() if _is_linear(sub)]
        if len(linears) >= 2 and name not in inspection.linears:
            inspection.linears[name] = linears
        merged = [n for n in linears if ALREADY_FUSED.match(n)]
        merged += [n for n, p in module.named_parameters(recurse=False) if ALREADY_FUSED.match(n) and p.dim() >= 2]
        if merged and name not in inspection.already_fused:
            inspection.already_fused[name] = merged
    return asdict(inspection)


def _build_on_meta(target, config):
    import torch

    with torch.device("meta"):
        return target.causal_lm(config)


def _is_linear(module) -> bool:
    """`nn.Linear` and GPT-2's `Conv1D` (a linear with a transposed weight) both count as projections."""
    from torch import nn

    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


# --- verification: fused == original on a tiny random model, under every construction variant ---------------------


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


def verify(model_type: str, text: str, variants: int | None = None) -> dict:
    """Equivalence of the fused causal LM (loaded from the original's checkpoint) and the original; plain data.

    Checked under the tiny config and under every construction variant of it (`fusegen.compiler.validate.
    construction_variants`, all fields probed, at most `variants` of them if given): the type is verified only
    when every config that the original runs is verified (see `_combined`).
    """
    import torch

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"fusegen-coverage-{model_type}-") as tmp:
        result = _verify_in(Path(tmp), model_type, text, torch, variants)
    result.seconds = time.perf_counter() - start
    return asdict(result)


def _verify_in(tmp: Path, model_type: str, text: str, torch, variants: int | None = None) -> Verification:
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import ShrinkError, tiny_config

    target = resolve(model_type)
    try:
        fused_class = import_causal_lm(tmp, model_type, text, target.causal_lm.__name__)
    except Exception as error:  # noqa: BLE001
        return Verification("failed", reason=f"generated module: {_short(error)}")
    try:
        config = model_config(target, tiny_config(target.config_class))
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
    from fusegen.compiler.validate import merging_classes as merging_in_text

    return merging_in_text(text)


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
    exercised = sorted(set(merging_classes(fused).values()) - set(unexercised))
    rows = input_rows(config)
    input_ids = random_input(config, batch=BATCH * rows)
    extra = _extra_inputs(original, torch)
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
        actual = _logits(fused, input_ids, torch, **extra, **kwargs)
    except Exception as error:  # noqa: BLE001
        upstream = _loaded_original_fails(target, checkpoint, input_ids, torch, **extra, **kwargs)
        if upstream is not None:
            return ConfigCheck(label, "skipped", reason=upstream)
        return ConfigCheck(label, "failed", reason=f"fused forward: {_short(error)}")
    if expected.shape != actual.shape:
        return ConfigCheck(label, "mismatch", reason=f"logits shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    diff = (expected - actual).abs().max().item()
    if math.isnan(diff):
        return ConfigCheck(label, "mismatch", reason="fused logits contain NaN (the original's do not)")
    greedy = compare_greedy(original, fused, input_ids[:rows, : LENGTH // 2], torch)
    bound = logits_tolerance(expected)
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


def merging_classes(fused) -> dict[str, str]:
    """`{original class name: fused class name}` for the generated classes that hold a merged linear."""
    import inspect

    from fusegen.compiler.propagate import PREFIX

    module = sys.modules[type(fused).__module__]
    found = {}
    for name, value in vars(module).items():
        if isinstance(value, type) and name.startswith(PREFIX) and value.__module__ == module.__name__:
            try:
                source = inspect.getsource(value)
            except (OSError, TypeError):
                continue
            if "MergedColumnLinear(" in source:
                found[name.removeprefix(PREFIX)] = name
    return found


def unused_fused_classes(original, fused) -> tuple[list[str], list[str]]:
    """(fused classes the fused model never builds though the original builds their original, fused classes whose
    original the tiny model does not contain at all).

    The first is a fault that loading and logits cannot show: the fused model silently runs the original class.
    The second only means the tiny config does not exercise that class.
    """
    built = {type(module).__name__ for module in fused.modules()}
    originals = {type(module).__name__ for module in original.modules()}
    unused, unexercised = [], []
    for original_name, fused_name in sorted(merging_classes(fused).items()):
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
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    logits = output.logits if hasattr(output, "logits") else output[0]
    return logits.float()


def compare_greedy(original, fused, prompt, torch) -> str:
    """`same`/`differ` over `NEW_TOKENS` greedy tokens, or why generation was not compared."""
    if not original.can_generate():
        return "not a generation model"
    config = original.generation_config
    kwargs = {
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "pad_token_id": config.pad_token_id if config.pad_token_id is not None else 0,
    }
    try:
        with torch.no_grad():
            expected = original.generate(prompt, **kwargs)
    except Exception as error:  # noqa: BLE001
        return f"original generate fails: {_short(error)}"
    try:
        with torch.no_grad():
            actual = fused.generate(prompt, **kwargs)
    except Exception as error:  # noqa: BLE001
        return f"fused generate fails: {_short(error)}"
    return "same" if torch.equal(expected, actual) else "differ"


# --- the whole run ---------------------------------------------------------------------------------------------------


def preload() -> None:
    """Import what every worker needs once, before forking: it otherwise costs each worker seconds."""
    import transformers.core_model_loading
    import transformers.generation.utils
    import transformers.modeling_utils  # noqa: F401


def collect(model_types: list[str], jobs: int, timeout: float, log=print, variants: int | None = None) -> list[Row]:
    """Sweep, then inspect every type and verify every fused one (under at most `variants` construction variants
    besides the tiny config; None: all of them), each in its own process."""
    from fusegen.tools.sweep import sweep

    preload()

    entries = {}
    for done, entry in enumerate(sweep(model_types, jobs), start=1):
        entries[entry.model_type] = entry
        log(f"[build {done}/{len(model_types)}] {entry.model_type}: {entry.status}")
    tasks = [(f"inspect:{t}", inspect_original, (t,)) for t in model_types]
    tasks += [(f"verify:{t}", verify, (t, e.text, variants)) for t, e in entries.items() if e.status == "fused"]
    tasks.sort(key=lambda task: task[0].partition(":")[2])
    results: dict[str, dict] = {}
    for done, (key, result) in enumerate(run_isolated(tasks, jobs, timeout), start=1):
        results[key] = result
        if key.startswith("verify:"):
            configs = len(result.get("checks", [])) or 1
            log(
                f"[verify {done}/{len(tasks)}] {key[7:]}: {result.get('status')} ({configs} configs) "
                f"{result.get('reason', '')[:160]}"
            )
    rows = []
    for model_type in model_types:
        entry = entries[model_type]
        inspected = results.get(f"inspect:{model_type}", {})
        if "status" in inspected:  # the inspection itself timed out or crashed
            inspected = {"error": inspected.get("reason", "")}
        verified = results.get(f"verify:{model_type}")
        rows.append(
            Row(
                model_type,
                entry.status,
                entry.report,
                entry.error,
                Inspection(**inspected),
                (
                    Verification(**{k: v for k, v in verified.items() if k in Verification.__dataclass_fields__})
                    if verified
                    else None
                ),
            )
        )
    return rows


# --- analysis of the rows --------------------------------------------------------------------------------------------


def has_kind(row: Row, kind: str) -> bool:
    """Whether the model has what fusion kind `kind` fuses (a q/k/v triplet for `qkv`), fused, refused or just present
    (the kind says how to recognise it by name: `fusegen.fusions.base.Kind.present`)."""
    from fusegen import fusions

    test = fusions.kind(kind).present
    for outcome in row.report.get("classes", []):
        if any(plan["kind"] == kind for plan in outcome["fused"]):
            return True
        if any(test(refusal["projections"]) for refusal in outcome["refused"]):
            return True
    return any(test(names) for names in row.inspection.linears.values())


def fused_kind(row: Row, kind: str) -> bool:
    return any(plan["kind"] == kind for outcome in row.report.get("classes", []) for plan in outcome["fused"])


def is_verified(row: Row) -> bool:
    return row.verification is not None and row.verification.status == "verified"


def summary_counts(rows: list[Row]) -> list[tuple[str, int]]:
    fused = [r for r in rows if r.status == "fused"]
    checks = [check for r in fused if r.verification for check in r.verification.checks]
    return [
        ("model types swept", len(rows)),
        ("fused and verified equivalent (under every config)", sum(is_verified(r) for r in fused)),
        ("fused, not verified", sum(not is_verified(r) for r in fused)),
        ("nothing to fuse", sum(r.status == "nothing" for r in rows)),
        ("errors (input the compiler refuses, with a reason)", sum(r.status == "error" for r in rows)),
        ("... of which inherent (listed under 'Inherent cases', with the reason)", sum(map(_error_inherent, rows))),
        ("crashes", sum(r.status == "crash" for r in rows)),
        (
            "types with attention fused and verified",
            sum(bool(_fused_in(r, "attention")) and is_verified(r) for r in fused),
        ),
        ("types with an MLP fused and verified", sum(bool(_fused_in(r, "MLP")) and is_verified(r) for r in fused)),
        ("types with a norm fused and verified", sum(bool(_fused_in(r, "norm")) and is_verified(r) for r in fused)),
        ("types where a trace stopped early (some class)", sum(bool(trace_stops(r)) for r in rows)),
        ("... of which every stop inherent (listed under 'Inherent cases')", sum(map(_all_stops_inherent, rows))),
        ("types with a fusion refused as unreachable", sum(bool(_refused_by(r, "unreachable")) for r in rows)),
        ("configs verified (tiny configs and construction variants)", sum(c["status"] == "verified" for c in checks)),
        (
            "construction variants skipped (the original does not run them)",
            sum(c["status"] == "skipped" for c in checks),
        ),
    ] + kind_counts(rows)


def kind_counts(rows: list[Row]) -> list[tuple[str, int]]:
    """Per fusion kind with a coverage label (`Kind.label`): the types that have what it fuses, and how many of
    those have it fused and verified."""
    from fusegen import fusions

    counts = []
    for kind in (k for k in fusions.kinds() if k.label):
        pieces, group = kind.label
        having = [r for r in rows if has_kind(r, kind.name)]
        counts.append((f"types with {group}", len(having)))
        counts.append(
            (
                f"... of which {pieces} fused and verified",
                sum(fused_kind(r, kind.name) and is_verified(r) for r in having),
            )
        )
    return counts


# --- per-type summary: which part of the model is fused ------------------------------------------------------------

_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)
_MLP_NAME = re.compile(r"mlp|feedforward|feed_forward|ffn|expert|moe|dense|gated", re.IGNORECASE)
_NORM_NAME = re.compile(r"norm", re.IGNORECASE)
_PACKED_ATTENTION = re.compile(r"^(qkv_proj|qkv|c_attn|Wqkv|query_key_value|wqkv)$")
_PACKED_MLP = re.compile(r"^(gate_up_proj|w13|gate_up)$")
PARTS = ("attention", "MLP", "norm", "other")


def part_of(class_name: str, kind: str, projections) -> str:
    """Which part of a layer a fusion (or refusal) belongs to: `attention`, `MLP`, `norm` or `other`.

    The kind decides where it says (a kind naming a norm, `qkv`, `glu`), then the projections' roles (q/k/v, gate/up),
    then the class's name (`BartAttention`'s `kv_proj`, an MLA pair in `DeepseekV3Attention`). Only the summary
    reads it: a wrong guess puts a fusion in the wrong column, never changes what was verified.
    """
    from fusegen import fusions

    if "norm" in kind.lower():
        return "norm"
    if kind == "qkv" or fusions.kind("qkv").present(projections):
        return "attention"
    if kind == "glu" or fusions.kind("glu").present(projections):
        return "MLP"
    for part, pattern in (("norm", _NORM_NAME), ("attention", _ATTENTION_NAME), ("MLP", _MLP_NAME)):
        if pattern.search(class_name):
            return part
    return "other"


def _fused_in(row: Row, part: str) -> list[str]:
    """The classes of `row` with a fusion in `part`."""
    return list(
        dict.fromkeys(
            outcome["class"]
            for outcome in row.report.get("classes", [])
            for plan in outcome["fused"]
            if part_of(outcome["class"], plan["kind"], [name for name, _ in plan["shards"]]) == part
        )
    )


def _refused_in(row: Row, part: str) -> list[str]:
    """The rule ids of `row`'s refusals in `part`, each once."""
    return list(
        dict.fromkeys(
            refusal["rule"]
            for outcome in row.report.get("classes", [])
            for refusal in outcome["refused"]
            if part_of(outcome["class"], "", refusal["projections"]) == part
        )
    )


def _refused_by(row: Row, rule: str) -> list[str]:
    return [o["class"] for o in row.report.get("classes", []) for r in o["refused"] if r["rule"] == rule]


# --- inherent cases: what no change on our side makes pass, with the reason --------------------------------------

INHERENT_STOPS: dict[tuple[str, str], tuple[str, str]] = {
    ("phi4_multimodal", "Phi4MultimodalImageEmbedding"): (
        "data-dependent forward",
        (
            "reached only with images; its forward loops over the crop grid of each image read off the values of "
            "`image_sizes` (`height, width = image_sizes[idx]`), which no meta value knows; its linears run one after "
            "the other (`img_projection_up` then `img_projection_down`), so there is no group to fuse either"
        ),
    ),
    ("phi4_multimodal", "Phi4MultimodalAudioEmbedding"): (
        "data-dependent forward",
        (
            "reached only with audio; its forward sizes the audio embeddings from the values of its size arguments "
            "(`len(...)` of per-sample sizes); its linears run one after the other (`up_proj_for_*` then `down_proj_for_*`), "
            "so there is no group to fuse either"
        ),
    ),
    ("big_bird", "BigBirdBlockSparseAttention"): (
        "meta-trace limit",
        (
            "block-sparse attention runs only on at least (5 + 2 * num_random_blocks) * block_size tokens with four "
            "block masks that BigBirdModel derives from a real attention mask; the model's meta forward stops first "
            "(`pad_token_id in input_ids` calls `.item()`), and on shorter inputs BigBirdModel switches its layers to "
            "full attention by rebuilding them (`set_attention_type` copies `query`/`key`/`value` by name)"
        ),
    ),
}
"""(model type, class) -> (category, reason) for trace stops no input we can build gets past; see
`tests/test_coverage_inherent.py`, which checks each still stops where it says."""

INHERENT_ERROR_NOTES: dict[str, str] = {
    "gemma3n": "its text part is swept as `gemma3n_text`",
}
"""model type -> what to add to an inherent error's reason (where the rest of the model is covered)."""

_MISSING_LIBRARY = re.compile(r"requires the (\w+) library but it was not found")


def inherent_cases(row: Row) -> list[tuple[str, str, str]]:
    """(what, category, reason) for each case of `row` that is inherent: a build error that names a library this
    environment lacks (`environment`), and each trace stop listed in `INHERENT_STOPS`."""
    cases = []
    libraries = list(dict.fromkeys(_MISSING_LIBRARY.findall(row.error or "")))
    if row.status == "error" and libraries:
        reason = f"the model needs the {' and '.join(libraries)} libraries, which this environment does not install"
        note = INHERENT_ERROR_NOTES.get(row.model_type)
        cases.append(("build", "environment", f"{reason}; {note}" if note else reason))
    for name, _ in trace_stops(row):
        if (row.model_type, name) in INHERENT_STOPS:
            category, reason = INHERENT_STOPS[(row.model_type, name)]
            cases.append((f"trace of {name}", category, reason))
    return cases


def _all_stops_inherent(row: Row) -> bool:
    stops = trace_stops(row)
    return bool(stops) and all((row.model_type, name) in INHERENT_STOPS for name, _ in stops)


def _error_inherent(row: Row) -> bool:
    return row.status == "error" and any(what == "build" for what, _, _ in inherent_cases(row))


def trace_stops(row: Row) -> list[tuple[str, str]]:
    """(class, why) for each candidate class of `row` whose trace stopped before the end of its forward."""
    return [(o["class"], o["trace_stopped"]) for o in row.report.get("classes", []) if o.get("trace_stopped")]


def part_cell(row: Row, part: str) -> str:
    """`fused` (verified or not: the last column says), `refused: <rules>`, `packed` (the checkpoint already stores
    it merged), or empty when the model has no such group."""
    if _fused_in(row, part):
        return "fused"
    refused = _refused_in(row, part)
    if refused:
        return "refused: " + ", ".join(refused)
    packed = _PACKED_ATTENTION if part == "attention" else _PACKED_MLP if part == "MLP" else None
    if packed and any(packed.match(n) for names in row.inspection.already_fused.values() for n in names):
        return "packed"
    return ""


def _summary_markdown(row: Row) -> str:
    refusals = [
        f"{refusal['rule']}: {outcome['class']}"
        for outcome in row.report.get("classes", [])
        for refusal in outcome["refused"]
    ]
    stops = [f"{name}: {why}" for name, why in trace_stops(row)]
    cells = [f"`{row.model_type}`", *(_escape(part_cell(row, part)) for part in PARTS)]
    cells += [_cell(list(dict.fromkeys(refusals))), _cell(stops), _escape(_configs_cell(row))]
    return "| " + " | ".join(cells) + " |"


def _configs_cell(row: Row) -> str:
    """`yes: tiny + N variants` when every config is verified, else what is not, by config."""
    v = row.verification
    if v is None:
        return "" if row.status != "fused" else "no: not run"
    checks = v.checks or [{"config": "tiny", "status": v.status}]
    variants = [c for c in checks if c["config"] != "tiny"]
    passed = [c["config"] for c in variants if c["status"] == "verified"]
    skipped = [c["config"] for c in variants if c["status"] == "skipped"]
    if v.status != "verified":
        return f"no ({v.status})"
    text = f"yes: tiny + {len(passed)} variant{'s' if len(passed) != 1 else ''}"
    if passed:
        text += f" ({', '.join(passed)})"
    if skipped:
        text += f"; skipped: {', '.join(skipped)}"
    if v.left_out:
        text += f"; {len(v.left_out)} not run (--variants)"
    return text


# --- markdown --------------------------------------------------------------------------------------------------------


def render_markdown(rows: list[Row]) -> str:
    """The whole document; nothing in it depends on the run (no timings), so a rerun only diffs on real changes."""
    import transformers

    import fusegen

    lines = [
        "# Coverage: every causal LM of the installed Transformers",
        "",
        (
            f"Generated by `python -m fusegen.tools.coverage` (fusegen {fusegen.__version__}, transformers "
            f"{transformers.__version__}, torch {_torch_version()}). Never edit by hand: rerun the command."
        ),
        "",
        (
            f"Verification: the original causal LM is built from a tiny config (`fusegen/compiler/shrink.py`), every "
            f"parameter drawn by `fusegen.testkit.randomise` (matrices N(0, 1/fan_in), vectors N(0, 1)), saved with `save_pretrained`, and loaded into the fused class with "
            f"`from_pretrained` (any missing, unexpected or mismatched key fails). Logits on a fixed random "
            f"{BATCH}x{LENGTH} input must agree within {TOLERANCE:g} times their scale, max(1, max |logit|) (fp32; "
            "`fusegen.compiler.validate.logits_tolerance`), and {NEW_TOKENS} greedy tokens must be "
            "identical. The same check runs under every construction variant of the tiny config: each config with one "
            "field changed that changes what `__init__` builds (a bias flag, MQA, dense vs MoE layers, a layer-kind "
            "list made uniform, an optional projection; `fusegen/compiler/validate.py`, `construction_variants`, every "
            "field probed). A type counts as verified only if every config verified; a variant the original itself "
            "cannot run is listed as skipped, never counted."
        ),
        "",
        "## Summary",
        "",
        "| | model types |",
        "|---|---:|",
    ]
    lines += [f"| {label} | {count} |" for label, count in summary_counts(rows)]
    lines += [
        "",
        "## Per model type: what is fused",
        "",
        (
            "`fused`: merged (the last column says whether verified); `refused: <rule ids>`: a group was found and "
            "declined (the detailed table below gives each reason); `packed`: the checkpoint already stores the group "
            "merged. Trace stops name the class and why its trace ended before the end of its forward."
        ),
        "",
        "| model type | attention | MLP | norm | other | refused (rule: class) | trace stopped | verified under |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_summary_markdown(row) for row in rows]
    lines += ["", "## Unreachable fusions, and why", ""]
    unreachable = [
        f"- `{row.model_type}`, {outcome['class']}: {refusal['reason']}"
        for row in rows
        for outcome in row.report.get("classes", [])
        for refusal in outcome["refused"]
        if refusal["rule"] == "unreachable"
    ]
    lines += unreachable or ["None: every fused class is built by its causal LM."]
    lines += [
        "",
        "## Inherent cases, and why",
        "",
        (
            "Errors and trace stops that no change on our side makes pass: `environment` (a library this environment "
            "does not install), `data-dependent forward` (the forward's structure follows tensor values), "
            "`meta-trace limit` (no input we can build reaches the class on `meta`). Upstream faults of a default "
            "config are worked around in `fusegen/compiler/shrink.py` (`FIXES`); a config the original itself does not "
            "run after its own `from_pretrained` is listed as skipped with `upstream:` in its reason."
        ),
        "",
    ]
    inherent = [
        f"- `{row.model_type}`, {what}: **{category}**: {reason}"
        for row in rows
        for what, category, reason in inherent_cases(row)
    ]
    lines += inherent or ["None."]
    lines += [
        "",
        "## Per model type: details",
        "",
        "| model type | build | fused | refused | already fused | verified | error |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row_markdown(row) for row in rows]
    return "\n".join(lines) + "\n"


def _torch_version() -> str:
    import torch

    return torch.__version__


def _row_markdown(row: Row) -> str:
    fused, refused = [], []
    for outcome in row.report.get("classes", []):
        for plan in outcome["fused"]:
            shards = " + ".join(name for name, _ in plan["shards"])
            fused.append(f"{outcome['class']}: {shards} → {plan['merged']} ({plan['kind']})")
        for refusal in outcome["refused"]:
            refused.append(
                f"{outcome['class']}: {' + '.join(refusal['projections'])}: {refusal['rule']}: {refusal['reason']}"
            )
    already = [f"{cls}: {', '.join(names)}" for cls, names in row.inspection.already_fused.items()]
    cells = [
        f"`{row.model_type}`",
        row.status,
        _cell(fused),
        _cell(refused),
        _cell(already),
        _verified_cell(row),
        _cell(
            [_error_line(row.error)]
            if row.error
            else ([f"inspection: {row.inspection.error}"] if row.inspection.error else [])
        ),
    ]
    return "| " + " | ".join(cells) + " |"


def _verified_cell(row: Row) -> str:
    v = row.verification
    if v is None:
        return "" if row.status != "fused" else "no: not run"
    if v.status == "verified":
        note = f"; {v.reason}" if v.reason else ""
        configs = f"{len(v.checks)} configs; " if len(v.checks) > 1 else ""
        return _escape(f"yes ({configs}max abs diff {v.max_abs_diff:.1e}; greedy {v.greedy}{note})")
    detail = v.reason or v.status
    return _escape(f"no ({v.status}): {detail}")


def _error_line(error: str) -> str:
    """The last line of a traceback (or the whole message of a reasoned error)."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines and lines[0].startswith("Traceback") else " ".join(lines)


def _cell(items: list[str]) -> str:
    return "<br>".join(_escape(item) for item in items)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:400]


# --- command line ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusegen.tools.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes (default 1)")
    parser.add_argument("--output", type=Path, default=Path("docs/coverage.md"), metavar="FILE")
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types only")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, metavar="S", help="per model type, in seconds")
    parser.add_argument(
        "--variants",
        type=int,
        default=None,
        metavar="N",
        help="verify at most N construction variants per type besides the tiny config (default: all)",
    )
    args = parser.parse_args(argv)

    from fusegen.compiler.resolve import causal_lm_types

    known = causal_lm_types()
    model_types = known if not args.only else list(dict.fromkeys(args.only))
    unknown = [t for t in model_types if t not in known]
    if unknown:
        parser.error(f"unknown model types: {', '.join(unknown)}")
    start = time.perf_counter()
    log = lambda line: print(line, file=sys.stderr, flush=True)
    rows = collect(model_types, args.jobs, args.timeout, log=log, variants=args.variants)
    text = render_markdown(rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    for label, count in summary_counts(rows):
        print(f"{label}: {count}")
    print(f"wrote {args.output} ({len(rows)} model types in {time.perf_counter() - start:.0f} s, {args.jobs} jobs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
