"""Fused vs original, side by side: decode, prefill, roofline, load and build figures in one command (not a test).

    python bench/run.py [--quick] [--json OUT] [--markdown OUT] [--threads N] [--no-compile]
                        [--only SECTIONS] [--shapes SHAPES] [--noise-threshold CORES] [--wait-quiet SECONDS]
    python bench/run.py --device cuda [--modes eager,static,compile] [--shapes llama1b,qwen05b] [--quick] [--json OUT]

`--device DEV` runs only the on-device section (`bench_device`): the same original/fused pairs in bf16, decode and
prefill timed on the device's own clock (CUDA events; host time after a synchronise elsewhere), in eager mode with
the dynamic cache, eager with a StaticCache, and torch.compile with a StaticCache. Without such a device it prints
why and exits 0; `--device cpu` runs the very same code (tests/test_bench.py keeps it working).

Everything runtime-related runs in this one process, original (A) and fused (B) interleaved A B A B ... after warm-up,
so drift in machine load hits both alike; figures are medians over repetitions and ratios are fused / original
(< 1 means the fused model is faster or smaller). Load, build and torch.compile run in fresh subprocesses (peak RSS
only ever grows within a process, and a compile must not disturb the eager runs).

Shared machines: every A B round also records how much CPU OTHER processes used meanwhile (/proc/stat minus our own
rusage). Rounds during which others used more than --noise-threshold of a core are repeated (up to a cap) and left
out of the medians; each figure reports how many rounds were clean. With 2 OpenMP threads on 2 cores, one busy
neighbour can slow a GEMM several-fold, so without this the figures mostly measure the neighbours.

Models are random-weight, built from configs (no hub access): Llama-3.2-1B shapes and Qwen2.5-0.5B shapes with few
layers. Each is written once per dtype with `save_pretrained` and both classes `from_pretrained` the same directory,
with `attn_implementation="sdpa"`, so the weights and the attention kernel are the same; only the projections differ.

See docs/benchmarks.md for the figures of a full run and how to read them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# In transformers 5.x the decoder's KV cache argument is `cache=` (and the output field `.cache`); the old
# `past_key_values=` still works through a deprecation shim until 5.40. We use the new name everywhere.
CACHE_KWARG = "cache"

SHAPES = {
    # Llama-3.2-1B (tied embeddings, llama3 rope scaling), truncated to few layers.
    "llama1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    },
    # Qwen2.5-0.5B (tied embeddings, q/k/v biases), truncated to few layers.
    "qwen05b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # Overhead-bound control (not a real model): so small that a decode step is mostly Python/dispatch/launch
    # overhead rather than weight streaming -- the regime where merging GEMMs pays on any hardware. fp32 only;
    # each timed repetition runs `repeat` x more calls so a round stays long enough for the noise check.
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 2048,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
SHAPE_DTYPES = {"tiny": ("fp32",)}  # default: DTYPES
SHAPE_REPEAT = {"tiny": 20}  # default: 1

DTYPES = ("fp32", "bf16")

FULL = {
    "layers": 4,
    "decode_batches": (1, 8),
    "cache_lens": (128, 1024),
    "decode_warmup": 2,
    "decode_reps": 15,
    "decode_steps": 4,  # consecutive decode calls per round (each timed; the round's figure is their mean)
    "decode_reps_big": 9,  # fewer for batch 8 (fp32 GEMMs with 8 rows are slow on this CPU)
    "decode_steps_big": 2,
    "prefill_len": 512,
    "prefill_warmup": 1,
    "prefill_reps": 9,
    "load_reps": 3,
    "build_reps": 3,
    "bw_reps": 10,
    "max_rounds_factor": 3.0,  # at most this many x reps rounds when rejecting noisy ones
    "compile": True,
}
QUICK = {
    **FULL,
    "layers": 2,
    "decode_warmup": 1,
    "decode_reps": 5,
    "decode_steps": 2,
    "decode_reps_big": 4,
    "decode_steps_big": 1,
    "prefill_reps": 4,
    "load_reps": 1,
    "build_reps": 1,
    "bw_reps": 4,
    "max_rounds_factor": 1.5,
    "compile": False,
}


# --------------------------------------------------------------------------------------------------------------------
# helpers


def log(*args) -> None:
    print(*args, flush=True)


def median(values):
    return statistics.median(values) if values else float("nan")


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def model_classes(model_type: str):
    if model_type == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from generated.fused_llama import FusedLlamaForCausalLM

        return LlamaConfig, LlamaForCausalLM, FusedLlamaForCausalLM
    if model_type == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from generated.fused_qwen2 import FusedQwen2ForCausalLM

        return Qwen2Config, Qwen2ForCausalLM, FusedQwen2ForCausalLM
    raise ValueError(model_type)


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def make_config(shape: str, layers: int):
    params = dict(SHAPES[shape])
    config_cls, _, _ = model_classes(params.pop("model_type"))
    return config_cls(num_hidden_layers=layers, **params)


def write_checkpoints(shape: str, layers: int, directory: Path, dtypes=None) -> dict[str, Path]:
    """Build the ORIGINAL class with random weights and save it once per dtype (default: the shape's); returns dtype
    name -> directory."""
    import torch

    config = make_config(shape, layers)
    _, original_cls, _ = model_classes(config.model_type)
    try:  # skip transformers' own (slow, normal_) init: every parameter is overwritten below anyway
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - other transformers versions
        no_init_weights = contextlib.nullcontext
    torch.manual_seed(0)
    with no_init_weights():
        model = original_cls(config)
    generator = torch.Generator().manual_seed(0)
    bound = 0.02 * 3**0.5  # uniform with the std of initializer_range=0.02 (uniform_ is ~4x faster than normal_)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.9, 1.1, generator=generator)
            else:
                param.uniform_(-bound, bound, generator=generator)
    model.tie_weights()  # no_init_weights also skipped the tying
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    paths = {}
    for dtype in dtypes or SHAPE_DTYPES.get(shape, DTYPES):
        path = directory / f"{shape}-{dtype}"
        model.to(torch_dtype(dtype)).save_pretrained(path)
        paths[dtype] = path
    del model
    gc.collect()
    return paths


def load_pair(path: Path, dtype: str, original: bool = True):
    """(original, fused) loaded from the same checkpoint directory; `original=False` loads only the fused one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    _, original_cls, fused_cls = model_classes(config.model_type)
    kwargs = {"dtype": torch_dtype(dtype), "attn_implementation": "sdpa"}
    fused = fused_cls.from_pretrained(path, **kwargs).eval()
    assert fused.config._attn_implementation == "sdpa"
    if not original:
        return None, fused
    original = original_cls.from_pretrained(path, **kwargs).eval()
    assert original.config._attn_implementation == "sdpa"
    return original, fused


def decode_weight_bytes(model, batch: int = 1) -> int:
    """Parameter bytes one decode step reads: every linear (merged or not) and norm, `batch` embedding rows, lm_head.

    With tied embeddings lm_head's weight IS the embedding matrix: it is counted once, in full, as lm_head.
    """
    from torch import nn

    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            total += batch * module.embedding_dim * module.weight.element_size()
            continue
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total


# --------------------------------------------------------------------------------------------------------------------
# contention-aware interleaving

_HZ = os.sysconf("SC_CLK_TCK")


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, machine-wide busy CPU s incl. steal, this process's CPU s) -- for `others_cores`."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), (sum(ticks) - ticks[3] - ticks[4]) / _HZ, usage.ru_utime + usage.ru_stime


def others_cores(before, after) -> float:
    """Average number of cores used by OTHER processes (and the hypervisor's steal) between two snapshots."""
    wall = after[0] - before[0]
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall if wall > 0 else 0.0


def in_process(run):
    """Adapt a runner returning seconds to the (value, others_cores) protocol of `interleaved`."""

    def measured():
        before = cpu_snapshot()
        value = run()
        return value, others_cores(before, cpu_snapshot())

    return measured


class Sampler:
    """Runs rounds A B (A B ...) and keeps the ones during which other processes stayed below `threshold` cores."""

    def __init__(self, threshold: float, max_rounds_factor: float, wait_quiet: float = 0.0):
        self.threshold = threshold
        self.factor = max_rounds_factor
        self.wait_quiet = wait_quiet
        self.waited = 0.0

    def wait(self) -> None:
        """Sleep (up to `wait_quiet` s) until a 2 s window in which other processes stayed below the threshold."""
        deadline = time.perf_counter() + self.wait_quiet
        while time.perf_counter() < deadline:
            before = cpu_snapshot()
            time.sleep(2.0)
            self.waited += 2.0
            if others_cores(before, cpu_snapshot()) <= self.threshold:
                return

    def interleaved(self, runners: list, warmup: int, reps: int) -> tuple[list[list], dict]:
        self.wait()
        for _ in range(warmup):
            for run in runners:
                run()
        max_rounds = max(reps, round(reps * self.factor))
        rounds = []
        while sum(noise <= self.threshold for _, noise in rounds) < reps and len(rounds) < max_rounds:
            values, noise = [], 0.0
            for run in runners:
                value, others = run()
                values.append(value)
                noise = max(noise, others)
            rounds.append((values, noise))
        clean = [values for values, noise in rounds if noise <= self.threshold]
        noisy = len(clean) < max(2, (reps + 1) // 2)
        chosen = [values for values, _ in rounds] if noisy else clean
        info = {
            "rounds": len(rounds),
            "clean_rounds": len(clean),
            "used_rounds": len(chosen),
            "noisy": noisy,  # too few clean rounds: ALL rounds were used, treat the figure with suspicion
            "others_cores_median": median([noise for _, noise in rounds]),
        }
        return [list(column) for column in zip(*chosen)], info


SAMPLER = Sampler(0.15, 3.0)


def summarise(samples_a: list[float], samples_b: list[float], info: dict) -> dict:
    a, b = median(samples_a), median(samples_b)
    paired = sorted(y / x for x, y in zip(samples_a, samples_b))
    q = len(paired) // 4
    return {
        "orig_ms": a * 1e3,
        "fused_ms": b * 1e3,
        "ratio": b / a,
        # median and interquartile range of the per-round ratios (A and B ran back to back): a noise gauge
        "paired_ratio": median(paired),
        "paired_iqr": (paired[q], paired[-q - 1]),
        **info,
    }


def noise_note(row: dict) -> str:
    note = f"{row['used_rounds']}/{row['rounds']} rounds"
    return note + (" NOISY" if row["noisy"] else "")


class CopyProbe:
    """1 GiB `dst.copy_(src)` -- the memory bandwidth yardstick -- plus a 1 GiB read (`sum`) for reference.

    GB/s count read + write (2 GiB moved per copy, STREAM's convention). On a VM the host's other tenants move this
    figure by tens of percent over minutes, so the roofline rows run the copy inside their own A B rounds (A B copy)
    and use the bandwidth measured alongside, not a figure from minutes earlier.
    """

    N = 1 << 30

    def __init__(self) -> None:
        import torch

        self.src = torch.empty(self.N, dtype=torch.uint8)
        self.src.fill_(1)
        self.dst = torch.empty_like(self.src)
        self.dst.fill_(0)
        self.as_float = self.src.view(torch.float32)

    def copy(self) -> float:
        start = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - start

    def read(self) -> float:
        start = time.perf_counter()
        self.as_float.sum()
        return time.perf_counter() - start

    def gbps(self, copy_seconds: float) -> float:
        return 2 * self.N / copy_seconds / 1e9


PROBE: CopyProbe | None = None


def memory_bandwidth(reps: int) -> dict:
    (copies, reads), info = SAMPLER.interleaved([in_process(PROBE.copy), in_process(PROBE.read)], 1, reps)
    return {
        "copy_gbps": PROBE.gbps(median(copies)),
        "copy_gbps_best": PROBE.gbps(min(copies)),
        "read_gbps": PROBE.N / median(reads) / 1e9,
        **info,
    }


def gemv_bandwidth(reps: int) -> dict:
    """GB/s of weight read by one lm_head-sized linear at batch 1 (1 x 2048 @ 2048 x 128256), per dtype.

    The copy bandwidth is what memory can do; this is what the GEMM library's batch-1 kernel does with it here. A
    decode step is a chain of such calls, so this -- not the copy figure -- is the ceiling any rewrite of the model
    code (fusion included) can approach without replacing the kernel.
    """
    import torch
    import torch.nn.functional as F

    out = {}
    for name in DTYPES:
        weight = torch.empty(128256, 2048, dtype=torch_dtype(name)).uniform_(-0.03, 0.03)
        x = torch.randn(1, 2048).to(weight.dtype)

        def run(weight=weight, x=x) -> float:
            with torch.inference_mode():
                start = time.perf_counter()
                F.linear(x, weight)
                return time.perf_counter() - start

        (times,), _ = SAMPLER.interleaved([in_process(run)], 1, reps)
        out[name] = weight.numel() * weight.element_size() / median(times) / 1e9
        del weight
    return out


# --------------------------------------------------------------------------------------------------------------------
# runtime: decode, prefill, numerics (one process)


def decode_step_runner(model, cache, tokens, steps: int):
    """Time `steps` single-token forwards on `cache`, cropping it back after each (untimed), so every step sees the
    same cache length and the same tensor shapes. Returns the mean seconds per step."""
    import torch

    kwargs = {CACHE_KWARG: cache, "use_cache": True}

    def run() -> float:
        total = 0.0
        with torch.inference_mode():
            for _ in range(steps):
                start = time.perf_counter()
                model(tokens, **kwargs)
                total += time.perf_counter() - start
                cache.crop(-1)
        return total / steps

    return in_process(run)


def prefill_runner(model, ids, repeat: int = 1):
    """Time a prompt forward (mean of `repeat` calls) the way generate() runs it: fresh cache, last logits only."""
    import torch

    def run() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            for _ in range(repeat):
                model(ids, use_cache=True, logits_to_keep=1)
            return (time.perf_counter() - start) / repeat

    return in_process(run)


def numerics(original, fused, vocab: int) -> dict:
    """Max |logit diff| on a 2x48 prompt (full logits), one cached decode step at batch 2, and one at batch 1.

    Batch 1 is reported apart: MKL's fp32 one-row GEMV rounds by the weight's 16-byte alignment, and the original's
    weights sit at their checkpoint file offsets while merged ones are freshly allocated (docs/analysis.md).
    """
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 48), generator=generator)
    tok = torch.randint(0, vocab, (2, 1), generator=generator)
    with torch.inference_mode():
        out_a = original(ids, use_cache=True)
        out_b = fused(ids, use_cache=True)
        prompt = (out_a.logits.float() - out_b.logits.float()).abs().max().item()
        step_a = original(tok, **{CACHE_KWARG: out_a.cache}, use_cache=True).logits
        step_b = fused(tok, **{CACHE_KWARG: out_b.cache}, use_cache=True).logits
        step = (step_a.float() - step_b.float()).abs().max().item()
        out_a = original(ids[:1], use_cache=True)
        out_b = fused(ids[:1], use_cache=True)
        step_a = original(tok[:1], **{CACHE_KWARG: out_a.cache}, use_cache=True).logits
        step_b = fused(tok[:1], **{CACHE_KWARG: out_b.cache}, use_cache=True).logits
        step_b1 = (step_a.float() - step_b.float()).abs().max().item()
    return {"prompt": prompt, "decode": step, "decode_batch1": step_b1}


