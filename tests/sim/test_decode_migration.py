"""Migration of running requests in the decode simulator (LbkitDecode(migrate_every_s=...))."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.core import PRESETS
from lbkit.sim import _decode_kernels as K
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
    with pytest.raises(ValueError, match="migrate_every_s"):
        LbkitDecode(1, 4, migrate_every_s=-1.0)
    with pytest.raises(ValueError, match="max_migrations"):
        LbkitDecode(1, 4, migrate_every_s=0.1, max_migrations=-1)


def _state(delay_per_token, in_step):
    """Two engines of two ranks; on engine 0: request 0 active on rank 0, 1 and 2 pending on
    rank 0; 3 absent."""
    DI = np.zeros((K.N_DI, 4), dtype=np.int64)
    DI[K.DI_RANK] = [0, 0, 0, -1]
    DI[K.DI_LEFT] = [5, 5, 5, 5]
    DI[K.DI_KV] = [70, 10, 20, 30]
    DI[K.DI_POS] = [0, -1, -1, -1]
    DI[K.DI_NEXT] = [-1, 2, -1, -1]
    DF = np.full((K.N_DF, 4), np.nan)
    DK = np.zeros((K.N_DK, 4), dtype=np.int64)
    DK[K.DK_B, 0], DK[K.DK_S, 0], DK[K.DK_PB, 0], DK[K.DK_PS, 0] = 3, 100, 2, 30
    DE = np.zeros((K.N_DE, 2))
    DE[K.DE_END] = [7.0 if in_step else np.inf, np.inf]
    DE[K.DE_NACT], DE[K.DE_PHEAD], DE[K.DE_PTAIL], DE[K.DE_THEAD] = [1, 0], [1, -1], [2, -1], -1
    ACT = np.zeros((2, 4), dtype=np.int64)
    D = np.zeros(K.N_D)
    D[K.D_RANKS] = 2
    D[K.D_MIG_TOKEN] = delay_per_token
    return DI, DF, DK, DE, ACT, D


@pytest.mark.jit_parity(kernels=(K.decode_migrate,))
@pytest.mark.parametrize("delay_per_token", [0.0, 0.01])
@pytest.mark.parametrize("in_step", [False, True])
def test_decode_migrate_kernel_jit_parity(delay_per_token, in_step):
    moves = [(0, 1), (2, 1), (1, 1), (1, 0), (3, 0), (0, 0), (0, 2)]
    outs = []
    for fn in (K.decode_migrate, K.decode_migrate.py_func):
        arrays = _state(delay_per_token, in_step)
        codes = [fn(i, g, 1.0 + j, *arrays) for j, (i, g) in enumerate(moves)]
        outs.append((codes, arrays))
    assert outs[0][0] == outs[1][0] == [0, 0, 0, 0, -1, 0, 0]
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_migrate_kernel_keeps_the_ledger():
    """Counts follow the request; with a transfer time it leaves the pending list for the
    transit list (or, in a running step, is marked to leave at the step's end)."""
    DI, DF, DK, DE, ACT, D = _state(0.01, in_step=True)
    assert K.decode_migrate(2, 1, 1.0, DI, DF, DK, DE, ACT, D) == 0  # pending, the list's tail
    assert DE[K.DE_PHEAD, 0] == 1 and DE[K.DE_PTAIL, 0] == 1 and DE[K.DE_THEAD, 0] == 2
    assert DI[K.DI_POS, 2] == K.POS_TRANSIT and DF[K.DF_READY, 2] == pytest.approx(1.2)
    assert K.decode_migrate(0, 1, 2.0, DI, DF, DK, DE, ACT, D) == 0  # active in the step
    assert DE[K.DE_NACT, 0] == 1 and DI[K.DI_POS, 0] == 0 and DF[K.DF_READY, 0] == 2.7
    np.testing.assert_array_equal(DK[K.DK_B], [1, 2, 0, 0])
    np.testing.assert_array_equal(DK[K.DK_S], [10, 90, 0, 0])
    np.testing.assert_array_equal(DK[K.DK_PB], [1, 0, 0, 0])
    np.testing.assert_array_equal(DK[K.DK_TB], [0, 2, 0, 0])
    np.testing.assert_array_equal(DK[K.DK_TS], [0, 90, 0, 0])
    # to engine 1: request 2 leaves engine 0's transit list for engine 1's and restarts
    assert K.decode_migrate(2, 3, 3.0, DI, DF, DK, DE, ACT, D) == 0
    assert DE[K.DE_THEAD, 0] == -1 and DE[K.DE_THEAD, 1] == 2 and DF[K.DF_READY, 2] == 3.2
    # a pending request moved to another engine waits for it even without a transfer time
    D[K.D_MIG_TOKEN] = 0.0
    assert K.decode_migrate(1, 2, 4.0, DI, DF, DK, DE, ACT, D) == 0
    assert DE[K.DE_PHEAD, 0] == -1 and DE[K.DE_PTAIL, 0] == -1 and DE[K.DE_THEAD, 1] == 1
    assert DI[K.DI_NEXT, 1] == 2 and DF[K.DF_READY, 1] == 4.0
    np.testing.assert_array_equal(DK[K.DK_B], [0, 1, 1, 1])
    np.testing.assert_array_equal(DK[K.DK_TB], [0, 1, 1, 1])
    np.testing.assert_array_equal(DK[K.DK_PB], [0, 0, 0, 0])


class _Scripted:
    """Routes every request to rank 0; at the first decision at or after ``at_s`` asks to move
    ``request`` to ``rank``."""

    def __init__(self, request, rank, at_s):
        self.move, self.at_s, self.done = (request, rank), at_s, False
        self.views = []

    def route(self, request, kv_tokens, /, *, now_s, view):
        return 0

    def observe(self, finished, /, *, now_s, view):
        self.views.append((view.num_requests.copy(), view.kv_tokens.copy()))

    def migrations(self, *, now_s, view):
        if now_s >= self.at_s and not self.done:
            self.done = True
            return [self.move]
        return []


def test_transfer_time_stalls_the_migrated_request():
    """Unit costs (step ``1 + B + 0.001 S``): request 0 (1,000 tokens, 10 steps) is moved at
    5 s, during its second step (3.0-6.001 s); it finishes that step, waits for its
    1,001 x 0.01 s transfer (until 15.01 s) while request 1 runs alone (6.001-8.101 s), then
    runs its last 8 steps on rank 1 (16 + 0.001 x (1,002 + ... + 1,009) s)."""
    unit = PRESETS["unit"]
    t = Trace(arrival_s=[0.0, 5.0], total_tokens=[1000, 100], output_tokens=[11, 2])
    kw = dict(num_engines=1, ranks_per_engine=2, cost=unit.decode)
    run = simulate_decode(t, _Scripted(0, 1, 5.0), migration_s_per_kv_token=0.01, **kw)
    assert run.rank.tolist() == [1, 0]
    assert run.finish_s[1] == pytest.approx(8.101)
    assert run.finish_s[0] == pytest.approx(15.01 + 16 + 0.001 * sum(range(1002, 1010)))
    assert run.migrations == 1 and run.migration_s == pytest.approx(10.01)
    assert run.tokens_generated == 11 and run.num_steps == 11
    # without a transfer time it keeps its pace (steps of both ranks overlap)
    free = simulate_decode(t, _Scripted(0, 1, 5.0), **kw)
    assert free.migrations == 1 and free.migration_s == 0.0
    assert free.finish_s[0] < run.finish_s[0] - 9.0 and free.tokens_generated == 11


def test_a_request_moved_to_another_engine_joins_its_next_step():
    """Two engines of one rank, unit costs. Request 0 (1,000 tokens, 10 steps) runs on engine
    0 (steps 0-3.0, 3.0-6.001 s); moved at 5 s to engine 1, idle until then, it finishes its
    step on engine 0 and, without a transfer time, engine 1 starts a step at 6.001 s for its
    last 8 steps (16 + 0.001 x (1,002 + ... + 1,009) s)."""
    unit = PRESETS["unit"]
    t = Trace(arrival_s=[0.0, 5.0], total_tokens=[1000, 100], output_tokens=[11, 2])
    pol = _Scripted(0, 1, 5.0)
    run = simulate_decode(t, pol, num_engines=2, ranks_per_engine=1, cost=unit.decode)
    assert run.rank.tolist() == [1, 0] and run.migrations == 1 and run.migration_s == 0.0
    assert run.finish_s[0] == pytest.approx(6.001 + 16 + 0.001 * sum(range(1002, 1010)))
    assert run.finish_s[1] == pytest.approx(6.001 + 2.1)  # request 1 alone on engine 0
    assert run.tokens_generated == 11
    assert pol.views[-1][0].sum() == 0 and pol.views[-1][1].sum() == 0


def test_lbkit_migrates_across_engines():
    """Two engines of 8 ranks: lbkit's balancer plans over all 16 ranks and the simulator
    moves requests between engines; every request finishes and the ledger empties."""
    t = _heavy_tailed(800, seed=2)
    pol = LbkitDecode(2, 8, migrate_every_s=0.0)
    run = simulate_decode(t, pol, num_engines=2, ranks_per_engine=8, cost=H800.decode,
                          migration_s_per_kv_token=1e-6)  # fmt: skip
    assert run.migrations > 0 and not np.isnan(run.finish_s).any()
    assert run.tokens_generated == int((t.output_tokens - 1).sum())
    assert len(pol.balancer) == 0


def test_transfer_with_a_latency_only():
    unit = PRESETS["unit"]
    t = Trace(arrival_s=[0.0, 5.0], total_tokens=[1000, 100], output_tokens=[11, 2])
    pol = _Scripted(0, 1, 5.0)
    run = simulate_decode(t, pol, num_engines=1, ranks_per_engine=2, cost=unit.decode,
                          migration_latency_s=20.0)  # fmt: skip
    assert run.migration_s == 20.0
    assert run.finish_s[0] == pytest.approx(25.0 + 16 + 0.001 * sum(range(1002, 1010)))
    # the simulator's ledger is empty at the end: the transfer's reservation was released
    assert pol.views[-1][0].sum() == 0 and pol.views[-1][1].sum() == 0


class _RandomMigrator:
    """Least-requests routing; at every decision moves one random running request."""

    def __init__(self, ranks, seed):
        self.rng = np.random.default_rng(seed)
        self.ranks = ranks
        self.running = set()
        self.last_view = None

    def route(self, request, kv_tokens, /, *, now_s, view):
        self.running.add(request)
        return int(np.argmin(view.num_requests))

    def observe(self, finished, /, *, now_s, view):
        self.running.difference_update(finished.tolist())
        self.last_view = view

    def migrations(self, *, now_s, view):
        if not self.running or self.rng.random() < 0.3:
            return []
        i = sorted(self.running)[self.rng.integers(len(self.running))]
        return [(i, int(self.rng.integers(self.ranks)))]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("latency_s", [0.0, 0.003, 0.05])
@pytest.mark.parametrize("engines", [1, 2])
def test_random_migrations_with_transfers_conserve_every_token(seed, latency_s, engines):
    """Whatever the moves (pending, mid-step, in transit, to the same rank, to another
    engine), every request generates exactly its tokens and the per-rank ledger empties."""
    t = synthetic_trace(300, rate_per_s=200.0, rng=seed)
    pol = _RandomMigrator(4, seed)
    run = simulate_decode(t, pol, num_engines=engines, ranks_per_engine=4 // engines,
                          cost=H800.decode, migration_latency_s=latency_s,
                          migration_s_per_kv_token=1e-6)  # fmt: skip
    fin = run.output_tokens > 1
    assert not np.isnan(run.finish_s[fin]).any()
    assert run.tokens_generated == int((t.output_tokens[fin] - 1).sum())
    assert run.migrations > 0 and run.migration_s > 0.0
    assert pol.last_view.num_requests.sum() == 0 and pol.last_view.kv_tokens.sum() == 0
    m = decode_metrics(run)
    assert m["finished"] + m["refused"] + m["in_flight"] == m["arrived"]


def test_transfer_options_are_checked():
    t = Trace(arrival_s=[0.0], total_tokens=[10], output_tokens=[3])
    with pytest.raises(ValueError, match="migration_latency_s"):
        simulate_decode(t, "lbkit", cost=H800.decode, migration_latency_s=-1.0)
    with pytest.raises(ValueError, match="migration_s_per_kv_token"):
        simulate_decode(t, "lbkit", cost=H800.decode, migration_s_per_kv_token=float("nan"))


def test_the_lbkit_policy_is_the_decode_balancers_defaults():
    from lbkit.decode import DecodeBalancer

    pol = LbkitDecode(1, 8)
    assert pol.balancer.state_dict()["config"] == DecodeBalancer(8).state_dict()["config"]
    # With the pool's admission limits: the same balancer given those limits, nothing else.
    t = Trace(arrival_s=[0.0, 0.0], total_tokens=[10, 20], output_tokens=[3, 3])
    simulate_decode(t, pol, num_engines=1, ranks_per_engine=8, cost=H800.decode,
                    max_kv_tokens=1000, kv_watermark_tokens=10)  # fmt: skip
    want = DecodeBalancer(8, max_kv_tokens=990).state_dict()["config"]
    assert pol.balancer.state_dict()["config"] == want


def test_the_default_makes_room_under_back_pressure_and_loses_nothing():
    # Ranks of 40,000 tokens and prompts up to a rank's size: without room-making a long prompt
    # at the queue's head waits for a rank to drain.
    rng = np.random.default_rng(7)
    n = 600
    t = Trace(
        arrival_s=np.sort(rng.uniform(0.0, 5.0, n)),
        total_tokens=np.minimum(rng.lognormal(8.0, 1.2, n), 30000).astype(np.int64) + 1,
        output_tokens=np.maximum(2, rng.lognormal(4.0, 0.8, n)).astype(np.int64),
    )
    kw = dict(num_engines=1, ranks_per_engine=8, cost=H800.decode, max_kv_tokens=40000,
              kv_watermark_tokens=400, migration_s_per_kv_token=1.76e-6)  # fmt: skip
    plain = simulate_decode(t, LbkitDecode(1, 8, migrate_every_s=None), **kw)
    room_only = simulate_decode(t, LbkitDecode(1, 8, max_migrations=0), **kw)
    pol = LbkitDecode(1, 8)
    default = simulate_decode(t, pol, **kw)
    for run in (plain, room_only, default):
        assert run.finished.sum() == run.arrived.sum() - run.refused.sum()
    assert plain.migrations == 0 and room_only.migrations > 0 and default.migrations > 0
    assert np.nansum(room_only.wait_s) < np.nansum(plain.wait_s)
    pol.balancer._check()
    assert len(pol.balancer) == 0  # every request finished and left the ledger
