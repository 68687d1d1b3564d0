"""Migration of running requests in the decode simulator (LbkitDecode(migrate_every_s=...))."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.core import PRESETS
from lbkit.sim import _kernels as K
from lbkit.sim.engine import simulate_decode
from lbkit.sim.metrics import decode_metrics
from lbkit.sim.policies_decode import LbkitDecode
from lbkit.sim.traces import Trace
from lbkit.sim.workload import synthetic_trace

H800 = PRESETS["h800_dsv3"]


def _heavy_tailed(n=3000, seed=4):
    rng = np.random.default_rng(seed)
    return Trace(
        arrival_s=np.sort(rng.uniform(0.0, 30.0, n)),
        total_tokens=np.maximum(1, rng.lognormal(8.8, 1.4, n)).astype(np.int64),
        output_tokens=np.maximum(2, rng.lognormal(5.5, 1.0, n)).astype(np.int64),
    )


def _run(trace, every, moves=1):
    pol = LbkitDecode(1, 16, migrate_every_s=every, max_migrations=moves)
    run = simulate_decode(trace, pol, num_engines=1, ranks_per_engine=16, cost=H800.decode,
                          window_s=(5.0, 30.0))  # fmt: skip
    return pol, run


def test_migration_conserves_requests_and_raises_balance():
    """Placement at admission leaves the imbalance departures create; migrating one request
    at every arrival (at most) lowers both imbalances and raises the efficiency (measured on
    this trace: 0.897 to 0.981)."""
    t = _heavy_tailed()
    still_pol, still = _run(t, None)
    pol, moved = _run(t, 0.0)
    n = pol.balancer.statistics().migrated
    assert n > 0 and still_pol.balancer.statistics().migrated == 0
    assert pol.migrated_kv_tokens > 0
    for run in (still, moved):  # every request finished, on a valid rank
        assert not np.isnan(run.finish_s).any() and (run.rank >= 0).all() and (run.rank < 16).all()
        assert len(pol.balancer) == 0
    a, b = decode_metrics(still)["window"], decode_metrics(moved)["window"]
    assert b["balance_efficiency"] >= a["balance_efficiency"] + 0.05
    assert b["count_imbalance"] < a["count_imbalance"] and b["kv_imbalance"] < a["kv_imbalance"]
    # the simulator's per-rank ledger and the balancer's agree on where requests finished
    assert (moved.rank != still.rank).any()


def test_migration_is_deterministic():
    t = _heavy_tailed(800, seed=1)
    a, b = _run(t, 0.01)[1], _run(t, 0.01)[1]
    np.testing.assert_array_equal(a.rank, b.rank)
    np.testing.assert_array_equal(a.finish_s, b.finish_s)


class _BadMigrator:
    """Routes request i to rank i % 2 and then asks for one given migration."""

    def __init__(self, move):
        self.move = move
        self.done = False

    def route(self, request, kv_tokens, /, *, now_s, view):
        return request % 2

    def observe(self, finished, /, *, now_s, view):
        pass

    def migrations(self, *, now_s, view):
        if now_s > 0.5 and not self.done:
            self.done = True
            return [self.move]
        return []


@pytest.mark.parametrize(
    ("move", "kw", "match"),
    [
        ((0, 9), {}, "outside"),
        ((0, 3), {}, "another engine"),
        ((1, 1), {}, "not running"),  # request 1 arrives later: not admitted yet
        ((0, 1), {"max_batch": 1}, "capacity"),
    ],
)
def test_bad_migrations_are_refused(move, kw, match):
    t = Trace(arrival_s=[0.0, 0.4, 2.0], total_tokens=[100, 100, 100],
              output_tokens=[400, 400, 400])  # fmt: skip
    if move == (1, 1):
        t = Trace(arrival_s=[0.0, 0.6, 2.0], total_tokens=[100, 100, 100],
                  output_tokens=[400, 400, 400])  # fmt: skip
    with pytest.raises(ValueError, match=match):
        simulate_decode(t, _BadMigrator(move), num_engines=2, ranks_per_engine=2,
                        cost=H800.decode, **kw)  # fmt: skip


def test_lbkit_decode_migration_options_are_checked():
    with pytest.raises(ValueError, match="migrate_every_s: migration needs one decode engine"):
        LbkitDecode(2, 4, migrate_every_s=0.1)
    with pytest.raises(ValueError, match="migrate_every_s"):
        LbkitDecode(1, 4, migrate_every_s=-1.0)
    with pytest.raises(ValueError, match="max_migrations"):
        LbkitDecode(1, 4, migrate_every_s=0.1, max_migrations=-1)


@pytest.mark.skipif(not hasattr(K.decode_migrate, "py_func"), reason="numba JIT disabled")
def test_decode_migrate_kernel_jit_parity():
    t = synthetic_trace(50, rate_per_s=20.0, rng=3)
    pol = LbkitDecode(1, 4, migrate_every_s=0.0)
    simulate_decode(t, pol, num_engines=1, ranks_per_engine=4, cost=H800.decode)
    for pending in (True, False):
        outs = []
        for fn in (K.decode_migrate, K.decode_migrate.py_func):
            DI = np.zeros((K.N_DI, 2), dtype=np.int64)
            DI[K.DI_RANK] = [0, -1]
            DI[K.DI_LEFT] = [5, 5]
            DI[K.DI_KV] = [70, 10]
            DI[K.DI_POS] = -1 if pending else 0
            DK = np.array([[3, 1], [500, 80], [1, 0], [70, 0]], dtype=np.int64)
            D = np.zeros(K.N_D)
            D[K.D_RANKS] = 2
            codes = (fn(0, 1, DI, DK, D), fn(1, 0, DI, DK, D))
            outs.append((codes, DI.tolist(), DK.tolist()))
        assert outs[0] == outs[1]
        assert outs[0][0] == (0, -1)
