"""Benchmarks of ``lbkit.decode``: decision latency (pytest-benchmark) and stream balance (script).

Microbenchmarks, groups ``<function>|<size>``. Admission is measured beside a bare
``numpy.argmin`` over the same number of ranks, in one run, with the same rounds and iterations,
so that their ratio can be read off the table::

    python -m pytest benchmarks/bench_decode.py --benchmark-enable -p no:cacheprovider

Under the default ``--benchmark-disable`` each body runs once (and checks its result).

Run as a script, it replays seeded decode streams through every policy and prints the balance
table (count and KV imbalance, modelled balance efficiency), optionally as JSON::

    python benchmarks/bench_decode.py [--seeds 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import lbkit
from lbkit.core import PRESETS
from lbkit.decode import DecodeBalancer, assign_batch, pick_rank, plan_migrations

ROUNDS, ITERATIONS = 30, 1000  # 30k admissions per benchmark
COST = PRESETS["h800_dsv3"].decode.with_combine("max")


@pytest.fixture(scope="module", autouse=True)
def _warm():
    lbkit.warmup(packages=("decode",))


def _engine(ranks: int, **kw) -> DecodeBalancer:
    """A balancer holding 16 requests per rank with lognormal KV lengths."""
    bal = DecodeBalancer(ranks, **kw)
    rng = np.random.default_rng(0)
    for i in range(16 * ranks):
        bal.admit(f"w{i}", int(rng.lognormal(8.5, 1.0)), expected_output_tokens=100)
    return bal


@pytest.mark.parametrize("ranks", [128])
def bench_numpy_argmin(benchmark, ranks):
    loads = np.random.default_rng(0).random(ranks)
    benchmark.group = f"decode_admit|{ranks}"
    benchmark.extra_info["baseline"] = True
    got = benchmark.pedantic(
        np.argmin, args=(loads,), rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=1
    )
    assert got == loads.argmin()


@pytest.mark.parametrize(
    ("ranks", "lookahead"), [(128, 0), (128, 8)], ids=["default", "lookahead8"]
)
def bench_admit(benchmark, ranks, lookahead):
    bal = _engine(ranks, lookahead_steps=lookahead)
    ids = itertools.count()

    def admit():
        return bal.admit(next(ids), 3000)

    benchmark.group = f"decode_admit|{ranks}"
    d = benchmark.pedantic(admit, rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=1)
    assert d.reason == "placed"
    bal._check()
    assert len(bal) == 16 * ranks + next(ids)


@pytest.mark.parametrize("ranks", [128])
def bench_admit_and_finish(benchmark, ranks):
    bal = _engine(ranks)
    ids = itertools.count()

    def cycle():
        i = next(ids)
        bal.admit(i, 3000)
        return bal.finish(i)

    benchmark.group = f"decode_admit|{ranks}"
    benchmark.pedantic(cycle, rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=1)
    bal._check()
    assert len(bal) == 16 * ranks


@pytest.mark.parametrize("ranks", [128])
def bench_step(benchmark, ranks):
    bal = _engine(ranks, lookahead_steps=8)
    benchmark.group = f"decode_step|{ranks}x16"
    benchmark(bal.step)
    bal._check()


@pytest.mark.parametrize("ranks", [128])
def bench_pick_rank(benchmark, ranks):
    rng = np.random.default_rng(1)
    b, s = rng.integers(0, 32, ranks), rng.integers(0, 10**6, ranks)
    benchmark.group = f"decode_pick_rank|{ranks}"
    assert benchmark(pick_rank, b, s, 3000).reason == "placed"


@pytest.mark.parametrize(("ranks", "batch"), [(128, 256)])
def bench_assign_batch(benchmark, ranks, batch):
    rng = np.random.default_rng(2)
    b, s = rng.integers(0, 32, ranks), rng.integers(0, 10**6, ranks)
    kv = rng.lognormal(8.5, 1.0, batch).astype(np.int64)
    benchmark.group = f"decode_assign_batch|{ranks}x{batch}"
    out = benchmark(assign_batch, b, s, kv)
    assert out.num_requests.sum() == b.sum() + batch


@pytest.mark.parametrize(("ranks", "requests", "moves"), [(64, 4096, 4)])
def bench_plan_migrations(benchmark, ranks, requests, moves):
    rng = np.random.default_rng(3)
    rank = rng.integers(0, ranks, requests)
    kv = rng.lognormal(8.8, 1.2, requests).astype(np.int64)
    benchmark.group = f"decode_plan_migrations|{ranks}x{requests}x{moves}"
    plan_migrations(rank, kv, num_ranks=ranks, max_moves=moves)  # compile first
    out = benchmark(plan_migrations, rank, kv, num_ranks=ranks, max_moves=moves)
    assert len(out.request) == moves and out.objective_after < out.objective_before


# ---------------------------------------------------------------------------- stream balance
def stream_table(seeds: int = 10, ranks: tuple[int, ...] = (8, 16, 64)) -> dict:
    """Mean balance figures per policy over seeded streams (:mod:`lbkit.sim.streams`)."""
    from lbkit.decode import POLICIES
    from lbkit.sim.streams import make_stream, replay

    policies = [*POLICIES, "sum_of_squares+lookahead8"]
    out: dict = {}
    for n in ranks:
        rows: dict = {p: {"count_imbalance": [], "kv_imbalance": [], "efficiency": []}
                      for p in policies}  # fmt: skip
        for seed in range(seeds):
            stream = make_stream(seed, steps=300, rate=n * 0.75, kv_sigma=1.0, kv_median=6000.0)
            for p in policies:
                name, h = (p.split("+")[0], 8) if "+" in p else (p, 0)
                r = replay(stream, n, name, cost=COST, lookahead_steps=h)
                rows[p]["count_imbalance"].append(r.count_imbalance)
                rows[p]["kv_imbalance"].append(r.kv_imbalance)
                rows[p]["efficiency"].append(r.efficiency)
        out[str(n)] = {p: {k: float(np.mean(v)) for k, v in row.items()} for p, row in rows.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    lbkit.warmup(packages=("decode",))
    table = stream_table(args.seeds)
    print(
        "Streams: 300 steps, Poisson arrivals (0.75 per rank per step), lognormal KV (median "
        "6000, sigma 1), lognormal outputs (median 60, sigma 1); figures after 50 warm-up steps,\n"
        f"mean over {args.seeds} seeds; efficiency of h800_dsv3 decode step times, combine=max."
    )
    for n, rows in table.items():
        print(f"\n{n} ranks\n{'policy':28s} {'count imb':>10s} {'KV imb':>10s} {'efficiency':>11s}")
        for p, r in rows.items():
            print(
                f"{p:28s} {r['count_imbalance']:10.3f} {r['kv_imbalance']:10.3f} "
                f"{r['efficiency']:11.4f}"
            )
    if args.json is not None:
        tables = [
            {
                "title": f"Decode streams, {n} ranks",
                "note": f"Mean over {args.seeds} seeds; `python benchmarks/bench_decode.py`.",
                "columns": ["policy", "count imbalance", "KV imbalance", "balance efficiency"],
                "rows": [
                    [p, r["count_imbalance"], r["kv_imbalance"], r["efficiency"]]
                    for p, r in rows.items()
                ],
            }
            for n, rows in table.items()
        ]
        payload = {"decode_streams": table, "tables": tables}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
