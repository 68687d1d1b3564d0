"""The option objects of the goodput search: validation, value semantics, and equal options giving
identical results through prefill_goodput, ideal_goodput and run_goodput."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.cli import build_parser
from lbkit.core import PRESETS
from lbkit.sim.goodput import DEFAULT_SLO, Slo
from lbkit.sim.goodput_bench import (
    CACHE_MODES,
    DEFAULT_GOODPUT_OPTIONS,
    GoodputOptions,
    Pools,
    ideal_goodput,
    local_caches,
    prefill_goodput,
    prepare_cache,
    run_goodput,
)
from lbkit.sim.policies_decode import DECODE_POLICIES
from lbkit.sim.workload import default_workload

POOL_FIELDS = [f.name for f in dataclasses.fields(Pools)]
POSITIVE_REALS = ("rel_tol", "budget_s")
NOT_AN_INT = st.one_of(
    st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.booleans(), st.just([1])
)
NOT_A_REAL = st.one_of(st.text(max_size=3), st.none(), st.booleans(), st.just([1.0]))
NOT_POSITIVE = st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf))
#: Small pools and a short trace: each search replays ~10 times, in well under a second.
SMALL = Pools(prefill_engines=1, ranks_per_engine=2, decode_engines=1, decode_ranks=4)
COST = PRESETS["h800_dsv3"]
UNKNOWN_CHOICE = st.one_of(
    st.text(max_size=12).filter(lambda v: v not in CACHE_MODES and v not in DECODE_POLICIES),
    st.none(),
    st.integers(),
)
#: (class, field, bad values, error, rule the message states).
BAD = [
    *[(Pools, f, st.integers(max_value=0), ValueError, "must be >= 1") for f in POOL_FIELDS],
    *[(Pools, f, NOT_AN_INT, TypeError, "must be an integer") for f in POOL_FIELDS],
    *[(GoodputOptions, f, NOT_POSITIVE, ValueError, "must ") for f in POSITIVE_REALS],
    *[(GoodputOptions, f, NOT_A_REAL, TypeError, "must be a real number") for f in POSITIVE_REALS],
    (GoodputOptions, "seed", st.integers(max_value=-1), ValueError, "must be >= 0"),
    (GoodputOptions, "seed", NOT_AN_INT, TypeError, "must be an integer"),
    (GoodputOptions, "cache", UNKNOWN_CHOICE, ValueError, "must be one of"),
    (GoodputOptions, "decode_policy", UNKNOWN_CHOICE, ValueError, "must be one of"),
    (GoodputOptions, "pools", st.sampled_from([(8, 8, 1, 64), {"prefill_engines": 8}, None,
                                               DEFAULT_SLO]), TypeError, "must be a Pools"),
    (GoodputOptions, "slo", st.sampled_from([DEFAULT_SLO.as_dict(), 0.99, Pools()]), TypeError,
     "must be a Slo"),
]  # fmt: skip


# ------------------------------------------------------------------ validation and value semantics
@pytest.mark.parametrize(
    ("cls", "field", "values", "error", "rule"),
    BAD,
    ids=[f"{c.__name__}.{f}-{e.__name__}" for c, f, _, e, _ in BAD],
)
@given(data=st.data())
def test_options_reject_bad_values_by_name(cls, field, values, error, rule, data):
    value = data.draw(values, label=field)
    with pytest.raises(error, match=f"^{re.escape(field)}: {re.escape(rule)}"):
        cls(**{field: value})


@given(sizes=st.lists(st.integers(1, 4096), min_size=4, max_size=4))
def test_pools_normalise_numpy_integers_and_compare_by_value(sizes):
    plain = Pools(*sizes)
    numpy = Pools(*(np.int64(n) for n in sizes))
    assert plain == numpy and hash(plain) == hash(numpy)
    assert all(type(getattr(numpy, f)) is int for f in POOL_FIELDS)
    assert numpy.num_prefill_ranks == sizes[0] * sizes[1]


@pytest.mark.parametrize("cache", CACHE_MODES)
@pytest.mark.parametrize("decode_policy", sorted(DECODE_POLICIES))
def test_options_accept_every_choice(cache, decode_policy):
    opts = GoodputOptions(cache=cache, decode_policy=decode_policy)
    assert (opts.cache, opts.decode_policy) == (cache, decode_policy)


@given(
    rel_tol=st.floats(1e-6, 1.0),
    budget_s=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**32),
    ranks=st.integers(1, 64),
)
def test_options_compare_by_value(rel_tol, budget_s, seed, ranks):
    kw = dict(rel_tol=rel_tol, budget_s=budget_s, seed=seed)
    a = GoodputOptions(pools=Pools(ranks_per_engine=ranks), **kw)
    b = GoodputOptions(
        pools=Pools(ranks_per_engine=np.int64(ranks)),
        **{k: np.float64(v) if k != "seed" else np.uint64(v) for k, v in kw.items()},
    )
    assert a == b and hash(a) == hash(b) and dataclasses.replace(a) == a
    assert type(b.rel_tol) is float and type(b.budget_s) is float and type(b.seed) is int
    assert a != dataclasses.replace(a, seed=seed + 1)


def test_options_are_frozen_and_slotted():
    opts = GoodputOptions()
    for obj, field, value in ((opts, "seed", 1), (opts.pools, "decode_ranks", 8)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, value)
        assert not hasattr(obj, "__dict__")


def test_defaults_are_what_lbkit_bench_runs():
    args = build_parser().parse_args(["bench"])
    opts = DEFAULT_GOODPUT_OPTIONS
    assert opts == GoodputOptions()
    assert opts.pools == Pools(**{f: getattr(args, f) for f in POOL_FIELDS})
    assert opts.slo == Slo(ttft_s=args.slo_ttft, ttft_slowdown=args.slo_ttft_slowdown,
                           tpot_s=args.slo_tpot, attainment=args.attainment)  # fmt: skip
    assert (opts.cache, opts.budget_s, opts.seed) == (args.cache, args.budget, args.seed)
    # SPEC section 8: the DeepSeek unit, bisection to 1%, lbkit routing the decode pool.
    pools = opts.pools
    assert (pools.num_prefill_ranks, pools.decode_engines * pools.decode_ranks) == (64, 64)
    assert (opts.rel_tol, opts.decode_policy) == (0.01, "lbkit")


# ------------------------------------------------------------------ the searches
@pytest.fixture(scope="module")
def trace():
    return default_workload(num_requests=250, rng=4)


def _equal_pair(cache: str) -> tuple[GoodputOptions, GoodputOptions]:
    # The same options built two ways: plain values, and numpy scalars through replace().
    a = GoodputOptions(pools=SMALL, slo=Slo(tpot_s=0.06), cache=cache, rel_tol=0.05, seed=2)
    b = dataclasses.replace(
        GoodputOptions(),
        pools=Pools(*(np.int32(getattr(SMALL, f)) for f in POOL_FIELDS)),
        slo=Slo(tpot_s=np.float64(0.06)),
        cache=cache,
        rel_tol=np.float64(0.05),
        seed=np.int64(2),
    )
    assert a == b and a is not b
    return a, b


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_equal_options_give_identical_goodput(trace, cache):
    a, b = _equal_pair(cache)
    prepared = prepare_cache(trace, cache)
    hook = local_caches(SMALL.num_prefill_ranks) if cache == "local" else None
    for policy in ("random", "lbkit"):
        ga, gb = (prefill_goodput(prepared, policy, cost=COST, options=o, start_rate=1.0,
                                  rank_cache=hook) for o in (a, b))  # fmt: skip
        assert ga.search.requests_per_s > 0
        assert ga.search == gb.search and ga.metrics == gb.metrics
    ia, ib = (ideal_goodput(prepared, cost=COST, options=o, start_rate=1.0) for o in (a, b))
    assert ia.search.requests_per_s > 0 and ia == ib


def test_equal_options_give_identical_reports(trace):
    a, b = _equal_pair("global")
    prepared = prepare_cache(trace, "global")
    ra, rb = (run_goodput(prepared, policies=["least_tokens", "vllm"], cost=COST, options=o)
              for o in (a, b))  # fmt: skip
    assert ra == rb
    assert ra["slo"] == a.slo.as_dict() and ra["cache"] == "global"
    assert set(ra["goodput"]) == {"least_tokens", "vllm"}


def test_the_ideal_ignores_the_cache_mode(trace):
    # Its reference sees the trace's cached tokens (the global hits) in every cached mode.
    prepared = prepare_cache(trace, "global")
    a = GoodputOptions(pools=SMALL, rel_tol=0.05)
    got = [ideal_goodput(prepared, cost=COST, options=dataclasses.replace(a, cache=c),
                         start_rate=1.0) for c in ("global", "local")]  # fmt: skip
    assert got[0] == got[1]


def test_searches_reject_bad_arguments(trace):
    opts = GoodputOptions(pools=SMALL, cache="none")
    kw = dict(cost=COST, options=opts, start_rate=1.0)
    with pytest.raises(TypeError, match="^options: must be a GoodputOptions"):
        prefill_goodput(trace, "lbkit", cost=COST, options=SMALL, start_rate=1.0)
    with pytest.raises(TypeError, match="^options: must be a GoodputOptions"):
        run_goodput(trace, policies=["lbkit"], cost=COST, options={"cache": "none"})
    with pytest.raises(TypeError, match="^cost: must be a CostPreset"):
        ideal_goodput(trace, cost=COST.prefill, options=opts, start_rate=1.0)
    with pytest.raises(TypeError, match="^trace: must be a Trace"):
        ideal_goodput([1, 2], **kw)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="^start_rate: must"):
            prefill_goodput(trace, "lbkit", **{**kw, "start_rate": bad})
    local = dataclasses.replace(opts, cache="local")
    with pytest.raises(ValueError, match="^rank_cache: required with cache='local'"):
        prefill_goodput(trace, "lbkit", **{**kw, "options": local})
    with pytest.raises(ValueError, match="^policies: must be one of"):
        run_goodput(trace, policies=["lbkit", "fastest"], cost=COST, options=opts)
