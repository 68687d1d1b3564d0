"""Checks of the ``lbkit`` command line, run before any work: option ranges, files, limits.

Every check raises ``ValueError`` with a message that starts with the culprit, an option
(``"--prefill-engines: ..."``) or a file and line (``"t.jsonl: line 3: ..."``), which
:func:`lbkit.cli.main` prints as one line on stderr before exiting with status 2.

The limits below bound what one run of ``lbkit`` may ask for, so that an absurd input is refused
at once instead of ending in a ``MemoryError`` or in hours of simulation (docs/cli.md).
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "MAX_EPLB_GPUS",
    "MAX_EPLB_SLOT_LAYERS",
    "MAX_EXPERTS",
    "MAX_LAYERS",
    "MAX_POOL_RANKS",
    "MAX_PREFILL_STEPS",
    "MAX_REPEAT",
    "MAX_REPLICAS",
    "MAX_REQUESTS",
    "MAX_REQUEST_TOKENS",
    "MAX_SEED",
    "check_count",
    "check_input_file",
    "check_outputs",
    "check_real_option",
    "option_name",
    "refuse_ignored",
]

#: Largest pool ``lbkit bench`` simulates: ranks of the prefill pool (engines x ranks per
#: engine) and, separately, of the decode pool. 64 DeepSeek units of 64 GPUs each.
MAX_POOL_RANKS = 4096
#: Most requests ``lbkit bench`` replays (after ``--max-requests``).
MAX_REQUESTS = 1_048_576
#: Largest prompt (``total_tokens``) and largest output of one request ``lbkit bench`` replays:
#: 2**24 = 16,777,216 tokens, above the longest context window of any model served today.
MAX_REQUEST_TOKENS = 2**24
#: Most prefill steps one replay of the trace may need (estimated by
#: :func:`lbkit.cli.bench_checks.predicted_prefill_steps`; the goodput search replays every
#: policy about ten times). The built-in workload needs about 108,000 at ``--budget 1``; a replay
#: at the limit took 4.7 s on the shared 2-core machine (docs/cli.md).
MAX_PREFILL_STEPS = 4_000_000
#: Largest ``--seed`` (seeds are 32-bit, as numpy's legacy generator's).
MAX_SEED = 2**32 - 1
#: ``lbkit eplb``: most layers of a load matrix (after summing recordings).
MAX_LAYERS = 1024
#: ``lbkit eplb``: most logical experts per layer.
MAX_EXPERTS = 4096
#: ``lbkit eplb``: most physical expert slots (``--num-replicas``) per layer.
MAX_REPLICAS = 16_384
#: ``lbkit eplb``: most GPUs (``--num-gpus``).
MAX_EPLB_GPUS = 4096
#: ``lbkit eplb``: most slots planned in all, layers x ``--num-replicas`` x ``--repeat`` x
#: methods: about 3 minutes on the shared 2-core machine (the default method planned
#: 1,024 layers x 4,096 slots in 171 s there, load average 6.5).
MAX_EPLB_SLOT_LAYERS = 2**22
#: ``lbkit eplb``: most timed repetitions (``--repeat``).
MAX_REPEAT = 100


def option_name(dest: str) -> str:
    """The command-line spelling of an argparse destination: ``"num_gpus"`` -> ``"--num-gpus"``.

    Examples
    --------
    >>> option_name("prefill_engines")
    '--prefill-engines'
    """
    return "--" + dest.replace("_", "-")


def check_count(args: argparse.Namespace, dest: str, low: int, high: int, why: str = "") -> int:
    """The integer option ``dest`` of ``args``, refused unless ``low <= value <= high``.

    ``why`` says where ``high`` comes from (shown when the value is too large).

    Examples
    --------
    >>> ns = argparse.Namespace(repeat=0)
    >>> check_count(ns, "repeat", 1, 100)
    Traceback (most recent call last):
    ...
    ValueError: --repeat: must be an integer from 1 to 100, got 0
    """
    value = getattr(args, dest)
    if not low <= value <= high:
        note = f" ({why})" if why and value > high else ""
        raise ValueError(
            f"{option_name(dest)}: must be an integer from {low:,} to {high:,}{note}, got {value:,}"
        )
    return value


def check_real_option(
    args: argparse.Namespace,
    dest: str,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    unit: str = "",
) -> float:
    """The float option ``dest`` of ``args``, refused unless finite and within its range.

    The range is ``[low, high]``, or ``(low, high]`` with ``low_open``.

    Examples
    --------
    >>> ns = argparse.Namespace(attainment=float("nan"))
    >>> check_real_option(ns, "attainment", 0.0, 1.0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: --attainment: must be a number in (0, 1], got nan
    """
    value = getattr(args, dest)
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        lo = "(" if low_open else "["
        raise ValueError(
            f"{option_name(dest)}: must be a number in {lo}{low:g}, {high:g}]{unit}, got {value:g}"
        )
    return value


def refuse_ignored(given: Iterable[str], dest: str, reason: str) -> None:
    """Refuse the option ``dest`` if the user gave it: in this combination it does nothing.

    Examples
    --------
    >>> refuse_ignored({"format"}, "format", "ignored without --load")
    Traceback (most recent call last):
    ...
    ValueError: --format: ignored without --load
    """
    if dest in given:
        raise ValueError(f"{option_name(dest)}: {reason}")


def check_input_file(path: Path, option: str) -> Path:
    """Refuse an input path that is missing, not a regular file, or unreadable.

    Examples
    --------
    >>> check_input_file(Path("/no/such/trace.jsonl"), "--trace")
    Traceback (most recent call last):
    ...
    ValueError: --trace: file not found: /no/such/trace.jsonl
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"{option}: file not found: {path}") from None
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"{option}: {path} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{option}: {path} is not a regular file")
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror}") from None
    return path


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def check_outputs(outputs: Mapping[str, Path | None], inputs: Mapping[str, Path | None]) -> None:
    """Refuse output paths that cannot be written, or that collide with each other or an input.

    ``outputs`` and ``inputs`` map option names (``"--json"``) to paths (``None``: not given).
    Each output is probed by opening it for writing (a file created by the probe is removed), so
    a missing directory, a directory given as a file or a read-only location is reported before
    any work.

    Examples
    --------
    >>> check_outputs({"--json": Path("/no/such/dir/r.json")}, {})
    Traceback (most recent call last):
    ...
    ValueError: --json: directory /no/such/dir does not exist
    """
    seen: dict[str, Path] = {k: v for k, v in inputs.items() if v is not None}
    for option, path in outputs.items():
        if path is None:
            continue
        for other, used in seen.items():
            if _same_file(path, used):
                raise ValueError(f"{option}: {path} is also the {other} file")
        seen[option] = path
        _probe_writable(path, option)


def _probe_writable(path: Path, option: str) -> None:
    parent = path.parent
    if path.is_dir():
        raise ValueError(f"{option}: {path} is a directory, not a file")
    if not parent.exists():
        raise ValueError(f"{option}: directory {parent} does not exist")
    if not parent.is_dir():
        raise ValueError(f"{option}: {parent} is not a directory")
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise ValueError(f"{option}: cannot write {path}: {exc.strerror}") from None
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass
