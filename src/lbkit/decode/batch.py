"""Place a batch of decode arrivals at once: longest first, one greedy kernel call.

Order matters for a greedy rule: placing the long requests first leaves the short ones, which
move the KV dimension little, to even out what remains (the idea of LPT scheduling). The batch is
sorted by KV tokens, longest first (stable: equal lengths keep their input order), and placed one
after another by the chosen policy inside one numba kernel.

Normalisers: with ``scale="mean"`` the batch uses the means over eligible ranks *after the whole
batch* (``Bhat = (sum B + m) / n``, ``Shat = (sum S + sum s) / n``) for every placement, so that
the batch is the greedy of one fixed objective.

Bound (proved in ``docs/decode.md``; uncapacitated, all ranks eligible, ``scale="mean"``):
write ``x_r = (B_r/Bhat, S_r/Shat)`` and ``F = max_r max(x_r)`` (the max-of-both-dimensions
objective, whose optimum is ``F* >= 1``). The sum-of-squares greedy, in any order, ends with

    F <= max(F0, 1 + rho + u_max) <= (2 + rho) F*,

where ``rho = max_j max(s_j / sbar, sbar / s_j)`` over requests with ``s_j > 0`` (``sbar =
Shat / Bhat``, the mean KV per request after the batch; ``s_j / sbar`` alone when a request has
``s_j = 0``), ``u_max = max_j max(1/Bhat, s_j/Shat) <= F*`` and ``F0 <= F*`` the objective of
the ranks' load before the batch. Measured against brute force on
small batches the gap is much smaller (``docs/decode.md`` reports it; ``tests/decode`` checks both).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lbkit.core.cost import DecodeCost
from lbkit.core.validation import as_int_array, as_rng, check_choice, check_int
from lbkit.decode import _kernels as K
from lbkit.decode._state import params, state_iv
from lbkit.decode.policies import DEFAULT_POLICY, POLICIES, POLICY_CODES
from lbkit.decode.reasons import reason_of

__all__ = ["ORDERS", "BatchAssignment", "assign_batch", "batch_bound"]

#: Placement orders of :func:`assign_batch`.
ORDERS = ("longest_first", "given")


class BatchAssignment(NamedTuple):
    """Result of :func:`assign_batch`.

    Attributes
    ----------
    ranks : ndarray of int64, shape (m,)
        Rank of each request in input order, -1 when refused.
    reasons : tuple of str, length m
        Reason code of each request (``"placed"`` or a refusal, see :mod:`.reasons`).
    num_requests, kv_tokens : ndarray of int64, shape (ranks,)
        Per-rank state after the batch.
    cursor : int
        Round-robin cursor after the batch (rank after the last placement).
    """

    ranks: np.ndarray
    reasons: tuple[str, ...]
    num_requests: np.ndarray
    kv_tokens: np.ndarray
    cursor: int


def assign_batch(
    num_requests: Any,
    kv_tokens: Any,
    new_kv_tokens: Any,
    /,
    *,
    policy: str = DEFAULT_POLICY,
    order: str = "longest_first",
    max_batch: Any = None,
    max_kv_tokens: Any = None,
    eligible: Any = None,
    scale: str = "mean",
    cost: DecodeCost | None = None,
    cursor: int = 0,
    rng: np.random.Generator | int | None = None,
) -> BatchAssignment:
    """Place ``m`` requests on ``n`` ranks at once.

    Parameters
    ----------
    num_requests, kv_tokens : array_like of int, shape (n,)
        Per-rank requests ``B_r`` and KV tokens ``S_r`` before the batch (>= 0).
    new_kv_tokens : array_like of int, shape (m,)
        KV tokens of each arriving request (>= 0).
    policy : str
        A key of :data:`~lbkit.decode.POLICIES`.
    order : {"longest_first", "given"}
        Placement order: by KV tokens, longest first (stable), or as given.
    max_batch, max_kv_tokens, eligible, scale, cost, cursor, rng
        As in :func:`~lbkit.decode.pick_rank`; ``scale="mean"`` uses the means after the whole
        batch (see the module documentation). ``rng`` draws the ``"random"`` policy's keys.

    Returns
    -------
    BatchAssignment

    Raises
    ------
    ValueError, TypeError
        As :func:`~lbkit.decode.pick_rank`, plus an unknown ``order`` or negative lengths.

    Runtime complexity: O(m log m + m n).

    Examples
    --------
    >>> out = assign_batch([0, 0], [0, 0], [100, 9000, 200, 8000, 300])
    >>> out.ranks.tolist(), out.kv_tokens.tolist(), out.num_requests.tolist()
    ([1, 0, 0, 1, 1], [9200, 8400], [2, 3])
    >>> assign_batch([0, 0], [0, 0], [5, 7], max_batch=1).reasons
    ('placed', 'placed')
    >>> assign_batch([0], [0], [5, 7], max_batch=1).reasons
    ('batch_full', 'placed')
    """
    check_choice(policy, "policy", tuple(POLICIES))
    check_choice(order, "order", ORDERS)
    X = state_iv(num_requests, kv_tokens, max_batch, max_kv_tokens, eligible)
    n = X.shape[1]
    kv = as_int_array(new_kv_tokens, "new_kv_tokens", ndim=1, min_value=0)
    m = kv.shape[0]
    code = POLICY_CODES[policy]
    P = params(code, scale, cost)
    cursor = check_int(cursor, "cursor", min_value=0, max_value=n - 1)
    keys = as_rng(rng).random((m, n)) if code == K.RANDOM else np.zeros((0, n))
    seq = np.argsort(-kv, kind="stable") if order == "longest_first" else np.arange(m)
    ok = X[K.ROW_OK] > 0
    n_ok = int(ok.sum())
    if n_ok:
        bhat = (X[K.ROW_B, ok].sum() + m) / n_ok
        shat = (X[K.ROW_S, ok].sum() + kv.sum()) / n_ok
    else:
        bhat = shat = 0.0
    out = np.empty(m, dtype=np.int64)
    cursor = K.assign_sequence(X, kv.astype(np.float64), seq, P, bhat, shat, cursor, keys, out)
    reasons = tuple(reason_of(int(r)) for r in out)
    ranks = np.where(out >= 0, out, -1)
    b = X[K.ROW_B].astype(np.int64)
    s = X[K.ROW_S].astype(np.int64)
    return BatchAssignment(ranks, reasons, b, s, int(cursor))


def batch_bound(num_requests: Any, kv_tokens: Any, new_kv_tokens: Any, /) -> float:
    """Proven bound ``max(F0, 1 + rho + u_max)`` on the greedy's max-of-both-dimensions objective.

    For :func:`assign_batch` with the default policy, ``scale="mean"``, no capacities and every
    rank eligible (see the module documentation). Returns ``inf`` for an empty batch that leaves
    no request anywhere (the objective is then undefined).

    Examples
    --------
    >>> batch_bound([0, 0], [0, 0], [100, 100])  # rho = 1, u_max = 1
    3.0
    >>> batch_bound([5, 0], [0, 0], [100, 100])  # sbar = 100 / 3.5, rho = 3.5, u_max = 1
    5.5
    """
    b = as_int_array(num_requests, "num_requests", ndim=1, min_value=0, allow_empty=False)
    s = as_int_array(kv_tokens, "kv_tokens", shape=b.shape, min_value=0)
    kv = as_int_array(new_kv_tokens, "new_kv_tokens", ndim=1, min_value=0)
    n = b.shape[0]
    if kv.size == 0:
        return float("inf")
    bhat = float(b.sum() + kv.size) / n
    shat = float(s.sum() + kv.sum()) / n
    f0 = float(b.max()) / bhat
    sbar = shat / bhat
    if sbar == 0.0:  # no KV anywhere: the count dimension alone, rho = 0
        return max(f0, 1.0 + 1.0 / bhat)
    f0 = max(f0, float(s.max()) / shat)
    ratios = kv / sbar
    pos = ratios[kv > 0]
    rho = max(float(ratios.max()), float((1.0 / pos).max()) if pos.size else 0.0)
    u_max = max(1.0 / bhat, float(kv.max()) / shat)
    return max(f0, 1.0 + rho + u_max)
