"""Errors the command line turns into messages and exit codes: the one place that decides both.

Exit codes of every `fusegen` command: 0 ok, 1 drift found (or a verified model out of tolerance), 2 bad usage or
input (the message names the file, tensor or model), 3 an internal error (a bug in fusegen: the traceback is printed
so it can be reported; never confused with 1, which a CI job reads as "regenerate").
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable

EXIT_OK, EXIT_DRIFT, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


class FusegenError(Exception):
    """Something the user must fix; its message says what and where."""

    exit_code = EXIT_ERROR


class InputError(FusegenError):
    """A bad target, file or option: exit code 2."""


def _is_bad_input(error: BaseException) -> bool:
    """Errors that are the input's fault: ours, a file the OS refused, a checkpoint the runtime refused.

    `CheckpointError` is looked up only if its module is loaded (an error cannot be one otherwise), so importing
    this module stays free of torch.
    """
    files = sys.modules.get("fusegen.runtime.files")
    kinds = (FusegenError, OSError) + ((files.CheckpointError,) if files is not None else ())
    return isinstance(error, kinds)


def fail(message: str, code: int = EXIT_ERROR) -> int:
    """Print `fusegen: error: <message>` on stderr and return the exit code."""
    print(f"fusegen: error: {message}", file=sys.stderr)
    return code


def command(handler: Callable[..., int]) -> Callable[..., int]:
    """Run a command handler: its own exit code, 2 with one `fusegen: error:` line for bad input, 3 for a bug.

    Every subcommand goes through this (cli.main wraps each handler; `convert.run` and `verify.run`, which are also
    called directly, are wrapped where they are defined), so the codes and the message format exist once.
    """

    @functools.wraps(handler)
    def run(*args, **kwargs) -> int:
        try:
            return handler(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - sorted into bad input and bugs right here
            if _is_bad_input(error):
                return fail(str(error), getattr(error, "exit_code", EXIT_ERROR))
            traceback.print_exc()
            return fail(f"internal error, please report it: {type(error).__name__}: {error}", EXIT_INTERNAL)

    return run


def first_line(error: BaseException) -> str:
    """The first two non-blank lines of an exception's message, joined, at most 300 characters (for one-line reports)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return " ".join(lines[:2])[:300]


def short_error(error: BaseException) -> str:
    """`Type: message` plus where in the source it was raised (file:line), for triage in one line."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" [{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}]" if frames else ""
    return f"{type(error).__name__}: {first_line(error)}{where}"
