"""Fused vs original, side by side: decode, prefill, roofline, load and build figures in one command (not a test).

    python bench/run.py [--quick] [--json OUT] [--markdown OUT] [--threads N] [--no-compile]
                        [--only SECTIONS] [--shapes SHAPES] [--noise-threshold CORES] [--wait-quiet SECONDS]
    python bench/run.py --device cuda [--modes eager,static,compile] [--shapes llama1b,qwen05b] [--quick] [--json OUT]

`--device DEV` runs only the on-device section (`bench_device`): the same original/fused pairs in bf16, decode and
prefill timed on the device's own clock (CUDA events; host time after a synchronise elsewhere), in eager mode with
the dynamic cache, eager with a StaticCache, and torch.compile with a StaticCache. Without such a device it prints
why and exits 0; `--device cpu` runs the very same code (tests/test_bench.py keeps it working).

Everything runtime-related runs in this one process, original (A) and fused (B) interleaved A B A B ... after warm-up,
so drift in machine load hits both alike; figures are medians over repetitions and ratios are fused / original
(< 1 means the fused model is faster or smaller). Load, build and torch.compile run in fresh subprocesses (peak RSS
only ever grows within a process, and a compile must not disturb the eager runs).

Shared machines: every A B round also records how much CPU OTHER processes used meanwhile (/proc/stat minus our own
rusage). Rounds during which others used more than --noise-threshold of a core are repeated (up to a cap) and left
out of the medians; each figure reports how many rounds were clean. With 2 OpenMP threads on 2 cores, one busy
neighbour can slow a GEMM several-fold, so without this the figures mostly measure the neighbours.

Models are random-weight, built from configs (no hub access): Llama-3.2-1B shapes and Qwen2.5-0.5B shapes with few
layers. Each is written once per dtype with `save_pretrained` and both classes `from_pretrained` the same directory,
with `attn_implementation="sdpa"`, so the weights and the attention kernel are the same; only the projections differ.

See docs/benchmarks.md for the figures of a full run and how to read them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness and report, when this file is imported

import report
from harness import (
    CACHE_KWARG,
    DEVICE_MODES,
    DTYPES,
    FULL,
    QUICK,
    ROOT,
    SHAPE_DTYPES,
    SHAPE_REPEAT,
    SHAPES,
    Bench,
    CopyProbe,
    Launcher,
    Sampler,
    _mode_cache,
    child_compile,
    child_load,
    decode_step_runner,
    decode_weight_bytes,
    device_clock,
    device_decode_runner,
    device_prefill_runner,
    device_unavailable,
    gemv_bandwidth,
    in_process,
    installed_bytecode,
    load_kwargs,
    machine_info,
    median,
    memory_bandwidth,
    numerics,
    prefill_runner,
    quiet_transformers,
    run_child,
    summarise,
    timed_command,
    write_checkpoints,
)
from report import log

from fusegen.testkit import load_fused, load_pair

__all__ = ["QUICK", "Bench", "Sampler", "device_clock", "main", "run_device_section"]


# --------------------------------------------------------------------------------------------------------------------
# runtime: decode, prefill, numerics (one process)


def runtime_section(bench: Bench, shape: str, dtype: str, path: Path) -> None:
    """Numerics, then decode rows per cache length and batch, then prefill, for one shape and dtype."""
    import torch

    models = load_pair(path, **load_kwargs(dtype))
    diff = numerics(*models, models[0].config.vocab_size)
    bench.results["numerics"][f"{shape}_{dtype}"] = diff
    log(report.numerics_line(diff))
    weight_bytes = decode_weight_bytes(models[1])
    assert weight_bytes == decode_weight_bytes(models[0]), "original and fused should read the same weight bytes"
    bench.results["weight_bytes"][f"{shape}_{dtype}"] = weight_bytes
    generator = torch.Generator().manual_seed(2)
    for cache_len in bench.cfg["cache_lens"]:
        decode_rows(bench, shape, dtype, path, models, cache_len, weight_bytes, generator)
    prefill_row(bench, shape, dtype, models, generator)
    del models
    gc.collect()


def decode_rows(bench: Bench, shape, dtype, path, models, cache_len: int, weight_bytes: int, generator) -> None:
    """Each model prefills its own cache of `cache_len` tokens; one decode row per batch size on copies of it."""
    import torch

    vocab = models[0].config.vocab_size
    ids = torch.randint(0, vocab, (1, cache_len), generator=generator)
    with torch.inference_mode():  # each model prefills its own cache
        caches = [model(ids, use_cache=True, logits_to_keep=1).cache for model in models]
    for batch in bench.cfg["decode_batches"]:
        current = caches[0].layers[0].keys.shape[0]
        if batch != current:  # replicate the batch-1 prefill across the batch (8x cheaper than prefilling it)
            for cache in caches:
                cache.batch_repeat_interleave(batch // current)
        assert all(c.layers[0].keys.shape[0] == batch and c.get_seq_length() == cache_len for c in caches)
        tokens = torch.randint(0, vocab, (batch, 1), generator=generator)
        key = f"{shape}_{dtype}_b{batch}_kv{cache_len}"
        bench.results["decode"][key] = decode_row(bench, shape, dtype, path, models, caches, ids, tokens, weight_bytes)
        log(report.decode_line(key, bench.results["decode"][key]))
    del caches
    gc.collect()


def decode_row(bench: Bench, shape, dtype, path, models, caches, ids, tokens, weight_bytes: int) -> dict:
    """One decode figure: A B rounds, plus at batch 1 the copy probe (roofline) and, at the first cache length, an
    A/A control (a second, independently loaded fused model: the noise floor of a ratio)."""
    import torch

    cfg, bandwidth = bench.cfg, bench.results["bandwidth"]
    batch_one = tokens.shape[0] == 1
    steps = (cfg["decode_steps"] if batch_one else cfg["decode_steps_big"]) * SHAPE_REPEAT.get(shape, 1)
    runners = [decode_step_runner(m, c, tokens, steps) for m, c in zip(models, caches)]
    control = batch_one and ids.shape[1] == cfg["cache_lens"][0]
    if control:
        control_model = load_fused(path, **load_kwargs(dtype))
        with torch.inference_mode():
            control_cache = control_model(ids, use_cache=True, logits_to_keep=1).cache
        runners.append(decode_step_runner(control_model, control_cache, tokens, steps))
    if batch_one:  # roofline rows: measure the copy bandwidth in the same rounds (A B [B'] copy)
        runners.append(in_process(bench.probe.copy))
    reps = cfg["decode_reps"] if batch_one else cfg["decode_reps_big"]
    (a, b, *extra), info = bench.sampler.interleaved(runners, cfg["decode_warmup"], reps)
    row = summarise(a, b, info)
    if control:
        row["aa_ratio"] = median(extra[0]) / median(b)  # fused again / fused: should be 1 +- noise
    row_bandwidth = bench.probe.gbps(median(extra[-1])) if batch_one else bandwidth["copy_gbps"]
    floor_s = weight_bytes / (row_bandwidth * 1e9)
    row.update(
        copy_gbps=row_bandwidth,
        floor_ms=floor_s * 1e3,
        fused_floor_fraction=floor_s / median(b),
        orig_floor_fraction=floor_s / median(a),
        fused_gemv_fraction=weight_bytes / (bandwidth["gemv_gbps"][dtype] * 1e9) / median(b),
        steps=steps,
    )
    return row


def prefill_row(bench: Bench, shape: str, dtype: str, models, generator) -> None:
    """A prompt of `prefill_len` tokens, batch 1, last logits only, A B rounds."""
    import torch

    cfg = bench.cfg
    ids = torch.randint(0, models[0].config.vocab_size, (1, cfg["prefill_len"]), generator=generator)
    runners = [prefill_runner(m, ids, SHAPE_REPEAT.get(shape, 1)) for m in models]
    (a, b), info = bench.sampler.interleaved(runners, cfg["prefill_warmup"], cfg["prefill_reps"])
    row = summarise(a, b, info)
    row.update(tokens=cfg["prefill_len"])
    key = f"{shape}_{dtype}_prefill{cfg['prefill_len']}"
    bench.results["prefill"][key] = row
    log(report.prefill_line(key, row))


# --------------------------------------------------------------------------------------------------------------------
# subprocess measurements: load, compile, build


def load_section(bench: Bench, name: str, path: Path, dtype: str) -> None:
    """from_pretrained + first forward in fresh processes, original and fused interleaved; medians and ratios."""
    runners = [
        lambda v=variant: run_child(bench.launcher, ["load", v, str(path), dtype], bench.threads, 600)
        for variant in ("orig", "fused")
    ]
    (orig_runs, fused_runs), info = bench.sampler.interleaved(runners, 0, bench.cfg["load_reps"])
    med = {
        variant: {key: median([run[key] for run in runs]) for key in runs[0]}
        for variant, runs in (("orig", orig_runs), ("fused", fused_runs))
    }
    grown = {v: med[v]["peak_rss_mib"] - med[v]["rss_after_import_mib"] for v in med}
    row = {
        "orig": med["orig"],
        "fused": med["fused"],
        "load_ratio": med["fused"]["load_s"] / med["orig"]["load_s"],
        "from_pretrained_ratio": med["fused"]["from_pretrained_s"] / med["orig"]["from_pretrained_s"],
        "rss_ratio": med["fused"]["peak_rss_mib"] / med["orig"]["peak_rss_mib"],
        "rss_growth_ratio": grown["fused"] / grown["orig"] if grown["orig"] > 0 else None,
        **info,
    }
    bench.results["load"][f"{name}_{dtype}"] = row
    for line in report.load_lines(name, dtype, row):
        log(line)


def load_sections(bench: Bench, paths: dict, quick: bool) -> None:
    load_section(bench, "llama1b", paths["llama1b"]["bf16"], "bf16")
    if not quick:
        load_section(bench, "qwen05b", paths["qwen05b"]["bf16"], "bf16")


def compile_section(bench: Bench, path: Path, dtype: str, cache_len: int) -> None:
    """Eager vs torch.compile'd decode of both classes, in a fresh process (`harness.child_compile`)."""
    cfg = bench.cfg
    args = ["compile", str(path), dtype, str(cache_len), str(cfg["decode_reps"]), str(cfg["decode_steps"])]
    try:
        row, _ = run_child(bench.launcher, [*args, str(bench.sampler.threshold)], bench.threads, timeout=1200)
    except RuntimeError as error:
        bench.results["compile"] = {"error": str(error)[-800:]}
        log(f"  torch.compile: FAILED or timed out: {str(error)[-800:]}")
        return
    bench.results["compile"] = row
    log(report.compile_line(dtype, cache_len, row))