def bench_runtime(shape: str, dtype: str, path: Path, cfg: dict, bandwidth: float, gemv: float, results: dict) -> None:
    import torch

    original, fused = load_pair(path, dtype)
    vocab = original.config.vocab_size
    diff = numerics(original, fused, vocab)
    results["numerics"][f"{shape}_{dtype}"] = diff
    log(
        f"  numerics: max|logits diff| prompt {diff['prompt']:.3g}, decode step {diff['decode']:.3g}, "
        f"batch-1 decode step {diff['decode_batch1']:.3g}"
    )

    weight_bytes = decode_weight_bytes(fused)
    assert weight_bytes == decode_weight_bytes(original), "original and fused should read the same weight bytes"
    results["weight_bytes"][f"{shape}_{dtype}"] = weight_bytes

    generator = torch.Generator().manual_seed(2)
    for cache_len in cfg["cache_lens"]:
        ids = torch.randint(0, vocab, (1, cache_len), generator=generator)
        with torch.inference_mode():  # each model prefills its own cache
            caches = [model(ids, use_cache=True, logits_to_keep=1).cache for model in (original, fused)]
        for batch in cfg["decode_batches"]:
            current = caches[0].layers[0].keys.shape[0]
            if batch != current:  # replicate the batch-1 prefill across the batch (8x cheaper than prefilling it)
                for cache in caches:
                    cache.batch_repeat_interleave(batch // current)
            assert all(c.layers[0].keys.shape[0] == batch and c.get_seq_length() == cache_len for c in caches)
            tokens = torch.randint(0, vocab, (batch, 1), generator=generator)
            big = batch > 1
            steps = (cfg["decode_steps_big"] if big else cfg["decode_steps"]) * SHAPE_REPEAT.get(shape, 1)
            reps = cfg["decode_reps_big"] if big else cfg["decode_reps"]
            runners = [decode_step_runner(m, c, tokens, steps) for m, c in zip((original, fused), caches)]
            control = batch == 1 and cache_len == cfg["cache_lens"][0]
            if control:  # A/A control: a second, independently loaded fused model -- the noise floor of a ratio
                control_model = load_pair(path, dtype, original=False)[1]
                with torch.inference_mode():
                    control_cache = control_model(ids, use_cache=True, logits_to_keep=1).cache
                runners.append(decode_step_runner(control_model, control_cache, tokens, steps))
            if batch == 1:  # roofline rows: measure the copy bandwidth in the same rounds (A B [B'] copy)
                runners.append(in_process(PROBE.copy))
            (a, b, *extra), info = SAMPLER.interleaved(runners, cfg["decode_warmup"], reps)
            row = summarise(a, b, info)
            if control:
                row["aa_ratio"] = median(extra[0]) / median(b)  # fused again / fused: should be 1 +- noise
                del control_model, control_cache, runners
            row_bandwidth = PROBE.gbps(median(extra[-1])) if batch == 1 else bandwidth
            floor_s = weight_bytes / (row_bandwidth * 1e9)
            row.update(
                copy_gbps=row_bandwidth,
                floor_ms=floor_s * 1e3,
                fused_floor_fraction=floor_s / median(b),
                orig_floor_fraction=floor_s / median(a),
                fused_gemv_fraction=weight_bytes / (gemv * 1e9) / median(b),
                steps=steps,
            )
            key = f"{shape}_{dtype}_b{batch}_kv{cache_len}"
            results["decode"][key] = row
            log(
                f"  decode  {key:26} orig {row['orig_ms']:8.2f} ms  fused {row['fused_ms']:8.2f} ms  "
                f"ratio {row['ratio']:.3f} (paired IQR {row['paired_iqr'][0]:.3f}-{row['paired_iqr'][1]:.3f}, "
                f"{noise_note(row)})  floor {row['floor_ms']:.1f} ms at {row['copy_gbps']:.1f} GB/s: "
                f"fused at {row['fused_floor_fraction']:.0%} (of the GEMV ceiling: {row['fused_gemv_fraction']:.0%})"
                + (f"; A/A control (fused again / fused) {row['aa_ratio']:.3f}" if "aa_ratio" in row else "")
            )
        del caches
        gc.collect()

    ids = torch.randint(0, vocab, (1, cfg["prefill_len"]), generator=generator)
    runners = [prefill_runner(m, ids, SHAPE_REPEAT.get(shape, 1)) for m in (original, fused)]
    (a, b), info = SAMPLER.interleaved(runners, cfg["prefill_warmup"], cfg["prefill_reps"])
    row = summarise(a, b, info)
    row.update(tokens=cfg["prefill_len"])
    key = f"{shape}_{dtype}_prefill{cfg['prefill_len']}"
    results["prefill"][key] = row
    log(
        f"  prefill {key:26} orig {row['orig_ms']:8.1f} ms  fused {row['fused_ms']:8.1f} ms  "
        f"ratio {row['ratio']:.3f} (paired IQR {row['paired_iqr'][0]:.3f}-{row['paired_iqr'][1]:.3f}, "
        f"{noise_note(row)})"
    )
    del original, fused
    gc.collect()


# --------------------------------------------------------------------------------------------------------------------
# subprocess measurements: load, compile, build


class Launcher:
    """A tiny Python process, started before this one allocates anything big, that runs our subprocesses for us.

    Why: on Linux `ru_maxrss` survives `execve` -- a child spawned from this (multi-GiB) process starts with OUR peak
    RSS as its own, which would make every "peak RSS" the parent's. A child of a 10 MiB launcher starts near zero.
    The launcher also times each command and measures the other processes' CPU use meanwhile (this process waits idle).
    """

    CODE = (
        "import json, os, resource, subprocess, sys, time\n"
        "HZ = os.sysconf('SC_CLK_TCK')\n"
        "def snap():\n"
        "    with open('/proc/stat') as f:\n"
        "        t = [int(v) for v in f.readline().split()[1:9]]\n"
        "    u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "    return time.perf_counter(), (sum(t) - t[3] - t[4]) / HZ, u.ru_utime + u.ru_stime\n"
        "for line in sys.stdin:\n"
        "    req = json.loads(line)\n"
        "    a = snap()\n"
        "    try:\n"
        "        p = subprocess.run(req['cmd'], capture_output=True, text=True, timeout=req['timeout'],\n"
        "                           env=req['env'], cwd=req['cwd'])\n"
        "        res = {'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr}\n"
        "    except subprocess.TimeoutExpired:\n"
        "        res = {'rc': None, 'stdout': '', 'stderr': 'timed out after %s s' % req['timeout']}\n"
        "    b = snap()\n"
        "    res['seconds'] = b[0] - a[0]\n"
        "    res['others'] = max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / res['seconds']\n"
        "    print(json.dumps(res), flush=True)\n"
    )

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", self.CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, command: list[str], timeout: float = 1800, env: dict | None = None) -> dict:
        request = {"cmd": command, "timeout": timeout, "env": env or dict(os.environ), "cwd": str(ROOT)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


LAUNCHER: Launcher | None = None


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["BENCH_THREADS"] = str(threads)
    return env


def run_child(args: list[str], threads: int, timeout: float) -> tuple[dict, float]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    proc = LAUNCHER.run(command, timeout=timeout, env=child_env(threads))
    if proc["rc"] != 0:
        raise RuntimeError(f"child {args} failed ({proc['rc']}):\n{proc['stderr'][-3000:]}")
    return json.loads(proc["stdout"].strip().splitlines()[-1]), proc["others"]


def timed_command(command: list[str]) -> tuple[float, float]:
    proc = LAUNCHER.run(command)
    if proc["rc"] != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc['rc']}):\n{proc['stderr'][-3000:]}")
    return proc["seconds"], proc["others"]


