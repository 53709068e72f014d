"""Errors a user can act on: the entry points (train.py, eval.py, `python -m dspark.export`) print their
message as one line and exit with status 2, instead of a traceback."""
from __future__ import annotations

import sys
from contextlib import contextmanager


class UserError(ValueError):
    """Bad input or a damaged file; the message names the key or file and what to do."""


class ConfigError(UserError):
    """A config value is wrong; the message names the key."""


def require(cond: bool, key: str, msg: str) -> None:
    """ConfigError "<key>: <msg>" unless cond."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


class IntegrityError(UserError):
    """A file dspark wrote is truncated, altered or incomplete; the message names it."""


class RunDirBusy(UserError):
    """Another live run holds the run directory's lock."""


@contextmanager
def one_line_errors(prog: str):
    """Turns a UserError into `prog: error: <message>` on stderr and exit status 2."""
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
