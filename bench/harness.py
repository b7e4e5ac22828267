"""bench/run.py's harness: shapes and repetition plans, random checkpoints, contention-aware timing, runners, children.

Everything here measures; nothing prints (that is bench/report.py). The state a run carries (the plan, the noise
sampler, the copy probe, the subprocess launcher, the results) is one `Bench` value handed to each section, never a
module global, so a section can be run alone (tests/test_bench.py) or from another script (bench/coldstart.py).
"""

from __future__ import annotations

import compileall
import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RUN = Path(__file__).resolve().with_name("run.py")
"""The script children are started as (`run.py --child ...`)."""

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
# models


def installed_bytecode(checkout: Path) -> bool:
    """Compile `checkout`'s `fusegen` package to bytecode (`__pycache__`, git-ignored), as installing a wheel does;
    whether every module compiled.

    The import floor reads Transformers' and torch's modules as the bytecode pip compiled at install. A build from a
    source checkout under `PYTHONDONTWRITEBYTECODE=1` (this machine's environment sets it) would compile fusegen's
    own modules from source in every process, about 0.15 s here that an installed fusegen, or a checkout run once
    without that variable, does not pay; compiled first, both sides of the ratio import bytecode."""
    return compileall.compile_dir(str(checkout / "fusegen"), quiet=1)


def median(values):
    return statistics.median(values) if values else float("nan")


def timed(fn, reps: int) -> float:
    """Seconds per call of `fn` over `reps` calls, after one warm-up call (the micro-benchmarks' clock)."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def model_classes(model_type: str):
    """`(config class, original, fused)` from the test kit (`fusegen.testkit.model_classes`)."""
    from fusegen.testkit import model_classes as classes

    return classes(model_type)


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


def load_kwargs(dtype: str) -> dict:
    """What every bench passes to `fusegen.testkit.load_pair` / `load_fused`: the dtype and sdpa attention."""
    return {"dtype": torch_dtype(dtype), "attn_implementation": "sdpa"}


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


# --------------------------------------------------------------------------------------------------------------------
# runners: each returns a callable giving (seconds, other processes' cores) per call, for `Sampler.interleaved`


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


# --------------------------------------------------------------------------------------------------------------------
# subprocesses: load, compile, build


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


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["BENCH_THREADS"] = str(threads)
    return env


def run_child(launcher: Launcher, args: list[str], threads: int, timeout: float) -> tuple[dict, float]:
    """`run.py --child ARGS` through `launcher`: its last stdout line as JSON, and the other processes' cores."""
    command = [sys.executable, str(RUN), "--child", *args]
    proc = launcher.run(command, timeout=timeout, env=child_env(threads))
    if proc["rc"] != 0:
        raise RuntimeError(f"child {args} failed ({proc['rc']}):\n{proc['stderr'][-3000:]}")
    return json.loads(proc["stdout"].strip().splitlines()[-1]), proc["others"]


def timed_command(launcher: Launcher, command: list[str]) -> tuple[float, float]:
    proc = launcher.run(command)
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


def child_compile(path: str, dtype: str, cache_len: int, reps: int, steps: int, threshold: float) -> dict:
    """Eager and torch.compile'd decode (batch 1) of both classes, interleaved; compile wall time of each."""
    import torch

    _child_threads()
    quiet_transformers()
    sampler = Sampler(threshold, 3.0)
    from fusegen.testkit import load_pair

    original, fused = load_pair(Path(path), **load_kwargs(dtype))
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
    (eager_a, eager_b, comp_a, comp_b), info = sampler.interleaved(runners, 1, reps)
    out["eager"] = summarise(eager_a, eager_b, info)
    out["compiled"] = summarise(comp_a, comp_b, info)
    out["compiled_over_eager_orig"] = median(comp_a) / median(eager_a)
    out["compiled_over_eager_fused"] = median(comp_b) / median(eager_b)
    return out


# --------------------------------------------------------------------------------------------------------------------
# on-device timing (`--device`)

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


# --------------------------------------------------------------------------------------------------------------------
# the run's state


@dataclass
class Bench:
    """What every section needs: the repetition plan, the noise sampler, and (for a full run) the copy probe and the
    subprocess launcher; sections add their figures to `results`."""

    cfg: dict
    sampler: Sampler
    threads: int = 0
    launcher: Launcher | None = None
    probe: CopyProbe | None = None
    results: dict = field(default_factory=dict)


def memory_bandwidth(bench: Bench) -> dict:
    """1 GiB copy and read bandwidth (median of `bw_reps` interleaved rounds), GB/s."""
    probe = bench.probe
    (copies, reads), info = bench.sampler.interleaved(
        [in_process(probe.copy), in_process(probe.read)], 1, bench.cfg["bw_reps"]
    )
    return {
        "copy_gbps": probe.gbps(median(copies)),
        "copy_gbps_best": probe.gbps(min(copies)),
        "read_gbps": probe.N / median(reads) / 1e9,
        **info,
    }


def gemv_bandwidth(bench: Bench) -> dict:
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

        (times,), _ = bench.sampler.interleaved([in_process(run)], 1, bench.cfg["bw_reps"])
        out[name] = weight.numel() * weight.element_size() / median(times) / 1e9
        del weight
    return out


def machine_info(quick: bool, layers: int, noise_threshold: float) -> dict:
    """The machine and software a CPU run measured on (after `torch.set_num_threads`), and its load average."""
    import torch
    import transformers

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "quick": quick,
        "layers": layers,
        "noise_threshold_cores": noise_threshold,
        "loadavg_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"
