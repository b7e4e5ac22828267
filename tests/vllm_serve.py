"""Serve a checkpoint with vLLM in this process and print one JSON line: greedy tokens and the served module classes.

Used by tests/test_vllm.py (one fresh process per engine, as a server would start) and runnable by hand:

    python tests/vllm_serve.py MODEL_DIR --prompts '[[1, 5, 9]]' --max-tokens 12 [--tp 2] [--lora ADAPTER_DIR]

vLLM's engine and workers run in child processes (spawned), hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os

RESULT = "VLLM_SERVE_RESULT "


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model-impl", default="transformers")
    parser.add_argument("--lora", default=None, help="a PEFT adapter directory, served with enable_lora=True")
    parser.add_argument("--max-lora-rank", type=int, default=8)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends a function to the workers
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core) for core in range(args.tp)))

    from vllm import LLM, SamplingParams

    from fusegen.runtime.vllm import served_classes

    extra = {"enable_lora": True, "max_lora_rank": args.max_lora_rank, "max_loras": 1} if args.lora else {}
    llm = LLM(
        model=args.model,
        trust_remote_code=True,
        model_impl=args.model_impl,
        skip_tokenizer_init=True,
        dtype="float32",
        tensor_parallel_size=args.tp,
        max_model_len=128,
        enforce_eager=True,
        seed=0,
        **extra,
    )
    request = None
    if args.lora:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("adapter", 1, args.lora)
    prompts = [{"prompt_token_ids": ids} for ids in json.loads(args.prompts)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), lora_request=request)
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    classes = llm.apply_model(served_classes)
    print(RESULT + json.dumps({"tokens": tokens, "classes": classes}), flush=True)


if __name__ == "__main__":
    main()
