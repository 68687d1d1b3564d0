"""What the default policy is for, on seeded random decode streams.

Streams: Poisson arrivals, lognormal KV lengths and output lengths (departures), replayed through a
DecodeBalancer per policy (:mod:`lbkit.sim.streams`). Imbalance of a dimension is ``sum_t max_r /
sum_t mean_r`` over the steps after warm-up; efficiency is ``balance_efficiency`` of the per-rank
step times modelled by the ``h800_dsv3`` decode preset with ``combine="max"``.
"""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.sim.streams import make_stream, replay

COST = PRESETS["h800_dsv3"].decode.with_combine("max")
BASELINES = ("round_robin", "least_requests", "least_kv", "random")
#: Tolerance of the per-stream efficiency comparison. In the stated regime the worst deficit on
#: 100 random streams was 0.004, but a targeted search (``hypothesis.target``, 250 streams) found
#: 0.041: one request with 20x the mean KV pins a rank, short requests keep joining it (their KV
#: term is small), and ``least_kv`` keeps them away. Averaged over streams the default wins
#: (``test_on_average_the_default_is_the_most_efficient_policy``).
EFFICIENCY_TOL = 0.05
#: Relative tolerance of the per-stream KV comparison with ``least_requests``. Both replays hold the
#: same KV in total at every step (departures and growth do not depend on the placement), so the
#: ratio of the two KV imbalances is the ratio of ``sum_t max_r S_r``. It is not always <= 1: with
#: few requests per rank and heavy tails one long request is a large part of a rank's KV, lands on
#: the lightest rank and keeps it the heaviest while its co-residents stay; a better balanced engine
#: has a heavier lightest rank, and ``least_requests``, whose KV is spread wide, sometimes leaves a
#: lighter one. Measured: the default's ratio was at most 1.0144 on 3,000 streams of a targeted
#: search (``hypothesis.target``) over this strategy, while ``least_requests``' KV imbalance exceeds
#: the default's by 21.5% in the median (7.3% at the 5% quantile) of 2,000 random streams.
KV_REL_TOL = 0.03


@given(
    seed=st.integers(0, 2**32 - 1),
    ranks=st.sampled_from([4, 8, 16]),
    sigma=st.floats(0.8, 2.0),
    rate=st.floats(1.0, 12.0),
    kv_median=st.sampled_from([500.0, 3000.0, 8000.0, 30000.0]),
)
# Streams where least_requests' KV imbalance is below the default's (ratios 1.0015, 1.0144 and
# 1.0116; 94, 73 and 298 requests in flight on average), and the closest count comparison found
# (least_kv's count imbalance 0.0185 above the default's).
@example(seed=491, ranks=8, sigma=1.0, rate=1.359375, kv_median=500.0)
@example(seed=1487799822, ranks=16, sigma=1.8, rate=1.0, kv_median=3000.0)
@example(seed=8482, ranks=16, sigma=1.9082320845023146, rate=4.5839229414987965, kv_median=30000.0)
@example(seed=21059782, ranks=4, sigma=0.8, rate=1.0, kv_median=8000.0)
def test_default_balances_both_dimensions_better_than_either_single_dimension_baseline(
    seed, ranks, sigma, rate, kv_median
):
    # sigma >= 0.8: with near-uniform lengths KV is proportional to the count, and balancing the
    # count alone balances both (least_requests then matches the default on KV to within 0.5%).
    stream = make_stream(seed, steps=200, rate=rate, kv_sigma=sigma, kv_median=kv_median)
    default = replay(stream, ranks, "sum_of_squares", cost=COST)
    by_count = replay(stream, ranks, "least_requests", cost=COST)
    by_kv = replay(stream, ranks, "least_kv", cost=COST)
    assert default.count_imbalance <= by_kv.count_imbalance + 1e-12
    assert default.kv_imbalance <= by_count.kv_imbalance * (1.0 + KV_REL_TOL)
    assert default.refused == by_count.refused == by_kv.refused == 0


@given(
    seed=st.integers(0, 2**32 - 1),
    ranks=st.sampled_from([8, 16]),
    sigma=st.floats(0.5, 1.2),
    rate=st.floats(4.0, 12.0),
    balance=st.floats(0.8, 1.25),
)
def test_default_is_at_least_as_efficient_as_every_baseline_when_both_dimensions_matter(
    seed, ranks, sigma, rate, balance
):
    # Regime: the mean KV per request is within 25% of b/k, where the count and KV terms of the
    # step cost are equal. Far outside it one term alone sets the step time, and the baseline
    # that balances that term can beat the default by a few percent (docs/decode.md).
    mean_kv = COST.b / COST.k * balance
    median = mean_kv / np.exp(sigma**2 / 2)
    stream = make_stream(seed, steps=200, rate=rate, kv_sigma=sigma, kv_median=median)
    default = replay(stream, ranks, "sum_of_squares", cost=COST).efficiency
    for name in BASELINES:
        assert default >= replay(stream, ranks, name, cost=COST).efficiency - EFFICIENCY_TOL, name


def test_on_average_the_default_is_the_most_efficient_policy():
    eff = {p: [] for p in ("sum_of_squares", *BASELINES)}
    for seed in range(6):
        for ranks in (8, 16):
            stream = make_stream(seed, steps=250, rate=8.0, kv_sigma=1.0, kv_median=6000.0)
            for p in eff:
                eff[p].append(replay(stream, ranks, p, cost=COST).efficiency)
    mean = {p: float(np.mean(v)) for p, v in eff.items()}
    assert mean["sum_of_squares"] == max(mean.values()), mean


def test_migrating_one_request_per_step_undoes_what_departures_unbalance():
    """Placement at admission cannot undo the imbalance departures leave; one migration per step
    (``DecodeBalancer.rebalance(1)``) lowers both imbalances and raises the efficiency on every
    seeded stream, by at least 0.01 (measured: 0.017-0.043 on these six streams)."""
    for seed in range(6):
        stream = make_stream(seed, steps=250, rate=8.0, kv_sigma=1.0, kv_median=6000.0)
        still = replay(stream, 16, "sum_of_squares", cost=COST)
        moved = replay(stream, 16, "sum_of_squares", cost=COST, migrate_every=1)
        assert moved.migrated > 0 and still.migrated == 0
        assert moved.efficiency >= still.efficiency + 0.01, seed
        assert moved.count_imbalance < still.count_imbalance, seed
        assert moved.kv_imbalance < still.kv_imbalance, seed
