"""What a benchmark script records about its run: progress lines, the load average, the commit.

Shared by the scripts of this folder (run as ``python benchmarks/NAME.py``, which puts this
folder on ``sys.path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "PUBLIC_TRACES",
    "REPLAN_SHAPES",
    "REPLAN_TRACE",
    "ROOT",
    "TRACES",
    "csv_names",
    "deepseek_eplb",
    "git_commit",
    "load_avg",
    "log",
    "replan_loads",
    "rounds_run",
    "write_results",
]

#: The checkout these scripts belong to.
ROOT = Path(__file__).resolve().parents[1]
#: Where the public traces live: the steering repository's shared folder beside the checkout.
TRACES = ROOT / ".." / "shared" / "traces"
#: Trace name -> file under :data:`TRACES` (``None``: the built-in workload).
PUBLIC_TRACES = {
    "mooncake": "mooncake_conversation/conversation_trace.jsonl",
    "azure": "azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv",
    "default": None,
}

#: DeepSeek-V3 expert loads (SGLang ``logical_count``) of the EPLB re-planning benchmarks.
REPLAN_TRACE = TRACES / "moe_expert_load_deepseek_v3" / "prefill_in1024.json"
#: (slots, GPUs, nodes, policy) of the EPLB re-planning benchmarks.
REPLAN_SHAPES = (
    (288, 32, 4, "global"),
    (288, 32, 4, "hierarchical"),
    (320, 64, 8, "global"),
    (320, 64, 8, "hierarchical"),
)


def log(msg: str, start: float) -> None:
    """A progress line on stderr, stamped with the seconds since ``start`` (perf_counter)."""
    print(f"[{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr, flush=True)


def load_avg() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (``None`` where there are none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git_commit(root: Path) -> str | None:
    """The checkout measured (``+dirty``: with uncommitted changes under ``src``), so that
    figures can be matched with the library code that produced them."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")  # fmt: skip


def csv_names(text: str | None, known: Iterable[str], what: str) -> list[str]:
    """The names of a comma-separated option (all of ``known`` when ``None``); exits naming the
    option ``--what`` on an unknown or empty list."""
    known = list(known)
    if text is None:
        return known
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"--{what}: unknown {bad[0] if bad else '(empty)'!r}; "
                         f"choose from {', '.join(known)}")  # fmt: skip
    return names


def save_partial(out: dict, path: Path | None, start: float, tables, *, done: bool) -> None:
    """Write a benchmark's results after every cell (``complete`` false until the end), so that
    a long run that is stopped keeps what it measured: ``tables(out)`` rebuilds the tables."""
    import json

    out["complete"] = done
    out["tables"] = tables(out)
    out["machine"]["load_avg_end"] = load_avg()
    out["wall_s"] = round(time.perf_counter() - start, 1)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")


def write_results(out: dict, path: Path | None, start: float) -> None:
    """Finish a benchmark's record (the load average at the end, the wall time since ``start``)
    and write it as JSON to ``path``, or print it without one."""
    import json

    out["load_avg_end"] = load_avg()
    out["wall_s"] = round(time.perf_counter() - start, 1)
    text = json.dumps(out, indent=1)
    if path is not None:
        path.write_text(text + "\n")
    else:
        print(text)


def rounds_run(script: str, description: str, default_rounds: int):
    """Start a benchmark timed over alternating rounds: parse ``--rounds`` (at least 1) and
    ``--json``, and begin its record (command, commit, load average). Returns ``(args, start,
    out)``, ``start`` the perf_counter for :func:`write_results`."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=default_rounds)
    ap.add_argument("--json", help="write the table to this file")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds: must be at least 1")
    out = {
        "command": " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]]),
        "commit": git_commit(ROOT),
        "load_avg_start": load_avg(),
    }
    return args, time.perf_counter(), out


def replan_loads():
    """Loads of the EPLB re-planning benchmarks: ``(w0, w1, name)``, layers 3-60 of
    :data:`REPLAN_TRACE` (lognormal loads with sigma 1, seed 0, without the trace directory) and
    the same drifted by lognormal sigma 0.1 (seed 1)."""
    import json

    import numpy as np

    from lbkit.eplb import drift, synthetic_expert_load

    if REPLAN_TRACE.is_file():
        w0 = np.array(json.loads(REPLAN_TRACE.read_text())["logical_count"], dtype=np.float64)
        w0, name = w0[3:], "trace prefill_in1024"
    else:
        w0, name = synthetic_expert_load(58, 256, sigma=1.0, rng=0), "lognormal"
    return w0, drift(w0, sigma=0.1, rng=1), name


def deepseek_eplb():
    """DeepSeek's reference ``eplb.py`` loaded from the file ``LBKIT_DEEPSEEK_EPLB`` names, and
    torch: ``(module, torch)``, or ``(None, None)`` when the variable is unset or torch is
    missing."""
    import importlib.util

    path = os.environ.get("LBKIT_DEEPSEEK_EPLB")
    if not path:
        return None, None
    try:
        import torch
    except ImportError:
        return None, None
    spec = importlib.util.spec_from_file_location("deepseek_eplb", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, torch