def build_section(bench: Bench) -> None:
    """`fusegen build llama qwen2` into a temp dir vs importing the two modeling modules it reads (the floor)."""
    floor_cmd = [
        sys.executable,
        "-c",
        "import transformers.models.llama.modeling_llama, transformers.models.qwen2.modeling_qwen2",
    ]
    installed_bytecode(ROOT)  # both sides import bytecode, as an installed fusegen does
    with tempfile.TemporaryDirectory(prefix="fusegen-bench-build-") as out:
        build_cmd = [sys.executable, "-m", "fusegen", "build", "llama", "qwen2", "--output-dir", out]
        runners = [lambda: timed_command(bench.launcher, build_cmd), lambda: timed_command(bench.launcher, floor_cmd)]
        try:
            (builds, floors), info = bench.sampler.interleaved(runners, 1, bench.cfg["build_reps"])
        except RuntimeError as error:
            bench.results["build"] = {"error": str(error)[-1000:]}
            log(f"  build FAILED: {str(error)[-1000:]}")
            return
    row = {"build_s": median(builds), "import_floor_s": median(floors), **info}
    row["ratio"] = row["build_s"] / row["import_floor_s"]
    bench.results["build"] = row
    log(report.build_line(row))


# --------------------------------------------------------------------------------------------------------------------
# --device: the same fused-vs-original pairs timed on an accelerator (CUDA events), bf16, eager / static / compile


