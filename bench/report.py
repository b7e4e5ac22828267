"""bench/run.py's report: every line it logs, the summary tables, the flat JSON keys and the Markdown tables.

Nothing here measures; each function takes figures `bench/harness.py` produced and formats them (the same text
and keys as before the split, so docs/benchmarks.md and scripts reading the JSON see no change).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import DTYPES


def log(*args) -> None:
    print(*args, flush=True)


def noise_note(row: dict) -> str:
    note = f"{row['used_rounds']}/{row['rounds']} rounds"
    return note + (" NOISY" if row["noisy"] else "")


# --------------------------------------------------------------------------------------------------------------------
# one line per measurement, as it is taken


def machine_line(machine: dict, layers: int) -> str:
    return (
        f"fusegen bench ({'quick' if machine['quick'] else 'full'}): {machine['cpu']}, {machine['cores']} cores, "
        f"torch {machine['torch']} ({machine['cpu_capability']}), transformers {machine['transformers']}, "
        f"torch.set_num_threads({machine['threads']}), {layers} layers, "
        f"load average {' '.join(f'{x:.2f}' for x in machine['loadavg_start'])}"
    )


def bandwidth_line(bw: dict) -> str:
    return (
        f"memory bandwidth: 1 GiB copy_ {bw['copy_gbps']:.1f} GB/s (read+write, median; best {bw['copy_gbps_best']:.1f}), "
        f"1 GiB read (sum) {bw['read_gbps']:.1f} GB/s ({noise_note(bw)})"
    )


def gemv_line(gemv_gbps: dict) -> str:
    return "batch-1 GEMV ceiling (1 x 2048 @ 2048 x 128256): " + ", ".join(
        f"{name} {gbps:.1f} GB/s" for name, gbps in gemv_gbps.items()
    )


def numerics_line(diff: dict) -> str:
    return (
        f"  numerics: max|logits diff| prompt {diff['prompt']:.3g}, decode step {diff['decode']:.3g}, "
        f"batch-1 decode step {diff['decode_batch1']:.3g}"
    )


def decode_line(key: str, row: dict) -> str:
    return (
        f"  decode  {key:26} orig {row['orig_ms']:8.2f} ms  fused {row['fused_ms']:8.2f} ms  "
        f"ratio {row['ratio']:.3f} (paired IQR {row['paired_iqr'][0]:.3f}-{row['paired_iqr'][1]:.3f}, "
        f"{noise_note(row)})  floor {row['floor_ms']:.1f} ms at {row['copy_gbps']:.1f} GB/s: "
        f"fused at {row['fused_floor_fraction']:.0%} (of the GEMV ceiling: {row['fused_gemv_fraction']:.0%})"
        + (f"; A/A control (fused again / fused) {row['aa_ratio']:.3f}" if "aa_ratio" in row else "")
    )


def prefill_line(key: str, row: dict) -> str:
    return (
        f"  prefill {key:26} orig {row['orig_ms']:8.1f} ms  fused {row['fused_ms']:8.1f} ms  "
        f"ratio {row['ratio']:.3f} (paired IQR {row['paired_iqr'][0]:.3f}-{row['paired_iqr'][1]:.3f}, "
        f"{noise_note(row)})"
    )


def load_lines(name: str, dtype: str, row: dict) -> list[str]:
    lines = []
    for v in ("orig", "fused"):
        m = row[v]
        lines.append(
            f"  load {name} {dtype} {v:5}: import {m['import_s']:.2f} s, from_pretrained {m['from_pretrained_s']:.2f} s, "
            f"first forward {m['first_forward_s']:.2f} s, peak RSS {m['peak_rss_mib']:.0f} MiB "
            f"({m['rss_after_import_mib']:.0f} after import; VmHWM {m['vm_hwm_mib']:.0f})"
        )
    lines.append(
        f"  load {name} {dtype}: load ratio {row['load_ratio']:.2f}, peak RSS ratio {row['rss_ratio']:.2f} "
        f"(growth after import {row['rss_growth_ratio']:.2f}; {noise_note(row)})"
    )
    return lines


def compile_line(dtype: str, cache_len: int, row: dict) -> str:
    e, c = row["eager"], row["compiled"]
    return (
        f"  compile llama1b {dtype} b1 kv{cache_len}: compile {row['orig_compile_s']:.0f} s (orig) / "
        f"{row['fused_compile_s']:.0f} s (fused); eager orig {e['orig_ms']:.1f} fused {e['fused_ms']:.1f} ms "
        f"(ratio {e['ratio']:.3f}); compiled orig {c['orig_ms']:.1f} fused {c['fused_ms']:.1f} ms "
        f"(ratio {c['ratio']:.3f}; {noise_note(c)}); max|compiled - eager| {row['fused_compiled_vs_eager_maxdiff']:.2g}"
    )


def build_line(row: dict) -> str:
    return (
        f"  build: fusegen build llama qwen2 {row['build_s']:.2f} s, import floor {row['import_floor_s']:.2f} s, "
        f"ratio {row['ratio']:.2f} ({noise_note(row)})"
    )


def device_lines(device_type: str, shape: str, mode: str, row: dict) -> list[str]:
    return [
        f"  {device_type} {shape} bf16 {mode:7} {key:18} orig {r['orig_ms']:8.2f} ms  fused {r['fused_ms']:8.2f} ms"
        f"  ratio {r['ratio']:.3f} (paired IQR {r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f}, "
        f"{noise_note(r)})"
        for key, r in row.items()
    ]


# --------------------------------------------------------------------------------------------------------------------
# the end of a run: tables, targets, files


def flat_keys(results: dict) -> dict:
    """The flat JSON the issue asks for (headline keys first), plus per-shape keys."""
    flat: dict = {}
    dec, pre = results["decode"], results["prefill"]

    def get(table, key, field):
        return table.get(key, {}).get(field)

    for dtype in DTYPES:
        flat[f"decode_ratio_{dtype}"] = get(dec, f"llama1b_{dtype}_b1_kv128", "ratio")
    for dtype in DTYPES:
        flat[f"prefill_ratio_{dtype}"] = get(pre, f"llama1b_{dtype}_prefill512", "ratio")
    flat["decode_roofline_fraction"] = get(dec, "llama1b_fp32_b1_kv128", "fused_floor_fraction")
    flat["decode_roofline_fraction_bf16"] = get(dec, "llama1b_bf16_b1_kv128", "fused_floor_fraction")
    for dtype in DTYPES:  # the same step against what the batch-1 GEMM kernel achieves on its own
        flat[f"decode_gemv_ceiling_fraction_{dtype}"] = get(dec, f"llama1b_{dtype}_b1_kv128", "fused_gemv_fraction")
        flat[f"gemv_bandwidth_gbps_{dtype}"] = results["bandwidth"]["gemv_gbps"][dtype]
    load = results["load"].get("llama1b_bf16", {})
    flat["load_ratio"] = load.get("load_ratio")
    flat["load_rss_ratio"] = load.get("rss_ratio")
    build = results.get("build", {})
    flat["build_seconds"] = build.get("build_s")
    flat["import_floor_seconds"] = build.get("import_floor_s")
    flat["build_ratio"] = build.get("ratio")
    flat["copy_bandwidth_gbps"] = results["bandwidth"]["copy_gbps"]
    flat["read_bandwidth_gbps"] = results["bandwidth"]["read_gbps"]
    flat["threads"] = results["machine"]["threads"]
    flat["quick"] = results["machine"]["quick"]
    flat["layers"] = results["machine"]["layers"]
    flat["noisy_figures"] = sorted(
        [f"decode_{k}" for k, r in dec.items() if r["noisy"]]
        + [f"prefill_{k}" for k, r in pre.items() if r["noisy"]]
        + [f"load_{k}" for k, r in results["load"].items() if r["noisy"]]
        + (["build"] if build.get("noisy") else [])
    )
    for key, row in dec.items():
        flat[f"decode_ratio_{key}"] = row["ratio"]
        flat[f"decode_orig_ms_{key}"] = row["orig_ms"]
        flat[f"decode_fused_ms_{key}"] = row["fused_ms"]
        flat[f"decode_roofline_fraction_{key}"] = row["fused_floor_fraction"]
        if "aa_ratio" in row:
            flat[f"decode_aa_control_ratio_{key}"] = row["aa_ratio"]
    for key, row in pre.items():
        flat[f"prefill_ratio_{key}"] = row["ratio"]
        flat[f"prefill_orig_ms_{key}"] = row["orig_ms"]
        flat[f"prefill_fused_ms_{key}"] = row["fused_ms"]
    for key, row in results["load"].items():
        flat[f"load_ratio_{key}"] = row["load_ratio"]
        flat[f"load_rss_ratio_{key}"] = row["rss_ratio"]
        flat[f"load_orig_seconds_{key}"] = row["orig"]["load_s"]
        flat[f"load_fused_seconds_{key}"] = row["fused"]["load_s"]
        flat[f"load_orig_peak_rss_mib_{key}"] = row["orig"]["peak_rss_mib"]
        flat[f"load_fused_peak_rss_mib_{key}"] = row["fused"]["peak_rss_mib"]
    for key, row in results["numerics"].items():
        flat[f"max_abs_logit_diff_{key}"] = max(row["prompt"], row["decode"])
        flat[f"max_abs_logit_diff_batch1_decode_{key}"] = row["decode_batch1"]
    comp = results.get("compile")
    if comp and "error" not in comp:
        flat["compile_decode_ratio"] = comp["compiled"]["ratio"]
        flat["compile_orig_ms"] = comp["compiled"]["orig_ms"]
        flat["compile_fused_ms"] = comp["compiled"]["fused_ms"]
        flat["compile_eager_ratio"] = comp["eager"]["ratio"]
        flat["compile_seconds_orig"] = comp["orig_compile_s"]
        flat["compile_seconds_fused"] = comp["fused_compile_s"]
    elif comp:
        flat["compile_error"] = comp["error"]
    flat["wall_seconds"] = results["wall_seconds"]
    return flat


def print_tables(results: dict) -> None:
    log("\n== decode step, ms (median of clean rounds); ratio = fused / original; floor = weight bytes / copy BW ==")
    log(
        f"{'config':28} {'orig':>9} {'fused':>9} {'ratio':>6}  {'paired IQR':>11}  {'rounds':>12} {'GB/s':>5} "
        f"{'floor':>7} {'fused/floor':>11} {'fused/GEMV':>10} {'A/A':>6}"
    )
    for key, r in results["decode"].items():
        log(
            f"{key:28} {r['orig_ms']:9.2f} {r['fused_ms']:9.2f} {r['ratio']:6.3f}  "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f}  {noise_note(r):>12} {r['copy_gbps']:5.1f} "
            f"{r['floor_ms']:7.1f} {r['fused_floor_fraction']:11.0%} {r['fused_gemv_fraction']:10.0%} "
            + (f"{r['aa_ratio']:6.3f}" if "aa_ratio" in r else f"{'':6}")
        )
    log("\n== prefill, ms (batch 1, logits for the last token only) ==")
    for key, r in results["prefill"].items():
        log(
            f"{key:28} {r['orig_ms']:9.1f} {r['fused_ms']:9.1f} {r['ratio']:6.3f}  "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f}  {noise_note(r):>12}"
        )


def markdown_tables(results: dict) -> str:
    """The figures as Markdown tables (what docs/benchmarks.md shows)."""
    m = results["machine"]
    lines = [
        (
            f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_capability']}), transformers "
            f"{m['transformers']}, Python {m['python']}, `torch.set_num_threads({m['threads']})`, {m['layers']} "
            f"layers. 1 GiB copy at start: {results['bandwidth']['copy_gbps']:.1f} GB/s (read + write), 1 GiB read: "
            f"{results['bandwidth']['read_gbps']:.1f} GB/s. Batch-1 GEMV ceiling (1 x 2048 @ 2048 x 128256): "
            + ", ".join(f"{k} {v:.1f} GB/s" for k, v in results["bandwidth"]["gemv_gbps"].items())
            + "."
        ),
        "",
        (
            "| decode step | original ms | fused ms | fused / original | paired-ratio IQR | clean rounds | copy GB/s "
            "| floor ms | fused / floor | fused / GEMV ceiling | A/A control |"
        ),
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, r in results["decode"].items():
        bw = f"{r['copy_gbps']:.1f}" if "_b1_" in key else "(start)"  # b1 rows measure it in their own rounds
        lines.append(
            f"| {key} | {r['orig_ms']:.1f} | {r['fused_ms']:.1f} | **{r['ratio']:.3f}** | "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f} | {r['used_rounds']}/{r['rounds']}"
            f"{' noisy' if r['noisy'] else ''} | {bw} | {r['floor_ms']:.1f} | {r['fused_floor_fraction']:.0%} | "
            f"{r['fused_gemv_fraction']:.0%} | " + (f"{r['aa_ratio']:.3f} |" if "aa_ratio" in r else " |")
        )
    lines += [
        "",
        "| prefill (1 x 512 tokens) | original ms | fused ms | fused / original | paired-ratio IQR | clean rounds |",
        "|---|---:|---:|---:|---|---|",
    ]
    for key, r in results["prefill"].items():
        lines.append(
            f"| {key} | {r['orig_ms']:.0f} | {r['fused_ms']:.0f} | **{r['ratio']:.3f}** | "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f} | {r['used_rounds']}/{r['rounds']}"
            f"{' noisy' if r['noisy'] else ''} |"
        )
    if results["load"]:
        lines += [
            "",
            (
                "| load (bf16 checkpoint, fresh process) | from_pretrained s | first forward s | load ratio | "
                "peak RSS MiB | RSS ratio |"
            ),
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, r in results["load"].items():
            for v in ("orig", "fused"):
                x = r[v]
                ratio = f"**{r['load_ratio']:.2f}**" if v == "fused" else ""
                rss = f"**{r['rss_ratio']:.2f}**" if v == "fused" else ""
                lines.append(
                    f"| {key} {v} | {x['from_pretrained_s']:.2f} | {x['first_forward_s']:.2f} | {ratio} | "
                    f"{x['peak_rss_mib']:.0f} | {rss} |"
                )
    build = results.get("build", {})
    if "build_s" in build:
        lines += [
            "",
            "| build | seconds |",
            "|---|---:|",
            f"| `fusegen build llama qwen2` | {build['build_s']:.2f} |",
            f"| import floor (import both modeling modules) | {build['import_floor_s']:.2f} |",
            f"| ratio | **{build['ratio']:.2f}** |",
        ]
    comp = results.get("compile")
    if comp and "error" not in comp:
        e, c = comp["eager"], comp["compiled"]
        lines += [
            "",
            "| torch.compile, llama1b fp32 b1 kv128 | original ms | fused ms | fused / original | clean rounds |",
            "|---|---:|---:|---:|---|",
            (
                f"| eager | {e['orig_ms']:.1f} | {e['fused_ms']:.1f} | {e['ratio']:.3f} | "
                f"{e['used_rounds']}/{e['rounds']}{' noisy' if e['noisy'] else ''} |"
            ),
            (
                f"| compiled (compile {comp['orig_compile_s']:.0f} s / {comp['fused_compile_s']:.0f} s) | "
                f"{c['orig_ms']:.1f} | {c['fused_ms']:.1f} | {c['ratio']:.3f} | {c['used_rounds']}/{c['rounds']}"
                f"{' noisy' if c['noisy'] else ''} |"
            ),
        ]
    return "\n".join(lines) + "\n"


def check_targets(flat: dict) -> list[str]:
    def fmt(v):
        return "n/a" if v is None else f"{v:.3f}"

    decode = [v for k, v in flat.items() if k.startswith("decode_ratio_") and k.count("_") > 3]
    return [
        (
            f"decode ratio <= 0.95 at llama1b b1 kv128 fp32 / bf16: {fmt(flat['decode_ratio_fp32'])} / "
            f"{fmt(flat['decode_ratio_bf16'])}"
        ),
        f"decode ratio never > 1.00 (max over all decode configs): {fmt(max(decode) if decode else None)}",
        f"prefill ratio <= 1.00 llama1b fp32 / bf16: {fmt(flat['prefill_ratio_fp32'])} / {fmt(flat['prefill_ratio_bf16'])}",
        f"decode >= 70% of bandwidth floor (llama1b b1 kv128 fp32): {fmt(flat['decode_roofline_fraction'])}",
        f"build <= 1.3x import floor: {fmt(flat.get('build_ratio'))}",
    ]


def summary(results: dict, flat: dict, sections: dict, waited: float) -> None:
    """The closing tables, the targets and the wall-time line."""
    print_tables(results)
    log("\n== targets ==")
    for line in check_targets(flat):
        log("  " + line)
    if flat["noisy_figures"]:
        log(f"  too few clean rounds (machine busy) for: {', '.join(flat['noisy_figures'])}")
    log(
        f"\nwall time {results['wall_seconds']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in sections.items())
        + f"; waited {waited:.0f} s for quiet); load average at end "
        + " ".join(f"{x:.2f}" for x in results["machine"]["loadavg_end"])
    )


def write_files(results: dict, flat: dict, json_path: Path | None, markdown_path: Path | None) -> None:
    """`--json OUT` (flat, and OUT.full.json with everything) and `--markdown OUT`."""
    if json_path:
        json_path.write_text(json.dumps(flat, indent=1) + "\n")
        full = json_path.with_name(json_path.stem + ".full.json")
        full.write_text(json.dumps(results, indent=1, default=str) + "\n")
        log(f"wrote {json_path} (flat) and {full} (everything)")
    if markdown_path:
        markdown_path.write_text(markdown_tables(results))
        log(f"wrote {markdown_path}")
