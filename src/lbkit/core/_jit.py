"""Optional-JIT shim: one place that decides how lbkit's kernels are compiled, cached and run.

Kernels are plain loops over numpy arrays. They are compiled with ``numba.njit(nogil=True)``,
never with ``fastmath`` or ``parallel`` (router paths must be deterministic and must not start
thread pools). Two decorators:

:func:`jit`
    A numba kernel, compiled on its first call (router kernels: small, called per request).
:func:`entry`
    The top-level kernel of a slow planner (EPLB), called from Python only. Compiling one takes
    a minute or more (numba compiles every kernel it reaches), so its first call in a process
    runs the same code as plain Python instead, which takes about a second, and a compiled copy
    is used as soon as one exists, in memory or in the disk cache. The two give bit-identical
    results (no fastmath: every float operation is the same IEEE operation in the same order).

**When an entry compiles** (``LBKIT_JIT``, read at each call):

- ``"background"`` (default): while no compiled copy exists, the entry runs as Python, and
  the first such call then starts ``lbkit._warmup.main(["--background", PACKAGE])``: a
  separate, low-priority process that compiles the package's kernels into the disk cache and
  exits. Later calls load them from there. It is a process, not a thread, so it never holds
  this process's GIL or compiler lock (a fork in the meantime is safe), and it needs nothing
  of this process once started. Without a disk cache nothing is started.
- ``"inline"``: the first call compiles (numba's own behaviour); the test suite uses it.
- ``"python"``: entries compile only in :func:`lbkit.warmup`.

**Disk cache** (on by default; ``LBKIT_JIT_CACHE=0`` turns it off): compiled kernels are saved
in ``LBKIT_CACHE_DIR``, else ``$NUMBA_CACHE_DIR/lbkit``, else the user cache directory
(``$XDG_CACHE_HOME/lbkit`` or ``~/.cache/lbkit``; ``~/Library/Caches/lbkit`` on macOS), in a
sub-directory named after a hash of lbkit's source, so that no process ever loads a kernel
compiled from other source (numba itself checks only the file a kernel is defined in, not the
files of the kernels it calls); older sub-directories beyond the newest four are removed.
Safety under multiprocessing (numba issue 4807: concurrent writers of one function's cache can
pair an index entry with another signature's code): every save holds an exclusive ``flock`` on
``write.lock`` in the cache directory, so index updates are serialised and each one re-reads the
index; numba writes every file to a temporary name and renames it (atomic), and it writes the
index before the data, so a reader sees either no entry, or an entry whose data is complete or
missing (then it compiles or runs as Python). Background compilers also hold ``compile.lock``
for their whole run, so several processes starting at once compile once. Where ``fcntl`` is
missing (Windows) the disk cache is off.

With ``NUMBA_DISABLE_JIT=1`` numba returns the Python function itself, which is how the test
suite checks JIT parity and measures coverage. If numba cannot be imported at all, both
decorators degrade to plain Python.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

try:  # numba is a core dependency; the fallback keeps lbkit importable on exotic platforms.
    import numba as _numba
except ImportError:  # pragma: no cover - exercised only where numba is absent
    _numba = None

try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows
    _fcntl = None

__all__ = [
    "HAVE_NUMBA",
    "JIT_MODES",
    "Entry",
    "KernelEvent",
    "cache_dir",
    "entry",
    "file_lock",
    "jit",
    "jit_disabled",
    "jit_mode",
    "record_kernels",
]

HAVE_NUMBA = _numba is not None

#: Values of ``LBKIT_JIT`` (module docstring); the first is the default.
JIT_MODES = ("background", "inline", "python")

#: Sub-directories (one per lbkit source version) kept in the cache root.
_KEEP_VERSIONS = 4

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def jit_disabled() -> bool:
    """Whether kernels run as Python throughout (``NUMBA_DISABLE_JIT=1``, or no numba)."""
    return _numba is None or bool(_numba.config.DISABLE_JIT)


def jit_mode() -> str:
    """The value of ``LBKIT_JIT`` (``"background"`` when unset).

    Raises
    ------
    ValueError
        If ``LBKIT_JIT`` is set to anything but one of :data:`JIT_MODES`.

    Examples
    --------
    >>> jit_mode() in JIT_MODES
    True
    """
    mode = os.environ.get("LBKIT_JIT", "") or JIT_MODES[0]
    if mode not in JIT_MODES:
        raise ValueError(f"LBKIT_JIT: must be one of {JIT_MODES}, got {mode!r}")
    return mode


# --------------------------------------------------------------------------------------------
# Disk cache
# --------------------------------------------------------------------------------------------

_CACHE_ROOT: dict[str, str | None] = {}


def _user_cache_root() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "lbkit"
    if os.name == "nt":  # pragma: no cover
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "lbkit" / "Cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lbkit"


def _source_hash() -> str:
    """Hash of every Python source file of lbkit (path and content)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _prune(root: Path, keep: Path) -> None:
    versions = [p for p in root.glob("jit-*") if p.is_dir() and p != keep]
    versions.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in versions[_KEEP_VERSIONS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def cache_dir() -> str | None:
    """Directory of lbkit's compiled kernels, or ``None`` when the disk cache is off.

    See the module docstring for how it is chosen. Resolved once per process and environment.

    Examples
    --------
    >>> path = cache_dir()
    >>> path is None or "jit-" in path
    True
    """
    key = "|".join(
        os.environ.get(k, "") for k in ("LBKIT_JIT_CACHE", "LBKIT_CACHE_DIR", "NUMBA_CACHE_DIR")
    )
    if key in _CACHE_ROOT:
        return _CACHE_ROOT[key]
    path: str | None = None
    if os.environ.get("LBKIT_JIT_CACHE", "1") != "0" and _fcntl is not None and HAVE_NUMBA:
        if os.environ.get("LBKIT_CACHE_DIR"):
            root = Path(os.environ["LBKIT_CACHE_DIR"])
        elif os.environ.get("NUMBA_CACHE_DIR"):
            root = Path(os.environ["NUMBA_CACHE_DIR"]) / "lbkit"
        else:
            root = _user_cache_root()
        version = root / f"jit-{_source_hash()}"
        try:
            version.mkdir(parents=True, exist_ok=True)
            os.utime(version)
            _prune(root, version)
            path = str(version)
        except OSError:  # read-only home, full disk: run without a disk cache
            path = None
    _CACHE_ROOT[key] = path
    return path


@contextlib.contextmanager
def file_lock(name: str, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``name`` in :func:`cache_dir`; yields whether it is held.

    Yields ``False`` without waiting when the lock is taken and ``blocking`` is false, or when
    there is no disk cache.

    Examples
    --------
    >>> with file_lock("example.lock") as held:
    ...     held in (True, False)
    True
    """
    root = cache_dir()
    if root is None or _fcntl is None:
        yield False
        return
    fd = os.open(os.path.join(root, name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            _fcntl.flock(fd, _fcntl.LOCK_EX | (0 if blocking else _fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            _fcntl.flock(fd, _fcntl.LOCK_UN)
    finally:
        os.close(fd)


class KernelEvent(NamedTuple):
    """One kernel made ready: compiled, or loaded from the disk cache."""

    kernel: str  # module.qualname
    how: str  # "compiled" or "cache"
    seconds: float  # wall clock (a compile includes the kernels it compiled for itself)
    nested: bool  # made ready while compiling another kernel


_RECORDERS: list[list[KernelEvent]] = []
_DEPTH = [0]


@contextlib.contextmanager
def record_kernels() -> Iterator[list[KernelEvent]]:
    """Collect a :class:`KernelEvent` for every lbkit kernel compiled or loaded meanwhile.

    Examples
    --------
    >>> import numpy as np
    >>> with record_kernels() as events:
    ...     pass
    >>> events
    []
    """
    events: list[KernelEvent] = []
    _RECORDERS.append(events)
    try:
        yield events
    finally:
        _RECORDERS.remove(events)


def _record(func: Any, how: str, seconds: float, nested: bool) -> None:
    if _RECORDERS and (getattr(func, "__module__", None) or "").startswith("lbkit"):
        event = KernelEvent(f"{func.__module__}.{func.__qualname__}", how, seconds, nested)
        for events in _RECORDERS:
            events.append(event)


if HAVE_NUMBA:
    from numba.core import caching as _caching
    from numba.core import event as _event

    class _Locator(_caching._SourceFileBackedLocatorMixin, _caching._CacheLocator):
        """Cache files of a kernel under :func:`cache_dir`, by module path."""

        def __init__(self, py_func: Any, py_file: str) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            rel = Path(py_file).resolve().relative_to(_PACKAGE_ROOT).with_suffix("")
            self._cache_path = os.path.join(cache_dir() or "", *rel.parts)

        def get_cache_path(self) -> str:
            return self._cache_path

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            if cache_dir() is None:
                return None
            try:
                Path(py_file).resolve().relative_to(_PACKAGE_ROOT)
            except ValueError:  # not a file of lbkit (e.g. a doctest)
                return None
            return super().from_function(py_func, py_file)

    class _CacheImpl(_caching.CompileResultCacheImpl):
        _locator_classes = [_Locator]  # noqa: RUF012 - numba's own class attribute

    class _FunctionCache(_caching.FunctionCache):
        _impl_class = _CacheImpl

        def load_overload(self, sig: Any, target_context: Any) -> Any:
            start = time.perf_counter()
            cres = super().load_overload(sig, target_context)
            if cres is not None:
                _record(self._py_func, "cache", time.perf_counter() - start, _DEPTH[0] > 0)
            return cres

        def save_overload(self, sig: Any, data: Any) -> None:
            with file_lock("write.lock") as held:
                if held:
                    super().save_overload(sig, data)

    class _LazyCache(_caching.NullCache):
        """numba's cache slot of a dispatcher: the disk cache, made on first use (importing a
        kernel module stays cheap), or nothing when the disk cache is off."""

        def __init__(self, py_func: Any) -> None:
            self._py_func = py_func
            self._real: Any = None
            self._key: str | None = None

        def _cache(self) -> Any:
            root = cache_dir()
            if root is None:
                return None
            if self._key != root:
                self._key = root
                try:
                    self._real = _FunctionCache(self._py_func)
                except RuntimeError:  # no locator: not a file of lbkit
                    self._real = None
            return self._real

        @property
        def cache_path(self) -> str:
            real = self._cache()
            return real.cache_path if real is not None else ""

        def load_overload(self, sig: Any, target_context: Any) -> Any:
            real = self._cache()
            return None if real is None else real.load_overload(sig, target_context)

        def save_overload(self, sig: Any, data: Any) -> None:
            real = self._cache()
            if real is not None:
                real.save_overload(sig, data)

    class _CompileListener(_event.Listener):
        def __init__(self) -> None:
            self._start: list[float] = []

        def on_start(self, event: Any) -> None:
            self._start.append(time.perf_counter())
            _DEPTH[0] += 1

        def on_end(self, event: Any) -> None:
            _DEPTH[0] -= 1
            seconds = time.perf_counter() - self._start.pop()
            _record(event.data["dispatcher"].py_func, "compiled", seconds, _DEPTH[0] > 0)

    _event.register("numba:compile", _CompileListener())


# --------------------------------------------------------------------------------------------
# Decorators
# --------------------------------------------------------------------------------------------

#: id(dispatcher) -> (dispatcher, Python function) of every kernel made by jit().
_KERNELS: dict[int, tuple[Any, Any]] = {}
_TWINS: dict[int, Any] = {}
_NAMESPACES: dict[int, dict[str, Any]] = {}


def jit(func: F) -> F:
    """Compile ``func`` with numba in lbkit's standard mode (``nogil``, no fastmath).

    The compiled function keeps the original in ``.py_func`` (numba's convention; the fallback
    sets it too), so tests can compare the jitted kernel with the plain Python one. Compiled
    code goes to the disk cache (module docstring).

    Examples
    --------
    >>> import numpy as np
    >>> @jit
    ... def total(x):
    ...     s = 0.0
    ...     for v in x:
    ...         s += v
    ...     return s
    >>> float(total(np.arange(4.0)))
    6.0
    >>> float(total.py_func(np.arange(4.0)))
    6.0
    """
    if _numba is None:  # pragma: no cover
        func.py_func = func  # type: ignore[attr-defined]
        return func
    compiled = _numba.njit(nogil=True, cache=False, fastmath=False)(func)
    if not hasattr(compiled, "py_func"):  # NUMBA_DISABLE_JIT=1 returns the function itself
        compiled.py_func = func
        return compiled
    compiled._cache = _LazyCache(func)
    _KERNELS[id(compiled)] = (compiled, func)
    return compiled


def _namespace(globals_: dict[str, Any]) -> dict[str, Any]:
    """A copy of a kernel module's globals with every kernel replaced by its Python twin."""
    ns = _NAMESPACES.get(id(globals_))
    if ns is None:
        ns = dict(globals_)
        _NAMESPACES[id(globals_)] = ns  # before filling it: kernels call each other
        for name, value in globals_.items():
            if id(value) in _KERNELS or isinstance(value, Entry):
                ns[name] = _twin(value)
    return ns


def _twin(kernel: Any) -> Any:
    """``kernel`` as plain Python that calls the Python twins of the kernels it calls."""
    func = kernel.py_func if isinstance(kernel, Entry) else _KERNELS[id(kernel)][1]
    twin = _TWINS.get(id(func))
    if twin is None:
        twin = types.FunctionType(
            func.__code__,
            _namespace(func.__globals__),
            func.__name__,
            func.__defaults__,
            func.__closure__,
        )
        twin.__qualname__ = func.__qualname__
        twin.__doc__ = func.__doc__
        _TWINS[id(func)] = twin
    return twin


_BACKGROUND_STARTED: set[str] = set()

#: What the background process runs (``-m lbkit._warmup`` would import the module twice).
_BACKGROUND_MAIN = "import sys, lbkit._warmup as w; sys.exit(w.main(sys.argv[1:]))"


def _start_background_compile(package: str) -> None:
    """Start the background compiler of ``package`` once per package and process (module
    docstring); does nothing without a disk cache, a Python executable or ``os.posix_spawn``
    (the disk cache needs ``fcntl``, so platforms without one have neither)."""
    if package in _BACKGROUND_STARTED:
        return
    _BACKGROUND_STARTED.add(package)
    root = cache_dir()
    if root is None or not sys.executable or not hasattr(os, "posix_spawn"):
        return
    env = dict(os.environ, LBKIT_JIT="inline", LBKIT_CACHE_DIR=str(Path(root).parent))
    env.pop("LBKIT_JIT_CACHE", None)
    _reap_background()
    argv = [sys.executable, "-c", _BACKGROUND_MAIN, "--background", package]
    # Not subprocess.Popen: a Popen object dropped while its child runs warns (ResourceWarning,
    # an error under ``-W error``); a spawned pid is reaped later.
    actions = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    with contextlib.suppress(OSError):
        _BACKGROUND_PIDS.append(
            os.posix_spawn(sys.executable, argv, env, file_actions=actions, setsid=True)
        )


#: Background compilers started by this process, reaped (waited for) once they exit.
_BACKGROUND_PIDS: list[int] = []


def _reap_background() -> None:
    """Collect the exit status of background compilers that have finished (no zombies)."""
    for pid in list(_BACKGROUND_PIDS):
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
        _BACKGROUND_PIDS.remove(pid)


class Entry:
    """A top-level kernel that runs compiled when it can and as Python otherwise.

    See :func:`entry`. ``dispatcher`` is the numba kernel, ``py_func`` the original function
    (numba's convention), :attr:`interpreted` the function as plain Python throughout.
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        self.py_func = func
        self.dispatcher = jit(func)
        self.__name__ = func.__name__
        self.__qualname__ = func.__qualname__
        self.__module__ = func.__module__
        self.__doc__ = func.__doc__
        self.__wrapped__ = func
        self._checked: set[tuple[Any, ...]] = set()
        self._ready: set[tuple[Any, ...]] = set()  # _quick_key of arguments known compiled

    @property
    def interpreted(self) -> Callable[..., Any]:
        """The function as plain Python: it and every kernel it calls run uncompiled."""
        if jit_disabled():
            return self.py_func
        return _twin(self)

    def signature(self, *args: Any) -> tuple[Any, ...]:
        """numba types of ``args``, the key of a compiled copy."""
        return tuple(self.dispatcher.typeof_pyval(a) for a in args)

    def is_compiled(self, *args: Any) -> bool:
        """Whether a compiled copy for the types of ``args`` is loaded (or loads now from the
        disk cache). Never compiles."""
        if jit_disabled():
            return False
        sig = self.signature(*args)
        if sig in self.dispatcher.overloads:
            return True
        if sig in self._checked and not _cache_changed(self):
            return False
        self._checked.add(sig)
        from numba.core.compiler_lock import global_compiler_lock

        disp = self.dispatcher
        with global_compiler_lock:
            cres = disp._cache.load_overload(sig, disp.targetctx)
            if cres is None:
                return False
            # As numba's Dispatcher.compile does for a cache hit.
            disp._cache_hits[sig] += 1
            if not cres.objectmode:
                disp.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
            disp.add_overload(cres)
        return True

    def __call__(self, *args: Any) -> Any:
        if jit_disabled():
            return self.py_func(*args)
        key = _quick_key(args)
        if key in self._ready:
            return self.dispatcher(*args)
        if self.is_compiled(*args):
            if key is not None:
                self._ready.add(key)
            return self.dispatcher(*args)
        mode = jit_mode()
        if mode == "inline":
            return self.dispatcher(*args)
        _reap_background()
        result = self.interpreted(*args)
        if mode == "background":  # after the call, so that the compiler does not slow it down
            _start_background_compile(self.__module__.split(".")[1])
        return result

    def __repr__(self) -> str:
        return f"<lbkit entry kernel {self.__module__}.{self.__qualname__}>"


_INDEX_STAMPS: dict[int, float] = {}


def _quick_key(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What numba's type of ``args`` depends on, cheaply (``None``: not known here)."""
    key: list[Any] = []
    for a in args:
        flags = getattr(a, "flags", None)
        if flags is not None and hasattr(a, "dtype"):
            key.append(
                (
                    a.dtype.str,
                    a.ndim,
                    flags.c_contiguous,
                    flags.f_contiguous,
                    flags.writeable,
                    flags.aligned,
                )
            )
        elif type(a) in (int, float, bool):
            key.append(type(a))
        else:
            return None
    return tuple(key)


def _cache_changed(kernel: Entry) -> bool:
    """Has the cache index of ``kernel`` changed since it was last looked at?"""
    real = kernel.dispatcher._cache._cache()
    if real is None:
        return False
    try:
        stamp = os.stat(real._cache_file._index_path).st_mtime_ns
    except OSError:
        stamp = -1.0
    changed = _INDEX_STAMPS.get(id(kernel)) != stamp
    _INDEX_STAMPS[id(kernel)] = stamp
    return changed


def entry(func: Callable[..., Any]) -> Entry:
    """Make ``func`` a top-level kernel (:class:`Entry`): compiled when a compiled copy exists,
    plain Python otherwise (module docstring). Only Python calls it; kernels call :func:`jit`
    kernels.

    Examples
    --------
    >>> import numpy as np
    >>> @entry
    ... def total(x):
    ...     s = 0.0
    ...     for v in x:
    ...         s += v
    ...     return s
    >>> float(total.interpreted(np.arange(4.0)))
    6.0
    """
    return Entry(func)
