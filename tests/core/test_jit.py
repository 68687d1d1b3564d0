"""The JIT shim: entry kernels run as Python until compiled, the disk cache, its locks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lbkit.core import _jit

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(code: str, env: dict[str, str]) -> str:
    full = dict(os.environ, PYTHONPATH=SRC, **env)
    full.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return out.stdout.strip().splitlines()[-1]


def test_jit_mode_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("LBKIT_JIT", "sometimes")
    with pytest.raises(ValueError, match="LBKIT_JIT"):
        _jit.jit_mode()
    monkeypatch.delenv("LBKIT_JIT")
    assert _jit.jit_mode() == "background"


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LBKIT_JIT_CACHE", "0")
    assert _jit.cache_dir() is None
    monkeypatch.delenv("LBKIT_JIT_CACHE")
    monkeypatch.setenv("LBKIT_CACHE_DIR", str(tmp_path / "a"))
    path = _jit.cache_dir()
    if path is None:  # no fcntl or no numba: the disk cache is off
        return
    assert Path(path).parent == tmp_path / "a" and Path(path).name.startswith("jit-")
    monkeypatch.delenv("LBKIT_CACHE_DIR")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "b"))
    assert Path(_jit.cache_dir()).parent == tmp_path / "b" / "lbkit"


def test_old_source_versions_are_pruned(monkeypatch, tmp_path):
    for k in range(6):
        old = tmp_path / f"jit-old{k}"
        old.mkdir()
        os.utime(old, (1_000_000 + k, 1_000_000 + k))
    monkeypatch.setenv("LBKIT_CACHE_DIR", str(tmp_path))
    path = _jit.cache_dir()
    if path is None:
        return
    left = sorted(p.name for p in tmp_path.iterdir())
    assert Path(path).name in left and len(left) == _jit._KEEP_VERSIONS
    assert "jit-old5" in left and "jit-old0" not in left


def test_file_lock_is_exclusive_across_processes(monkeypatch, tmp_path):
    monkeypatch.setenv("LBKIT_CACHE_DIR", str(tmp_path))
    if _jit.cache_dir() is None:
        return
    code = """
        from lbkit.core import _jit
        with _jit.file_lock("t.lock", blocking=False) as held:
            print(held)
    """
    with _jit.file_lock("t.lock") as held:
        assert held
        assert _run(code, {"LBKIT_CACHE_DIR": str(tmp_path)}) == "False"
    assert _run(code, {"LBKIT_CACHE_DIR": str(tmp_path)}) == "True"


@_jit.entry
def _total_of_squares(x):
    s = 0.0
    for v in x:
        s += _square(v)
    return s


@_jit.jit
def _square(v):
    return v * v


def test_entry_runs_as_python_until_compiled(monkeypatch):
    if _jit.jit_disabled():
        return
    x = np.arange(5.0)
    twin = _total_of_squares.interpreted
    assert twin is not _total_of_squares.py_func
    # The twin calls the twin of _square, not the numba dispatcher.
    assert twin.__globals__["_square"] is not _square
    assert twin.__globals__["_square"].__code__ is _square.py_func.__code__
    monkeypatch.setenv("LBKIT_JIT", "python")
    monkeypatch.setenv("LBKIT_JIT_CACHE", "0")
    assert _total_of_squares(x) == 30.0
    assert not _total_of_squares.dispatcher.signatures
    monkeypatch.setenv("LBKIT_JIT", "inline")
    assert _total_of_squares(x) == 30.0
    assert _total_of_squares.is_compiled(x)


def test_compiled_kernels_are_loaded_from_the_disk_cache(tmp_path):
    code = """
        import json, numpy as np
        from lbkit.core import _jit
        from lbkit.eplb import _primitives
        with _jit.record_kernels() as events:
            _primitives.apportion_minmax(np.array([3.0, 1.0]), 3, np.empty(2, dtype=np.int64))
        print(json.dumps([[e.kernel, e.how] for e in events if not e.nested]))
    """
    env = {"LBKIT_CACHE_DIR": str(tmp_path), "LBKIT_JIT": "inline"}
    first = json.loads(_run(code, env))
    if not first:  # no disk cache on this platform
        return
    assert first == [["lbkit.eplb._primitives.apportion_minmax", "compiled"]]
    assert json.loads(_run(code, env)) == [["lbkit.eplb._primitives.apportion_minmax", "cache"]]


def test_background_compiler_exits_at_once_for_a_package_without_kernels(tmp_path):
    code = """
        import lbkit._warmup as w
        print(w.main(["--background", "core"]))
    """
    assert _run(code, {"LBKIT_CACHE_DIR": str(tmp_path)}) == "0"


def test_concurrent_saves_of_several_signatures_stay_consistent(tmp_path):
    """numba issue 4807: processes saving different signatures of one kernel at once must not
    pair an index entry with another signature's code (the saves hold write.lock)."""
    compile_one = """
        import sys, numpy as np
        from lbkit.eplb import _primitives
        dtype = {"f8": np.float64, "f4": np.float32, "i8": np.int64}[sys.argv[1]]
        print(_primitives.argmax(np.array([1, 5, 3], dtype=dtype)))
    """
    env = dict(os.environ, PYTHONPATH=SRC, LBKIT_CACHE_DIR=str(tmp_path), LBKIT_JIT="inline")
    env.pop("NUMBA_DISABLE_JIT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(compile_one), kind],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for kind in ("f8", "f4", "i8")
    ]
    assert [p.communicate(timeout=600)[0].strip() for p in procs] == ["1", "1", "1"]
    assert all(p.returncode == 0 for p in procs)
    check = """
        import json, numpy as np
        from lbkit.core import _jit
        from lbkit.eplb import _primitives
        out = []
        with _jit.record_kernels() as events:
            for dtype in (np.float64, np.float32, np.int64):
                out.append(int(_primitives.argmax(np.array([2, 0, 7, 1], dtype=dtype))))
        print(json.dumps([out, sorted({e.how for e in events})]))
    """
    got = json.loads(_run(check, {"LBKIT_CACHE_DIR": str(tmp_path), "LBKIT_JIT": "inline"}))
    if _jit.cache_dir() is None:
        return
    assert got == [[2, 2, 2], ["cache"]]


