"""Read expert-load matrices as serving engines dump them.

Formats, chosen by file suffix:

- ``.json``: an object with key ``"logical_count"`` (SGLang's expert-distribution dump and its
  ``--init-expert-location`` input) or a bare nested list. Shape ``[layers, experts]``, or
  ``[recordings, layers, experts]``, which is summed over the recordings.
- ``.npy``: a 2-D or 3-D array, same meaning. ``.npz``: the array under key ``logical_count``
  (or the only array in the file).
- ``.csv`` / ``.txt``: one layer per row, experts as comma-separated columns; a first line that
  is not numeric is taken as a header and skipped; ``#`` starts a comment line.

Loads must be finite, non-negative numbers (booleans are refused), and a 3-D dump's sum over its
recordings must stay finite in float64. Dense layers recorded as all zeros (DeepSeek-V3's first
three) can be dropped with ``drop_zero_layers=True``. Every error names the file (and the line,
for CSV): a missing file, a directory, a binary file, malformed content or a bad value.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array, check_int

__all__ = ["ExpertLoad", "logical_from_physical", "read_expert_load"]

FORMATS = ("json", "npy", "npz", "csv")


class ExpertLoad(NamedTuple):
    """An expert-load matrix read from a file.

    Attributes
    ----------
    weight : ndarray, shape (layers, experts)
        Load per logical expert (float64).
    layers : ndarray of int64, shape (layers,)
        Index of each kept row in the file (differs from ``arange`` when zero layers are dropped).
    source_format : str
        One of ``"json"``, ``"npy"``, ``"npz"``, ``"csv"``.
    num_layers_read : int
        Layers in the file, before any were dropped.
    """

    weight: np.ndarray
    layers: np.ndarray
    source_format: str
    num_layers_read: int


def read_expert_load(
    path: str | Path, /, *, format: str | None = None, drop_zero_layers: bool = False
) -> ExpertLoad:
    """Read an expert-load matrix from ``path``.

    Parameters
    ----------
    path : str or Path
        File to read.
    format : {"json", "npy", "npz", "csv"}, optional
        Override detection by suffix.
    drop_zero_layers : bool, default False
        Drop layers whose loads are all zero (dense layers in a per-layer dump).

    Returns
    -------
    ExpertLoad

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        ``path`` is not a regular file, unknown format, text that is not UTF-8, malformed
        content (the message names the line for CSV), wrong shape, negative, boolean or
        non-finite loads, a sum over recordings beyond the float64 range, or nothing left after
        dropping zero layers.
    TypeError
        The array does not hold real numbers (e.g. strings in a ``.npy``).

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> p = os.path.join(d, "load.json")
    >>> with open(p, "w") as f:
    ...     _ = f.write('{"logical_count": [[0, 0, 0], [3, 1, 2]]}')
    >>> read_expert_load(p, drop_zero_layers=True)
    ExpertLoad(weight=array([[3., 1., 2.]]), layers=array([1]), source_format='json',
               num_layers_read=2)
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"load file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file (a directory?)")
    fmt = format if format is not None else _detect(path)
    if fmt not in FORMATS:
        raise ValueError(f"format: must be one of {', '.join(FORMATS)}; got {fmt!r}")
    raw = {"json": _read_json, "npy": _read_npy, "npz": _read_npz, "csv": _read_csv}[fmt](path)
    arr = _as_loads(raw, path.name)
    if arr.ndim == 3:
        with np.errstate(over="ignore"):
            summed = arr.sum(axis=0)
        if not np.isfinite(summed).all():
            layer, expert = (int(i) for i in np.argwhere(~np.isfinite(summed))[0])
            raise ValueError(
                f"{path.name}: layer {layer}, expert {expert}: the sum over the "
                f"{arr.shape[0]} recordings exceeds the largest float64 "
                f"({np.finfo(np.float64).max:.4g})"
            )
        arr = summed
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(
            f"{path.name}: expected a [layers, experts] or [recordings, layers, experts] matrix, "
            f"got shape {np.shape(raw)}"
        )
    num_read = arr.shape[0]
    layers = np.arange(num_read, dtype=np.int64)
    if drop_zero_layers:
        keep = (arr > 0).any(axis=1)  # no sum: loads near the float64 limit would overflow
        if not keep.any():
            raise ValueError(f"{path.name}: every layer is all zeros; nothing to balance")
        arr, layers = arr[keep], layers[keep]
    return ExpertLoad(weight=arr, layers=layers, source_format=fmt, num_layers_read=num_read)


def _as_loads(raw: Any, name: str) -> np.ndarray:
    """``raw`` as float64 loads, refusing booleans and values beyond the float64 range."""
    dtype = getattr(raw, "dtype", None)
    if dtype is not None and dtype.kind == "b":
        raise ValueError(f"{name}: holds booleans (dtype bool), not loads")
    if dtype is not None and dtype.kind == "f" and dtype.itemsize > 8 and raw.size:
        big = np.abs(raw) > np.finfo(np.float64).max
        if (big & np.isfinite(raw)).any():
            index = tuple(int(i) for i in np.argwhere(big & np.isfinite(raw))[0])
            raise ValueError(
                f"{name}: load at index {index} exceeds the largest float64 "
                f"({np.finfo(np.float64).max:.4g})"
            )
    return as_float_array(raw, name, nonnegative=True)


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path.name}: not UTF-8 text ({exc.reason} at byte {exc.start}); a binary file?"
        ) from None


