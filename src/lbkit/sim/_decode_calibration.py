"""Calibration of a decode-only replay: the arrival time-scale that loads ranks to a batch.

Part of :mod:`lbkit.sim.bench` (import :func:`scale_to_decode_batch` and :func:`steady_window`
from there), whose :func:`~lbkit.sim.bench.run_decode_bench` calibrates with them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from lbkit.core.cost import DecodeCost
from lbkit.core.validation import check_int, check_real
from lbkit.sim import _decode_kernels as K
from lbkit.sim.traces import Trace

__all__ = ["SATURATED", "TARGET_SATURATED", "scale_to_decode_batch", "steady_window"]

#: Batch gain below which halving the arrival scale counts as saturated (capacity-bound).
SATURATED = 1.01
#: Share of the saturated batch that a capacity-bound calibration aims at.
TARGET_SATURATED = 0.95


def scale_to_decode_batch(
    trace: Trace,
    batch_per_rank: float,
    /,
    *,
    num_engines: int = 1,
    ranks_per_engine: int = 64,
    cost: DecodeCost,
    iterations: int = 8,
    max_kv_tokens: int | None = None,
    kv_watermark_tokens: int = 0,
) -> tuple[Trace, float, float]:
    """Time-scale ``trace`` so a decode-only replay holds ``batch_per_rank`` requests per rank.

    Decode pools are sized so that each rank runs a batch of tens of requests; a prefill pool's
    handovers rarely load a decode engine that much. This picks the arrival time-scale of a
    decode-only replay (:func:`~lbkit.sim.engine.simulate_decode` of a trace): a first guess from
    Little's law (``batch * ranks`` requests in flight, each for ``mean(o - 1)`` steps of the
    cost model's step time at that batch), then a bisection of ``iterations`` replays under
    ``least_requests`` on the logarithm of the scale (the batch, measured in the steady window
    of :func:`steady_window`, falls as arrivals stretch); the closest scale seen wins.

    With a KV capacity (``max_kv_tokens``, ``kv_watermark_tokens`` as in
    :func:`~lbkit.sim.engine.simulate_decode`) the running batch saturates: faster arrivals only
    lengthen the wait queue. When halving the scale stops raising the batch by 1% below the
    target, the target becomes 95% of the largest batch measured (the pool near its
    capacity-bound occupancy, without an ever-growing queue) and the bisection aims at that;
    the returned batch (below the target) tells. Every search is bounded (at most
    ``17 + iterations`` replays).

    Returns
    -------
    (Trace, float, float)
        The scaled trace (arrivals shifted to start at 0), the factor applied to the shifted
        arrival times, and the mean batch per rank measured on the last replay.

    Raises
    ------
    ValueError
        ``batch_per_rank <= 0``, bad pool sizes, or a trace without two distinct arrival times
        or without a request needing a decode step.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> from lbkit.sim.workload import default_workload
    >>> t, f, b = scale_to_decode_batch(default_workload(num_requests=400), 4.0,
    ...                                 ranks_per_engine=8, cost=PRESETS["h800_dsv3"].decode)
    >>> 3.0 < b < 5.0
    True
    """
    from lbkit.sim.engine import simulate_decode

    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    target = check_real(batch_per_rank, "batch_per_rank", min_value=0.0, strict_min=True)
    e = check_int(num_engines, "num_engines", min_value=1)
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    if not isinstance(cost, DecodeCost):
        raise TypeError(f"cost: must be a DecodeCost, got {type(cost).__name__}")
    iterations = check_int(iterations, "iterations", min_value=0)
    arrival = np.asarray(trace.arrival_s, dtype=np.float64)
    span = float(arrival[-1] - arrival[0]) if len(trace) else 0.0
    steps = np.maximum(np.asarray(trace.output_tokens) - 1, 0)
    if not span > 0 or steps.sum() == 0:
        raise ValueError(
            "trace: needs arrivals over a positive time span and a request with more than one "
            "output token"
        )
    m = float(steps.mean())
    kv = float(np.mean(trace.total_tokens)) + m / 2.0
    step_s = float(cost.step_time(target, target * kv))
    rate = target * r * e / (m * step_s)  # arrivals per second for that many in flight
    factor = (len(trace) / rate) / span
    shifted = arrival - arrival[0]
    scaled = dataclasses.replace(trace, arrival_s=shifted * factor)

    seen: dict[float, float] = {}

    def batch(f: float) -> float:
        if f not in seen:
            t = dataclasses.replace(trace, arrival_s=shifted * f)
            run = simulate_decode(
                t, "least_requests", num_engines=e, ranks_per_engine=r, cost=cost,
                window_s=steady_window(t), max_kv_tokens=max_kv_tokens,
                kv_watermark_tokens=kv_watermark_tokens,
            )  # fmt: skip
            w = run.window_sums
            # running requests: engine steps (summed over engines) of r ranks each
            seen[f] = float(w[K.DACC_TOKENS] / max(w[K.DACC_STEPS] * r, 1.0))
        return seen[f]

    # The batch falls as arrivals stretch (larger factor); bisect on log(factor) inside a
    # bracket grown from the first guess, keeping the closest factor seen.
    lo, hi = factor, factor
    prev = -math.inf
    for _ in range(8):
        b = batch(lo)
        if b >= target:
            break
        if b < prev * SATURATED:  # capacity-bound: aim below the saturated batch
            target = TARGET_SATURATED * max(seen.values())
            lo = max(f for f in seen if seen[f] >= target)
            break
        prev = b
        lo /= 2.0
    for _ in range(8):
        if batch(hi) <= target:
            break
        hi *= 2.0
    best = min((abs(math.log(max(b, 1e-12) / target)), f) for f, b in seen.items())
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        b = batch(mid)
        best = min(best, (abs(math.log(max(b, 1e-12) / target)), mid))
        if b > target:
            lo = mid
        else:
            hi = mid
    factor = best[1]
    scaled = dataclasses.replace(trace, arrival_s=shifted * factor)
    return scaled, factor, batch(factor)


def steady_window(trace: Trace, /, *, skip: float = 0.25) -> tuple[float, float]:
    """The arrivals' span without its first ``skip`` share: ``(t0 + skip * span, t_last)``.

    Decode statistics over this window leave out the ramp-up (the pool filling) and the drain
    after the last arrival, where batches are small and imbalance is dominated by integrality.

    Examples
    --------
    >>> steady_window(Trace(arrival_s=[0.0, 4.0], total_tokens=[1, 1], output_tokens=[1, 1]))
    (1.0, 4.0)
    """
    a = trace.arrival_s
    t0, t1 = float(a[0]), float(a[-1])
    return t0 + skip * (t1 - t0), t1
