"""argparse types with range checks, for the numeric flags of every command.

A number out of range is refused while the arguments are parsed, so the error comes before any
file is opened, downloaded, packed or loaded, as argparse's usual `error: argument --port: ...`
(exit status 2). Rules that belong to the runtime (sampling parameters: SamplingParams, the
context size: backend.check_max_context) stay there; the commands check them before the slow
work instead of repeating them here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse `type` taking an integer in [lo, hi] (no upper bound when hi is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            wanted = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return value

    return parse


port = int_range(1, 65535)  # TCP; 0 (any free port) is not a port a client could be told
