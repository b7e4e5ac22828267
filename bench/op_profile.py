"""Where a decode step's time goes, original vs fused, by operator (torch.profiler; not a test).

    python bench/op_profile.py [--shape llama1b] [--dtype fp32] [--batch 1] [--cache 128] [--layers 4]

Loads both classes from one random-weight checkpoint (bench/run.py's shapes), prefills the same cache, then profiles
`--steps` decode steps of each, interleaved, and prints self CPU time per operator side by side (ms per step), the
operator call counts, and the totals. It is the evidence behind the "why" column of docs/benchmarks.md: it shows
whether a ratio comes from the GEMMs themselves or from what the split adds around them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench

from fusegen.testkit import load_pair

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")


def decode_step(model, cache, tokens):
    """One single-token forward on `cache`, cropped back afterwards so every step sees the same cache length."""
    kwargs = {bench.CACHE_KWARG: cache, "use_cache": True}

    def step() -> None:
        model(tokens, **kwargs)
        cache.crop(-1)

    return step


def prefill_step(model, ids):
    """A prompt forward the way generate() runs it: fresh cache, last logits only."""
    return lambda: model(ids, use_cache=True, logits_to_keep=1)


def profile_steps(step, steps: int) -> dict[str, list[float]]:
    """Operator name -> [self CPU microseconds per step, calls per step] over `steps` calls of `step`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        step()  # warm-up
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                step()
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages(group_by_input_shape=True):
        if not event.key.startswith(("aten::", "mkldnn::")):
            continue
        name = event.key
        if name in GEMMS:  # one row per GEMM shape: which projection (merged or not) costs what
            name = f"{name} {'x'.join(map(str, event.input_shapes[0]))} @ {'x'.join(map(str, event.input_shapes[1]))}"
        table[name][0] += event.self_cpu_time_total / steps
        table[name][1] += event.count / steps
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama1b", choices=sorted(bench.SHAPES))
    parser.add_argument("--dtype", default="fp32", choices=bench.DTYPES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prefill", type=int, metavar="TOKENS", help="profile a prompt forward instead of decode")
    parser.add_argument("--rounds", type=int, default=3, help="profile A B A B ... and keep each op's median")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    import torch

    bench.quiet_transformers()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="fusegen-profile-") as tmp:
        path = bench.write_checkpoints(args.shape, args.layers, Path(tmp))[args.dtype]
        models = load_pair(path, **bench.load_kwargs(args.dtype))
    vocab = models[0].config.vocab_size
    steps = []
    with torch.inference_mode():
        for model in models:
            if args.prefill:
                steps.append(prefill_step(model, torch.randint(0, vocab, (args.batch, args.prefill))))
                continue
            cache = model(torch.randint(0, vocab, (1, args.cache)), use_cache=True, logits_to_keep=1).cache
            if args.batch > 1:
                cache.batch_repeat_interleave(args.batch)
            steps.append(decode_step(model, cache, torch.randint(0, vocab, (args.batch, 1))))

    rounds: list[list[dict]] = [[], []]
    for _ in range(args.rounds):
        for i in (0, 1):
            rounds[i].append(profile_steps(steps[i], args.steps))

    def median_table(tables: list[dict]) -> dict[str, tuple[float, float]]:
        names = set().union(*tables)
        return {n: tuple(bench.median([t.get(n, [0.0, 0.0])[k] for t in tables]) for k in (0, 1)) for n in names}

    orig, fused = (median_table(t) for t in rounds)
    names = sorted(set(orig) | set(fused), key=lambda n: -max(orig.get(n, (0, 0))[0], fused.get(n, (0, 0))[0]))
    what = f"prefill of {args.prefill} tokens" if args.prefill else f"decode, cache {args.cache}"
    title = f"{args.shape} {args.dtype} batch {args.batch} {what}, {args.layers} layers: self CPU ms/step"
    print(f"\n{title}\n{'operator':44} {'original':>9} {'fused':>9} {'diff':>8} {'calls o/f':>12}")
    for name in names[: args.top]:
        (a, ca), (b, cb) = orig.get(name, (0.0, 0.0)), fused.get(name, (0.0, 0.0))
        print(f"{name:44} {a / 1e3:9.3f} {b / 1e3:9.3f} {(b - a) / 1e3:+8.3f} {ca:5.0f}/{cb:<5.0f}")
    total_a, total_b = (sum(v[0] for v in t.values()) / 1e3 for t in (orig, fused))
    calls_a, calls_b = (sum(v[1] for v in t.values()) for t in (orig, fused))
    gemm_a, gemm_b = (sum(v[0] for n, v in t.items() if n.startswith(GEMMS)) / 1e3 for t in (orig, fused))
    print(f"{'GEMMs':44} {gemm_a:9.3f} {gemm_b:9.3f} {gemm_b - gemm_a:+8.3f}")
    print(
        f"{'everything else':44} {total_a - gemm_a:9.3f} {total_b - gemm_b:9.3f} {total_b - gemm_b - total_a + gemm_a:+8.3f}"
    )
    print(
        f"{'total (aten ops)':44} {total_a:9.3f} {total_b:9.3f} {total_b - total_a:+8.3f} {calls_a:5.0f}/{calls_b:<5.0f}"
    )
    print(f"fused / original (profiled self time): {total_b / total_a:.3f}")


if __name__ == "__main__":
    main()
