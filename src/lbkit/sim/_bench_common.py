"""What the benches of :mod:`lbkit.sim.bench` share: checking the policies they are asked for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["policy_names"]


def policy_names(policies: Sequence[str] | None, table: Any, kind: str) -> list[str]:
    """The policies asked for (all of ``table`` for ``None``), checked, without repeats.

    Raises
    ------
    ValueError
        A name not in ``table`` (the message names the ``kind`` and lists the choices).
    """
    if policies is None:
        return list(table)
    policies = list(policies)
    out = []
    for p in policies:
        if p not in table:
            raise ValueError(
                f"policies: unknown {kind} policy {p!r}; choose from {', '.join(table)}"
            )
        if p not in out:
            out.append(p)
    return out
