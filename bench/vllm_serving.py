"""vLLM serving figures: fusegen's classes vs vLLM's Transformers backend on the original vs vLLM's native model.

    python bench/vllm_serving.py [--shapes tiny,0.5b] [--dtype bfloat16] [--tp 1]

Run in the vLLM venv (docs/serving.md). For each shape a random Llama checkpoint is made locally (no download), the
fused file is built under the installed Transformers, and three engines are started, each in a fresh process:

- `fusegen`: the `fusegen export` of the checkpoint, `model_impl="transformers"` (fusegen's classes + its plugin);
- `transformers`: the original checkpoint, `model_impl="transformers"` (vLLM's Transformers backend with its own fusers);
- `native`: the original checkpoint, `model_impl="vllm"` (vLLM's own Llama).

Figures per engine: start-up (process start to the first generated token, engine construction included), prefill
throughput (8 prompts of 256 tokens, one output token each; prompt tokens / s) and decode throughput (8 prompts of 16
tokens, 64 new tokens each; generated tokens / s, prefill excluded by subtracting a one-token run). Nothing here is
CPU-specific: on a GPU build of vLLM the same command runs unchanged (pass `--dtype` as you like). These are figures,
not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (128, 2, 4, 2, 256, 256),
    "0.5b": (896, 24, 14, 2, 4864, 151936),  # Qwen2-0.5B's shape, Llama architecture
}
RESULT = "BENCH_RESULT "


def make_checkpoint(shape: str, path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.save_pretrained(path)


def engine(args) -> None:
    """One engine in this process: print start-up, prefill and decode figures as one JSON line."""
    started = float(os.environ["BENCH_STARTED"])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        trust_remote_code=True,
        model_impl=args.impl,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        max_model_len=512,
        seed=0,
    )
    vocab = 256

    def prompts(count, length):
        return [
            {"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(length)]} for i in range(count)
        ]

    llm.generate(prompts(1, 4), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    startup = time.time() - started

    def timed(batch, max_tokens):
        begin = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - begin

    timed(prompts(8, 256), 1)  # warm-up
    prefill = min(timed(prompts(8, 256), 1) for _ in range(3))
    short = prompts(8, 16)
    one = min(timed(short, 1) for _ in range(2))
    decode = min(timed(short, 65) for _ in range(2)) - one
    print(
        RESULT
        + json.dumps({"startup_s": startup, "prefill_tok_s": 8 * 256 / prefill, "decode_tok_s": 8 * 64 / decode}),
        flush=True,
    )


def run_engine(model: Path, impl: str, args) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--engine",
        str(model),
        "--impl",
        impl,
        "--dtype",
        args.dtype,
        "--tp",
        str(args.tp),
    ]
    env = {**os.environ, "BENCH_STARTED": repr(time.time())}
    if args.tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core) for core in range(args.tp)))
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]
    if result.returncode or not lines:
        raise RuntimeError(f"{impl} on {model} failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        args.model = args.engine
        engine(args)
        return

    import transformers
    import vllm

    from fusegen.cli import main as fusegen

    print(f"vllm {vllm.__version__}, transformers {transformers.__version__}, dtype {args.dtype}, tp {args.tp}")
    print("| shape | engine | start-up to first token (s) | prefill (tok/s) | decode (tok/s) |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        assert fusegen(["build", "llama", "--output-dir", str(work / "generated")]) == 0
        for shape in args.shapes.split(","):
            original, export = work / f"{shape}-original", work / f"{shape}-export"
            make_checkpoint(shape, original)
            argv = ["export", str(original), str(export), "--model", "llama"]
            assert fusegen([*argv, "--generated-dir", str(work / "generated")]) == 0
            for name, model, impl in (
                ("fusegen", export, "transformers"),
                ("transformers", original, "transformers"),
                ("native", original, "vllm"),
            ):
                figures = run_engine(model, impl, args)
                print(
                    f"| {shape} | {name} | {figures['startup_s']:.1f} | {figures['prefill_tok_s']:.0f} | "
                    f"{figures['decode_tok_s']:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
