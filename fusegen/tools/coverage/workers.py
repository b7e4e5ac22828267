"""Worker processes of the coverage run: each task in a forked process of its own, killed at its timeout.

Not the sweep's process pool (`fusegen.tools.sweep`): a pool cannot kill one hung task, and every generated module
must register its checkpoint conversions in a clean Transformers, so each task gets a fresh process."""

from __future__ import annotations

import multiprocessing
import sys
import time
import traceback
from collections.abc import Callable, Iterator


def run_isolated(tasks: list[tuple[str, Callable, tuple]], jobs: int, timeout: float) -> Iterator[tuple[str, object]]:
    """Run `fn(*args)` for each `(key, fn, args)` in a forked process of its own, `jobs` at a time.

    A process per task (not a pool) so that a hung model can be killed at `timeout` and a segfault costs one result,
    and so every generated module registers its checkpoint conversions in a clean Transformers.
    Yields `(key, result)`, where a timeout or a dead worker is a `Verification`-style dict with that status.
    """
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pending = list(tasks)
    running: dict = {}
    while pending or running:
        while pending and len(running) < max(jobs, 1):
            key, fn, args = pending.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(sender, fn, args), daemon=True)
            process.start()
            sender.close()
            running[receiver] = (key, process, time.monotonic())
        for receiver in wait(list(running), timeout=1.0):
            key, process, _ = running.pop(receiver)
            try:
                result = receiver.recv()
            except EOFError:
                result = {"status": "crash", "reason": f"worker died (exit code {process.exitcode})"}
            process.join()
            receiver.close()
            yield key, result
        for receiver, (key, process, started) in list(running.items()):
            if time.monotonic() - started > timeout:
                process.kill()
                process.join()
                receiver.close()
                del running[receiver]
                yield key, {"status": "timeout", "reason": f"no result within {timeout:.0f} s"}


def _child(sender, fn: Callable, args: tuple) -> None:
    """Worker body: one thread (the machine is shared), quiet Transformers logs, the result sent back as data."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        result = fn(*args)
    except BaseException:  # noqa: BLE001 - anything raised is the result
        result = {"status": "crash", "reason": traceback.format_exc(limit=8)}
    sender.send(result)
    sender.close()
