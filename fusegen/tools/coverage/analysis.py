"""Analysis of the rows: the summary counts, the per-kind counts, which part of a model is fused, and the inherent
cases (what no change on our side makes pass, with the reason)."""

from __future__ import annotations

import re

from fusegen.tools.coverage.rows import Row

TOWERS = ("text", "vision", "audio")
"""Where in a model a class sits: `text` (the text model, and anything not in a tower), a `vision` tower, an `audio`
tower; see `towers_of`."""


TOWER_NAMES = {
    "vision": re.compile(r"(^|_)(vision|visual|image|img|vit)(_|$)", re.IGNORECASE),
    "audio": re.compile(r"(^|_)(audio|speech)(_|$)", re.IGNORECASE),
}
"""A module path component that opens a tower (`model.vision_tower`, `model.visual`, `vision_model`, `audio_tower`)."""


TOWER_LABELS = {"text": "the text model", "vision": "the vision tower", "audio": "the audio tower"}


def tower_of_path(path: str) -> str:
    """The tower of the module at `path`: the first component naming a tower decides (`TOWER_NAMES`), else `text`."""
    for component in path.split("."):
        for tower, pattern in TOWER_NAMES.items():
            if pattern.search(component):
                return tower
    return "text"


def towers_of(row: Row, class_name: str) -> list[str]:
    """The towers holding `class_name` in `row`'s original model (`Inspection.places`, from its default config); a
    class found in both (CLIP's attention) is in both. `text` when the inspection did not see the class."""
    places = row.inspection.places.get(class_name) or [""]
    found = {tower_of_path(place) for place in places}
    return [tower for tower in TOWERS if tower in found]


def _in(row: Row, class_name: str, tower: str | None) -> bool:
    return tower is None or tower in towers_of(row, class_name)


def has_tower(row: Row, tower: str) -> bool:
    """Whether `row`'s original model holds some module class in `tower`."""
    return any(tower_of_path(place) == tower for places in row.inspection.places.values() for place in places)


def has_kind(row: Row, kind: str, tower: str | None = None) -> bool:
    """Whether the model has what fusion kind `kind` fuses (a q/k/v triplet for `qkv`), fused, refused or just present
    (the kind says how to recognise it by name: `fusegen.fusions.base.Kind.present`); in `tower` only, if given."""
    from fusegen import fusions

    test = fusions.kind(kind).present
    for outcome in row.report.get("classes", []):
        if not _in(row, outcome["class"], tower):
            continue
        if any(plan["kind"] == kind for plan in outcome["fused"]):
            return True
        if any(test(refusal["projections"]) for refusal in outcome["refused"]):
            return True
    return any(test(names) for name, names in row.inspection.linears.items() if _in(row, name, tower))


def fused_kind(row: Row, kind: str, tower: str | None = None) -> bool:
    return any(
        plan["kind"] == kind
        for outcome in row.report.get("classes", [])
        if _in(row, outcome["class"], tower)
        for plan in outcome["fused"]
    )


def packed_in(row: Row, part: str, tower: str | None = None) -> bool:
    """Whether the original already stores `part`'s group merged (`qkv_proj`, `gate_up_proj`: `PACKED_*_NAME`) in a
    class of `tower` (any, if None)."""
    packed = PACKED_ATTENTION_NAME if part == "attention" else PACKED_MLP_NAME if part == "MLP" else None
    return bool(packed) and any(
        packed.match(n) for name, names in row.inspection.already_fused.items() if _in(row, name, tower) for n in names
    )


def is_verified(row: Row) -> bool:
    return row.verification is not None and row.verification.status == "verified"


def summary_counts(rows: list[Row]) -> list[tuple[str, int]]:
    fused = [r for r in rows if r.status == "fused"]
    checks = [check for r in fused if r.verification for check in r.verification.checks]
    return (
        [
            ("model types swept", len(rows)),
            ("fused and verified equivalent (under every config)", sum(is_verified(r) for r in fused)),
            ("fused, not verified", sum(not is_verified(r) for r in fused)),
            ("nothing to fuse", sum(r.status == "nothing" for r in rows)),
            ("errors (input the compiler refuses, with a reason)", sum(r.status == "error" for r in rows)),
            (
                "... of which inherent (listed under 'Inherent cases', with the reason)",
                sum(map(_error_inherent, rows)),
            ),
            ("crashes", sum(r.status == "crash" for r in rows)),
            (
                "types with attention fused and verified",
                sum(bool(fused_in(r, "attention")) and is_verified(r) for r in fused),
            ),
            *(
                (
                    f"... in {TOWER_LABELS[tower]}",
                    sum(bool(fused_in(r, "attention", tower)) and is_verified(r) for r in fused),
                )
                for tower in TOWERS
            ),
            ("types with an MLP fused and verified", sum(bool(fused_in(r, "MLP")) and is_verified(r) for r in fused)),
            ("types with a norm fused and verified", sum(bool(fused_in(r, "norm")) and is_verified(r) for r in fused)),
            ("types where a trace stopped early (some class)", sum(bool(trace_stops(r)) for r in rows)),
            ("... of which every stop inherent (listed under 'Inherent cases')", sum(map(_all_stops_inherent, rows))),
            ("types with a fusion refused as unreachable", sum(bool(_refused_by(r, "unreachable")) for r in rows)),
            (
                "configs verified (tiny configs and construction variants)",
                sum(c["status"] == "verified" for c in checks),
            ),
            (
                "construction variants skipped (the original does not run them)",
                sum(c["status"] == "skipped" for c in checks),
            ),
        ]
        + kind_counts(rows)
        + vision_counts(rows)
    )


