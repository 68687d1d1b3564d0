"""Read expert-load matrices as serving engines dump them.

Formats, chosen by file suffix:

- ``.json``: an object with key ``"logical_count"`` (SGLang's expert-distribution dump and its
  ``--init-expert-location`` input) or a bare nested list. Shape ``[layers, experts]``, or
  ``[recordings, layers, experts]``, which is summed over the recordings.
- ``.npy``: a 2-D or 3-D array, same meaning. ``.npz``: the array under key ``logical_count``
  (or the only array in the file).
- ``.csv`` / ``.txt``: one layer per row, experts as comma-separated columns; a first line that
  is not numeric is taken as a header and skipped; ``#`` starts a comment line.

Loads must be finite and non-negative. Dense layers recorded as all zeros (DeepSeek-V3's first
three) can be dropped with ``drop_zero_layers=True``.
"""

from __future__ import annotations

import json
import math
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
        Unknown format, malformed content (the message names the line for CSV), wrong shape,
        negative or non-finite loads, or nothing left after dropping zero layers.

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
    if not path.is_file():
        raise FileNotFoundError(f"load file not found: {path}")
    fmt = format if format is not None else _detect(path)
    if fmt not in FORMATS:
        raise ValueError(f"format: must be one of {', '.join(FORMATS)}; got {fmt!r}")
    raw = {"json": _read_json, "npy": _read_npy, "npz": _read_npz, "csv": _read_csv}[fmt](path)
    arr = as_float_array(raw, f"{path.name}", nonnegative=True)
    if arr.ndim == 3:
        arr = arr.sum(axis=0)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(
            f"{path.name}: expected a [layers, experts] or [recordings, layers, experts] matrix, "
            f"got shape {np.shape(raw)}"
        )
    num_read = arr.shape[0]
    layers = np.arange(num_read, dtype=np.int64)
    if drop_zero_layers:
        keep = arr.sum(axis=1) > 0
        if not keep.any():
            raise ValueError(f"{path.name}: every layer is all zeros; nothing to balance")
        arr, layers = arr[keep], layers[keep]
    return ExpertLoad(weight=arr, layers=layers, source_format=fmt, num_layers_read=num_read)


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
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
    if isinstance(data, dict):
        if "logical_count" not in data:
            raise ValueError(
                f"{path.name}: JSON object has no 'logical_count' key "
                f"(keys: {', '.join(sorted(map(str, data))[:5])})"
            )
        data = data["logical_count"]
    if not isinstance(data, list):
        raise ValueError(f"{path.name}: expected a nested list of loads")
    try:
        return np.array(data, dtype=np.float64)
    except (ValueError, TypeError):
        raise ValueError(
            f"{path.name}: 'logical_count' is not a rectangular array of numbers"
        ) from None


def _read_npy(path: Path) -> Any:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise ValueError(f"{path.name}: not a readable .npy array ({exc})") from None


def _read_npz(path: Path) -> Any:
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = list(data.keys())
            if "logical_count" in keys:
                return data["logical_count"]
            if len(keys) == 1:
                return data[keys[0]]
    except ValueError as exc:
        raise ValueError(f"{path.name}: not a readable .npz archive ({exc})") from None
    raise ValueError(f"{path.name}: .npz needs a 'logical_count' array or exactly one array")


def _read_csv(path: Path) -> Any:
    rows: list[list[float]] = []
    width = None
    header_allowed = True
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
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
