"""Errors the command line turns into messages and exit codes."""


class FusegenError(Exception):
    """Something the user must fix; its message says what and where."""

    exit_code = 2


class InputError(FusegenError):
    """A bad target, file or option: exit code 2."""
