"""The ``lbkit`` command-line tool.

``lbkit eplb`` plans expert placement for a load matrix and compares methods against the lower
bound; ``lbkit bench`` replays a workload through simulated prefill and decode pools. Both check
every option, input file and output path before any work (:mod:`lbkit.cli.checks`; the limits
are in docs/cli.md). Every failure ends the program with exit status 2 and one line on stderr
that names the culprit (the option, or the file and line), never a traceback; no warning is
printed: a numerical warning inside lbkit is a failure too (reported as such), and warnings of
other libraries are dropped.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from lbkit import __version__
from lbkit.cli import bench as _bench
from lbkit.cli import eplb as _eplb

__all__ = ["main"]

#: Exceptions that mean "bad input": reported in one line, exit status 2.
USER_ERRORS = (ValueError, TypeError, KeyError, OSError)
#: Exit status of every failure.
EXIT_FAILURE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_FAILURE, f"{self.prog}: error: {_one_line(message)}\n")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lbkit`` and its subcommands."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(
        prog="lbkit",
        description="Load-balancing algorithms for large-model serving.",
    )
    parser.add_argument("--version", action="version", version=f"lbkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    commands = {"eplb": _eplb.add_parser(sub), "bench": _bench.add_parser(sub)}
    return parser, commands


_UNSET = object()


def _given(argv: Sequence[str] | None, args: argparse.Namespace) -> frozenset[str]:
    """The options the user gave (by destination), found by parsing again with no defaults."""
    parser, commands = _build()
    dests = [k for k in vars(args) if k not in ("command", "run")]
    commands[args.command].set_defaults(**dict.fromkeys(dests, _UNSET))
    explicit = vars(parser.parse_args(argv))
    return frozenset(k for k in dests if explicit.get(k, _UNSET) is not _UNSET)


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
    parser, _ = _build()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a parse error (already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_FAILURE
    prog = f"lbkit {args.command}"
    try:
        args.given = _given(argv, args)
        with warnings.catch_warnings():
            # Other libraries' warnings (deprecations, layout hints) are not shown; a numerical
            # warning (overflow, invalid value) or any warning of lbkit's own stops the run.
            warnings.simplefilter("ignore")
            warnings.filterwarnings("error", category=RuntimeWarning)
            warnings.filterwarnings("error", module=r"lbkit(\.|$)")
            return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        print(f"{prog}: error: the output pipe was closed", file=sys.stderr)
        return EXIT_FAILURE
    except USER_ERRORS as exc:
        message = str(exc).strip()
        if isinstance(exc, KeyError) and message.startswith(("'", '"')):
            message = message[1:-1]
        print(f"{prog}: error: {_one_line(message) or type(exc).__name__}", file=sys.stderr)
        return EXIT_FAILURE
    except MemoryError:
        print(f"{prog}: error: out of memory; ask for a smaller run", file=sys.stderr)
        return EXIT_FAILURE
    except Warning as exc:
        print(
            f"{prog}: error: numerical failure ({type(exc).__name__}: {_one_line(str(exc))}); "
            f"the input is outside what lbkit computes exactly, please report it",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    except Exception as exc:  # a bug: still one line, with what a report needs
        print(
            f"{prog}: error: internal error ({type(exc).__name__}: {_one_line(str(exc))[:200]}); "
            f"please report it with the command line",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured, or already closed
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
