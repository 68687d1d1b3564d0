"""Exact metrics of hand-built runs (every expected figure worked out by hand in the comments).

The simulator's own tests check metrics on simulated runs, where most figures are only known to
be plausible; here each field of ``prefill_metrics`` / ``decode_metrics`` is checked against a
value computed from the definitions in ``docs/metrics.md``.
"""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.sim.engine import DecodeRun, PrefillRun
from lbkit.sim.metrics import (
    balance_series,
    decode_metrics,
    fluid_ttft_s,
    percentiles,
    prefill_metrics,
)
from lbkit.sim.traces import Trace

nan = np.nan
approx = pytest.approx


def _prefill_run(**over):
    # 4 requests arriving at 1, 2, 3, 4 s; request 2 refused, request 3 in flight.
    trace = Trace(
        arrival_s=[1.0, 2.0, 3.0, 4.0],
        total_tokens=[100, 2000, 1000, 5000],
        output_tokens=[10, 10, 10, 10],
    )
    fields = dict(
        policy="p",
        trace=trace,
        num_engines=2,
        ranks_per_engine=3,  # 6 ranks
        cost=None,
        budget_s=1.0,
        rank=np.array([0, 1, -1, 2]),
        finish_s=np.array([3.0, 6.0, nan, nan]),  # TTFT 2 and 4
        alone_s=np.array([1.0, 0.5, 0.5, 4.0]),  # slowdown 2 and 8
        step_mean_s=2.5,
        step_max_s=4.0,
        num_steps=7,
        overruns=1,
        tokens_computed=1900,  # uncached of finished (100 + 1500) + 300 in flight
        rank_busy_s=np.array([4.0, 2.0, 2.0, 2.0, 1.0, 1.0]),  # 12 rank-seconds
        bin_s=1.0,
        bin_mean_s=np.zeros(1),
        bin_max_s=np.zeros(1),
        end_s=11.0,  # 10 s after the first arrival
        num_arrived=4,
        work_sharing="budget",
        moves=5,
        busy_steps=np.array([0, 2, 1, 3]),
        busy_mean_s=np.array([0.0, 0.5, 0.5, 1.5]),
        busy_max_s=np.array([0.0, 1.0, 1.0, 2.0]),
        few_steps=2,
        few_mean_s=0.5,
        few_max_s=1.0,
        cached_tokens=np.array([0, 500, 0, 0]),
    )
    fields.update(over)
    return PrefillRun(**fields)


def test_prefill_metrics_of_a_hand_built_run():
    m = prefill_metrics(_prefill_run(), edges=(1000,), offered_utilization=0.5)
    assert m["balance_efficiency"] == 2.5 / 4.0
    # TTFT of the finished: [2, 4] -> p50 3, p90 2 + 0.9 * 2, p99 2 + 0.99 * 2
    assert m["ttft_p50_s"] == approx(3.0)
    assert m["ttft_p90_s"] == approx(3.8)
    assert m["ttft_p99_s"] == approx(3.98)
    assert m["ttft_mean_s"] == approx(3.0)
    # slowdowns [2, 8]
    assert m["ttft_slowdown_p50"] == approx(5.0)
    assert m["ttft_slowdown_p99"] == approx(2.0 + 0.99 * 6.0)
    assert (m["finished"], m["refused"], m["in_flight"], m["arrived"]) == (2, 1, 1, 4)
    assert (m["steps"], m["budget_overruns"], m["tokens_computed"]) == (7, 1, 1900)
    assert m["busy_utilization"] == approx(12.0 / (6 * 10.0))
    assert (m["end_s"], m["work_sharing"], m["moves"]) == (11.0, "budget", 5)
    assert m["offered_utilization"] == 0.5
    # buckets of (1000,): 100 -> '<1000'; 2000, 1000 (lower edge inclusive), 5000 -> '>=1000'
    per = m["per_bucket"]
    assert list(per) == ["<1000", ">=1000"]
    assert per["<1000"]["requests"] == 1 and per["<1000"]["finished"] == 1
    assert per["<1000"]["ttft_p50_s"] == approx(2.0)
    assert per["<1000"]["ttft_slowdown_p99"] == approx(2.0)
    assert per[">=1000"]["requests"] == 3 and per[">=1000"]["finished"] == 1
    assert per[">=1000"]["ttft_p99_s"] == approx(4.0)
    assert per[">=1000"]["ttft_slowdown_p99"] == approx(8.0)
    # fluid pool of 6 ranks: nothing ever queues (arrivals 1 s apart, work <= 1 rank-s), so
    # the routed requests 0, 1, 3 take their alone times 1, 0.5, 4
    ref = m["reference"]
    assert ref["balance_efficiency"] == 1.0
    assert ref["ttft_p50_s"] == approx(1.0)
    assert ref["ttft_mean_s"] == approx(5.5 / 3)


