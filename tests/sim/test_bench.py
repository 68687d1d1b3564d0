"""The bench runner: SPEC section 7 keys, determinism of the JSON, bad input."""

from __future__ import annotations

import json

import pytest

from lbkit.sim.bench import run_bench
from lbkit.sim.workload import default_workload

SMALL = {"prefill_engines": 2, "ranks_per_engine": 2, "decode_ranks": 4}


def _strip(report):
    return {k: v for k, v in report.items() if k != "timing"}


def test_report_has_the_contract_keys_and_is_deterministic():
    t = default_workload(num_requests=400, rng=3)
    a = run_bench(t, seed=5, **SMALL).report
    b = run_bench(t, seed=5, **SMALL).report
    assert json.dumps(_strip(a), sort_keys=True) == json.dumps(_strip(b), sort_keys=True)
    for entry in a["prefill"].values():
        for key in ("balance_efficiency", "ttft_p50_s", "ttft_p99_s", "finished", "refused"):
            assert key in entry
        assert entry["finished"] + entry["refused"] + entry["in_flight"] == 400
    for entry in a["decode"].values():
        for key in ("balance_efficiency", "count_imbalance", "kv_imbalance", "tpot_p99_s",
                    "finished", "refused"):  # fmt: skip
            assert key in entry
    assert a["options"]["seed"] == 5 and a["workload"]["requests"] == 400


def test_seed_changes_randomised_policies_only():
    t = default_workload(num_requests=300, rng=3)
    a = run_bench(t, seed=1, prefill_policies=["random", "least_tokens"], **SMALL).report
    b = run_bench(t, seed=2, prefill_policies=["random", "least_tokens"], **SMALL).report
    assert a["prefill"]["least_tokens"] == b["prefill"]["least_tokens"]
    assert a["prefill"]["random"] != b["prefill"]["random"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"utilization": 0.0}, "utilization: must be > 0"),
        ({"utilization": -1.0}, "utilization: must be > 0"),
        ({"prefill_engines": 0}, "prefill_engines: must be >= 1"),
        ({"decode_ranks": 0}, "decode_ranks: must be >= 1"),
        ({"prefill_policies": ["nope"]}, "unknown prefill policy 'nope'"),
        ({"cost": "h100"}, "cost: must be one of"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_bench(default_workload(num_requests=10), **kwargs)
