"""Merged projections in isolation: one GEMM vs the pieces it replaces, and the GLU on merged halves (not a test).

    python bench/gemm.py [--hidden 2048 --intermediate 8192 --q 2048 --kv 512] [--rows 1,8,512]

For each dtype and row count: q/k/v as three linears vs one merged linear + split, gate/up as two vs one, and
`silu(gate) * up` on two separate outputs vs on the two halves of the merged output. Variants run interleaved
(7 rounds, medians); every merged result is checked bit-identical to its pieces. Defaults: Llama-3.2-1B shapes.
Last, per dtype: does a one-row linear give the same bits when its weight starts 1-15 elements further into memory?
(It does not for MKL's fp32 GEMV at offsets that are not a multiple of 16 bytes; see docs/analysis.md.)
"""

from __future__ import annotations

import argparse
import statistics

from harness import timed  # bench/harness.py


def variants(x, qkv: list, gate_up: list, sizes: list[int]) -> dict:
    """name -> (pieces, merged): callables returning lists of tensors that must be bit-identical."""
    import torch
    import torch.nn.functional as F

    merged_qkv, merged_gate_up, i = torch.cat(qkv), torch.cat(gate_up), gate_up[0].shape[0]
    gate, up = (F.linear(x, w) for w in gate_up)
    half_gate, half_up = F.linear(x, merged_gate_up).split([i, i], dim=-1)
    return {
        "qkv": (lambda: [F.linear(x, w) for w in qkv], lambda: F.linear(x, merged_qkv).split(sizes, dim=-1)),
        "gate_up": (lambda: [F.linear(x, w) for w in gate_up], lambda: F.linear(x, merged_gate_up).split([i, i], -1)),
        "silu(gate)*up": (lambda: [F.silu(gate) * up], lambda: [F.silu(half_gate) * half_up]),
    }


def misaligned_offsets(weight, x) -> list[int]:
    """Element offsets (1-15) at which a copy of `weight` gives `F.linear(x, weight)` different bits."""
    import torch
    import torch.nn.functional as F

    expected = F.linear(x, weight)
    buffer = torch.empty(weight.numel() + 16, dtype=weight.dtype)
    differ = []
    for offset in range(1, 16):
        moved = buffer[offset : offset + weight.numel()].view_as(weight)
        moved.copy_(weight)
        if not torch.equal(F.linear(x, moved), expected):
            differ.append(offset)
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--q", type=int, default=2048)
    parser.add_argument("--kv", type=int, default=512)
    parser.add_argument("--rows", default="1,8,512")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import torch

    h, i, sizes = args.hidden, args.intermediate, [args.q, args.kv, args.kv]
    print(f"hidden {h}, intermediate {i}, q/k/v {sizes}, {torch.get_num_threads()} threads; ratio = merged / pieces")
    for dtype in (torch.float32, torch.bfloat16):
        generator = torch.Generator().manual_seed(0)
        qkv = [torch.randn(n, h, generator=generator).mul_(0.02).to(dtype) for n in sizes]
        gate_up = [torch.randn(i, h, generator=generator).mul_(0.02).to(dtype) for _ in range(2)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, h, generator=generator).to(dtype)
            cases = variants(x, qkv, gate_up, sizes)
            reps = max(2, 400 // rows)
            line = []
            with torch.inference_mode():
                for name, (pieces, merged) in cases.items():
                    identical = all(torch.equal(a, b) for a, b in zip(pieces(), merged()))
                    a, b = [], []
                    for _ in range(args.rounds):
                        a.append(timed(pieces, reps))
                        b.append(timed(merged, reps))
                    ms_a, ms_b = statistics.median(a) * 1e3, statistics.median(b) * 1e3
                    line.append(f"{name} {ms_a:.3f}/{ms_b:.3f} ms {ms_b / ms_a:.3f}{'' if identical else ' DIFFERS'}")
            print(f"{str(dtype).removeprefix('torch.'):8} rows {rows:4}: " + " | ".join(line), flush=True)
        with torch.inference_mode():
            offsets = misaligned_offsets(qkv[0], torch.randn(1, h, generator=generator).to(dtype))
        print(f"{str(dtype).removeprefix('torch.'):8} one row, q weight moved by 1-15 elements: differs at {offsets}")


if __name__ == "__main__":
    main()