def test_prefill_balance_loss_split():
    loss = prefill_metrics(_prefill_run(), edges=(1000,))["balance_loss"]
    # 1 - 2.5/4; idle: (1 * 2/3 + 1 * 1/3 + 2 * 0) / 4 = 0.25 (k busy ranks of 3)
    assert loss["total"] == approx(0.375)
    assert loss["idle_ranks"] == approx(0.25)
    assert loss["unequal_busy_ranks"] == approx(0.125)
    assert loss["steps_by_busy_ranks"] == [0, 2, 1, 3]
    assert loss["step_time_share_by_busy_ranks"] == approx([0.0, 0.25, 0.25, 0.5])
    assert loss["few_requests_step_time_share"] == approx(0.25)
    assert loss["few_requests_balance"] == approx(0.5)
    assert loss["few_requests_loss"] == approx(0.125)
    no_few = prefill_metrics(_prefill_run(few_max_s=0.0, few_mean_s=0.0), edges=(1000,))
    assert no_few["balance_loss"]["few_requests_balance"] == 1.0
    assert prefill_metrics(_prefill_run(busy_steps=None), edges=(1000,))["balance_loss"] == {}


def test_prefill_metrics_of_a_run_without_steps():
    run = _prefill_run(step_mean_s=0.0, step_max_s=0.0)
    m = prefill_metrics(run, edges=(1000,))
    assert m["balance_efficiency"] == 1.0
    assert m["balance_loss"] == {}
    assert "offered_utilization" not in m


def test_prefill_conservation_is_checked():
    with pytest.raises(AssertionError, match="work conservation"):
        prefill_metrics(_prefill_run(tokens_computed=1599), edges=(1000,))
    # nothing in flight: the tokens must match exactly
    done = _prefill_run(finish_s=np.array([3.0, 6.0, nan, 9.0]), tokens_computed=6601)
    with pytest.raises(AssertionError, match="work conservation"):
        prefill_metrics(done, edges=(1000,))
    assert prefill_metrics(_prefill_run(finish_s=done.finish_s, tokens_computed=6600),
                           edges=(1000,))["in_flight"] == 0  # fmt: skip


def test_fluid_ttft_queues_the_work_ahead():
    # 2 ranks; three 3 s requests at t=0: backlogs 0, 3, 6 rank-s -> waits 0, 1.5, 3;
    # at t=1 the backlog is 6 + 3 - 2 * 1 = 7 -> wait 3.5, then 1 s alone.
    out = fluid_ttft_s(np.array([0.0, 0.0, 0.0, 1.0]), np.array([3.0, 3.0, 3.0, 1.0]),
                       num_ranks=2)  # fmt: skip
    assert out.tolist() == approx([3.0, 4.5, 6.0, 4.5])
    assert fluid_ttft_s(np.zeros(0), np.zeros(0), num_ranks=3).shape == (0,)


def test_percentiles_keys_and_empty_input():
    got = percentiles(np.array([0.0, 10.0]), prefix="x", unit="_tokens")
    assert got == {"x_p50_tokens": 5.0, "x_p90_tokens": 9.0, "x_p99_tokens": approx(9.9),
                   "x_mean_tokens": 5.0}  # fmt: skip
    assert percentiles(np.array([nan, np.inf]), prefix="y") == {
        "y_p50_s": None, "y_p90_s": None, "y_p99_s": None, "y_mean_s": None}  # fmt: skip


