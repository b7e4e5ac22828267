"""`fusegen verify`: check on a real checkpoint that the fused class computes what the original class computes.

Both models are loaded from the same canonical checkpoint: the original through `AutoModelForCausalLM.from_pretrained`
(Transformers' own path, the reference), the fused one through `load_checkpoint` (the path a server uses). Random
prompts are run through both: a prefill, then greedy decode steps with the KV cache. The fused model is fed the
original's greedy tokens (teacher forcing), so every compared logit has the same inputs and one disagreement cannot
cascade into a different continuation.

Pass criterion: max |logit difference| <= tolerance. Greedy-token agreement is printed but not judged on its own:
if every logit is within `tol`, the two argmaxes can only differ where the original's top two logits are within
`2 * tol` of each other, i.e. a numerical tie.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from fusegen.errors import EXIT_DRIFT, EXIT_OK, InputError, command
from fusegen.runtime.loading import FUSED, LAYOUT_KEY, load_checkpoint, open_checkpoint
from fusegen.testkit import TOLERANCE
from fusegen.tools.checkpoint_cli import add_checkpoint_arguments
from fusegen.tools.convert import causal_lm_class, import_fused_module, read_config

EXIT_MISMATCH = EXIT_DRIFT
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_TOLERANCE = TOLERANCE  # the one fp32 tolerance (fusegen/testkit.py)
# bf16 keeps 8 significant bits: neighbouring values are 2**-7 * |x| apart. The fused GEMM accumulates in a different
# order than three separate ones, so an output element may round to the neighbouring bf16 value, and that difference
# travels through every later layer; it is expected, not a fault. An absolute bound cannot fit logits of every scale,
# so the bf16 bound is relative to the largest reference logit: 2**-4 (6.25%) of it, i.e. 8 bf16 spacings at that
# magnitude. Measured on random llama/qwen2 models (hidden 64-1024, 2-8 layers, 4 prompts x 16 tokens + 4 steps):
# 0.5-1.2% of max |logit|, growing with depth, hence the ~5x headroom for deeper models. A real fault (k and v rows
# swapped in ONE layer) measured 97-156%, an order of magnitude above the bound.
BF16_RELATIVE_TOLERANCE = 2**-4


@dataclass(frozen=True)
class Comparison:
    """Agreement of the two models over all prompts."""

    max_abs_diff: float
    reference_scale: float  # max |logit| of the original
    agreed: int  # greedy decisions (last prefill position + each decode step) on which both argmaxes agree
    decisions: int


def tolerance(dtype_name: str, reference_scale: float) -> float:
    """Allowed max |logit difference|: absolute in fp32, relative to the logit scale in bf16 (see the constants)."""
    if dtype_name == "fp32":
        return FP32_TOLERANCE
    return BF16_RELATIVE_TOLERANCE * max(reference_scale, 1.0)


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """Seeded random token ids: reproducible, and independent of any tokenizer being present."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator) for _ in range(count)]


@torch.no_grad()
def trace(model, prompt: torch.Tensor, steps: int, forced: list[int] | None = None):
    """Prefill `prompt`, then `steps` cached decode steps; returns (logits per call in fp32, tokens fed).

    The fed token is the model's own greedy choice, or `forced[step]` when replaying another model's choices.
    """
    output = model(input_ids=prompt[None], use_cache=True)
    logits, tokens = [output.logits[0].float()], []
    for step in range(steps):
        token = forced[step] if forced is not None else int(logits[-1][-1].argmax())
        tokens.append(token)
        output = model(input_ids=torch.tensor([[token]]), cache=output.cache, use_cache=True)
        logits.append(output.logits[0].float())
    return logits, tokens


def compare(original, fused, prompts: list[torch.Tensor], steps: int) -> Comparison:
    """Run every prompt through both models (fused replays the original's tokens) and summarise the differences."""
    max_diff, scale, agreed, decisions = 0.0, 0.0, 0, 0
    for prompt in prompts:
        expected, tokens = trace(original, prompt, steps)
        actual, _ = trace(fused, prompt, steps, forced=tokens)
        for reference, candidate in zip(expected, actual):
            max_diff = max(max_diff, (reference - candidate).abs().max().item())
            scale = max(scale, reference.abs().max().item())
            agreed += int(reference[-1].argmax() == candidate[-1].argmax())
            decisions += 1
    return Comparison(max_diff, scale, agreed, decisions)


def load_models(checkpoint_dir: Path, generated_dir: Path, dtype: torch.dtype):
    """(original, fused) in eval mode and `dtype`, from the same canonical checkpoint."""
    from transformers import AutoModelForCausalLM

    config = read_config(checkpoint_dir)
    if getattr(config, LAYOUT_KEY, None) == FUSED:
        raise InputError(f"{checkpoint_dir} is a fused-layout checkpoint; verify the canonical one it came from")
    fused_class = causal_lm_class(import_fused_module(generated_dir, config.model_type))
    with open_checkpoint(checkpoint_dir, allow_pickle=False):
        pass  # every weight file's header and size checked first: a damaged file is named, not a traceback
    try:
        original = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as error:
        raise InputError(f"{checkpoint_dir}: Transformers cannot load it: {error}") from error
    fused = fused_class(original.config).to(dtype)
    load_checkpoint(fused, checkpoint_dir)
    return original.eval(), fused.eval()


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `fusegen verify CHECKPOINT_DIR [--generated-dir DIR] [--prompts N] [--dtype fp32|bf16]`."""
    parser = subparsers.add_parser("verify", help="compare the fused and original models on a checkpoint")
    add_checkpoint_arguments(parser, output=False)
    parser.add_argument("--prompts", type=_positive, default=4, metavar="N", help="random prompts (default 4)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--prompt-length", type=_positive, default=16, metavar="T")
    parser.add_argument("--steps", type=int, default=4, metavar="S", help="greedy decode steps per prompt")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


@command
def run(args: argparse.Namespace) -> int:
    """Exit 0 within tolerance, 1 beyond it, 2 on bad input (`fusegen: error: ...` on stderr, see fusegen.errors)."""
    original, fused = load_models(args.checkpoint_dir, args.generated_dir, DTYPES[args.dtype])
    prompts = random_prompts(args.prompts, args.prompt_length, original.config.vocab_size, args.seed)
    result = compare(original, fused, prompts, max(args.steps, 0))
    allowed = tolerance(args.dtype, result.reference_scale)
    ok = result.max_abs_diff <= allowed
    print(f"{type(original).__name__} vs {type(fused).__name__} ({args.dtype}, {args.prompts} prompts)")
    print(
        f"max abs logit diff: {result.max_abs_diff:.3g} (tolerance {allowed:.3g}; max |logit| {result.reference_scale:.3g})"
    )
    print(f"greedy-token agreement: {result.agreed}/{result.decisions}")
    print("OK" if ok else "MISMATCH: beyond tolerance")
    return EXIT_OK if ok else EXIT_MISMATCH