def _vm_hwm_mib() -> float | None:
    """Peak RSS of this process's current address space (/proc VmHWM), a cross-check of ru_maxrss."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def _child_threads() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "0")) or torch.get_num_threads())


def child_load(variant: str, path: str, dtype: str) -> dict:
    """In a fresh process: import, from_pretrained, first forward; wall times and peak RSS (ru_maxrss, MiB)."""
    start = time.perf_counter()
    import torch

    _child_threads()
    quiet_transformers()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    _, original_cls, fused_cls = model_classes(config.model_type)
    cls = fused_cls if variant == "fused" else original_cls
    imported = time.perf_counter()
    rss_imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = cls.from_pretrained(path, dtype=torch_dtype(dtype), attn_implementation="sdpa").eval()
    loaded = time.perf_counter()
    ids = torch.arange(16).unsqueeze(0)
    with torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)
    forwarded = time.perf_counter()
    return {
        "import_s": imported - start,
        "from_pretrained_s": loaded - imported,
        "first_forward_s": forwarded - loaded,
        "load_s": forwarded - imported,
        "rss_after_import_mib": rss_imported,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "vm_hwm_mib": _vm_hwm_mib(),
    }


def bench_load(name: str, path: Path, dtype: str, reps: int, threads: int, results: dict) -> None:
    runners = [
        lambda v=variant: run_child(["load", v, str(path), dtype], threads, 600) for variant in ("orig", "fused")
    ]
    (orig_runs, fused_runs), info = SAMPLER.interleaved(runners, 0, reps)
    med = {
        variant: {key: median([run[key] for run in runs]) for key in runs[0]}
        for variant, runs in (("orig", orig_runs), ("fused", fused_runs))
    }
    grown = {v: med[v]["peak_rss_mib"] - med[v]["rss_after_import_mib"] for v in med}
    row = {
        "orig": med["orig"],
        "fused": med["fused"],
        "load_ratio": med["fused"]["load_s"] / med["orig"]["load_s"],
        "from_pretrained_ratio": med["fused"]["from_pretrained_s"] / med["orig"]["from_pretrained_s"],
        "rss_ratio": med["fused"]["peak_rss_mib"] / med["orig"]["peak_rss_mib"],
        "rss_growth_ratio": grown["fused"] / grown["orig"] if grown["orig"] > 0 else None,
        **info,
    }
    results["load"][f"{name}_{dtype}"] = row
    for v in ("orig", "fused"):
        m = med[v]
        log(
            f"  load {name} {dtype} {v:5}: import {m['import_s']:.2f} s, from_pretrained {m['from_pretrained_s']:.2f} s, "
            f"first forward {m['first_forward_s']:.2f} s, peak RSS {m['peak_rss_mib']:.0f} MiB "
            f"({m['rss_after_import_mib']:.0f} after import; VmHWM {m['vm_hwm_mib']:.0f})"
        )
    log(
        f"  load {name} {dtype}: load ratio {row['load_ratio']:.2f}, peak RSS ratio {row['rss_ratio']:.2f} "
        f"(growth after import {row['rss_growth_ratio']:.2f}; {noise_note(row)})"
    )


def child_compile(path: str, dtype: str, cache_len: int, reps: int, steps: int, threshold: float) -> dict:
    """Eager and torch.compile'd decode (batch 1) of both classes, interleaved; compile wall time of each."""
    import torch

    _child_threads()
    quiet_transformers()
    global SAMPLER
    SAMPLER = Sampler(threshold, 3.0)
    original, fused = load_pair(Path(path), dtype)
    vocab = original.config.vocab_size
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (1, cache_len), generator=generator)
    tokens = torch.randint(0, vocab, (1, 1), generator=generator)
    out = {}
    with torch.inference_mode():
        caches = [m(ids, use_cache=True, logits_to_keep=1).cache for m in (original, fused)]
    compiled = []
    for name, model, cache in (("orig", original, caches[0]), ("fused", fused, caches[1])):
        cmodel = torch.compile(model, dynamic=False)
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(3):  # the first calls compile (and may recompile once the guards see the cache)
                logits = cmodel(tokens, **{CACHE_KWARG: cache}, use_cache=True).logits
                cache.crop(-1)
            out[f"{name}_compile_s"] = time.perf_counter() - start
            eager = model(tokens, **{CACHE_KWARG: cache}, use_cache=True).logits
            cache.crop(-1)
        out[f"{name}_compiled_vs_eager_maxdiff"] = (logits.float() - eager.float()).abs().max().item()
        compiled.append(cmodel)
    runners = [
        decode_step_runner(model, cache, tokens, steps)
        for model, cache in zip((original, fused, *compiled), (*caches, *caches))
    ]
    (eager_a, eager_b, comp_a, comp_b), info = SAMPLER.interleaved(runners, 1, reps)
    out["eager"] = summarise(eager_a, eager_b, info)
    out["compiled"] = summarise(comp_a, comp_b, info)
    out["compiled_over_eager_orig"] = median(comp_a) / median(eager_a)
    out["compiled_over_eager_fused"] = median(comp_b) / median(eager_b)
    return out