def test_balance_series_skips_empty_bins():
    t, eff = balance_series(0.5, np.array([1.0, 0.0, 3.0]), np.array([2.0, 0.0, 4.0]))
    assert t.tolist() == [0.0, 1.0]
    assert eff.tolist() == [0.5, 0.75]


def _decode_run(**over):
    # r0, r1 finish; r2 finishes at handover (one output token); r3 never arrives;
    # r4 refused; r5 in flight.
    fields = dict(
        policy="d",
        num_engines=2,
        ranks_per_engine=3,
        cost=None,
        handover_s=np.array([1.0, 2.0, 3.0, nan, 4.0, 5.0]),
        rank=np.array([0, 1, -2, -1, -1, 0]),
        finish_s=np.array([5.0, 6.0, 3.0, nan, nan, nan]),
        output_tokens=np.array([5, 9, 1, 3, 2, 4]),  # TPOT 4/4 = 1.0 and 4/8 = 0.5
        step_mean_s=6.0,
        step_max_s=8.0,
        step_time_s=8.0,
        count_imbalance_s=12.0,
        kv_imbalance_s=10.0,
        count_floor_s=9.6,
        num_steps=10,
        tokens_generated=60,
        bin_s=1.0,
        bin_mean_s=np.zeros(1),
        bin_max_s=np.zeros(1),
        end_s=11.0,  # 10 s after the first handover
        migrations=2,
        migration_s=0.5,
        wait_s=np.array([0.0, 0.5, 0.0, nan, 2.0, 1.0]),
        preemptions=3,
        kv_capacity_tokens=1000,
    )
    fields.update(over)
    return DecodeRun(**fields)


def test_decode_metrics_of_a_hand_built_run():
    m = decode_metrics(_decode_run(), total_tokens=np.array([100, 2000, 1000, 50, 3000, 999]),
                       edges=(1000,))  # fmt: skip
    assert m["balance_efficiency"] == 0.75
    assert m["count_imbalance"] == 1.5
    assert m["kv_imbalance"] == 1.25
    assert m["tpot_p50_s"] == approx(0.75)
    assert m["tpot_p90_s"] == approx(0.95)
    assert m["tpot_mean_s"] == approx(0.75)
    assert (m["finished"], m["refused"], m["in_flight"], m["arrived"]) == (3, 1, 1, 5)
    assert m["single_token"] == 1
    assert m["steps"] == 10
    assert m["step_time_mean_s"] == approx(0.8)
    assert m["batch_per_rank_mean"] == approx(60 / (10 * 3))
    assert m["mean_running_per_rank"] == approx(2.0)
    assert m["busy_fraction"] == approx(8.0 / (2 * 10.0))
    assert (m["end_s"], m["migrations"], m["migration_s"]) == (11.0, 2, 0.5)
    assert (m["kv_capacity_tokens"], m["preemptions"], m["refused_by_reason"]) == (1000, 3, {})
    # admitted (arrived, not refused, not single-token): r0, r1, r5 waited 0, 0.5, 1.0
    assert m["waited"] == 2
    assert m["wait_p50_s"] == approx(0.5)
    assert m["wait_mean_s"] == approx(0.5)
    # buckets: '<1000' holds r0, r5 (r3 never arrived); '>=1000' r1, r2, r4
    assert m["per_bucket"]["<1000"]["requests"] == 2
    assert m["per_bucket"]["<1000"]["tpot_p50_s"] == approx(1.0)
    assert m["per_bucket"][">=1000"]["requests"] == 3
    assert m["per_bucket"][">=1000"]["tpot_p99_s"] == approx(0.5)
    ref = m["reference"]
    assert ref["count_imbalance"] == approx(1.2)
    assert ref["step_time_mean_s"] == approx(0.6)
    assert (ref["balance_efficiency"], ref["kv_imbalance"]) == (1.0, 1.0)
    assert "window" not in m