def _leaves_are_numbers(data: Any) -> bool:
    """Whether every leaf of the nested lists ``data`` is an int or a float (bool is not)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if type(item) is list:
            stack.extend(item)
        elif type(item) not in (int, float):
            return False
    return True


def _detect(path: Path) -> str:
    suffix = path.suffix.lower().lstrip(".")
    if suffix == "txt":
        return "csv"
    if suffix in FORMATS:
        return suffix
    raise ValueError(
        f"{path.name}: cannot tell the format from suffix {path.suffix!r}; "
        f"use one of .json, .npy, .npz, .csv or set the format explicitly"
    )


def _read_json(path: Path) -> Any:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"{path.name}: JSON nested too deeply") from None
    except ValueError:  # an integer of more than 4300 digits
        raise ValueError(f"{path.name}: a number with more than 4300 digits") from None
    if isinstance(data, dict):
        if "logical_count" not in data:
            raise ValueError(
                f"{path.name}: JSON object has no 'logical_count' key "
                f"(keys: {', '.join(sorted(map(str, data))[:5])})"
            )
        data = data["logical_count"]
    if not isinstance(data, list):
        raise ValueError(f"{path.name}: expected a nested list of loads")
    if not _leaves_are_numbers(data):
        raise ValueError(
            f"{path.name}: 'logical_count' holds something other than numbers (a string, a "
            f"boolean, null or an object)"
        )
    try:
        return np.array(data, dtype=np.float64)
    except OverflowError:
        raise ValueError(
            f"{path.name}: a load exceeds the largest float64 ({np.finfo(np.float64).max:.4g})"
        ) from None
    except (ValueError, TypeError):
        raise ValueError(
            f"{path.name}: 'logical_count' is not a rectangular array of numbers"
        ) from None


def _read_npy(path: Path) -> Any:
    try:
        with open(path, "rb") as fh:  # closed also when numpy cannot parse it
            out = np.load(fh, allow_pickle=False)
            if not isinstance(out, np.ndarray):  # an .npz archive under an .npy name
                out.close()
                raise ValueError("it holds an .npz archive")
            return out
    except (ValueError, EOFError, OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path.name}: not a readable .npy array ({str(exc)[:80]})") from None


def _read_npz(path: Path) -> Any:
    try:
        with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as data:
            keys = list(data.keys())
            if "logical_count" in keys:
                return data["logical_count"]
            if len(keys) == 1:
                return data[keys[0]]
    except (ValueError, EOFError, OSError, KeyError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path.name}: not a readable .npz archive ({str(exc)[:80]})") from None
    raise ValueError(f"{path.name}: .npz needs a 'logical_count' array or exactly one array")


def _read_csv(path: Path) -> Any:
    rows: list[list[float]] = []
    width = None
    header_allowed = True
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        fields = [f.strip() for f in text.split(",")]
        try:
            values = [float(f) for f in fields]
        except ValueError:
            if header_allowed:
                header_allowed = False
                continue  # a header line before the first row
            raise ValueError(
                f"{path.name}: line {lineno}: non-numeric field in {text[:60]!r}"
            ) from None
        header_allowed = False
        if any(not math.isfinite(v) for v in values):
            raise ValueError(f"{path.name}: line {lineno}: loads must be finite")
        if any(v < 0 for v in values):
            raise ValueError(f"{path.name}: line {lineno}: loads must be non-negative")
        if width is None:
            width = len(values)
        elif len(values) != width:
            raise ValueError(
                f"{path.name}: line {lineno}: expected {width} columns, got {len(values)}"
            )
        rows.append(values)
    if not rows:
        raise ValueError(f"{path.name}: no data rows")
    return np.array(rows, dtype=np.float64)


def logical_from_physical(physical_load: Any, phy2log: Any, /, *, num_experts: int) -> np.ndarray:
    """Sum per-slot (physical) loads into per-expert (logical) loads.

    Engines that already run a placement often record load per physical slot (vLLM's EPLB keeps
    a window of per-physical-expert token counts). Planning needs logical loads: the tokens of
    all replicas of an expert added up.

    Parameters
    ----------
    physical_load : array_like, shape (layers, slots) or (recordings, layers, slots)
        Tokens routed to each physical slot; a leading recordings axis is summed.
    phy2log : array_like of int, shape (layers, slots)
        Logical expert of each slot under the placement that produced the recording.
    num_experts : int
        Number of logical experts.

    Returns
    -------
    ndarray of float64, shape (layers, num_experts)

    Runtime complexity: O(recordings × layers × slots).

    Examples
    --------
    >>> logical_from_physical([[5, 3, 2, 4]], [[0, 1, 0, 2]], num_experts=3)
    array([[7., 3., 4.]])
    """
    load = as_float_array(physical_load, "physical_load", nonnegative=True)
    if load.ndim == 3:
        load = load.sum(axis=0)
    if load.ndim != 2:
        raise ValueError(
            f"physical_load: must have shape (layers, slots) or (recordings, layers, slots), "
            f"got {load.shape}"
        )
    num_experts = check_int(num_experts, "num_experts", min_value=1)
    p2l = as_int_array(phy2log, "phy2log", shape=load.shape, min_value=0, max_value=num_experts - 1)
    out = np.zeros((load.shape[0], num_experts))
    np.add.at(out, (np.arange(load.shape[0])[:, None], p2l), load)
    return out
