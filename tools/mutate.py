"""Mutation testing of lbkit's decision kernels and pure functions (deterministic, no dependency).

Why a driver of our own: mutmut 3 leaves every decorated function alone (so every ``@jit``
kernel, the code that matters most here), and cosmic-ray rewrites the files of the working tree
in place. This driver mutates a module's AST, writes the mutant into a temporary copy of the
project (never the real tree), and runs only the test files that cover the module (plus the
module's own doctests) with ``NUMBA_DISABLE_JIT=1``, so no numba compile is needed and every
kernel runs as Python (the JIT-parity tests, which need the JIT, are deselected). A mutant is
*killed* when the tests fail (or cannot import it, or run out of the per-mutant time budget),
*survived* when they pass.

Mutation operators (one mutant per site and replacement):

- comparisons: ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``is``/``in`` negated;
- arithmetic (also augmented assignment): ``+`` <-> ``-``, ``*`` <-> ``/``, ``//`` -> ``*``,
  ``%`` -> ``//``, ``**`` -> ``*``, ``&`` <-> ``|``, ``<<`` <-> ``>>``;
- boolean operators ``and`` <-> ``or``; ``not x`` -> ``x``; unary ``-x`` -> ``x``;
- constants: integers ``n`` -> ``n + 1`` and ``n - 1``, floats ``x`` -> ``x + 1``, ``True`` <->
  ``False`` (strings, docstrings, annotations, imports and ``__all__`` are never mutated);
- return values: ``return X`` -> ``return None``;
- removed statements: augmented assignments, assignments into an element or attribute
  (``a[i] = v``, ``o.f = v``), calls used as statements, ``break``, ``continue``, ``raise``.

Modules with more mutants than ``--sample`` are sampled with a seeded RNG (the same sample on
every run). Run from the repository root::

    nice -n 10 python tools/mutate.py --json benchmarks/results/mutation.json

``--module NAME`` (repeatable) restricts the run, ``--list`` prints the mutants without running
them, ``--show NAME:ID`` prints one mutant's diff. One mutant runs at a time (a forked child of
a process that has already imported numpy, numba, hypothesis and pytest, so a mutant costs only
its tests).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The EPLB planners run for seconds per call as Python: their property suites (test_rebalance,
# most of test_validation_and_bounds) take minutes per mutant. The golden plans and the fast
# checks stand in for them.
_EPLB_FAST = (
    "tests/eplb/test_validation_and_bounds.py::test_bad_input_is_rejected_with_a_named_rule",
    "tests/eplb/test_validation_and_bounds.py::test_check_placement_names_each_rule",
    "tests/eplb/test_validation_and_bounds.py::test_lower_bound_examples",
)
EPLB_TESTS = (
    *_EPLB_FAST,
    "tests/eplb/test_golden.py",
    "tests/eplb/test_mutation_eplb.py",
    "tests/eplb/test_mutation_packing.py",
    "tests/eplb/test_greedy_range.py",
)

#: The tests of the cost models (lbkit.core.cost and the private modules that hold them).
COST_TESTS = (
    "tests/core/test_cost.py",
    "tests/core/test_cost_split.py",
    "tests/core/test_mutation_cost.py",
)

#: Module under test -> (source file, test files (pytest node ids) run against its mutants).
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "decode/_kernels": (
        "src/lbkit/decode/_kernels.py",
        (
            "tests/decode/test_kernels.py",
            "tests/decode/test_policies.py",
            "tests/decode/test_batch.py",
            "tests/decode/test_room.py",
            "tests/decode/test_mutation_kernels.py",
            "tests/decode/test_mutation_room.py",
        ),
    ),
    "decode/policies": (
        "src/lbkit/decode/policies.py",
        (
            "tests/decode/test_policies.py",
            "tests/decode/test_kernels.py",
            "tests/decode/test_batch.py",
            "tests/decode/test_mutation_kernels.py",
            "tests/decode/test_mutation_policies.py",
        ),
    ),
    "prefill/apportion": (
        "src/lbkit/prefill/apportion.py",
        ("tests/prefill/test_apportion.py", "tests/prefill/test_mutation_prefill.py"),
    ),
    "prefill/chunking": (
        "src/lbkit/prefill/chunking.py",
        ("tests/prefill/test_chunking.py", "tests/prefill/test_mutation_prefill.py"),
    ),
    "prefill/ranks": (
        "src/lbkit/prefill/ranks.py",
        ("tests/prefill/test_ranks.py", "tests/prefill/test_mutation_prefill.py"),
    ),
    "core/cost": ("src/lbkit/core/cost.py", COST_TESTS),  # the presets
    "core/_prefill_cost": ("src/lbkit/core/_prefill_cost.py", COST_TESTS),
    "core/_decode_cost": ("src/lbkit/core/_decode_cost.py", COST_TESTS),
    # The shared terms have no examples of their own: the models' doctests exercise them.
    "core/_cost_common": (
        "src/lbkit/core/_cost_common.py",
        (*COST_TESTS, "src/lbkit/core/_prefill_cost.py", "src/lbkit/core/_decode_cost.py"),
    ),
    "eplb/bounds": (
        "src/lbkit/eplb/bounds.py",
        (*_EPLB_FAST, "tests/eplb/test_mutation_eplb.py"),
    ),
    "sim/metrics": (
        "src/lbkit/sim/metrics.py",
        (
            "tests/sim/test_engine.py",
            "tests/sim/test_engine_decode_only.py",
            "tests/sim/test_mutation_metrics.py",
        ),
    ),
    "eplb/_primitives": (
        "src/lbkit/eplb/_primitives.py",
        EPLB_TESTS,
    ),
    "eplb/greedy": (
        "src/lbkit/eplb/greedy.py",
        EPLB_TESTS,
    ),
    "eplb/_packing": (
        "src/lbkit/eplb/_packing.py",
        EPLB_TESTS,
    ),
}

#: Surviving mutants judged equivalent (no test can tell them from the original), by
#: ``(module, mutant id)`` with the reason. Ids are positions in the module's site order, so an
#: edit of a module renumbers its mutants: check this list against ``--show`` after one.
EQUIVALENT: dict[tuple[str, int], str] = {
    ("decode/_kernels", 5): "warmup() only compiles: its inputs are never checked",
    ("decode/_kernels", 10): "warmup() only compiles: its inputs are never checked",
    ("decode/_kernels", 291): "warmup() only compiles: its inputs are never checked",
    ("decode/_kernels", 303): "warmup() only compiles: its inputs are never checked",
    ("decode/_kernels", 419): "warmup() only compiles: its inputs are never checked",
    ("decode/_kernels", 157): "choose(): a secondary score that is the same constant for every "
    "rank breaks no tie",
    ("decode/_kernels", 227): "migrate(): bb starts at 1 instead of -1, but is read only after "
    "a move was found, which sets it",
    ("decode/_kernels", 229): "migrate(): src starts at 1 instead of -1, but is read only after "
    "a move was found, which sets it",
    ("decode/_kernels", 426): "choose(): 0 < capb -> 0 <= capb; a rank of capacity 0 was "
    "skipped as full before",
    ("decode/policies", 28): "_decide(): r >= 0 -> r >= -1; the only code it adds is -1, "
    "returned as -1 either way",
    ("prefill/apportion", 92): "np.zeros(d.shape[0]) -> d.shape[-1] on a 1-D array",
    ("prefill/apportion", 72): "_serving(): the initial -1 of every entry is overwritten by the "
    "loop, which writes -1 until the first bucket with engines",
    ("prefill/chunking", 78): "the downward step from 1 to 0 never runs: a solved chunk of 1 "
    "always fits (budget - total is exact, Sterbenz, so the solver's check is the plan's)",
    ("prefill/chunking", 23): "_work() with c = 0 is never called (every chunk has c >= 1)",
    ("prefill/chunking", 39): "_work() with c = 0 is never called (every chunk has c >= 1)",
    ("prefill/chunking", 28): "the solver's guess is corrected exactly both ways afterwards "
    "(only slower)",
    ("prefill/chunking", 57): "the solver's guess is corrected exactly both ways afterwards "
    "(only slower)",
    ("prefill/chunking", 58): "solve_chunk(0, p) is 0 anyway",
    ("prefill/chunking", 59): "the guess at no slack is corrected by the downward loop",
    ("prefill/chunking", 60): "a guess of -1 at no slack ends the plan as 0 does",
    ("eplb/_primitives", 185): "adopt(): cnt.shape[0] -> cnt.shape[-1] on a 1-D array",
    ("eplb/_packing", 5): "pack(): the local search keeps the loads in step; re-summing them "
    "changes rounding only (equivalent up to rounding: no golden plan differs)",
    ("eplb/_packing", 72): "_improve_pair_swap(): without the continue, the heaviest GPU as its "
    "own partner has gap 0 and is skipped by the next test",
    ("eplb/_packing", 121): "_improve_swaps(): bh starts at 1 instead of -1, but is read only "
    "after a swap was found, which sets it",
    ("eplb/_packing", 132): "_pair_makes_duplicate(): return None instead of False; both are "
    "false where the caller tests them",
    ("eplb/_packing", 154): "try_move(): best_g starts at -2 instead of -1, but the first GPU "
    "holding the donor always replaces it (any finite load is below the initial inf)",
    ("eplb/_packing", 158): "try_move(): without the break the scan goes on through the rest of "
    "the GPU's slots; a second replica of the donor there has the same load and is not taken",
    ("eplb/_packing", 185): "_improve_swaps(): bi starts at -2 instead of -1; both are < 0, the "
    "only test made of it before a swap sets it",
    ("eplb/_packing", 213): "_lpt(): ns >= 0 adds the case ns == 0, where the GPU is stashed and "
    "taken straight back (the same GPU)",
    ("eplb/_packing", 240): "_improve_swaps(): pruning at best_v - tol skips only partners h "
    "with (top + load[h]) / 2 >= best_v - tol, whose swaps all have v >= that mean and so fail "
    "the acceptance test v < best_v - tol anyway",
    ("eplb/greedy", 19): "_hierarchical(): log2mlog is written and never read (a dead store)",
    ("eplb/greedy", 122): "warmup() only compiles: its inputs are never checked",
    ("eplb/greedy", 123): "warmup() only compiles: its inputs are never checked",
    ("eplb/greedy", 128): "warmup() only compiles: its inputs are never checked",
    ("eplb/bounds", 7): "lower_bound(): a layer without load has bound 0, and max(0 / 1, 1) is "
    "1 whichever test picks the ratio",
    ("eplb/bounds", 13): "lower_bound(): as 7 (mean > -1 picks out / 1 = 0, then 1)",
    ("eplb/bounds", 14): "lower_bound(): the inner guard only avoids 0 / 0 where the outer "
    "test already picks 1",
    ("eplb/bounds", 17): "lower_bound(): as 14",
    ("eplb/greedy", 85): "warmup() only compiles: its inputs are never checked",
    ("eplb/greedy", 104): "warmup() only compiles: its inputs are never checked",
    ("core/_prefill_cost", 35): "solve_chunk(min_chunk=1): a chunk below 1 is already 0",
    ("core/_prefill_cost", 70): "solve_chunk(): a fourth downward step changes nothing the "
    "bisection after the steps would not (it finds the largest fitting chunk wherever the steps "
    "left one that overruns or is short); only the number of evaluations differs",
    ("core/_prefill_cost", 102): "step_time(): work() checks the same chunk_tokens array for "
    "negatives, under the same name and before anything else, so the error is the same",
    ("core/_prefill_cost", 167): "rank_step_s(): reshape(ranks, -2); numpy takes any negative "
    "size as the one to infer, as -1",
    ("core/_decode_cost", 46): "n.shape[0] -> n.shape[-1] on a 1-D array",
    ("eplb/bounds", 15): "the fallback mean of a layer without load is never used (ratio 1.0 "
    "there)",
}

_COMPARE = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BINOP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_SYMBOL = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
    ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+",
    ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
    ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>", ast.And: "and",
    ast.Or: "or",
}  # fmt: skip


@dataclass(frozen=True)
class Mutant:
    """One mutation site and replacement; ``index`` is its rank in the module's site order."""

    index: int
    line: int
    description: str


