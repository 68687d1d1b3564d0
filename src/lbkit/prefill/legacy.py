"""The keyword options of :class:`~lbkit.prefill.PrefillBalancer` before the option objects.

``PrefillBalancer(..., edges=..., wake_penalty_s=...)`` still works: :func:`from_keywords` maps
the old keywords onto :class:`RankChoice`, :class:`Buckets` and :class:`Rounds` and warns with a
``DeprecationWarning`` naming the replacement of each. As before, a least-load refinement
(``sample``, ``wake_penalty_s``, ``fill_holes``) given without ``rank_rule`` selects
``rule="least_load"``, and ``context_parallel=True`` selects ``rule="engine_mean"``; the warning
says so. Fields the old keywords leave out take the objects' defaults (``cold_start_s=5`` and
``max_drain_s=30`` since the option objects; pass ``None`` for the old behaviour).

Examples
--------
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     choice, buckets, rounds = from_keywords({"wake_penalty_s": 0.05}, None, None, None)
>>> choice.rule, choice.wake_penalty_s
('least_load', 0.05)
>>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
PrefillBalancer: keyword options are deprecated; wake_penalty_s: pass
choice=RankChoice(rule='least_load', wake_penalty_s=...) (wake_penalty_s selects
rule='least_load', as before)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lbkit.prefill.options import Buckets, RankChoice, Rounds

__all__ = ["BUCKET_KEYWORDS", "CHOICE_KEYWORDS", "ROUND_KEYWORDS", "from_keywords"]

#: Old keywords that are now fields of :class:`RankChoice` (``rank_rule`` is ``rule``;
#: ``context_parallel=True`` is ``rule="engine_mean"``).
CHOICE_KEYWORDS = (
    "rank_rule", "context_parallel", "step_budget_s", "growth_weight",
    "idle_growth_weight", "sample",
    "wake_penalty_s", "fill_holes", "spill_ratio",
)  # fmt: skip
#: Old keywords that are now fields of :class:`Buckets`.
BUCKET_KEYWORDS = ("edges", "min_engines", "max_engines", "initial_engines")
#: Old keywords that are now fields of :class:`Rounds`.
ROUND_KEYWORDS = (
    "round_s", "ema_alpha", "deadband", "max_moves", "min_dwell_s", "method", "cold_start_s",
    "max_drain_s",
)  # fmt: skip
_REFINEMENTS = ("sample", "wake_penalty_s", "fill_holes")


def _rule_of(kw: Mapping[str, Any]) -> tuple[str, str]:
    """The rule the old keywords select, and a note when they select it implicitly."""
    cp = kw.get("context_parallel", False)
    if not isinstance(cp, bool):
        raise TypeError(f"context_parallel: must be a bool, got {type(cp).__name__}")
    given = kw.get("rank_rule")
    if cp:
        if given not in (None, "least_load"):
            raise ValueError(
                f"context_parallel: selects rule='engine_mean', contradicting rank_rule={given!r}"
            )
        return "engine_mean", " (context_parallel=True is rule='engine_mean')"
    if given is not None:
        return given, ""
    refined = [k for k in _REFINEMENTS if kw.get(k) is not None and kw.get(k) is not False]
    if refined:
        verb = "selects" if len(refined) == 1 else "select"
        return "least_load", f" ({', '.join(refined)} {verb} rule='least_load', as before)"
    return "lockstep", ""


def _choice(kw: Mapping[str, Any]) -> tuple[RankChoice, str]:
    rule, note = _rule_of(kw)
    fields = {k: kw[k] for k in CHOICE_KEYWORDS[2:] if k in kw}
    return RankChoice(rule=rule, **fields), note


def from_keywords(
    legacy: Mapping[str, Any],
    choice: RankChoice | None,
    buckets: Buckets | None,
    rounds: Rounds | None,
    *,
    warn: bool = True,
    stacklevel: int = 3,
) -> tuple[RankChoice, Buckets, Rounds]:
    """Merge old keyword options into the option objects.

    Parameters
    ----------
    legacy : mapping
        Old keyword options (see ``CHOICE_KEYWORDS``, ``BUCKET_KEYWORDS``, ``ROUND_KEYWORDS``).
    choice, buckets, rounds : option object or None
        The objects given alongside (None: not given, the defaults).
    warn : bool, default True
        Warn with a ``DeprecationWarning`` naming the replacement of each keyword used.

    Returns
    -------
    tuple of RankChoice, Buckets, Rounds

    Raises
    ------
    TypeError
        An unknown keyword, or an old keyword mixed with the object that replaces it (e.g.
        ``sample`` with ``choice=``).
    ValueError
        Contradictory keywords (as the option objects reject them).
    """
    groups = (
        ("choice", RankChoice, CHOICE_KEYWORDS, choice),
        ("buckets", Buckets, BUCKET_KEYWORDS, buckets),
        ("rounds", Rounds, ROUND_KEYWORDS, rounds),
    )
    known = {k for _, _, keys, _ in groups for k in keys}
    unknown = sorted(set(legacy) - known)
    if unknown:
        raise TypeError(
            f"PrefillBalancer: unexpected keyword argument {unknown[0]!r} (options are "
            "choice=RankChoice(...), buckets=Buckets(...), rounds=Rounds(...))"
        )
    out: dict[str, Any] = {}
    hints: list[str] = []
    for arg, cls, keys, given in groups:
        used = [k for k in keys if k in legacy]
        if not used:
            out[arg] = cls() if given is None else given
            continue
        if given is not None:
            raise TypeError(
                f"{used[0]}: pass it inside {arg}={cls.__name__}(...), not beside {arg}="
            )
        note = ""
        if cls is RankChoice:
            obj, note = _choice(legacy)
            shown = [f"rule={obj.rule!r}"] + [f"{k}=..." for k in used if k in CHOICE_KEYWORDS[2:]]
        else:
            obj = cls(**{k: legacy[k] for k in used})
            shown = [f"{k}=..." for k in used]
        out[arg] = obj
        hints.append(f"{', '.join(used)}: pass {arg}={cls.__name__}({', '.join(shown)}){note}")
    if hints and warn:
        warnings.warn(
            "PrefillBalancer: keyword options are deprecated; " + "; ".join(hints),
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    return out["choice"], out["buckets"], out["rounds"]