def test_a_save_waits_for_the_write_lock(monkeypatch, tmp_path):
    """While another process holds write.lock, a compile finishes but its save waits."""
    monkeypatch.setenv("LBKIT_CACHE_DIR", str(tmp_path))
    if _jit.cache_dir() is None:
        return
    code = """
        import numpy as np
        from lbkit.eplb import _primitives
        print(_primitives.argmax(np.array([1.0, 5.0, 3.0])))
    """
    env = dict(os.environ, PYTHONPATH=SRC, LBKIT_CACHE_DIR=str(tmp_path), LBKIT_JIT="inline")
    env.pop("NUMBA_DISABLE_JIT", None)
    with _jit.file_lock("write.lock") as held:
        assert held
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE
        )
        # Compiling argmax takes a second or two; the save must then wait for the lock. (Under
        # a very heavy load the compile alone may outlast the wait, and this checks nothing.)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=8)
        assert not list(Path(_jit.cache_dir()).rglob("*.nbi"))
    assert proc.communicate(timeout=600)[0].strip() == b"1"
    assert list(Path(_jit.cache_dir()).rglob("*argmax*.nbi"))


def test_starting_the_background_compiler_warns_nothing_under_w_error(tmp_path):
    """A router running with ``-W error`` must not see a ResourceWarning for the compiler it
    started (a dropped ``subprocess.Popen`` whose child still runs warns)."""
    code = """
        import os, signal, gc
        import numpy as np
        import lbkit.eplb as E
        from lbkit.core import _jit
        E.rebalance_experts(np.arange(1.0, 9.0).reshape(1, 8), 8, 1, 1, 2)
        gc.collect()
        pids = list(_jit._BACKGROUND_PIDS)
        for pid in pids:  # the test needs no compiled kernels: stop the compiler
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        print(len(pids))
    """
    full = dict(os.environ, PYTHONPATH=SRC, LBKIT_CACHE_DIR=str(tmp_path), LBKIT_JIT="background")
    full.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert out.stderr == ""
