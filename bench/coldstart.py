"""Cold start, fused vs original: `from_pretrained` + first forward, and peak RSS, in fresh processes (not a test).

    python bench/coldstart.py [--runs 5] [--big-runs 3] [--shapes llama1b,qwen05b,llama3b] [--json OUT]

Per shape, a random-weight bf16 checkpoint is written once in the canonical layout (`save_pretrained` of the original
class) and converted to the fused layout (`fusegen convert`). Three variants are then timed, each in a FRESH process
started by bench/run.py's launcher (a small process started before anything big is allocated: Linux carries a
parent's peak RSS into a child), interleaved A B C A B C ... so machine drift hits all alike:

- `original`: the Transformers class, canonical checkpoint (the reference: everything memory-mapped, zero-copy);
- `fused`: the generated class, same canonical checkpoint (q/k/v and gate/up merged at load);
- `fused layout`: the generated class, the `fusegen convert` output (merged tensors memory-mapped as stored).

Each child runs bench/harness.py's `child_load` (started as `bench/run.py --child load`): import, then `from_pretrained(dtype=bf16, attn_implementation="sdpa")`,
then one 16-token forward; the figure is load + first forward (the first forward is where a memory-mapped weight is
actually read). Peak RSS is the child's `ru_maxrss` over the whole run. Printed per shape: the median of each variant,
the ratio of medians to the original, and the spread (min-max) of the per-round ratios. Rounds during which other
processes used more than --noise-threshold cores are repeated (up to --max-rounds-factor x) and left out, as in bench/run.py.

Shapes: Llama-3.2-1B and Qwen2.5-0.5B as in bench/run.py (4 layers), and Llama-3.2-3B shapes (hidden 3072,
intermediate 8192, 24 heads, 8 kv heads, head_dim 128) with 8 layers (a 2.4 GB bf16 checkpoint).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness
from harness import Bench, Launcher, Sampler
from report import log

harness.SHAPES.setdefault(
    "llama3b",
    {
        **harness.SHAPES["llama1b"],
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
)
LAYERS = {"llama1b": 4, "qwen05b": 4, "llama3b": 8}
VARIANTS = ("original", "fused", "fused layout")
TARGETS = {"fused": ("load + first forward", 1.2), "fused layout": ("load + first forward", 1.0)}
RSS_TARGET = 1.05


def child(bench: Bench, variant: str, canonical: Path, fused: Path) -> tuple[dict, float]:
    """One fresh-process measurement; a failing variant (e.g. before the fused layout loaded) is reported, not fatal."""
    kind, path = {"original": ("orig", canonical), "fused": ("fused", canonical), "fused layout": ("fused", fused)}[
        variant
    ]
    try:
        return harness.run_child(bench.launcher, ["load", kind, str(path), "bf16"], bench.threads, 900)
    except RuntimeError as error:
        return {"error": str(error).strip().splitlines()[-1][:300]}, 0.0


def measure(bench: Bench, shape: str, runs: int, workdir: Path) -> dict:
    from fusegen.tools.convert import convert_checkpoint

    layers = LAYERS.get(shape, 4)
    start = time.perf_counter()
    canonical = harness.write_checkpoints(shape, layers, workdir, dtypes=("bf16",))["bf16"]
    fused = convert_checkpoint(
        canonical,
        workdir / f"{shape}-fused",
        harness.SHAPES[shape]["model_type"],
        generated_dir=harness.ROOT / "generated",
    )
    size = sum(p.stat().st_size for p in canonical.glob("*.safetensors")) / 2**20
    log(f"[{shape}, {layers} layers, {size:.0f} MiB bf16] wrote and converted in {time.perf_counter() - start:.0f} s")
    runners = [lambda v=variant: child(bench, v, canonical, fused) for variant in VARIANTS]
    columns, info = bench.sampler.interleaved(runners, 0, runs)
    shutil.rmtree(canonical)
    shutil.rmtree(fused)
    result = {"shape": shape, "layers": layers, "checkpoint_mib": size, **info, "variants": {}}
    reference = columns[0]
    for variant, samples in zip(VARIANTS, columns):
        good = [s for s in samples if "error" not in s]
        if not good:
            result["variants"][variant] = {"error": samples[0]["error"]}
            continue
        row = {
            key: statistics.median(s[key] for s in good)
            for key in ("from_pretrained_s", "first_forward_s", "load_s", "peak_rss_mib")
        }
        if variant != "original":
            for key in ("load_s", "peak_rss_mib"):
                paired = [s[key] / r[key] for s, r in zip(samples, reference) if "error" not in s and "error" not in r]
                row[f"{key}_ratio"] = row[key] / result["variants"]["original"][key]
                row[f"{key}_ratio_spread"] = (min(paired), max(paired))
        row["runs"] = len(good)
        result["variants"][variant] = row
    return result


def report(results: list[dict]) -> None:
    log(
        "\nmedians over fresh processes; ratio = variant / original (ratio of medians; spread = min-max of the "
        "per-round ratios)"
    )
    log(
        f"{'shape':9} {'variant':13} {'load s':>7} {'1st fwd s':>9} {'total s':>7} {'ratio':>6} {'spread':>11} "
        f"{'peak MiB':>8} {'ratio':>6} {'spread':>11} {'rounds':>7}"
    )
    for result in results:
        for variant, row in result["variants"].items():
            if "error" in row:
                log(f"{result['shape']:9} {variant:13} failed: {row['error']}")
                continue
            ratios = (
                ""
                if variant == "original"
                else (
                    f"{row['load_s_ratio']:6.3f} {row['load_s_ratio_spread'][0]:5.2f}-{row['load_s_ratio_spread'][1]:<5.2f}"
                )
            )
            rss = (
                ""
                if variant == "original"
                else (
                    f"{row['peak_rss_mib_ratio']:6.3f} {row['peak_rss_mib_ratio_spread'][0]:5.2f}-"
                    f"{row['peak_rss_mib_ratio_spread'][1]:<5.2f}"
                )
            )
            log(
                f"{result['shape']:9} {variant:13} {row['from_pretrained_s']:7.3f} {row['first_forward_s']:9.3f} "
                f"{row['load_s']:7.3f} {ratios:>18} {row['peak_rss_mib']:8.0f} {rss:>18} "
                f"{result['used_rounds']:>3}/{result['rounds']}{' NOISY' if result['noisy'] else ''}"
            )
    log("\ntargets (medians):")
    for result in results:
        for variant, (what, limit) in TARGETS.items():
            row = result["variants"].get(variant, {})
            if "error" in row or not row:
                continue
            log(
                f"  {result['shape']:8} {variant:13} {what} {row['load_s_ratio']:.3f} (<= {limit}: "
                f"{'yes' if row['load_s_ratio'] <= limit else 'no'}); peak RSS {row['peak_rss_mib_ratio']:.3f} "
                f"(<= {RSS_TARGET}: {'yes' if row['peak_rss_mib_ratio'] <= RSS_TARGET else 'no'})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per variant (default 5)")
    parser.add_argument("--big-runs", type=int, default=3, help="the same for llama3b (default 3)")
    parser.add_argument("--shapes", default="llama1b,qwen05b,llama3b")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: cores)")
    parser.add_argument("--noise-threshold", type=float, default=0.15, help="see bench/run.py (default 0.15)")
    parser.add_argument(
        "--max-rounds-factor",
        type=float,
        default=2.0,
        help="at most this many x --runs rounds when dropping noisy ones",
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure as JSON")
    args = parser.parse_args()

    launcher = Launcher()  # before anything big is allocated
    import os

    import torch

    harness.quiet_transformers()
    threads = args.threads or os.cpu_count()
    bench = Bench({}, Sampler(args.noise_threshold, args.max_rounds_factor), threads, launcher)
    log(
        f"fusegen cold start: torch {torch.__version__}, {os.cpu_count()} cores, {threads} threads per child, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="fusegen-coldstart-") as tmp:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            runs = args.big_runs if shape == "llama3b" else args.runs
            results.append(measure(bench, shape, runs, Path(tmp)))
    launcher.close()
    report(results)
    log(
        f"\nwall time {time.perf_counter() - started:.0f} s; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