def bench_compile(path: Path, dtype: str, cache_len: int, cfg: dict, threads: int, results: dict) -> None:
    args = ["compile", str(path), dtype, str(cache_len), str(cfg["decode_reps"]), str(cfg["decode_steps"])]
    try:
        row, _ = run_child([*args, str(SAMPLER.threshold)], threads, timeout=1200)
    except RuntimeError as error:
        results["compile"] = {"error": str(error)[-800:]}
        log(f"  torch.compile: FAILED or timed out: {str(error)[-800:]}")
        return
    results["compile"] = row
    e, c = row["eager"], row["compiled"]
    log(
        f"  compile llama1b {dtype} b1 kv{cache_len}: compile {row['orig_compile_s']:.0f} s (orig) / "
        f"{row['fused_compile_s']:.0f} s (fused); eager orig {e['orig_ms']:.1f} fused {e['fused_ms']:.1f} ms "
        f"(ratio {e['ratio']:.3f}); compiled orig {c['orig_ms']:.1f} fused {c['fused_ms']:.1f} ms "
        f"(ratio {c['ratio']:.3f}; {noise_note(c)}); max|compiled - eager| {row['fused_compiled_vs_eager_maxdiff']:.2g}"
    )


def bench_build(reps: int, results: dict) -> None:
    """`fusegen build llama qwen2` into a temp dir vs importing the two modeling modules it reads (the floor)."""
    floor_cmd = [
        sys.executable,
        "-c",
        "import transformers.models.llama.modeling_llama, transformers.models.qwen2.modeling_qwen2",
    ]
    with tempfile.TemporaryDirectory(prefix="fusegen-bench-build-") as out:
        build_cmd = [sys.executable, "-m", "fusegen", "build", "llama", "qwen2", "--output-dir", out]
        try:
            (builds, floors), info = SAMPLER.interleaved(
                [lambda: timed_command(build_cmd), lambda: timed_command(floor_cmd)], 1, reps
            )
        except RuntimeError as error:
            results["build"] = {"error": str(error)[-1000:]}
            log(f"  build FAILED: {str(error)[-1000:]}")
            return
    row = {"build_s": median(builds), "import_floor_s": median(floors), **info}
    row["ratio"] = row["build_s"] / row["import_floor_s"]
    results["build"] = row
    log(
        f"  build: fusegen build llama qwen2 {row['build_s']:.2f} s, import floor {row['import_floor_s']:.2f} s, "
        f"ratio {row['ratio']:.2f} ({noise_note(row)})"
    )


