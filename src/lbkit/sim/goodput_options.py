"""Options of a goodput search (:mod:`lbkit.sim.goodput_bench`), grouped in frozen values.

:class:`Pools` holds the pool shapes, :class:`GoodputOptions` everything else a search replays
and judges apart from the trace, the policy and the cost model; both validate on construction
and compare by value, so that equal options give identical results. The defaults are what
``lbkit bench`` runs (SPEC section 8: 8 x 8 prefill ranks, one decode engine of 64 ranks, the
default SLO, the global prefix cache, bisection to 1%).

Examples
--------
>>> opts = GoodputOptions(pools=Pools(ranks_per_engine=4), cache="local")
>>> opts.pools.num_prefill_ranks, opts.cache, opts.decode_policy
(32, 'local', 'lbkit')
>>> dataclasses.replace(opts, cache="shared")
Traceback (most recent call last):
...
ValueError: cache: must be one of 'none', 'global', 'local'; got 'shared'
"""

from __future__ import annotations

import dataclasses

from lbkit.core.validation import check_choice, check_int, check_real
from lbkit.sim.goodput import DEFAULT_SLO, Slo
from lbkit.sim.policies_decode import DECODE_POLICIES, DEFAULT_DECODE_POLICY

__all__ = ["CACHE_MODES", "DEFAULT_GOODPUT_OPTIONS", "GoodputOptions", "Pools"]

#: Prefix-cache modes of the prefill pool (``lbkit bench --cache``).
CACHE_MODES = ("none", "global", "local")


@dataclasses.dataclass(frozen=True, slots=True)
class Pools:
    """Shapes of the prefill and decode pools (SPEC section 8: the DeepSeek unit by default).

    Parameters
    ----------
    prefill_engines : int, default 8
        Prefill engines (>= 1; ``lbkit bench --prefill-engines``).
    ranks_per_engine : int, default 8
        DP ranks per prefill engine (>= 1; ``--ranks-per-engine``).
    decode_engines : int, default 1
        Decode engines (>= 1; ``--decode-engines``).
    decode_ranks : int, default 64
        DP ranks per decode engine (>= 1; ``--decode-ranks``).

    Examples
    --------
    >>> Pools().num_prefill_ranks, Pools(prefill_engines=2, ranks_per_engine=4).num_prefill_ranks
    (64, 8)
    >>> Pools(decode_ranks=0)
    Traceback (most recent call last):
    ...
    ValueError: decode_ranks: must be >= 1, got 0
    """

    prefill_engines: int = 8
    ranks_per_engine: int = 8
    decode_engines: int = 1
    decode_ranks: int = 64

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_int(getattr(self, f.name), f.name, min_value=1))

    @property
    def num_prefill_ranks(self) -> int:
        """Prefill ranks in all (``prefill_engines * ranks_per_engine``)."""
        return self.prefill_engines * self.ranks_per_engine


@dataclasses.dataclass(frozen=True, slots=True)
class GoodputOptions:
    """What a goodput search replays and judges, apart from the trace, policy and cost model.

    Equal options give identical results: every field is a value (no generator, no hook).

    Parameters
    ----------
    pools : Pools, default ``Pools()``
        Prefill and decode pool shapes (8 x 8 prefill ranks, one decode engine of 64 ranks).
    slo : Slo, default :data:`lbkit.sim.goodput.DEFAULT_SLO`
        What a request must meet, and the share of requests that must meet it.
    cache : {"none", "global", "local"}, default "global"
        Prefix caches of the prefill pool (see the module docstring).
    decode_policy : str, default "lbkit"
        A key of :data:`lbkit.sim.policies_decode.DECODE_POLICIES`: routes the decode pool of
        every evaluation judged on TPOT.
    rel_tol : float, default 0.01
        Relative tolerance of the rate search (> 0; SPEC section 8: to 1%).
    budget_s : float, default 1.0
        Time budget of a prefill rank's step plan, seconds (> 0; ``--budget``).
    seed : int, default 0
        Seed of randomised policies (>= 0; ``--seed``).

    Examples
    --------
    >>> opts = GoodputOptions(pools=Pools(prefill_engines=2), cache="none")
    >>> opts.pools.num_prefill_ranks, opts.slo.attainment, opts == GoodputOptions()
    (16, 0.99, False)
    >>> dataclasses.replace(opts, rel_tol=0.0)
    Traceback (most recent call last):
    ...
    ValueError: rel_tol: must be > 0.0, got 0.0
    """

    pools: Pools = Pools()
    slo: Slo = DEFAULT_SLO
    cache: str = "global"
    decode_policy: str = DEFAULT_DECODE_POLICY
    rel_tol: float = 0.01
    budget_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, kind in (("pools", Pools), ("slo", Slo)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(
                    f"{name}: must be a {kind.__name__}, got {type(value).__name__} {value!r}"
                )
        check_choice(self.cache, "cache", CACHE_MODES)
        check_choice(self.decode_policy, "decode_policy", tuple(DECODE_POLICIES))
        pos = {"min_value": 0.0, "strict_min": True}
        object.__setattr__(self, "rel_tol", check_real(self.rel_tol, "rel_tol", **pos))
        object.__setattr__(self, "budget_s", check_real(self.budget_s, "budget_s", **pos))
        object.__setattr__(self, "seed", check_int(self.seed, "seed", min_value=0))


#: What ``lbkit bench`` runs by default.
DEFAULT_GOODPUT_OPTIONS = GoodputOptions()
