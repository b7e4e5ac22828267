"""Which half of a fused layer costs in prefill: swap attention or MLP modules between the two models (not a test).

    python bench/swap.py [--shape tiny] [--dtype fp32] [--tokens 512] [--rounds 15]

Loads bench/run.py's shape (4 layers) four ways -- original, fused, fused attention with the original MLP, original
attention with the fused MLP (the swapped modules are the original model's own, same weights) -- and times a
prompt forward of each, interleaved, medians of `--rounds`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench

from fusegen.testkit import load_fused, load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(bench.SHAPES))
    parser.add_argument("--dtype", default="fp32", choices=bench.DTYPES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    import torch

    bench.quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="fusegen-swap-") as tmp:
        path = bench.write_checkpoints(args.shape, args.layers, Path(tmp))[args.dtype]
        original, fused = load_pair(path, **bench.load_kwargs(args.dtype))
        fused_attention = load_fused(path, **bench.load_kwargs(args.dtype))
        fused_mlp = load_fused(path, **bench.load_kwargs(args.dtype))
    for layer, attention_only, mlp_only in zip(
        original.model.layers, fused_attention.model.layers, fused_mlp.model.layers
    ):
        attention_only.mlp = layer.mlp
        mlp_only.self_attn = layer.self_attn
    models = {
        "original": original,
        "fused": fused,
        "fused attention + original MLP": fused_attention,
        "original attention + fused MLP": fused_mlp,
    }
    ids = torch.randint(0, original.config.vocab_size, (1, args.tokens))

    def seconds(model) -> float:
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    times = {name: [] for name in models}
    with torch.inference_mode():
        reference = original(ids).logits
        for name, model in models.items():
            assert torch.equal(model(ids).logits, reference), name
        for _ in range(2):
            for model in models.values():
                seconds(model)
        for _ in range(args.rounds):
            for name, model in models.items():
                times[name].append(seconds(model))
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    print(f"{args.shape} {args.dtype}, prefill of {args.tokens} tokens, {args.layers} layers (logits identical):")
    for name, ms in medians.items():
        print(f"  {name:32} {ms:9.1f} ms  {ms / medians['original']:.3f}")


if __name__ == "__main__":
    main()