# --------------------------------------------------------------------------------------------------------------------
# --device: the same fused-vs-original pairs timed on an accelerator (CUDA events), bf16, eager / static / compile

DEVICE_MODES = ("eager", "static", "compile")


def device_unavailable(device) -> str | None:
    """Why `device` cannot be used here, or None. CPU always can; another type needs its torch backend to say so."""
    import torch

    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        return f"no {device.type} device here (torch.{device.type}.is_available() is not True)"
    return None


def device_clock(device):
    """`clock(fn) -> seconds` that `fn`'s work took ON `device`.

    CUDA runs kernels asynchronously: host time around a call measures how fast work is queued, not done. So on a GPU
    the call is bracketed by CUDA events and timed on the device's own clock after synchronising on the end event.
    Elsewhere (CPU, the fallback for other backends) it is host time, after synchronising the backend if it has a
    `synchronize` (e.g. MPS), so the same code path runs everywhere.
    """
    import torch

    if device.type == "cuda":

        def clock(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # ms -> s

        return clock
    backend = getattr(torch, device.type, None)
    synchronize = getattr(backend, "synchronize", None) if device.type != "cpu" else None

    def clock(fn) -> float:
        if synchronize:
            synchronize()
        start = time.perf_counter()
        fn()
        if synchronize:
            synchronize()
        return time.perf_counter() - start

    return clock


def _mode_cache(mode: str, model, batch: int, max_len: int):
    """A fresh KV cache for `mode`: None (the model makes a DynamicCache) for eager, a StaticCache otherwise."""
    if mode == "eager":
        return None
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def device_decode_runner(clock, model, cache, tokens, steps: int):
    """Mean device seconds of `steps` single-token forwards on `cache`, cropped back after each (untimed), so every
    step sees the same cache length; works for dynamic and static caches alike (both implement `crop`)."""
    import torch

    kwargs = {CACHE_KWARG: cache, "use_cache": True}

    def run() -> float:
        total = 0.0
        with torch.inference_mode():
            for _ in range(steps):
                total += clock(lambda: model(tokens, **kwargs))
                cache.crop(-1)
        return total / steps

    return in_process(run)


def device_prefill_runner(clock, model, mode: str, ids):
    """Device seconds of one prompt forward into a fresh cache (made untimed), last logits only, as generate() does."""
    import torch

    def run() -> float:
        cache = _mode_cache(mode, model, ids.shape[0], ids.shape[1] + 1)
        kwargs = {} if cache is None else {CACHE_KWARG: cache}
        with torch.inference_mode():
            return clock(lambda: model(ids, use_cache=True, logits_to_keep=1, **kwargs))

    return in_process(run)


def bench_device(shape: str, path: Path, device, modes, cfg: dict, compile_backend: str, results: dict) -> None:
    """Decode (batch 1 and 8, first cache length) and prefill, original vs fused, in each mode, on `device`."""
    import torch

    clock = device_clock(device)
    original, fused = (model.to(device) for model in load_pair(path, "bf16"))
    vocab, cache_len = original.config.vocab_size, cfg["cache_lens"][0]
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (1, cache_len), generator=generator).to(device)
    prefill_ids = torch.randint(0, vocab, (1, cfg["prefill_len"]), generator=generator).to(device)
    for mode in modes:
        models = [original, fused]
        row: dict = {}
        if mode == "compile":
            # Both classes' forwards share Transformers' decorator code object, so dynamo counts their graphs (two
            # classes x batches x prefill/decode) against ONE recompile limit (8); past it, it silently runs eager.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            models = [torch.compile(m, dynamic=False, backend=compile_backend) for m in models]
        for batch in cfg["decode_batches"]:
            ids = prompt.expand(batch, -1).contiguous()
            tokens = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
            caches, seconds, diffs = [], [], []
            for model in models:
                cache = _mode_cache(mode, model, batch, cache_len + 2)
                start = time.perf_counter()
                with torch.inference_mode():  # prefill, then one step (compiles both graphs in compile mode)
                    out = model(
                        ids, use_cache=True, logits_to_keep=1, **({} if cache is None else {CACHE_KWARG: cache})
                    )
                    cache = out.cache
                    diffs.append(model(tokens, **{CACHE_KWARG: cache}, use_cache=True).logits.float())
                    cache.crop(-1)
                seconds.append(time.perf_counter() - start)
                caches.append(cache)
            runners = [device_decode_runner(clock, m, c, tokens, cfg["decode_steps"]) for m, c in zip(models, caches)]
            (a, b), info = SAMPLER.interleaved(runners, cfg["decode_warmup"], cfg["decode_reps"])
            row[f"decode_b{batch}_kv{cache_len}"] = {
                **summarise(a, b, info),
                "first_call_s": seconds,  # prefill + first step; includes compilation in compile mode
                "max_abs_logit_diff": (diffs[0] - diffs[1]).abs().max().item(),
            }
            del caches
        runners = [device_prefill_runner(clock, m, mode, prefill_ids) for m in models]
        (a, b), info = SAMPLER.interleaved(runners, cfg["prefill_warmup"], cfg["prefill_reps"])
        row[f"prefill{cfg['prefill_len']}"] = summarise(a, b, info)
        results["device"][f"{shape}_bf16_{mode}"] = row
        for key, r in row.items():
            log(
                f"  {device.type} {shape} bf16 {mode:7} {key:18} orig {r['orig_ms']:8.2f} ms  fused {r['fused_ms']:8.2f} ms"
                f"  ratio {r['ratio']:.3f} (paired IQR {r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f}, "
                f"{noise_note(r)})"
            )
    del original, fused
    gc.collect()


