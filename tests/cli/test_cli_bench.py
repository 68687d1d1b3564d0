"""``lbkit bench`` end to end: tables, JSON, determinism, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lbkit.cli import main

FAST = ["--max-requests", "300", "--prefill-engines", "2", "--ranks-per-engine", "2",
        "--decode-ranks", "4", "--decode-batch", "4", "--no-eplb", "--no-goodput"]  # fmt: skip
#: The same with the goodput search, for a few policies (each search replays ~10 times).
GOODPUT = [a for a in FAST if a != "--no-goodput"]


def test_goodput_table_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", *GOODPUT, "--policies", "round_robin,least_tokens,vllm,dynamo,lbkit",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    first = text.splitlines()[0]
    assert first.startswith("Goodput at SLO") and "cache global" in first
    report = json.loads(out.read_text())
    rows = report["goodput"]
    assert list(rows) == ["round_robin", "least_tokens", "vllm", "dynamo", "lbkit"]
    ideal = report["ideal"]["requests_per_s"]
    best_peer = max(rows[n]["requests_per_s"] for n in ("vllm", "dynamo"))
    for name, row in rows.items():
        for key in ("requests_per_s", "vs_ideal", "vs_best_peer", "ttft_p99_s", "tpot_p99_s",
                    "attainment"):  # fmt: skip
            assert key in row, (name, key)
        assert row["requests_per_s"] <= ideal
        assert row["vs_ideal"] == pytest.approx(row["requests_per_s"] / ideal)
        assert row["vs_best_peer"] == pytest.approx(row["requests_per_s"] / best_peer)
        assert row["attainment"] >= 0.99
        # the curve holds the evaluations; the goodput is the best passing rate found
        passing = [r for r, a in row["curve"] if a >= 0.99]
        assert row["requests_per_s"] in passing
    assert report["options"]["slo"] == {"ttft_s": 2.0, "ttft_slowdown": 4.0, "tpot_s": 0.05,
                                        "attainment": 0.99}  # fmt: skip
    for m in report["decode"].values():
        assert m["mean_running_per_rank"] > 0


def test_slo_options_reach_the_report(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", *GOODPUT, "--policies", "least_tokens", "--slo-ttft", "8", "--slo-tpot",
            "0.1", "--slo-ttft-slowdown", "2", "--attainment", "0.95",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "95% of requests meet TTFT <= max(8 s, 2 x prefill alone) and TPOT <= 100 ms" in first
    rep = json.loads(out.read_text())
    assert rep["options"]["slo"] == {"ttft_s": 8.0, "ttft_slowdown": 2.0, "tpot_s": 0.1,
                                     "attainment": 0.95}  # fmt: skip
    assert rep["goodput"]["least_tokens"]["attainment"] >= 0.95


def test_plot_of_attainment_against_rate(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "g.png"
    args = ["bench", *GOODPUT, "--policies", "least_tokens,lbkit", "--plot", str(png)]
    assert main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_local_caches(tmp_path):
    out = tmp_path / "r.json"
    args = ["bench", *GOODPUT, "--policies", "least_tokens,dynamo", "--cache", "local",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["options"]["cache"] == "local"
    for row in rep["goodput"].values():
        assert 0.0 <= row["cached_share"] <= 1.0


def test_tables_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", *FAST, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Prefill" in text and "Decode" in text and "lbkit" in text and "*" in text
    report = json.loads(out.read_text())
    # per-bucket TTFT: one p50/p99 pair per bucket holding requests, counts in the title
    buckets = report["prefill"]["lbkit"]["per_bucket"]
    title = next(line for line in text.splitlines() if "Prefill TTFT by prompt length" in line)
    for label, m in buckets.items():
        assert f"{label} {m['requests']:,}" in title and f"{label} p50" in text
    assert set(report["prefill"]) >= {"round_robin", "lbkit", "lbkit_buckets", "least_tokens"}
    assert set(report["decode"]) >= {"round_robin", "least_kv", "lbkit"}
    assert "goodput" not in report  # --no-goodput


def test_decode_only_section(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", *FAST, "--policies", "least_kv,lbkit", "--decode-batch", "3", "--json"]
    assert main([*args, str(out)]) == 0
    assert "Decode-only replay at about 3 requests per rank" in capsys.readouterr().out
    full = json.loads(out.read_text())
    rep = {**full["decode_run"], "decode": full["decode"]}
    assert list(rep["decode"]) == ["least_kv", "lbkit"]
    assert rep["workload"]["batch_per_rank_target"] == 3.0
    for m in rep["decode"].values():
        assert m["window"]["steps"] > 0 and m["finished"] + m["refused"] == m["arrived"]


def test_decode_only_with_migration(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", *FAST, "--policies", "lbkit", "--decode-batch", "8", "--migrate-every",
            "0", "--max-migrations", "2", "--migration-gbps", "40", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "lbkit_migrate: up to 2 move(s) every 0 s, KV transfer 1.76 us per token" in text
    full = json.loads(out.read_text())
    rep = {**full["decode_run"], "decode": full["decode"]}
    assert list(rep["decode"]) == ["lbkit", "lbkit_migrate"]
    mig = rep["options"]["migration"]
    assert mig["max_migrations"] == 2 and mig["s_per_kv_token"] == pytest.approx(70272 / 40e9)
    plain, moved = rep["decode"]["lbkit"], rep["decode"]["lbkit_migrate"]
    # lbkit's defaults migrate too (room and one balance move before every routing decision)
    assert plain["migrations"] > 0 and moved["migrations"] > 0
    # transfer seconds = s_per_kv_token x KV tokens moved (each move carries its prompt at least)
    kv_per_move = moved["migration_s"] / moved["migrations"] / mig["s_per_kv_token"]
    assert kv_per_move >= 1.0
    assert moved["finished"] == plain["finished"] == moved["arrived"] - moved["refused"]


def test_router_replicas_add_rows(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", *FAST, "--policies", "lbkit", "--replicas", "3", "--sync", "reports",
            "--sync-period", "0.5", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    assert "lbkit_replicas" in capsys.readouterr().out
    full = json.loads(out.read_text())
    assert full["options"]["replicas"] == {"k": 3, "mode": "reports", "delay_s": 0.0005,
                                           "period_s": 0.5}  # fmt: skip
    assert list(full["decode"]) == ["lbkit", "lbkit_replicas"]
    # stale views under a KV capacity: the replicas admit only (migration is not modelled)
    assert full["decode_run"]["options"]["replicas"]["migration"] is False
    row = full["decode"]["lbkit_replicas"]
    assert row["migrations"] == 0 and row["finished"] + row["refused"] == row["arrived"]


def test_work_sharing_option(tmp_path):
    out = tmp_path / "r.json"
    args = ["bench", *FAST, "--policies", "round_robin,lbkit", "--work-sharing", "level"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["options"]["work_sharing"] == "level"
    for m in report["prefill"].values():
        assert m["work_sharing"] == "level" and m["finished"] == 300
        loss = m["balance_loss"]
        assert loss["total"] == pytest.approx(1.0 - m["balance_efficiency"])
        assert loss["idle_ranks"] + loss["unequal_busy_ranks"] == pytest.approx(loss["total"])
        assert sum(loss["steps_by_busy_ranks"]) == m["steps"]


def test_context_parallel_engines(tmp_path):
    """Under --work-sharing split lbkit routes by engine; a lower efficiency slows every policy
    on a workload of long prompts."""
    out = tmp_path / "r.json"
    reports = []
    for eff in ("1", "0.5"):
        args = ["bench", *FAST, "--policies", "round_robin,lbkit", "--work-sharing", "split",
                "--cp-efficiency", eff, "--json", str(out)]  # fmt: skip
        assert main(args) == 0
        reports.append(json.loads(out.read_text()))
    fast, slow = reports
    assert fast["options"]["cp_efficiency"] == 1.0 and slow["options"]["cp_efficiency"] == 0.5
    for name in ("round_robin", "lbkit"):
        assert fast["prefill"][name]["finished"] == slow["prefill"][name]["finished"] == 300
        assert fast["prefill"][name]["end_s"] <= slow["prefill"][name]["end_s"]


def test_json_is_deterministic_apart_from_timing(tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p in paths:
        assert main(["bench", *FAST, "--policies", "random,lbkit", "--json", str(p)]) == 0
    a, b = (json.loads(p.read_text()) for p in paths)
    a.pop("timing")
    b.pop("timing")
    assert a == b


def test_trace_file(tmp_path, capsys):
    p = tmp_path / "t.csv"
    rows = [
        f"2023-11-16 18:00:{i // 10:02d}.{i % 10}000000,{500 + 37 * i},{20 + i}" for i in range(60)
    ]
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    assert main(["bench", "--trace", str(p), *FAST[2:], "--policies", "lbkit,round_robin"]) == 0
    assert "t.csv" in capsys.readouterr().out


def test_unknown_format_is_refused_by_the_parser(capsys):
    assert main(["bench", "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "--format" in err and "Traceback" not in err and err.count("\n") == 1


def test_subprocess_bad_trace_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": -3, "output_length": 2}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "lbkit", "bench", "--trace", str(bad)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "input_length: must be a positive integer" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help_explains_every_option(capsys):
    assert main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    for opt in ("--trace", "--format", "--utilization", "--seed", "--prefill-engines",
                "--ranks-per-engine", "--decode-ranks", "--policies", "--max-requests", "--json",
                "--plot", "--decode-batch", "--work-sharing", "--cache", "--slo-ttft",
                "--slo-ttft-slowdown", "--slo-tpot", "--attainment", "--no-goodput"):  # fmt: skip
        assert opt in text
