"""Fused MoE vs original, and vs the fused model forced onto the eager experts loop (not a test).

    python bench/moe.py [--layers 4] [--rounds 9]

A random Mixtral (hidden 1024, 8 experts x intermediate 2048, top-2) saved once and loaded three ways: the original
class, the fused class (which keeps Transformers' `grouped_mm` experts kernel), and the fused class with
`experts_implementation="eager"` -- what fused MoE models ran before the build taught the fused base class to say it
supports experts implementations. Forwards without cache at 1 and 128 tokens, interleaved, medians of `--rounds`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench  # bench/harness.py: it also puts the repository root on sys.path, for `generated`


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()

    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from generated.fused_mixtral import FusedMixtralForCausalLM

    bench.quiet_transformers()
    config = MixtralConfig(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="fusegen-moe-") as tmp:
        MixtralForCausalLM(config).save_pretrained(tmp)
        models = {
            "original": MixtralForCausalLM.from_pretrained(tmp).eval(),
            "fused": FusedMixtralForCausalLM.from_pretrained(tmp).eval(),
            "fused, eager experts": FusedMixtralForCausalLM.from_pretrained(
                tmp, experts_implementation="eager"
            ).eval(),
        }
    print("experts implementation:", {name: m.config._experts_implementation for name, m in models.items()})

    def seconds(model, ids) -> float:
        start = time.perf_counter()
        model(ids)
        return time.perf_counter() - start

    with torch.inference_mode():
        for tokens in (1, 128):
            ids = torch.randint(0, config.vocab_size, (1, tokens))
            logits = {name: model(ids).logits for name, model in models.items()}
            for name in list(models)[1:]:
                diff = (logits[name] - logits["original"]).abs().max().item()
                print(f"{tokens:4} tokens: max |logits diff| {name} vs original: {diff:.3g}")
            times = {name: [] for name in models}
            for _ in range(args.rounds):
                for name, model in models.items():
                    times[name].append(seconds(model, ids))
            medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            print(
                f"{tokens:4} tokens: "
                + "  ".join(f"{name} {ms:.1f} ms ({ms / medians['original']:.3f})" for name, ms in medians.items())
            )


if __name__ == "__main__":
    main()
