"""Multi-process launches on CPU with gloo, shared by the tensor-parallel and distributed-checkpoint tests
(tests/test_tp.py, tests/test_multimodal_tp.py, tests/test_distributed_checkpoints.py).

A launch spawns one process per rank on a free port. Each rank runs the test module's worker inside `rank_group`,
which joins the gloo group (with a short collective timeout, so a rank waiting on a crashed one fails instead of
hanging) and, however the worker ends, writes the results it recorded to `<out_dir>/rank<r>.json` and leaves the
group. `launch` kills every rank still running after its timeout, so a deadlock fails the test, then reads every
rank's results: a rank that wrote none fails the test with the missing file's name.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

LAUNCH_TIMEOUT = 600  # seconds for one launch, interpreter start-up included (2 shared CPU cores)
GROUP_TIMEOUT = 180  # seconds gloo waits on a collective before failing (a loaded 2-core CI machine took >60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def rank_group(rank: int, world_size: int, port: int, out_dir, timeout: float = GROUP_TIMEOUT):
    """In a spawned rank: set the process-group environment, one thread, quiet Transformers, join the gloo group;
    yields the dict the worker fills with its results, written to `<out_dir>/rank<rank>.json` on the way out."""
    import warnings

    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.simplefilter("ignore", FutureWarning)  # `tp_plan=` is deprecated in favour of `distributed_config=`
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    results: dict = {}
    try:
        yield results
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def launch(worker, world_size: int, args: tuple, out_dir, timeout: float = LAUNCH_TIMEOUT) -> list[dict]:
    """Run `worker(rank, world_size, port, *args)` on `world_size` spawned processes; every rank's results."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(world_size, free_port(), *args), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} processes still running after {timeout}s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world_size)]
