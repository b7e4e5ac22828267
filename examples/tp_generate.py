"""Greedy generation with a fused model sharded over processes (tensor parallelism), with per-rank memory.

    # every rank loads only its slices of the checkpoint, then all ranks generate together
    torchrun --nproc-per-node 2 examples/tp_generate.py path/to/llama --prompt "The capital of France is"
    torchrun --nproc-per-node 2 examples/tp_generate.py path/to/llama --prompt-ids 1,2,3 --check

    # a random llama checkpoint to try it on (single process, no torchrun)
    python examples/tp_generate.py --make-random /tmp/llama-random --hidden-size 1024 --layers 8

The same command runs on GPUs (Transformers picks NCCL and one GPU per rank) and on CPU (gloo). `--check` also loads
the model whole in every rank and compares logits and greedy tokens with the sharded one. Needs `accelerate`
(`pip install .[tp]`). See docs/tensor-parallel.md.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch


def status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (Linux); 0 elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def fused_class_for(path: str):
    """The generated `Fused*ForCausalLM` for a checkpoint (saved by the original or the fused class)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    module = importlib.import_module(f"generated.fused_{config.model_type}")
    architecture = (config.architectures or [""])[0].removeprefix("Fused")
    name = f"Fused{architecture}"
    if not hasattr(module, name):
        name = next(n for n in module.__all__ if n.endswith("ForCausalLM"))
    return getattr(module, name)


def local_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (the local shard of each DTensor), tied parameters counted once."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for parameter in model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += local.numel() * local.element_size()
    return total


def prompt_ids(args, device) -> torch.Tensor:
    if args.prompt_ids:
        return torch.tensor([[int(i) for i in args.prompt_ids.split(",")]], device=device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    return tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)


def generate(args) -> None:
    import torch.distributed as dist
    from transformers import DistributedConfig

    fused_class = fused_class_for(args.checkpoint)
    before = status_kib("VmRSS")
    model = fused_class.from_pretrained(
        args.checkpoint, distributed_config=DistributedConfig(tp_plan="auto"), dtype=args.dtype
    ).eval()
    sharded = dist.is_available() and dist.is_initialized()  # one process: Transformers loads it whole
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)

    input_ids = prompt_ids(args, model.device)
    greedy = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    tokens = model.generate(input_ids, **greedy)
    # After a generation every weight page has been touched: safetensors maps the checkpoint, and pages of tensors
    # that are views of the file count only once read. VmHWM also counts those file pages (page cache, shared).
    memory = {
        "rank": rank,
        "rss_before_load_mib": before / 1024,
        "peak_rss_mib": status_kib("VmHWM") / 1024,
        "private_rss_mib": status_kib("RssAnon") / 1024,
        "weights_held_mib": local_weight_bytes(model) / 2**20,
    }
    if torch.cuda.is_available():
        memory["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    table = [memory] * world_size
    if sharded:
        dist.all_gather_object(table, memory)
    check = compare_with_single_process(fused_class, model, args, input_ids, tokens, greedy) if args.check else None

    if rank == 0:
        backend = dist.get_backend() if sharded else "not sharded"
        print(f"{fused_class.__name__} over {world_size} processes ({backend}):")
        for row in table:
            print("  " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        print("tokens:", tokens[0].tolist())
        if check:
            print("check against the single-process model:", check)


def compare_with_single_process(fused_class, model, args, input_ids, tokens, greedy) -> dict:
    """Logits and greedy tokens of the sharded model against the same class loaded whole in this process."""
    single = fused_class.from_pretrained(args.checkpoint, dtype=args.dtype).eval().to(model.device)
    with torch.no_grad():
        difference = (model(input_ids).logits - single(input_ids).logits).abs().max().item()
    return {
        "max_abs_logit_diff": difference,
        "same_greedy_tokens": torch.equal(tokens, single.generate(input_ids, **greedy)),
    }


def make_random(args) -> None:
    """Save a random llama checkpoint (original class, canonical layout) of the requested size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.make_random)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(f"wrote {args.make_random}: {size:.0f} MiB of float32 weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory (original or fused class)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--prompt-ids", help="comma-separated token ids, for checkpoints without a tokenizer")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, ... (default: the checkpoint's)")
    parser.add_argument("--check", action="store_true", help="compare with the model loaded whole, on every rank")
    parser.add_argument("--make-random", metavar="DIR", help="write a random llama checkpoint to DIR and exit")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args()
    if args.make_random:
        make_random(args)
    elif args.checkpoint:
        generate(args)
    else:
        parser.error("give a checkpoint (under torchrun) or --make-random DIR")


if __name__ == "__main__":
    main()