def test_decode_window_sums():
    # DACC order: mean, max, time, count imb, KV imb, steps, tokens, count floor
    sums = np.array([3.0, 4.0, 5.0, 10.0, 7.5, 4.0, 36.0, 6.0])
    m = decode_metrics(_decode_run(window_s=(2.0, 9.0), window_sums=sums))
    w = m["window"]
    assert (w["start_s"], w["stop_s"], w["steps"]) == (2.0, 9.0, 4)
    assert w["balance_efficiency"] == 0.75
    assert w["count_imbalance"] == 2.0
    assert w["kv_imbalance"] == 1.5
    assert w["count_imbalance_floor"] == 1.2
    assert w["batch_per_rank_mean"] == approx(36.0 / (4 * 3))
    assert m["mean_running_per_rank"] == approx(3.0)
    assert "per_bucket" not in m
    empty = decode_metrics(_decode_run(window_s=(0.0, 1.0), window_sums=np.zeros(8)))["window"]
    assert empty["steps"] == 0
    assert (empty["balance_efficiency"], empty["count_imbalance"], empty["kv_imbalance"],
            empty["count_imbalance_floor"], empty["batch_per_rank_mean"]) == (1.0, 1.0, 1.0,
                                                                              1.0, 0.0)  # fmt: skip


def test_decode_metrics_of_a_run_without_steps():
    run = _decode_run(step_mean_s=0.0, step_max_s=0.0, step_time_s=0.0, num_steps=0,
                      tokens_generated=6, wait_s=None)  # fmt: skip
    m = decode_metrics(run)
    assert (m["balance_efficiency"], m["count_imbalance"], m["kv_imbalance"]) == (1.0, 1.0, 1.0)
    assert m["reference"]["count_imbalance"] == 1.0
    assert m["step_time_mean_s"] == 0.0
    assert m["batch_per_rank_mean"] == approx(6 / 3)  # steps counted as at least 1
    assert "waited" not in m and "wait_p50_s" not in m


def test_decode_refusal_codes_and_conservation():
    refusal = np.array([0, 0, 0, 0, 2, 0], dtype=np.int8)
    m = decode_metrics(_decode_run(rank=np.array([0, 1, -2, -1, 3, 0]), refusal=refusal))
    assert m["refused"] == 1
    assert sum(m["refused_by_reason"].values()) == 1
    with pytest.raises(AssertionError, match="decode conservation"):
        # a request both finished and refused is counted twice
        decode_metrics(_decode_run(finish_s=np.array([5.0, 6.0, 3.0, nan, 9.0, nan])))


def test_rates_of_runs_shorter_than_a_second():
    # Elapsed time is measured from the first arrival (prefill) or handover (decode), with a
    # floor only against a zero-length run.
    m = prefill_metrics(_prefill_run(end_s=1.5), edges=(1000,), offered_utilization=0.5)
    assert m["busy_utilization"] == approx(12.0 / (6 * 0.5))
    d = decode_metrics(_decode_run(end_s=1.5, step_time_s=0.4))
    assert d["busy_fraction"] == approx(0.4 / (2 * 0.5))


def test_per_bucket_slowdown_is_the_99th_percentile():
    # Request 3 also finishes (TTFT 6 s, alone 4 s: slowdown 1.5) beside request 1 (slowdown 8).
    run = _prefill_run(finish_s=np.array([3.0, 6.0, nan, 10.0]), tokens_computed=6600)
    m = prefill_metrics(run, edges=(1000,), offered_utilization=0.5)
    assert m["per_bucket"][">=1000"]["ttft_slowdown_p99"] == approx(1.5 + 0.99 * 6.5)
    assert m["per_bucket"]["<1000"]["ttft_slowdown_p99"] == approx(2.0)


def test_decode_window_of_steps_shorter_than_a_second():
    # DACC order: mean, max, time, count imb, KV imb, steps, tokens, count floor
    sums = np.array([0.3, 0.4, 0.5, 1.0, 0.75, 4.0, 36.0, 0.6])
    w = decode_metrics(_decode_run(window_s=(2.0, 9.0), window_sums=sums))["window"]
    assert w["balance_efficiency"] == approx(0.75)
    assert (w["count_imbalance"], w["kv_imbalance"]) == (approx(2.0), approx(1.5))
    assert w["count_imbalance_floor"] == approx(1.2)