def run_device_section(args, cfg: dict) -> dict | None:
    """`--device DEV`: only the on-device section. Returns the results, or None (after saying why) without a device."""
    import torch

    device = torch.device(args.device)
    reason = device_unavailable(device)
    if reason:
        log(f"[--device {args.device}: skipped: {reason}; nothing measured]")
        return None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(DEVICE_MODES)
    if unknown:
        raise SystemExit(f"unknown --modes {sorted(unknown)}; choose from {', '.join(DEVICE_MODES)}")
    results: dict = {"machine": {"device": str(device), "torch": torch.__version__}, "device": {}}
    if device.type == "cuda":
        results["machine"]["gpu"] = torch.cuda.get_device_name(device)
    log(f"fusegen bench on {device} ({results['machine'].get('gpu', device.type)}), bf16, modes {', '.join(modes)}")
    with tempfile.TemporaryDirectory(prefix="fusegen-bench-device-") as tmp:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            path = write_checkpoints(shape, cfg["layers"], Path(tmp), dtypes=("bf16",))["bf16"]
            log(f"\n[{shape} bf16 on {device}]")
            bench_device(shape, path, device, modes, cfg, args.compile_backend, results)
    return results


# --------------------------------------------------------------------------------------------------------------------
# report


def flat_keys(results: dict) -> dict:
    """The flat JSON the issue asks for (headline keys first), plus per-shape keys."""
    flat: dict = {}
    dec, pre = results["decode"], results["prefill"]

    def get(table, key, field):
        return table.get(key, {}).get(field)

    for dtype in DTYPES:
        flat[f"decode_ratio_{dtype}"] = get(dec, f"llama1b_{dtype}_b1_kv128", "ratio")
    for dtype in DTYPES:
        flat[f"prefill_ratio_{dtype}"] = get(pre, f"llama1b_{dtype}_prefill512", "ratio")
    flat["decode_roofline_fraction"] = get(dec, "llama1b_fp32_b1_kv128", "fused_floor_fraction")
    flat["decode_roofline_fraction_bf16"] = get(dec, "llama1b_bf16_b1_kv128", "fused_floor_fraction")
    for dtype in DTYPES:  # the same step against what the batch-1 GEMM kernel achieves on its own
        flat[f"decode_gemv_ceiling_fraction_{dtype}"] = get(dec, f"llama1b_{dtype}_b1_kv128", "fused_gemv_fraction")
        flat[f"gemv_bandwidth_gbps_{dtype}"] = results["bandwidth"]["gemv_gbps"][dtype]
    load = results["load"].get("llama1b_bf16", {})
    flat["load_ratio"] = load.get("load_ratio")
    flat["load_rss_ratio"] = load.get("rss_ratio")
    build = results.get("build", {})
    flat["build_seconds"] = build.get("build_s")
    flat["import_floor_seconds"] = build.get("import_floor_s")
    flat["build_ratio"] = build.get("ratio")
    flat["copy_bandwidth_gbps"] = results["bandwidth"]["copy_gbps"]
    flat["read_bandwidth_gbps"] = results["bandwidth"]["read_gbps"]
    flat["threads"] = results["machine"]["threads"]
    flat["quick"] = results["machine"]["quick"]
    flat["layers"] = results["machine"]["layers"]
    flat["noisy_figures"] = sorted(
        [f"decode_{k}" for k, r in dec.items() if r["noisy"]]
        + [f"prefill_{k}" for k, r in pre.items() if r["noisy"]]
        + [f"load_{k}" for k, r in results["load"].items() if r["noisy"]]
        + (["build"] if build.get("noisy") else [])
    )
    for key, row in dec.items():
        flat[f"decode_ratio_{key}"] = row["ratio"]
        flat[f"decode_orig_ms_{key}"] = row["orig_ms"]
        flat[f"decode_fused_ms_{key}"] = row["fused_ms"]
        flat[f"decode_roofline_fraction_{key}"] = row["fused_floor_fraction"]
        if "aa_ratio" in row:
            flat[f"decode_aa_control_ratio_{key}"] = row["aa_ratio"]
    for key, row in pre.items():
        flat[f"prefill_ratio_{key}"] = row["ratio"]
        flat[f"prefill_orig_ms_{key}"] = row["orig_ms"]
        flat[f"prefill_fused_ms_{key}"] = row["fused_ms"]
    for key, row in results["load"].items():
        flat[f"load_ratio_{key}"] = row["load_ratio"]
        flat[f"load_rss_ratio_{key}"] = row["rss_ratio"]
        flat[f"load_orig_seconds_{key}"] = row["orig"]["load_s"]
        flat[f"load_fused_seconds_{key}"] = row["fused"]["load_s"]
        flat[f"load_orig_peak_rss_mib_{key}"] = row["orig"]["peak_rss_mib"]
        flat[f"load_fused_peak_rss_mib_{key}"] = row["fused"]["peak_rss_mib"]
    for key, row in results["numerics"].items():
        flat[f"max_abs_logit_diff_{key}"] = max(row["prompt"], row["decode"])
        flat[f"max_abs_logit_diff_batch1_decode_{key}"] = row["decode_batch1"]
    comp = results.get("compile")
    if comp and "error" not in comp:
        flat["compile_decode_ratio"] = comp["compiled"]["ratio"]
        flat["compile_orig_ms"] = comp["compiled"]["orig_ms"]
        flat["compile_fused_ms"] = comp["compiled"]["fused_ms"]
        flat["compile_eager_ratio"] = comp["eager"]["ratio"]
        flat["compile_seconds_orig"] = comp["orig_compile_s"]
        flat["compile_seconds_fused"] = comp["fused_compile_s"]
    elif comp:
        flat["compile_error"] = comp["error"]
    flat["wall_seconds"] = results["wall_seconds"]
    return flat