def device_section(bench: Bench, shape: str, path: Path, device, modes, compile_backend: str) -> None:
    """Decode (each batch, first cache length) and prefill, original vs fused, in each mode, on `device`."""
    import torch

    cfg, clock = bench.cfg, device_clock(device)
    original, fused = (model.to(device) for model in load_pair(path, **load_kwargs("bf16")))
    vocab, cache_len = original.config.vocab_size, cfg["cache_lens"][0]
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (1, cache_len), generator=generator).to(device)
    prefill_ids = torch.randint(0, vocab, (1, cfg["prefill_len"]), generator=generator).to(device)
    for mode in modes:
        models = [original, fused]
        if mode == "compile":
            # Both classes' forwards share Transformers' decorator code object, so dynamo counts their graphs (two
            # classes x batches x prefill/decode) against ONE recompile limit (8); past it, it silently runs eager.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            models = [torch.compile(m, dynamic=False, backend=compile_backend) for m in models]
        row: dict = {}
        for batch in cfg["decode_batches"]:
            ids = prompt.expand(batch, -1).contiguous()
            tokens = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
            row[f"decode_b{batch}_kv{cache_len}"] = device_decode_row(bench, clock, mode, models, ids, tokens)
        runners = [device_prefill_runner(clock, m, mode, prefill_ids) for m in models]
        (a, b), info = bench.sampler.interleaved(runners, cfg["prefill_warmup"], cfg["prefill_reps"])
        row[f"prefill{cfg['prefill_len']}"] = summarise(a, b, info)
        bench.results["device"][f"{shape}_bf16_{mode}"] = row
        for line in report.device_lines(device.type, shape, mode, row):
            log(line)
    del original, fused
    gc.collect()


