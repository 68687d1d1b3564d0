"""The limits of ``lbkit`` and what stays within them: the predicted work against the simulator,
exact planning of loads at the ends of the float64 range, real traces passing the checks, the
limits shown in ``--help``, and options given with their default value still counting as given."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from lbkit.cli import main
from lbkit.cli.bench_checks import predicted_prefill_steps, read_trace
from lbkit.cli.checks import MAX_POOL_RANKS, MAX_PREFILL_STEPS, MAX_REPLICAS, MAX_REQUEST_TOKENS
from lbkit.core import PRESETS

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces"
SMALL = ["--num-replicas", "24", "--num-groups", "4", "--num-nodes", "2", "--num-gpus", "8"]


@pytest.mark.parametrize("tokens", [1_000, 20_000, 200_000])
@pytest.mark.parametrize("budget_s", [1.0, 0.1, 0.02, 0.005])
def test_predicted_steps_are_close_to_the_simulated_ones(tokens, budget_s):
    from lbkit.sim.engine import simulate_prefill
    from lbkit.sim.metrics import prefill_metrics
    from lbkit.sim.traces import Trace

    cost = PRESETS["h800_dsv3"].prefill
    trace = Trace(arrival_s=[0.0], total_tokens=[tokens], output_tokens=[1])
    run = simulate_prefill(trace, "round_robin", num_engines=1, ranks_per_engine=1, cost=cost,
                           budget_s=budget_s)  # fmt: skip
    steps = prefill_metrics(run)["steps"]
    predicted = float(predicted_prefill_steps([tokens], cost=cost, budget_s=budget_s)[0])
    assert 0.8 <= predicted / steps <= 1.25, (predicted, steps)


def test_the_builtin_workload_is_well_inside_the_work_limit():
    from lbkit.sim.workload import default_workload

    trace = default_workload(num_requests=6_000, rng=0)
    steps = predicted_prefill_steps(trace.total_tokens, cost=PRESETS["h800_dsv3"].prefill,
                                    budget_s=1.0).sum()  # fmt: skip
    assert steps < MAX_PREFILL_STEPS / 10
    assert trace.total_tokens.max() < MAX_REQUEST_TOKENS


def _eplb_report(tmp_path: Path, weight: np.ndarray, name: str) -> dict:
    np.save(tmp_path / f"{name}.npy", weight)
    out = tmp_path / f"{name}.json"
    args = ["eplb", "--load", str(tmp_path / f"{name}.npy"), *SMALL, "--repeat", "1",
            "--json", str(out), "--save-plan", str(tmp_path / f"{name}.plan.json")]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    report["plan"] = json.loads((tmp_path / f"{name}.plan.json").read_text())["phy2log"]
    for entry in report["methods"].values():
        entry.pop("plan_time_s")
    report.pop("source")
    return report


def test_loads_at_the_ends_of_the_float64_range_plan_exactly(tmp_path, capsys):
    """Scaling loads by a power of two changes no plan and no figure; loads near 1e308 (whose
    sums overflow) or near the smallest normal float plan as the same loads of moderate size."""
    w = np.random.default_rng(3).lognormal(0, 1, (3, 16)) * 100
    base = _eplb_report(tmp_path, w, "base")
    for k in (1000, -1000):
        assert _eplb_report(tmp_path, np.ldexp(w, k), f"scaled{k}") == base
    near_max = w / w.max() * 1.7e308
    report = _eplb_report(tmp_path, near_max, "near_max")
    moderate = _eplb_report(tmp_path, near_max / 2.0**1000, "moderate")
    assert report == moderate
    for entry in report["methods"].values():
        assert 1.0 <= entry["moe_lb_mean"] < 2.0
    assert (
        1.0
        <= report["lower_bound"]["moe_lb_mean"]
        <= min(e["moe_lb_mean"] for e in report["methods"].values())
    )
    assert "nan" not in capsys.readouterr().out


def test_the_plan_is_the_librarys(tmp_path):
    from lbkit import eplb

    w = np.random.default_rng(5).lognormal(0, 1, (3, 16)) * 1000
    report = _eplb_report(tmp_path, w, "w")
    plan = eplb.rebalance_experts(w, 24, 4, 2, 8)
    assert report["plan"] == plan.phy2log.tolist()
    want = eplb.moe_lb(w, plan.phy2log, num_gpus=8)
    assert np.allclose(report["methods"]["default"]["per_layer"], want, atol=1e-6)


@pytest.mark.parametrize(
    "path",
    [
        TRACES / "mooncake_conversation" / "conversation_trace.jsonl",
        TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv",
    ],
    ids=["mooncake", "azure"],
)
def test_real_traces_pass_the_checks(path):
    if not path.is_file():
        pytest.skip("shared traces not present")
    args = argparse.Namespace(trace=path, format=None, max_requests=None, utilization=0.8,
                              cache="global", cost="h800_dsv3", budget=1.0,
                              given=frozenset())  # fmt: skip
    assert len(read_trace(args)) > 10_000


def test_help_states_the_limits(capsys):
    assert main(["bench", "--help"]) == 0
    bench = " ".join(capsys.readouterr().out.split())
    for figure in (f"{MAX_POOL_RANKS:,} ranks", f"{MAX_REQUEST_TOKENS:,}", f"{MAX_PREFILL_STEPS:,}",
                   "docs/cli.md"):  # fmt: skip
        assert figure in bench
    assert main(["eplb", "--help"]) == 0
    eplb = " ".join(capsys.readouterr().out.split())
    assert f"{MAX_REPLICAS:,}" in eplb and "power of two" in eplb and "docs/cli.md" in eplb


def test_an_option_given_with_its_default_value_counts_as_given(capsys):
    # --attainment 0.99 is the default, but giving it with --no-goodput still does nothing.
    assert main(["bench", "--no-goodput", "--attainment", "0.99"]) == 2
    assert "--attainment: ignored with --no-goodput" in capsys.readouterr().err
    # abbreviations are options given, too
    assert main(["bench", "--no-goodput", "--attain", "0.99"]) == 2
    assert "--attainment: ignored" in capsys.readouterr().err


def test_a_warning_inside_a_run_is_one_line_and_exit_2(monkeypatch, capsys):
    """A numerical warning that escaped the checks stops the run with one line, never a warning
    printed beside a result."""
    from lbkit.cli import eplb as cli_eplb

    def overflow(args):
        return np.array([1e300]).astype(np.float32)  # numpy warns: overflow encountered in cast

    monkeypatch.setattr(cli_eplb, "_check_options", overflow)
    assert main(["eplb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "numerical failure (RuntimeWarning: overflow" in err
    assert "Traceback" not in err


def test_an_internal_error_is_one_line_and_exit_2(monkeypatch, capsys):
    from lbkit.cli import eplb as cli_eplb

    def boom(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli_eplb, "_check_options", boom)
    assert main(["eplb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (ZeroDivisionError" in err