def print_tables(results: dict) -> None:
    log("\n== decode step, ms (median of clean rounds); ratio = fused / original; floor = weight bytes / copy BW ==")
    log(
        f"{'config':28} {'orig':>9} {'fused':>9} {'ratio':>6}  {'paired IQR':>11}  {'rounds':>12} {'GB/s':>5} "
        f"{'floor':>7} {'fused/floor':>11} {'fused/GEMV':>10} {'A/A':>6}"
    )
    for key, r in results["decode"].items():
        log(
            f"{key:28} {r['orig_ms']:9.2f} {r['fused_ms']:9.2f} {r['ratio']:6.3f}  "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f}  {noise_note(r):>12} {r['copy_gbps']:5.1f} "
            f"{r['floor_ms']:7.1f} {r['fused_floor_fraction']:11.0%} {r['fused_gemv_fraction']:10.0%} "
            + (f"{r['aa_ratio']:6.3f}" if "aa_ratio" in r else f"{'':6}")
        )
    log("\n== prefill, ms (batch 1, logits for the last token only) ==")
    for key, r in results["prefill"].items():
        log(
            f"{key:28} {r['orig_ms']:9.1f} {r['fused_ms']:9.1f} {r['ratio']:6.3f}  "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f}  {noise_note(r):>12}"
        )