def _skipped(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: docstrings, imports, annotations, decorators, f-strings,
    ``__all__``, ``if TYPE_CHECKING`` blocks."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            for sub in ast.walk(node):
                skip.add(id(sub))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                mark(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                mark(d)
            mark(node.returns)
            for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
                mark(a.annotation)
            for a in (node.args.vararg, node.args.kwarg):
                if a is not None:
                    mark(a.annotation)
        if isinstance(node, ast.ClassDef):
            for d in node.decorator_list:
                mark(d)
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.JoinedStr)):
            mark(node)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            mark(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            mark(node)
    return skip


def _removable(stmt: ast.stmt) -> bool:
    if isinstance(stmt, (ast.AugAssign, ast.Break, ast.Continue, ast.Raise)):
        return True
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, ast.Call)
    if isinstance(stmt, ast.Assign):
        return all(isinstance(t, (ast.Subscript, ast.Attribute)) for t in stmt.targets)
    return False


def _sites(tree: ast.Module):
    """Yield ``(node, kind, payload, line, description)`` for every mutation, in a fixed order."""
    skip = _skipped(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                new = _COMPARE.get(type(op))
                if new is not None:
                    yield node, "cmp", (i, new), line, f"{_SYMBOL[type(op)]} -> {_SYMBOL[new]}"
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            new = _BINOP.get(type(node.op))
            if new is not None:
                aug = "=" if isinstance(node, ast.AugAssign) else ""
                desc = f"{_SYMBOL[type(node.op)]}{aug} -> {_SYMBOL[new]}{aug}"
                yield node, "binop", new, line, desc
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            yield node, "boolop", new, line, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[new]}"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            sym = "not x" if isinstance(node.op, ast.Not) else "-x"
            yield node, "unary", None, line, f"{sym} -> x"
        elif isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool):
                yield node, "const", (not v), line, f"{v} -> {not v}"
            elif isinstance(v, int):
                yield node, "const", v + 1, line, f"{v} -> {v + 1}"
                yield node, "const", v - 1, line, f"{v} -> {v - 1}"
            elif isinstance(v, float):
                yield node, "const", v + 1.0, line, f"{v!r} -> {v + 1.0!r}"
        elif isinstance(node, ast.Return):
            if node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None
            ):
                yield node, "return", None, line, "return X -> return None"
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.If, ast.For, ast.While, ast.With)):
            for field in ("body", "orelse"):
                for j, stmt in enumerate(getattr(node, field, ())):
                    if id(stmt) not in skip and _removable(stmt):
                        text = ast.unparse(stmt).splitlines()[0][:60]
                        yield node, "remove", (field, j), stmt.lineno, f"removed `{text}`"


