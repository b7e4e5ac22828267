"""What the piece copies cost (issue 24: pieces that escape get `.clone()`, pieces whose layout shows `.contiguous()`).

    python bench/piece_copies.py [--layers 2] [--tokens 1,128] [--rounds 7]

Three figures, side by side, in one run:

1. The checked-in files: how many piece copies each `generated/fused_*.py` has (statements `p = p.clone()` or
   `p = p.contiguous()` right after a merged call's split, the only place the rewrite puts them). llama and qwen2,
   the common path, must have none.
2. A forward where the copies apply: Gemma 4 text (its attention stores its k/v pieces in `shared_kv_states`, so
   both are cloned), at its real widths (hidden 2304, 8 heads of 256, intermediate 9216) with `--layers` layers and
   a 1024-token vocabulary. The checked-in fused file (with the copies) against the same model built with
   `fusegen.fusions.merged.pieces.COPIES` off (no copies) and the original; eval-mode forward of one sequence of
   each `--tokens` length, the three interleaved for `--rounds` rounds, medians. Outputs are checked identical.
3. The copies in isolation at the first layer's widths: its merged q/k/v GEMM + split, with and without cloning k
   and v.

Times are this process's CPU time (`time.process_time`, every thread's), medians: on a shared machine the wall clock
of both sides stretches with other processes' load, the work each side does hardly. One torch thread by default
(`--threads`), so that CPU time is the work of one core.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLIT = re.compile(r"^\s*(?P<names>\w+(?:\s*,\s*\w+)+)\s*=\s*.*\.split\(")
COPY = re.compile(r"^\s*(?P<name>\w+) = (?P=name)\.(?P<kind>clone|contiguous)\(\)\s*$")


def piece_copies(text: str) -> list[str]:
    """The copy statements the rewrite put after a split of a merged output (`k = k.clone()`), in file order."""
    lines = text.splitlines()
    found = []
    for index, line in enumerate(lines):
        split = SPLIT.match(line)
        if not split:
            continue
        names = {name.strip() for name in split.group("names").split(",")}
        for following in lines[index + 1 :]:
            copy = COPY.match(following)
            if not copy or copy.group("name") not in names:
                break
            found.append(following.strip())
    return found


def checked_in_copies() -> dict[str, list[str]]:
    return {path.stem: piece_copies(path.read_text()) for path in sorted((ROOT / "generated").glob("fused_*.py"))}


def gemma4_config(layers: int):
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING["gemma4_text"]()
    return CONFIG_MAPPING["gemma4_text"](
        num_hidden_layers=layers,
        layer_types=defaults.layer_types[:layers],
        vocab_size=1024,
        vocab_size_per_layer_input=1024,
    )


def without_copies(model_type: str, directory: Path):
    """The fused module of `model_type` built with the piece copies switched off, imported from `directory`."""
    from fusegen.compiler.build import build
    from fusegen.fusions.merged import pieces
    from fusegen.testkit import import_file

    pieces.COPIES = False
    try:
        text = build(model_type, validate=False).text
    finally:
        pieces.COPIES = True
    path = directory / f"fused_{model_type}_no_copies.py"
    path.write_text(text)
    return import_file(path, f"fused_{model_type}_no_copies"), len(piece_copies(text))


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def model_figures(layers: int, tokens: list[int], rounds: int) -> tuple[list[str], list[int], int]:
    """The figure lines, and the first layer's q/k/v sizes and hidden size (for `isolated_figures`)."""
    import torch

    from fusegen.testkit import model_classes, save_random

    _, original_class, fused_class = model_classes("gemma4_text")
    config = gemma4_config(layers)
    with tempfile.TemporaryDirectory() as scratch:
        module, copies_off = without_copies("gemma4_text", Path(scratch))
        plain_class = getattr(module, fused_class.__name__)
        save_random(original_class, config, Path(scratch) / "original")
        models = {
            "with copies": fused_class.from_pretrained(Path(scratch) / "original").eval(),
            "without copies": plain_class.from_pretrained(Path(scratch) / "original").eval(),
            "original": original_class.from_pretrained(Path(scratch) / "original").eval(),
        }
        title = f"gemma4_text, {layers} layers, hidden {config.hidden_size}, eval forward of one sequence"
        lines = [f"{title} (copies in the file built without them: {copies_off}):"]
        for count in tokens:
            ids = torch.randint(0, config.vocab_size, (1, count), generator=torch.Generator().manual_seed(0))
            samples = {name: [] for name in models}
            with torch.no_grad():
                outputs = {name: model(ids).logits for name, model in models.items()}
                for name in ("with copies", "without copies"):
                    assert torch.equal(outputs[name], outputs["without copies"]), "the copies changed the logits"
                difference = (outputs["with copies"] - outputs["original"]).abs().max().item()
                for _ in range(rounds):
                    for name, model in models.items():
                        start = time.process_time()
                        model(ids)
                        samples[name].append(time.process_time() - start)
            figures = ", ".join(f"{name} {median_ms(times):.1f} ms CPU" for name, times in samples.items())
            ratio = median_ms(samples["with copies"]) / median_ms(samples["without copies"])
            lines.append(
                f"  {count:5d} tokens: {figures}; with/without {ratio:.3f}; |fused - original| {difference:.2e}"
            )
        sizes = list(models["with copies"].model.layers[0].self_attn.qkv_proj_sizes)
    return lines, sizes, config.hidden_size


def isolated_figures(sizes: list[int], hidden: int, tokens: list[int], rounds: int) -> list[str]:
    """The first layer's merged q/k/v (`sizes` rows of `hidden`) + split, with and without cloning k and v."""
    import torch
    import torch.nn.functional as F

    q, kv, _ = sizes
    weight = torch.randn(sum(sizes), hidden) / hidden**0.5
    lines = [f"merged q/k/v GEMM ({q}+{kv}+{kv} x {hidden}) + split, k and v cloned or not:"]
    for count in tokens:
        x = torch.randn(1, count, hidden)

        def plain(x=x):
            return F.linear(x, weight).split([q, kv, kv], dim=-1)

        def copied(x=x):
            a, b, c = F.linear(x, weight).split([q, kv, kv], dim=-1)
            return a, b.clone(), c.clone()

        samples = {"without": [], "with": []}
        reps = max(1, 2000 // count)
        with torch.no_grad():
            for _ in range(rounds):
                for name, fn in (("without", plain), ("with", copied)):
                    fn()
                    start = time.process_time()
                    for _ in range(reps):
                        fn()
                    samples[name].append((time.process_time() - start) / reps)
        without, with_ = median_ms(samples["without"]), median_ms(samples["with"])
        lines.append(
            f"  {count:5d} tokens: without {without * 1e3:.1f} us, with {with_ * 1e3:.1f} us CPU "
            f"(+{(with_ - without) * 1e3:.1f} us, {with_ / without:.3f}x)"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", default="1,128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    copies = checked_in_copies()
    print("piece copies in the checked-in files (generated/fused_*.py):")
    for name, found in copies.items():
        if found or name in ("fused_llama", "fused_qwen2"):
            print(f"  {name}: {len(found)} {found}")
    print(f"  the other {sum(1 for found in copies.values() if not found) - 2} files: 0")
    lines, sizes, hidden = model_figures(args.layers, tokens, args.rounds)
    for line in [*isolated_figures(sizes, hidden, tokens, args.rounds), *lines]:
        print(line)


if __name__ == "__main__":
    main()
