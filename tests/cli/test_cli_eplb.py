"""``lbkit eplb`` end to end: the built-in example, every input format, JSON output, and one-line
errors with a non-zero exit for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lbkit.cli import main
from lbkit.eplb import check_placement

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
EXPERT_FILE = TRACES / "moe_expert_load_deepseek_v3" / "prefill_in4096.json"

SMALL = ["--num-replicas", "24", "--num-groups", "4", "--num-nodes", "2", "--num-gpus", "8"]


def _weight(seed=0, layers=3, experts=16):
    return np.random.default_rng(seed).lognormal(0, 1, (layers, experts)).round(3) * 100


def test_builtin_example_compares_methods_against_the_bound(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    plan_json = tmp_path / "plan.json"
    assert (
        main(["eplb", "--repeat", "1", "--json", str(out_json), "--save-plan", str(plan_json)]) == 0
    )
    text = capsys.readouterr().out
    assert "built-in example (58 x 256" in text
    assert "greedy" in text and "default" in text and "lower bound" in text
    report = json.loads(out_json.read_text())
    assert report["num_layers"] == 58 and report["num_experts"] == 256
    assert report["policy"] == "hierarchical"  # 8 groups on 4 nodes, as DeepSeek chooses
    bound = report["lower_bound"]["moe_lb_mean"]
    for name, entry in report["methods"].items():
        assert entry["moe_lb_mean"] >= bound - 1e-9, name
        assert len(entry["per_layer"]) == 58
        assert entry["plan_time_s"] > 0
    assert report["methods"]["default"]["moe_lb_mean"] <= report["methods"]["greedy"]["moe_lb_mean"]
    plan = json.loads(plan_json.read_text())
    check_placement(
        np.array(plan["phy2log"]),
        np.array(plan["log2phy"]),
        np.array(plan["logcnt"]),
        num_experts=256,
        num_gpus=32,
    )


@pytest.mark.parametrize("suffix", ["json", "npy", "csv"])
def test_load_formats(tmp_path, capsys, suffix):
    w = _weight()
    path = tmp_path / f"load.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps({"logical_count": [[0.0] * 16, *w.tolist()]}))
    elif suffix == "npy":
        np.save(path, w)
    else:
        path.write_text("\n".join(",".join(str(v) for v in row) for row in w))
    out = tmp_path / "r.json"
    assert main(["eplb", "--load", str(path), *SMALL, "--repeat", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_layers"] == 3
    assert report["dropped_zero_layers"] == (1 if suffix == "json" else 0)
    assert set(report["methods"]) == {"greedy", "default"}
    assert "3 layers x 16 experts" in capsys.readouterr().out


def test_methods_and_policy_options(tmp_path, capsys):
    np.save(tmp_path / "w.npy", _weight())
    # The global policy has no groups or nodes: --num-groups and --num-nodes are left out.
    args = ["eplb", "--load", str(tmp_path / "w.npy"), "--num-replicas", "24", "--num-gpus", "8",
            "--repeat", "1"]  # fmt: skip
    assert (
        main([*args, "--methods", "greedy", "--policy", "global", "--json", str(tmp_path / "r")])
        == 0
    )
    report = json.loads((tmp_path / "r").read_text())
    assert list(report["methods"]) == ["greedy"] and report["policy"] == "global"
    assert report["num_groups"] is None and report["num_nodes"] is None
    assert "policy global (no group or node constraint)" in capsys.readouterr().out


def test_global_policy_plans_as_the_library_does_with_any_groups(tmp_path):
    """Under the global policy the CLI passes one group and one node: the plan is the one the
    library makes for the global policy with the groups and nodes of any valid call."""
    from lbkit import eplb

    w = _weight(layers=4, experts=12)  # 12 experts: the default 8 groups would not divide them
    np.save(tmp_path / "w.npy", w)
    plan = tmp_path / "plan.json"
    args = ["eplb", "--load", str(tmp_path / "w.npy"), "--num-replicas", "24", "--num-gpus", "8",
            "--policy", "global", "--repeat", "1", "--save-plan", str(plan)]  # fmt: skip
    assert main(args) == 0
    got = np.array(json.loads(plan.read_text())["phy2log"])
    want = eplb.rebalance_experts(w, 24, 4, 2, 8, policy="global").phy2log
    assert np.array_equal(got, want)


@pytest.mark.skipif(not EXPERT_FILE.is_file(), reason="shared expert-load files not present")
def test_real_sglang_dump(capsys):
    assert main(["eplb", "--load", str(EXPERT_FILE), "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    assert "58 layers x 256 experts, 3 all-zero layers dropped" in text


def test_argument_errors_are_one_line(capsys):
    assert main(["eplb", "--num-gpus", "many"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid int value: 'many'" in err


def test_console_script_and_module_entry_points(tmp_path):
    np.save(tmp_path / "w.npy", _weight())
    args = ["eplb", "--load", str(tmp_path / "w.npy"), *SMALL, "--repeat", "1"]
    run = subprocess.run([sys.executable, "-m", "lbkit", *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "lower bound" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "lbkit", "eplb", "--load", str(tmp_path / "nope.npy")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("lbkit eplb: error: --load: file not found")