def vision_counts(rows: list[Row]) -> list[tuple[str, int]]:
    """The vision towers: how many types have one, and their q/k/v: separate (and of those, fused and verified) or
    stored packed already."""
    having = [r for r in rows if has_kind(r, "qkv", "vision")]
    return [
        ("types with a vision tower", sum(has_tower(r, "vision") for r in rows)),
        ("types with a q/k/v triplet in the vision tower", len(having)),
        (
            "... of which the tower's q/k/v fused and verified",
            sum(fused_kind(r, "qkv", "vision") and is_verified(r) for r in having),
        ),
        ("types whose vision tower already packs q/k/v", sum(packed_in(r, "attention", "vision") for r in rows)),
    ]


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


_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)


_MLP_NAME = re.compile(r"mlp|feedforward|feed_forward|ffn|expert|moe|dense|gated", re.IGNORECASE)


_NORM_NAME = re.compile(r"norm", re.IGNORECASE)


PACKED_ATTENTION_NAME = re.compile(r"^(qkv_proj|qkv|c_attn|Wqkv|query_key_value|wqkv)$")


PACKED_MLP_NAME = re.compile(r"^(gate_up_proj|w13|gate_up)$")


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


def fused_in(row: Row, part: str, tower: str | None = None) -> list[str]:
    """The classes of `row` with a fusion in `part` (of `tower`, if given)."""
    return list(
        dict.fromkeys(
            outcome["class"]
            for outcome in row.report.get("classes", [])
            if _in(row, outcome["class"], tower)
            for plan in outcome["fused"]
            if part_of(outcome["class"], plan["kind"], [name for name, _ in plan["shards"]]) == part
        )
    )


def refused_in(row: Row, part: str, tower: str | None = None) -> list[str]:
    """The rule ids of `row`'s refusals in `part` (of `tower`, if given), each once."""
    return list(
        dict.fromkeys(
            refusal["rule"]
            for outcome in row.report.get("classes", [])
            if _in(row, outcome["class"], tower)
            for refusal in outcome["refused"]
            if part_of(outcome["class"], "", refusal["projections"]) == part
        )
    )


def _refused_by(row: Row, rule: str) -> list[str]:
    return [o["class"] for o in row.report.get("classes", []) for r in o["refused"] if r["rule"] == rule]


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


INHERENT_SKIPS: dict[str, tuple[str, str]] = {
    "llama4": (
        "upstream fault",
        (
            "`Llama4ForConditionalGeneration.forward` reads `image_outputs` off its language model's output "
            "(`MoeCausalLMOutputWithPast`, which has no such field) on every call, with or without images "
            "(transformers 5.24): the original never returns logits to compare with, so the fused classes stay "
            "unverified"
        ),
    ),
}
"""model type -> (category, reason) for a verification skipped because the original's forward cannot run on any
input we can build; see `tests/test_coverage_inherent.py`, which checks each still fails as it says."""


INHERENT_ERROR_NOTES: dict[str, str] = {
    "gemma3n": "its text part is swept as `gemma3n_text`",
}
"""model type -> what to add to an inherent error's reason (where the rest of the model is covered)."""


_MISSING_LIBRARY = re.compile(r"requires the (\w+) library but it was not found")


def inherent_cases(row: Row) -> list[tuple[str, str, str]]:
    """(what, category, reason) for each case of `row` that is inherent: a build error that names a library this
    environment lacks (`environment`), each trace stop listed in `INHERENT_STOPS`, and a skipped verification
    listed in `INHERENT_SKIPS`."""
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
    if row.verification is not None and row.verification.status == "skipped" and row.model_type in INHERENT_SKIPS:
        category, reason = INHERENT_SKIPS[row.model_type]
        cases.append(("verification", category, reason))
    return cases


def _all_stops_inherent(row: Row) -> bool:
    stops = trace_stops(row)
    return bool(stops) and all((row.model_type, name) in INHERENT_STOPS for name, _ in stops)


def _error_inherent(row: Row) -> bool:
    return row.status == "error" and any(what == "build" for what, _, _ in inherent_cases(row))


def trace_stops(row: Row) -> list[tuple[str, str]]:
    """(class, why) for each candidate class of `row` whose trace stopped before the end of its forward."""
    return [(o["class"], o["trace_stopped"]) for o in row.report.get("classes", []) if o.get("trace_stopped")]