def enumerate_mutants(source: str) -> list[Mutant]:
    tree = ast.parse(source)
    return [Mutant(i, s[3], s[4]) for i, s in enumerate(_sites(tree))]


def mutate(source: str, index: int) -> str:
    """The source of mutant ``index`` (``-1``: the unmutated module, re-printed the same way)."""
    tree = ast.parse(source)
    if index >= 0:
        for i, (node, kind, payload, _line, _desc) in enumerate(_sites(tree)):
            if i != index:
                continue
            if kind == "cmp":
                pos, new = payload
                node.ops[pos] = new()
            elif kind == "binop":
                node.op = payload()
            elif kind == "boolop":
                node.op = payload()
            elif kind == "unary":
                _replace(tree, node, node.operand)
            elif kind == "const":
                node.value = payload
            elif kind == "return":
                node.value = ast.Constant(None)
            elif kind == "remove":
                field, j = payload
                body = getattr(node, field)
                body[j] = ast.copy_location(ast.Pass(), body[j])
            break
        else:
            raise IndexError(index)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list):
                for k, item in enumerate(value):
                    if item is old:
                        value[k] = new
                        return
    raise LookupError("node not found")


def select(mutants: list[Mutant], sample: int, seed: int) -> list[Mutant]:
    if sample <= 0 or len(mutants) <= sample:
        return list(mutants)
    chosen = random.Random(seed).sample(mutants, sample)
    return sorted(chosen, key=lambda m: m.index)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _copy_project(dest: Path) -> None:
    for name in ("src", "tests"):
        shutil.copytree(
            ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    for name in ("conftest.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, dest / name)
    (dest / "benchmarks").mkdir()


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, with its waited-for children) of a running process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _run_tests(
    workdir: Path, tests: list[str], cpu_limit_s: float, wall_limit_s: float
) -> tuple[str, float]:
    """Run pytest on ``tests`` in a forked child; returns (``"pass"``/``"fail"``/``"timeout"``,
    CPU seconds). The limit is on the child's CPU time, so that a machine busy with other work
    does not pass for a mutant that loops (a wall-clock limit stops runaway children too)."""
    start = time.perf_counter()
    used = 0.0
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.setpgid(0, 0)
            os.chdir(workdir)
            if not os.environ.get("MUTATE_VERBOSE"):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
            sys.path.insert(0, str(workdir / "src"))
            import pytest
            from hypothesis import HealthCheck, Phase, settings

            # The "ci" profile without shrinking and explaining a failure: a mutant needs only
            # to fail, and explaining runs every kernel under a tracer.
            settings.register_profile(
                "mutation",
                max_examples=60,
                deadline=None,
                derandomize=True,
                database=None,
                phases=(Phase.explicit, Phase.reuse, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow],
            )
            os.environ["HYPOTHESIS_PROFILE"] = "mutation"

            opts = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not jit_parity"]
            code = pytest.main([*tests, *opts, "-W", "ignore::pytest.PytestWarning"])
            os._exit(int(code))
        except BaseException:
            os._exit(99)
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return ("pass" if code == 0 else "fail"), usage.ru_utime + usage.ru_stime
        used = max(used, _cpu_seconds(pid))
        if used > cpu_limit_s or time.perf_counter() - start > wall_limit_s:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout", used
        time.sleep(0.02)


def run_module(name: str, workdir: Path, args: argparse.Namespace) -> dict:
    rel, tests = MODULES[name]
    tests = [t for t in tests if (ROOT / t.partition("::")[0]).exists()] + [
        rel
    ]  # + the module's doctests
    target = workdir / rel
    original = (ROOT / rel).read_text()
    mutants = enumerate_mutants(original)
    chosen = select(mutants, args.sample, args.seed)
    if args.only:
        chosen = [m for m in chosen if m.index in args.only.get(name, set())]
    if args.baseline:
        chosen = []
    target.write_text(mutate(original, -1))
    verdict, base_s = _run_tests(workdir, tests, args.timeout_cap, 10 * args.timeout_cap)
    if verdict != "pass":  # reported, and the other modules still run
        print(f"  {name}: the unmutated module fails its tests ({verdict})", flush=True)
        return {"source": rel, "tests": tests, "mutants_total": len(mutants), "mutants_run": 0,
                "killed": 0, "score": None, "error": f"the unmutated module fails ({verdict})",
                "survivors": [], "results": []}  # fmt: skip
    timeout_s = min(args.timeout_cap, 3.0 * base_s + 10.0)
    print(f"  baseline {base_s:.1f} CPU s, limit {timeout_s:.0f} CPU s", flush=True)
    results = []
    for m in chosen:
        target.write_text(mutate(original, m.index))
        verdict, secs = _run_tests(workdir, tests, timeout_s, 10 * timeout_s)
        killed = verdict != "pass"
        results.append(
            {
                "id": m.index,
                "line": m.line,
                "mutation": m.description,
                "killed": killed,
                "how": verdict,
                "seconds": round(secs, 2),
            }
        )
        mark = "killed" if killed else "SURVIVED"
        print(f"  {name}:{m.index} L{m.line} {m.description}: {mark} ({verdict}, {secs:.1f} s)",
              flush=True)  # fmt: skip
    target.write_text(original)
    killed = sum(r["killed"] for r in results)
    for r in results:
        if not r["killed"] and (name, r["id"]) in EQUIVALENT:
            r["equivalent"] = EQUIVALENT[name, r["id"]]
    equivalent = sum("equivalent" in r for r in results)
    return {
        "source": rel,
        "tests": tests,
        "mutants_total": len(mutants),
        "mutants_run": len(results),
        "killed": killed,
        "score": round(killed / len(results), 4) if results else None,
        "equivalent": equivalent,
        "score_without_equivalent": (
            round(killed / (len(results) - equivalent), 4) if len(results) > equivalent else None
        ),
        "baseline_cpu_seconds": round(base_s, 2),
        "survivors": [r for r in results if not r["killed"]],
        "results": results,
    }


def _parse_only(values: list[str]) -> dict[str, set[int]]:
    only: dict[str, set[int]] = {}
    for v in values:
        name, _, ids = v.rpartition(":")
        only.setdefault(name, set()).update(int(i) for i in ids.split(","))
    return only


def _summarise(name: str, mod: dict) -> dict:
    """Recount a module's totals from its per-mutant results (after a merge)."""
    results = mod["results"]
    for r in results:
        r.pop("equivalent", None)
        if not r["killed"] and (name, r["id"]) in EQUIVALENT:
            r["equivalent"] = EQUIVALENT[name, r["id"]]
    killed = sum(r["killed"] for r in results)
    equivalent = sum("equivalent" in r for r in results)
    mod.update(
        mutants_run=len(results),
        killed=killed,
        score=round(killed / len(results), 4) if results else None,
        equivalent=equivalent,
        score_without_equivalent=(
            round(killed / (len(results) - equivalent), 4) if len(results) > equivalent else None
        ),
        survivors=[r for r in results if not r["killed"]],
    )
    return mod


def merge_reports(reports: list[dict]) -> dict:
    """One report from several runs, later ones first: a module run in full replaces the
    earlier run of it; a partial run (``--only``) replaces those mutants' results only."""
    out = {**reports[0], "modules": {}, "merged_from": [r["command"] for r in reports]}
    for rep in reports:
        for name, mod in rep["modules"].items():
            if mod.get("error") or not mod["results"]:
                out["modules"].setdefault(name, mod)
                continue
            old = out["modules"].get(name)
            if old is None or not old["results"] or len(mod["results"]) >= len(old["results"]):
                out["modules"][name] = mod
            else:
                by_id = {r["id"]: r for r in old["results"]}
                by_id.update({r["id"]: r for r in mod["results"]})
                old["results"] = [by_id[i] for i in sorted(by_id)]
    for name, mod in out["modules"].items():
        if mod["results"]:
            _summarise(name, mod)
    out["tables"] = [score_table(out)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append", choices=sorted(MODULES), help="repeatable")
    ap.add_argument("--sample", type=int, default=30, help="mutants per module (0: all)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument(
        "--timeout-cap", type=float, default=120.0, help="CPU seconds per mutant, at most"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--list", action="store_true", help="list the selected mutants and exit")
    ap.add_argument("--baseline", action="store_true", help="time the unmutated tests only")
    ap.add_argument("--show", metavar="MODULE:ID", help="print the diff of one mutant and exit")
    ap.add_argument("--only", action="append", default=[], metavar="MODULE:ID,ID",
                    help="run only these mutants (of the sample)")  # fmt: skip
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="merge these reports (later ones win) into --json and exit")  # fmt: skip
    args = ap.parse_args(argv)
    if args.merge:
        merged = merge_reports([json.loads(p.read_text()) for p in args.merge])
        if args.json:
            _write(args.json, merged)
        for name, r in merged["modules"].items():
            print(name, r["killed"], r["mutants_run"], r.get("equivalent"))
        return 0
    args.only = _parse_only(args.only)
    names = args.module or list(MODULES)
    if args.show:
        name, _, idx = args.show.rpartition(":")
        src = (ROOT / MODULES[name][0]).read_text()
        a, b = mutate(src, -1), mutate(src, int(idx))
        sys.stdout.writelines(difflib.unified_diff(a.splitlines(True), b.splitlines(True), n=2))
        return 0
    if args.list:
        for name in names:
            src = (ROOT / MODULES[name][0]).read_text()
            ms = enumerate_mutants(src)
            chosen = select(ms, args.sample, args.seed)
            print(f"{name}: {len(chosen)} of {len(ms)} mutants")
            for m in chosen:
                print(f"  {name}:{m.index} L{m.line} {m.description}")
        return 0

    os.environ.update(
        NUMBA_DISABLE_JIT="1",
        LBKIT_JIT="python",
        LBKIT_JIT_CACHE="0",
        CI="true",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONHASHSEED="0",
    )
    sys.dont_write_bytecode = True
    # What every mutant's tests import anyway: imported once here, inherited by each fork.
    import hypothesis  # noqa: F401
    import numba  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import scipy.optimize  # noqa: F401

    report: dict = {
        "command": "python tools/mutate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "sample_per_module": args.sample,
        "seed": args.seed,
        "env": (
            "NUMBA_DISABLE_JIT=1 LBKIT_JIT=python; Hypothesis: the 'ci' profile without shrinking"
        ),
        "modules": {},
    }
    with tempfile.TemporaryDirectory(prefix="lbkit-mutate-") as tmp:
        workdir = Path(tmp)
        _copy_project(workdir)
        for name in names:
            print(f"{name}:", flush=True)
            res = run_module(name, workdir, args)
            report["modules"][name] = res
            if args.json:
                _write(args.json, report)
            score = 100 * (res["score"] or 0)
            print(
                f"{name}: {res['killed']}/{res['mutants_run']} killed ({score:.0f}%) of "
                f"{res['mutants_total']}",
                flush=True,
            )
    total_run = sum(r["mutants_run"] for r in report["modules"].values())
    total_killed = sum(r["killed"] for r in report["modules"].values())
    report["total"] = {
        "mutants_run": total_run,
        "killed": total_killed,
        "score": round(total_killed / total_run, 4) if total_run else None,
    }
    for name, r in report["modules"].items():
        score = 100 * (r["score"] or 0)
        print(f"{name:20s} {r['killed']:4d}/{r['mutants_run']:<4d} {score:5.1f}%")
    if args.json:
        report["tables"] = [score_table(report)]
        _write(args.json, report)
    return 0


def score_table(report: dict, before: dict | None = None) -> dict:
    """The scores of a run as a ``{"title", "note", "columns", "rows"}`` table."""
    rows = []
    for name, r in report["modules"].items():
        rows.append(
            [
                name,
                r["mutants_total"],
                r["mutants_run"],
                r["killed"],
                r.get("equivalent", 0),
                None if r["score"] is None else round(100 * r["score"], 1),
                None
                if r.get("score_without_equivalent") is None
                else round(100 * r["score_without_equivalent"], 1),
            ]
        )
    return {
        "title": "Mutation scores",
        "note": (
            f"`{report['command']}`: {report['sample_per_module']} mutants sampled per module "
            f"(seed {report['seed']}), each run against the tests that cover its module with "
            "NUMBA_DISABLE_JIT=1 (the JIT-parity tests deselected); killed = a test failed, or "
            "the tests ran out of their CPU-time limit; equivalent = survivors no test can "
            "tell from the original, listed with the reason in tools/mutate.py (EQUIVALENT)."
        ),
        "columns": [
            "module",
            "mutants",
            "sampled",
            "killed",
            "equivalent",
            "score %",
            "score without equivalent %",
        ],
        "rows": rows,
    }


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
