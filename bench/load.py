"""Side-by-side load benchmark: `load_checkpoint` vs `FusedLlamaForCausalLM.from_pretrained` (not a test).

Writes a random mid-size llama (default: hidden 1024, 8 layers, vocab 32000, bf16, ~155M parameters) to a temporary
directory, in the canonical layout and in the fused layout (`convert_checkpoint`), then times each way of loading it
in a FRESH subprocess, because peak RSS (VmHWM) is per process and only ever grows. Each method runs
`--repeats` times (page cache warm after the first) and the median is printed.

    python bench/load.py [--hidden 1024] [--layers 8] [--repeats 3]

RSS counts resident memory-mapped file pages too: safetensors reads through mmap, so a method's peak includes the
pages of the checkpoint it touched while the file was mapped, on top of the model itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (how the model is built, which checkpoint load_checkpoint reads); from_pretrained does both itself.
METHODS = {
    "from_pretrained": (None, None),
    "load_checkpoint": ("init", "canonical"),
    "load_checkpoint+no_init": ("no_init", "canonical"),
    "load_checkpoint+no_init fused": ("no_init", "fused"),
}


def peak_rss_mib() -> float:
    """Peak RSS of this process image (VmHWM). Not `ru_maxrss`: Linux carries that across fork+exec, so a child would
    report its parent's high-water mark."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


@contextmanager
def default_dtype(dtype):
    """Build the model directly in the checkpoint's dtype, as from_pretrained does, so no fp32 copy ever exists."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(config, how: str):
    """Build the empty model in bf16; `no_init` skips the random init (Transformers' own `no_init_weights` helper),
    which load_checkpoint overwrites anyway, so only the time differs."""
    import torch
    from transformers.initialization import no_init_weights

    from generated.fused_llama import FusedLlamaForCausalLM

    with default_dtype(torch.bfloat16):
        if how == "no_init":
            with no_init_weights():
                return FusedLlamaForCausalLM(config)
        return FusedLlamaForCausalLM(config)


def measure(method: str, canonical: Path, fused: Path) -> dict:
    """Run one method in this process; return wall times (s) and peak RSS (MiB) after imports, load, one forward."""
    import torch
    from transformers import AutoConfig

    from fusegen.runtime import load_checkpoint
    from generated.fused_llama import FusedLlamaForCausalLM

    baseline = peak_rss_mib()
    how, layout = METHODS[method]
    start = time.perf_counter()
    if how is None:
        model = FusedLlamaForCausalLM.from_pretrained(canonical, dtype=torch.bfloat16)
        built = start
    else:
        model = build(AutoConfig.from_pretrained(canonical), how)
        built = time.perf_counter()
        load_checkpoint(model, canonical if layout == "canonical" else fused)
    end = time.perf_counter()
    loaded = peak_rss_mib()
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():  # touches every weight: from_pretrained may leave some memory-mapped until first use
        model.eval()(torch.arange(16).unsqueeze(0))
    return {
        "method": method,
        "construct_s": built - start,
        "load_s": end - built,
        "total_s": end - start,
        "baseline_mib": baseline,
        "loaded_mib": loaded,
        "forward_mib": peak_rss_mib(),
    }


def write_checkpoints(directory: Path, hidden: int, layers: int) -> tuple[Path, Path, int]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusegen.tools.convert import convert_checkpoint

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 256, 1),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    canonical = directory / "canonical"
    model.save_pretrained(canonical)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    fused = convert_checkpoint(canonical, directory / "fused", "llama", generated_dir=ROOT / "generated")
    return canonical, fused, parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "CANONICAL", "FUSED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, canonical, fused = args.child
        print(json.dumps(measure(method, Path(canonical), Path(fused))))
        return

    with tempfile.TemporaryDirectory() as tmp:
        canonical, fused, parameters = write_checkpoints(Path(tmp), args.hidden, args.layers)
        size = sum(p.stat().st_size for p in canonical.glob("*.safetensors")) / 2**20
        print(
            f"llama hidden={args.hidden} layers={args.layers}: {parameters / 1e6:.1f}M parameters, {size:.0f} MiB bf16"
        )
        results: dict[str, list[dict]] = {method: [] for method in METHODS}
        for _ in range(args.repeats):
            for method in METHODS:  # interleaved, so no method always runs on the coldest cache
                command = [sys.executable, __file__, "--child", method, str(canonical), str(fused)]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                results[method].append(json.loads(output.strip().splitlines()[-1]))
    print(f"median of {args.repeats} fresh processes each; peak RSS (VmHWM) in MiB above the after-imports baseline")
    header = f"{'method':31} {'construct s':>11} {'load s':>7} {'total s':>7} {'base':>5} {'+load':>6} {'+forward':>8}"
    print(header)
    for method, runs in results.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "method"}
        base = median["baseline_mib"]
        print(
            f"{method:31} {median['construct_s']:11.2f} {median['load_s']:7.2f} {median['total_s']:7.2f} "
            f"{base:5.0f} {median['loaded_mib'] - base:6.0f} {median['forward_mib'] - base:8.0f}"
        )


if __name__ == "__main__":
    main()
