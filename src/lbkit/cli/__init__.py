"""The ``lbkit`` command-line tool.

``lbkit eplb`` plans expert placement for a load matrix and compares methods against the lower
bound. Every error in the input (missing file, unknown format, malformed row, negative or NaN
load, impossible sizes) ends the program with a one-line message and exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lbkit import __version__
from lbkit.cli import bench as _bench
from lbkit.cli import eplb as _eplb

__all__ = ["main"]

#: Exceptions that mean "bad input": reported in one line, exit status 2.
USER_ERRORS = (ValueError, TypeError, KeyError, OSError)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lbkit`` and its subcommands."""
    parser = _Parser(
        prog="lbkit",
        description="Load-balancing algorithms for large-model serving.",
    )
    parser.add_argument("--version", action="version", version=f"lbkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _eplb.add_parser(sub)
    _bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lbkit`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    # One process, run again and again: cache compiled kernels on disk (see lbkit.core._jit).
    # Restored on return, so that calling main() from Python leaves the environment as it was.
    previous = os.environ.get("LBKIT_JIT_CACHE")
    os.environ.setdefault("LBKIT_JIT_CACHE", "1")
    try:
        return _run(argv)
    finally:
        if previous is None:
            os.environ.pop("LBKIT_JIT_CACHE", None)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except USER_ERRORS as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, KeyError) and message.startswith(("'", '"')):
            message = message[1:-1]
        print(f"lbkit {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lbkit {args.command}: interrupted", file=sys.stderr)
        return 130
