"""RMSNorm -> torch.nn.functional.rms_norm: per call, and over a prefill step of a small Llama (not a test).

    python bench/rmsnorm.py [--samples 200] [--rounds 9] [--tokens 512] [--layers 4] [--threads N]

Per call: each norm style's original forward (LlamaRMSNorm, OLMo 2, Gemma 3) vs the forward fusegen's `rmsnorm` kind
writes for it (`fusegen.fusions.rmsnorm`, derived from the installed source), on shapes (rows, size) and the per-head
(512, 16, 128) of a q/k norm; for reference also the one-call `F.rms_norm(x, shape, weight, eps)`, which is NOT
bit-identical to Llama's norm in bfloat16 (it applies the weight before rounding) and so is not what fusegen emits.
Prefill: a Llama-shaped model (Llama-3.2-1B widths, `--layers` layers, random weights, 1 x `--tokens` tokens) with
its norms original vs rewritten, same weights. Variants run interleaved (`--samples` calls each per shape, `--rounds`
prefill steps); each figure is the best sample (the machine is shared, and interference only ever adds time). Every rewritten output is checked
bit-identical to the original's, the prefill logits too.
"""

from __future__ import annotations

import argparse
import types

from harness import timed  # bench/harness.py

STYLES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    "olmo2": ("transformers.models.olmo2.modeling_olmo2", "Olmo2RMSNorm"),
    "gemma3": ("transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm"),
}
SHAPES = ((1, 2048), (512, 2048), (512, 16, 128))


def rewritten_forward(cls):
    """The forward fusegen's rmsnorm kind writes for `cls`, compiled in its module (raises if it is refused)."""
    import torch

    from fusegen.core import astutil
    from fusegen.fusions import rmsnorm

    with torch.device("meta"):
        instance = cls(8)
    plan = rmsnorm.derive(cls, instance)
    return rmsnorm.compile_forward(cls, astutil.method(rmsnorm.rewritten_class(cls, plan), "forward"))


def per_call(samples: int) -> None:
    import importlib

    import torch
    import torch.nn.functional as F

    print(f"per call, microseconds (best of {samples} interleaved samples); ratio = rewritten / original")
    print(f"{'style':8} {'dtype':9} {'shape':15} {'original':>9} {'rewritten':>9} {'ratio':>6} {'F.rms_norm(w)':>13}")
    for style, (module_name, class_name) in STYLES.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        fast = rewritten_forward(cls)
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                norm = cls(shape[-1]).to(dtype)
                with torch.no_grad():
                    norm.weight.normal_(1.0 if style != "gemma3" else 0.0, 0.1)
                x = torch.randn(shape).to(dtype)
                eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
                with torch.inference_mode():
                    assert torch.equal(cls.forward(norm, x), fast(norm, x)), (style, dtype, shape)
                    calls = {
                        "original": lambda cls=cls, norm=norm, x=x: cls.forward(norm, x),
                        "rewritten": lambda fast=fast, norm=norm, x=x: fast(norm, x),
                        "kernel": lambda norm=norm, x=x, eps=eps: F.rms_norm(x, x.shape[-1:], norm.weight, eps),
                    }
                    reps = max(1, int(2e5 // x.numel()))
                    times = {name: [] for name in calls}
                    for _ in range(samples):
                        for name, fn in calls.items():
                            times[name].append(timed(fn, reps))
                best = {name: min(values) * 1e6 for name, values in times.items()}
                print(
                    f"{style:8} {str(dtype)[6:]:9} {shape!s:15} {best['original']:9.1f} {best['rewritten']:9.1f} "
                    f"{best['rewritten'] / best['original']:6.3f} {best['kernel']:13.1f}"
                )


def prefill(rounds: int, tokens: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    fast = rewritten_forward(LlamaRMSNorm)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    print(
        f"\nprefill step: Llama-3.2-1B widths, {layers} layers, vocab {config.vocab_size}, 1 x {tokens} tokens, sdpa"
    )
    print(f"{'dtype':9} {'original ms':>11} {'rewritten ms':>12} {'ratio':>6} {'norm share':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(dtype).eval()
        norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
        input_ids = torch.randint(0, config.vocab_size, (1, tokens))

        def run(rewritten: bool, norms=norms, model=model, input_ids=input_ids):
            for norm in norms:
                if rewritten:
                    norm.forward = types.MethodType(fast, norm)
                else:
                    norm.__dict__.pop("forward", None)
            with torch.inference_mode():
                return model(input_ids, use_cache=False).logits

        assert torch.equal(run(False), run(True)), dtype
        times = {False: [], True: []}
        for _ in range(rounds):
            for rewritten in (False, True):
                times[rewritten].append(timed(lambda rewritten=rewritten: run(rewritten), 1))
        original, rewritten = (min(times[key]) * 1e3 for key in (False, True))
        hidden = torch.randn(1, tokens, config.hidden_size).to(dtype)
        with torch.inference_mode():
            one = min(timed(lambda n=norms[0], h=hidden: LlamaRMSNorm.forward(n, h), 3) for _ in range(rounds))
        share = one * 1e3 * len(norms) / original
        print(f"{str(dtype)[6:]:9} {original:11.1f} {rewritten:12.1f} {rewritten / original:6.3f} {share:10.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="per-call samples per variant")
    parser.add_argument("--rounds", type=int, default=9, help="prefill steps per variant")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    per_call(args.samples)
    prefill(args.rounds, args.tokens, args.layers)


if __name__ == "__main__":
    main()
