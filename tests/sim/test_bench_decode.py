"""Decode-only bench: calibration of the batch per rank, and the report."""

from __future__ import annotations

import pytest

from lbkit.core import PRESETS
from lbkit.sim.bench import run_decode_bench, scale_to_decode_batch, steady_window
from lbkit.sim.traces import Trace
from lbkit.sim.workload import default_workload

DEC = PRESETS["h800_dsv3"].decode


@pytest.mark.parametrize("batch", [2.0, 8.0])
def test_calibration_reaches_the_batch_and_more_batch_means_faster_arrivals(batch):
    t = default_workload(num_requests=600, rng=1)
    scaled, f, measured = scale_to_decode_batch(t, batch, ranks_per_engine=8, cost=DEC)
    assert measured == pytest.approx(batch, rel=0.15)
    assert scaled.arrival_s[0] == 0.0 and scaled.arrival_s[-1] == pytest.approx(
        (t.arrival_s[-1] - t.arrival_s[0]) * f
    )
    _, f2, _ = scale_to_decode_batch(t, 2 * batch, ranks_per_engine=8, cost=DEC)
    assert f2 < f


def test_run_decode_bench_reports_every_policy_in_the_window():
    rep = run_decode_bench(default_workload(num_requests=400, rng=2), batch_per_rank=4.0,
                           decode_ranks=8)  # fmt: skip
    assert rep["workload"]["batch_per_rank_target"] == 4.0
    for m in rep["decode"].values():
        assert m["finished"] + m["refused"] + m["in_flight"] == m["arrived"]
        assert m["window"]["steps"] > 0


def test_steady_window_and_bad_input():
    t = Trace(arrival_s=[2.0, 6.0], total_tokens=[1, 1], output_tokens=[3, 3])
    assert steady_window(t) == (3.0, 6.0)
    with pytest.raises(ValueError, match="batch_per_rank: must be > 0"):
        scale_to_decode_batch(t, 0.0, cost=DEC)
    with pytest.raises(TypeError, match="cost: must be a DecodeCost"):
        scale_to_decode_batch(t, 1.0, cost=PRESETS["unit"].prefill)
    one = Trace(arrival_s=[0.0, 1.0], total_tokens=[1, 1], output_tokens=[1, 1])
    with pytest.raises(ValueError, match="more than one output token"):
        scale_to_decode_batch(one, 1.0, cost=DEC)
    with pytest.raises(ValueError, match="unknown decode policy 'x'"):
        run_decode_bench(t, decode_policies=["x"])
