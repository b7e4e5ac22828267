"""bench/run.py's on-device section runs, on the CPU, the same code a GPU run uses (so it cannot rot unnoticed).

Tiny shape, few repetitions and `torch.compile(backend="eager")` (dynamo's capture and guards without inductor's C++
build), so it stays fast; the figures themselves are not checked, only that every mode produced finite ones and that
fused and original agree.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import run as bench

TINY_CFG = {
    **bench.QUICK,
    "layers": 1,
    "decode_batches": (1, 2),
    "cache_lens": (16,),
    "decode_warmup": 1,
    "decode_reps": 2,
    "decode_steps": 1,
    "prefill_len": 16,
    "prefill_warmup": 1,
    "prefill_reps": 2,
}


def device_args(device: str) -> argparse.Namespace:
    return argparse.Namespace(device=device, modes="eager,static,compile", shapes="tiny", compile_backend="eager")


def fixed_rounds() -> bench.Bench:
    """A run state without noise rejection: a fixed round count."""
    return bench.Bench(TINY_CFG, bench.Sampler(float("inf"), 1.0))


@pytest.mark.slow
def test_device_section_runs_every_mode_on_cpu():
    results = bench.run_device_section(device_args("cpu"), fixed_rounds())
    assert sorted(results["device"]) == ["tiny_bf16_compile", "tiny_bf16_eager", "tiny_bf16_static"]
    for mode, rows in results["device"].items():
        assert sorted(rows) == ["decode_b1_kv16", "decode_b2_kv16", "prefill16"], mode
        for key, row in rows.items():
            assert math.isfinite(row["ratio"]) and row["orig_ms"] > 0 and row["fused_ms"] > 0, (mode, key)
            assert row["used_rounds"] == TINY_CFG["prefill_reps" if key.startswith("prefill") else "decode_reps"]
            if key.startswith("decode"):  # bf16: a merged GEMM may round one element differently, no more
                assert row["max_abs_logit_diff"] < 0.05, (mode, key, row["max_abs_logit_diff"])


def test_device_section_without_the_device_says_so_and_measures_nothing(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device; the skip message cannot be exercised here")
    assert bench.run_device_section(device_args("cuda"), fixed_rounds()) is None
    assert "--device cuda: skipped: no cuda device here" in capsys.readouterr().out


def test_device_clock_times_the_call_on_cpu():
    clock = bench.device_clock(torch.device("cpu"))
    assert clock(lambda: sum(range(10000))) > 0
