"""`fusegen` sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (fusegen/cli.py, `quiet_openmp`), unless the user
set it, and only where it can still take effect."""

import os
import subprocess
import sys
from pathlib import Path

from fusegen import cli

ROOT = Path(__file__).resolve().parent.parent

# `main` as the console script runs it, with the parser (whose imports load torch) replaced by a probe that reports
# the policy and whether torch was loaded before it was set.
PROBE = """
import os, sys
from fusegen import cli

def probe():
    print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
    sys.exit(0)

cli.make_parser = probe
cli.main([])
"""


def _probe(**env):
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=environment, check=True
    )
    return done.stdout.split()


def test_the_command_line_sets_the_passive_policy_before_torch_loads():
    assert _probe() == ["PASSIVE", "False"]


def test_a_policy_the_user_set_is_kept():
    assert _probe(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "False"]


def test_a_process_that_loaded_torch_is_left_alone(monkeypatch):
    import torch  # noqa: F401 - loaded, as in any test process that calls `cli.main`

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli.quiet_openmp()
    assert "OMP_WAIT_POLICY" not in os.environ