def device_decode_row(bench: Bench, clock, mode: str, models, ids, tokens) -> dict:
    """Prefill and one step per model (compiling both graphs in compile mode), then timed decode steps, A B."""
    import torch

    caches, seconds, diffs = [], [], []
    for model in models:
        cache = _mode_cache(mode, model, ids.shape[0], ids.shape[1] + 2)
        start = time.perf_counter()
        with torch.inference_mode():  # prefill, then one step (compiles both graphs in compile mode)
            out = model(ids, use_cache=True, logits_to_keep=1, **({} if cache is None else {CACHE_KWARG: cache}))
            cache = out.cache
            diffs.append(model(tokens, **{CACHE_KWARG: cache}, use_cache=True).logits.float())
            cache.crop(-1)
        seconds.append(time.perf_counter() - start)
        caches.append(cache)
    steps = bench.cfg["decode_steps"]
    runners = [device_decode_runner(clock, m, c, tokens, steps) for m, c in zip(models, caches)]
    (a, b), info = bench.sampler.interleaved(runners, bench.cfg["decode_warmup"], bench.cfg["decode_reps"])
    return {
        **summarise(a, b, info),
        "first_call_s": seconds,  # prefill + first step; includes compilation in compile mode
        "max_abs_logit_diff": (diffs[0] - diffs[1]).abs().max().item(),
    }


def run_device_section(args, bench: Bench) -> dict | None:
    """`--device DEV`: only the on-device section. Returns the results, or None (after saying why) without a device."""
    import torch

    device = torch.device(args.device)
    reason = device_unavailable(device)
    if reason:
        log(f"[--device {args.device}: skipped: {reason}; nothing measured]")
        return None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(DEVICE_MODES)
    if unknown:
        raise SystemExit(f"unknown --modes {sorted(unknown)}; choose from {', '.join(DEVICE_MODES)}")
    machine = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    bench.results.update(machine=machine, device={})
    log(f"fusegen bench on {device} ({machine.get('gpu', device.type)}), bf16, modes {', '.join(modes)}")
    with tempfile.TemporaryDirectory(prefix="fusegen-bench-device-") as tmp:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            path = write_checkpoints(shape, bench.cfg["layers"], Path(tmp), dtypes=("bf16",))["bf16"]
            log(f"\n[{shape} bf16 on {device}]")
            device_section(bench, shape, path, device, modes, args.compile_backend)
    return bench.results


# --------------------------------------------------------------------------------------------------------------------
# the CPU run


def bandwidth_section(bench: Bench) -> None:
    """The 1 GiB copy/read yardstick and the batch-1 GEMV ceiling, measured first."""
    bench.probe = CopyProbe()
    bw = memory_bandwidth(bench)
    bench.results["bandwidth"] = bw
    log(report.bandwidth_line(bw))
    bw["gemv_gbps"] = gemv_bandwidth(bench)
    log(report.gemv_line(bw["gemv_gbps"]))


def checkpoints_section(bench: Bench, shapes: list[str], only: set[str], tmp: Path) -> dict:
    """Random checkpoints (per dtype) of every shape a selected section uses; `{shape: {dtype: path}}`."""
    written = list(shapes)
    if only & {"load", "compile"}:  # these use the llama1b (and qwen05b) checkpoints
        written = list(dict.fromkeys([*written, "llama1b", "qwen05b"]))
    paths = {}
    if only & {"runtime", "load", "compile"}:
        for shape in written:
            start = time.perf_counter()
            paths[shape] = write_checkpoints(shape, bench.cfg["layers"], tmp)
            log(
                f"wrote {shape} ({bench.cfg['layers']} layers) {' + '.join(paths[shape])} checkpoints in "
                f"{time.perf_counter() - start:.1f} s"
            )
    return paths