def markdown_tables(results: dict) -> str:
    """The figures as Markdown tables (what docs/benchmarks.md shows)."""
    m = results["machine"]
    lines = [
        (
            f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_capability']}), transformers "
            f"{m['transformers']}, Python {m['python']}, `torch.set_num_threads({m['threads']})`, {m['layers']} "
            f"layers. 1 GiB copy at start: {results['bandwidth']['copy_gbps']:.1f} GB/s (read + write), 1 GiB read: "
            f"{results['bandwidth']['read_gbps']:.1f} GB/s. Batch-1 GEMV ceiling (1 x 2048 @ 2048 x 128256): "
            + ", ".join(f"{k} {v:.1f} GB/s" for k, v in results["bandwidth"]["gemv_gbps"].items())
            + "."
        ),
        "",
        (
            "| decode step | original ms | fused ms | fused / original | paired-ratio IQR | clean rounds | copy GB/s "
            "| floor ms | fused / floor | fused / GEMV ceiling | A/A control |"
        ),
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, r in results["decode"].items():
        bw = f"{r['copy_gbps']:.1f}" if "_b1_" in key else "(start)"  # b1 rows measure it in their own rounds
        lines.append(
            f"| {key} | {r['orig_ms']:.1f} | {r['fused_ms']:.1f} | **{r['ratio']:.3f}** | "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f} | {r['used_rounds']}/{r['rounds']}"
            f"{' noisy' if r['noisy'] else ''} | {bw} | {r['floor_ms']:.1f} | {r['fused_floor_fraction']:.0%} | "
            f"{r['fused_gemv_fraction']:.0%} | " + (f"{r['aa_ratio']:.3f} |" if "aa_ratio" in r else " |")
        )
    lines += [
        "",
        "| prefill (1 x 512 tokens) | original ms | fused ms | fused / original | paired-ratio IQR | clean rounds |",
        "|---|---:|---:|---:|---|---|",
    ]
    for key, r in results["prefill"].items():
        lines.append(
            f"| {key} | {r['orig_ms']:.0f} | {r['fused_ms']:.0f} | **{r['ratio']:.3f}** | "
            f"{r['paired_iqr'][0]:.3f}-{r['paired_iqr'][1]:.3f} | {r['used_rounds']}/{r['rounds']}"
            f"{' noisy' if r['noisy'] else ''} |"
        )
    if results["load"]:
        lines += [
            "",
            (
                "| load (bf16 checkpoint, fresh process) | from_pretrained s | first forward s | load ratio | "
                "peak RSS MiB | RSS ratio |"
            ),
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, r in results["load"].items():
            for v in ("orig", "fused"):
                x = r[v]
                ratio = f"**{r['load_ratio']:.2f}**" if v == "fused" else ""
                rss = f"**{r['rss_ratio']:.2f}**" if v == "fused" else ""
                lines.append(
                    f"| {key} {v} | {x['from_pretrained_s']:.2f} | {x['first_forward_s']:.2f} | {ratio} | "
                    f"{x['peak_rss_mib']:.0f} | {rss} |"
                )
    build = results.get("build", {})
    if "build_s" in build:
        lines += [
            "",
            "| build | seconds |",
            "|---|---:|",
            f"| `fusegen build llama qwen2` | {build['build_s']:.2f} |",
            f"| import floor (import both modeling modules) | {build['import_floor_s']:.2f} |",
            f"| ratio | **{build['ratio']:.2f}** |",
        ]
    comp = results.get("compile")
    if comp and "error" not in comp:
        e, c = comp["eager"], comp["compiled"]
        lines += [
            "",
            "| torch.compile, llama1b fp32 b1 kv128 | original ms | fused ms | fused / original | clean rounds |",
            "|---|---:|---:|---:|---|",
            (
                f"| eager | {e['orig_ms']:.1f} | {e['fused_ms']:.1f} | {e['ratio']:.3f} | "
                f"{e['used_rounds']}/{e['rounds']}{' noisy' if e['noisy'] else ''} |"
            ),
            (
                f"| compiled (compile {comp['orig_compile_s']:.0f} s / {comp['fused_compile_s']:.0f} s) | "
                f"{c['orig_ms']:.1f} | {c['fused_ms']:.1f} | {c['ratio']:.3f} | {c['used_rounds']}/{c['rounds']}"
                f"{' noisy' if c['noisy'] else ''} |"
            ),
        ]
    return "\n".join(lines) + "\n"


def check_targets(flat: dict) -> list[str]:
    def fmt(v):
        return "n/a" if v is None else f"{v:.3f}"

    decode = [v for k, v in flat.items() if k.startswith("decode_ratio_") and k.count("_") > 3]
    return [
        (
            f"decode ratio <= 0.95 at llama1b b1 kv128 fp32 / bf16: {fmt(flat['decode_ratio_fp32'])} / "
            f"{fmt(flat['decode_ratio_bf16'])}"
        ),
        f"decode ratio never > 1.00 (max over all decode configs): {fmt(max(decode) if decode else None)}",
        f"prefill ratio <= 1.00 llama1b fp32 / bf16: {fmt(flat['prefill_ratio_fp32'])} / {fmt(flat['prefill_ratio_bf16'])}",
        f"decode >= 70% of bandwidth floor (llama1b b1 kv128 fp32): {fmt(flat['decode_roofline_fraction'])}",
        f"build <= 1.3x import floor: {fmt(flat.get('build_ratio'))}",
    ]


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    global LAUNCHER, SAMPLER
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer layers and repetitions; no torch.compile (<3 min)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the flat figures as JSON (and OUT.full.json)")
    parser.add_argument("--markdown", type=Path, metavar="OUT", help="write the figures as Markdown tables")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (default: cores)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile experiment")
    parser.add_argument(
        "--only", default="runtime,load,compile,build", help="comma-separated sections: runtime,load,compile,build"
    )
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated runtime shapes (default: {','.join(SHAPES)})"
    )
    parser.add_argument(
        "--noise-threshold",
        type=float,
        default=0.15,
        help="drop rounds during which other processes used more than this many cores (default 0.15)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each measurement, wait up to SECONDS for a quiet 2 s window (shared machines; default 0)",
    )
    parser.add_argument(
        "--device",
        metavar="DEV",
        help="only time decode and prefill on DEV (cuda, cuda:1, cpu, ...) with the device's clock, bf16, in "
        "--modes; skips with a message when DEV is absent",
    )
    parser.add_argument("--modes", default=",".join(DEVICE_MODES), help="with --device: eager,static,compile")
    parser.add_argument(
        "--compile-backend", default="inductor", help="with --device: torch.compile backend (default inductor)"
    )
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        kind, *rest = args.child
        if kind == "load":
            print(json.dumps(child_load(*rest)))
        elif kind == "compile":
            path, dtype, cache_len, reps, steps, threshold = rest
            print(json.dumps(child_compile(path, dtype, int(cache_len), int(reps), int(steps), float(threshold))))
        else:
            raise SystemExit(f"unknown child {kind}")
        return

    wall_start = time.perf_counter()
    LAUNCHER = Launcher()  # before importing torch or allocating anything
    import torch
    import transformers

    quiet_transformers()
    cfg = QUICK if args.quick else FULL
    SAMPLER = Sampler(args.noise_threshold, cfg["max_rounds_factor"], args.wait_quiet)
    torch.set_num_threads(args.threads)
    if args.device:
        device_results = run_device_section(args, cfg)
        LAUNCHER.close()
        if device_results is not None and args.json:
            args.json.write_text(json.dumps(device_results, indent=1, default=str) + "\n")
            log(f"wrote {args.json}")
        return
    machine = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "quick": args.quick,
        "layers": cfg["layers"],
        "noise_threshold_cores": args.noise_threshold,
        "loadavg_start": os.getloadavg(),
    }
    results: dict = {"machine": machine, "decode": {}, "prefill": {}, "load": {}, "numerics": {}, "weight_bytes": {}}
    log(
        f"fusegen bench ({'quick' if args.quick else 'full'}): {machine['cpu']}, {machine['cores']} cores, "
        f"torch {machine['torch']} ({machine['cpu_capability']}), transformers {machine['transformers']}, "
        f"torch.set_num_threads({machine['threads']}), {cfg['layers']} layers, "
        f"load average {' '.join(f'{x:.2f}' for x in machine['loadavg_start'])}"
    )

    global PROBE
    PROBE = CopyProbe()
    bw = memory_bandwidth(cfg["bw_reps"])
    results["bandwidth"] = bw
    log(
        f"memory bandwidth: 1 GiB copy_ {bw['copy_gbps']:.1f} GB/s (read+write, median; best {bw['copy_gbps_best']:.1f}), "
        f"1 GiB read (sum) {bw['read_gbps']:.1f} GB/s ({noise_note(bw)})"
    )
    bw["gemv_gbps"] = gemv_bandwidth(cfg["bw_reps"])
    log(
        "batch-1 GEMV ceiling (1 x 2048 @ 2048 x 128256): "
        + ", ".join(f"{name} {gbps:.1f} GB/s" for name, gbps in bw["gemv_gbps"].items())
    )

    only = {part.strip() for part in args.only.split(",")}
    shapes = [shape.strip() for shape in args.shapes.split(",")] if "runtime" in only else []
    written = list(shapes)
    if only & {"load", "compile"}:  # these use the llama1b (and qwen05b) checkpoints
        written = list(dict.fromkeys([*written, "llama1b", "qwen05b"]))
    sections: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fusegen-bench-") as tmp:
        paths = {}
        if only & {"runtime", "load", "compile"}:
            for shape in written:
                start = time.perf_counter()
                paths[shape] = write_checkpoints(shape, cfg["layers"], Path(tmp))
                log(
                    f"wrote {shape} ({cfg['layers']} layers) {' + '.join(paths[shape])} checkpoints in "
                    f"{time.perf_counter() - start:.1f} s"
                )
        if "runtime" in only:
            for shape in shapes:
                for dtype in SHAPE_DTYPES.get(shape, DTYPES):
                    start = time.perf_counter()
                    log(f"\n[{shape} {dtype}]")
                    bench_runtime(
                        shape, dtype, paths[shape][dtype], cfg, bw["copy_gbps"], bw["gemv_gbps"][dtype], results
                    )
                    sections[f"{shape}_{dtype}"] = time.perf_counter() - start

        if "load" in only:
            start = time.perf_counter()
            log("\n[load: from_pretrained + first forward, fresh process each, A B A B]")
            bench_load("llama1b", paths["llama1b"]["bf16"], "bf16", cfg["load_reps"], args.threads, results)
            if not args.quick:
                bench_load("qwen05b", paths["qwen05b"]["bf16"], "bf16", cfg["load_reps"], args.threads, results)
            sections["load"] = time.perf_counter() - start

        if "compile" in only:
            if cfg["compile"] and not args.no_compile:
                start = time.perf_counter()
                log("\n[torch.compile decode, llama1b fp32 b1 kv128, fresh process]")
                bench_compile(paths["llama1b"]["fp32"], "fp32", 128, cfg, args.threads, results)
                sections["compile"] = time.perf_counter() - start
            else:
                log("\n[torch.compile: skipped (--quick or --no-compile)]")

    if "build" in only:
        start = time.perf_counter()
        log("\n[build vs import floor]")
        bench_build(cfg["build_reps"], results)
        sections["build"] = time.perf_counter() - start

    LAUNCHER.close()
    machine["loadavg_end"] = os.getloadavg()
    results["section_seconds"] = sections
    results["wall_seconds"] = time.perf_counter() - wall_start
    results["waited_for_quiet_seconds"] = SAMPLER.waited
    print_tables(results)
    flat = flat_keys(results)
    log("\n== targets ==")
    for line in check_targets(flat):
        log("  " + line)
    if flat["noisy_figures"]:
        log(f"  too few clean rounds (machine busy) for: {', '.join(flat['noisy_figures'])}")
    log(
        f"\nwall time {results['wall_seconds']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in sections.items())
        + f"; waited {SAMPLER.waited:.0f} s for quiet); load average at end "
        + " ".join(f"{x:.2f}" for x in machine["loadavg_end"])
    )
    if args.json:
        args.json.write_text(json.dumps(flat, indent=1) + "\n")
        full = args.json.with_name(args.json.stem + ".full.json")
        full.write_text(json.dumps(results, indent=1, default=str) + "\n")
        log(f"wrote {args.json} (flat) and {full} (everything)")
    if args.markdown:
        args.markdown.write_text(markdown_tables(results))
        log(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