def cpu_sections(args, bench: Bench) -> dict[str, float]:
    """The sections `--only` selects, in order; returns each one's wall seconds."""
    only = {part.strip() for part in args.only.split(",")}
    shapes = [shape.strip() for shape in args.shapes.split(",")] if "runtime" in only else []
    sections: dict[str, float] = {}

    def timed(name: str, section, *section_args) -> None:
        start = time.perf_counter()
        section(bench, *section_args)
        sections[name] = time.perf_counter() - start

    with tempfile.TemporaryDirectory(prefix="fusegen-bench-") as tmp:
        paths = checkpoints_section(bench, shapes, only, Path(tmp))
        for shape in shapes:
            for dtype in SHAPE_DTYPES.get(shape, DTYPES):
                log(f"\n[{shape} {dtype}]")
                timed(f"{shape}_{dtype}", runtime_section, shape, dtype, paths[shape][dtype])
        if "load" in only:
            log("\n[load: from_pretrained + first forward, fresh process each, A B A B]")
            timed("load", load_sections, paths, args.quick)
        if "compile" in only and bench.cfg["compile"] and not args.no_compile:
            log("\n[torch.compile decode, llama1b fp32 b1 kv128, fresh process]")
            timed("compile", compile_section, paths["llama1b"]["fp32"], "fp32", 128)
        elif "compile" in only:
            log("\n[torch.compile: skipped (--quick or --no-compile)]")
    if "build" in only:
        log("\n[build vs import floor]")
        timed("build", build_section)
    return sections


def cpu_run(args, bench: Bench, wall_start: float) -> None:
    """Everything but `--device`: bandwidth, the selected sections, then the report and the files."""
    machine = machine_info(args.quick, bench.cfg["layers"], args.noise_threshold)
    bench.results.update(machine=machine, decode={}, prefill={}, load={}, numerics={}, weight_bytes={})
    log(report.machine_line(machine, bench.cfg["layers"]))
    bandwidth_section(bench)
    sections = cpu_sections(args, bench)
    bench.launcher.close()
    machine["loadavg_end"] = os.getloadavg()
    bench.results["section_seconds"] = sections
    bench.results["wall_seconds"] = time.perf_counter() - wall_start
    bench.results["waited_for_quiet_seconds"] = bench.sampler.waited
    flat = report.flat_keys(bench.results)
    report.summary(bench.results, flat, sections, bench.sampler.waited)
    report.write_files(bench.results, flat, args.json, args.markdown)


# --------------------------------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer layers and repetitions; no torch.compile (<3 min)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the flat figures as JSON (and OUT.full.json)")
    parser.add_argument("--markdown", type=Path, metavar="OUT", help="write the figures as Markdown tables")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (default: cores)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile experiment")
    parser.add_argument(
        "--only", default="runtime,load,compile,build", help="comma-separated sections: runtime,load,compile,build"
    )
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated runtime shapes (default: {','.join(SHAPES)})"
    )
    parser.add_argument(
        "--noise-threshold",
        type=float,
        default=0.15,
        help="drop rounds during which other processes used more than this many cores (default 0.15)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each measurement, wait up to SECONDS for a quiet 2 s window (shared machines; default 0)",
    )
    parser.add_argument(
        "--device",
        metavar="DEV",
        help="only time decode and prefill on DEV (cuda, cuda:1, cpu, ...) with the device's clock, bf16, in "
        "--modes; skips with a message when DEV is absent",
    )
    parser.add_argument("--modes", default=",".join(DEVICE_MODES), help="with --device: eager,static,compile")
    parser.add_argument(
        "--compile-backend", default="inductor", help="with --device: torch.compile backend (default inductor)"
    )
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_child_command(child: list[str]) -> None:
    """`--child load|compile ...`: one measurement in this fresh process, printed as one JSON line."""
    kind, *rest = child
    if kind == "load":
        print(json.dumps(child_load(*rest)))
    elif kind == "compile":
        path, dtype, cache_len, reps, steps, threshold = rest
        print(json.dumps(child_compile(path, dtype, int(cache_len), int(reps), int(steps), float(threshold))))
    else:
        raise SystemExit(f"unknown child {kind}")


def main() -> None:
    args = parse_args()
    if args.child:
        return run_child_command(args.child)
    wall_start = time.perf_counter()
    launcher = Launcher()  # before importing torch or allocating anything
    import torch

    quiet_transformers()
    cfg = QUICK if args.quick else FULL
    sampler = Sampler(args.noise_threshold, cfg["max_rounds_factor"], args.wait_quiet)
    bench = Bench(cfg, sampler, args.threads, launcher)
    torch.set_num_threads(args.threads)
    if not args.device:
        return cpu_run(args, bench, wall_start)
    device_results = run_device_section(args, bench)
    launcher.close()
    if device_results is not None and args.json:
        args.json.write_text(json.dumps(device_results, indent=1, default=str) + "\n")
        log(f"wrote {args.json}")
    return None


if __name__ == "__main__":
    main()
