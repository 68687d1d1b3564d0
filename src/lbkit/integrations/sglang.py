"""SGLang EPLB algorithm backed by lbkit: :func:`rebalance_experts`, :func:`register`.

SGLang (checked against release 0.5.23, ``python/sglang/srt/eplb/eplb_algorithms/__init__.py``)
plans expert locations through one dispatch function, ``rebalance_experts(tokens_per_expert,
num_physical_experts, num_local_physical_experts, num_groups, num_nodes, algorithm)``, which
``ExpertLocationMetadata.init_by_eplb`` (``eplb/expert_location.py``) calls with keyword
arguments, at start-up from ``--init-expert-location`` loads and at every EPLB rebalance. The
algorithm is an ``EplbAlgorithm`` enum member chosen by ``compute_algorithm`` from
``--eplb-algorithm`` (``auto``: ``deepseek_hierarchical`` when ``num_nodes`` divides
``num_groups``, else ``deepseek``). It returns ``(physical_to_logical_map [layers,
num_physical_experts], logical_to_all_physical_map [layers, num_logical_experts, X] padded with
-1, expert_count [layers, num_logical_experts])``. The enum is closed, so lbkit does not add a
name to it: :func:`register` replaces the dispatcher, and lbkit plans for the ``deepseek*``
algorithms (``*_hierarchical`` keeps SGLang's meaning: the hierarchical policy) while the
others (``elasticity_aware*``, which plan around failed ranks) stay SGLang's.

The dispatcher receives no previous plan; the installed one reads SGLang's plan in service
(``get_global_expert_location_metadata()``) and re-plans from it with few moves
(:func:`replan_experts`). Every rank computes the plan itself from the same all-reduced loads
and the same plan in service, and lbkit's plans are deterministic, so the ranks agree.

Enable it in every SGLang process with SGLang's plugin mechanism: lbkit declares the entry
point ``lbkit_eplb = "lbkit.integrations.sglang:load_plugin"`` in the ``sglang.srt.plugins``
group, which SGLang loads in the engine, scheduler and data-parallel controller processes; the
plugin does nothing unless ``LBKIT_EPLB=1`` is set.

Importing this module needs neither SGLang nor torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lbkit.core.validation import as_float_array, check_int
from lbkit.eplb import DEFAULT_METHOD, EplbPlan
from lbkit.integrations._planning import is_torch, plan_for_engine

if TYPE_CHECKING:
    import torch
    from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm

__all__ = [
    "ENABLE_ENV",
    "LBKIT_ALGORITHMS",
    "SGLANG_VERSION_CHECKED",
    "load_plugin",
    "rebalance_experts",
    "register",
    "replan_experts",
    "unregister",
]

#: Environment variable that makes :func:`load_plugin` register the adapter (value ``"1"``).
ENABLE_ENV = "LBKIT_EPLB"

#: SGLang release whose algorithm interface this module was written against.
SGLANG_VERSION_CHECKED = "0.5.23"

#: SGLang algorithm names lbkit plans for, and the lbkit policy each means.
LBKIT_ALGORITHMS: Mapping[str, str] = MappingProxyType(
    {
        "deepseek": "global",
        "deepseek_hierarchical": "hierarchical",
        "deepseek_vec": "global",
        "deepseek_vec_hierarchical": "hierarchical",
    }
)

#: Attribute of the installed dispatcher that holds SGLang's own.
_ORIGINAL = "__lbkit_original__"


def _algorithm_name(algorithm: Any) -> str:
    name = getattr(algorithm, "name", algorithm)  # an EplbAlgorithm member or its name
    if not isinstance(name, str):
        raise TypeError(
            f"algorithm: must be an EplbAlgorithm member or its name, got {algorithm!r}"
        )
    return name


def replan_experts(
    tokens_per_expert: Any,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    algorithm: Any,
    *,
    previous_physical_to_logical_map: Any = None,
) -> EplbPlan:
    """:func:`rebalance_experts`, re-planning from SGLang's plan in service when it can be kept.

    Parameters
    ----------
    tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups, num_nodes,
    algorithm
        As in :func:`rebalance_experts`.
    previous_physical_to_logical_map : torch.Tensor or array_like of int, optional
        Shape ``(layers, slots)``: the plan in service. Re-planned from (few moves, see
        :func:`lbkit.eplb.replan_experts`) when it has ``num_physical_experts`` slots, no empty
        ``-1`` slot and, for a hierarchical algorithm, every group on one node; otherwise the
        plan is fresh.

    Returns
    -------
    EplbPlan
        As in :func:`rebalance_experts`.

    Raises
    ------
    TypeError, ValueError
        As in :func:`rebalance_experts`; also a map with another number of layers, entries
        outside ``[-1, num_logical_experts)`` or a logical expert without a slot.

    Runtime complexity: that of :func:`lbkit.eplb.replan_experts`, or of
    :func:`rebalance_experts` without a usable map.

    Examples
    --------
    >>> from lbkit.eplb import drift, synthetic_expert_load
    >>> w = synthetic_expert_load(2, 16, rng=0)
    >>> old = rebalance_experts(w[None], 24, 6, 4, 1, "deepseek")  # one recording window
    >>> new = replan_experts(drift(w, sigma=0.1, rng=1)[None], 24, 6, 4, 1, "deepseek",
    ...                      previous_physical_to_logical_map=old.phy2log)
    >>> int((new.phy2log != old.phy2log).sum()) <= 24  # few of the 48 slots change
    True
    """
    name = _algorithm_name(algorithm)
    if name not in LBKIT_ALGORITHMS:
        raise ValueError(
            f"algorithm: lbkit plans for {sorted(LBKIT_ALGORITHMS)}, got {name!r} (register() "
            "leaves the other algorithms to SGLang)"
        )
    policy = LBKIT_ALGORITHMS[name]
    counts = as_float_array(tokens_per_expert, "tokens_per_expert", ndim=3, nonnegative=True)
    num_physical_experts = check_int(num_physical_experts, "num_physical_experts", min_value=1)
    num_local = check_int(num_local_physical_experts, "num_local_physical_experts", min_value=1)
    num_nodes = check_int(num_nodes, "num_nodes", min_value=1)
    if num_physical_experts % num_local:
        raise ValueError(
            f"num_local_physical_experts: must divide num_physical_experts "
            f"({num_physical_experts}), got {num_local}"
        )
    if num_groups is None:
        if policy == "hierarchical":
            raise ValueError(
                f"num_groups: algorithm {name!r} needs expert groups, got None (the model has "
                "no grouped routing; use a global algorithm)"
            )
        num_groups = 1
    num_groups = check_int(num_groups, "num_groups", min_value=1)
    num_gpus = num_physical_experts // num_local
    if num_gpus % num_nodes:
        raise ValueError(
            f"num_nodes: must divide the number of GPUs, num_physical_experts / "
            f"num_local_physical_experts ({num_gpus}), got {num_nodes}"
        )
    return plan_for_engine(
        counts.sum(axis=0),
        num_physical_experts,
        num_groups,
        num_nodes,
        num_gpus,
        previous=previous_physical_to_logical_map,
        previous_name="previous_physical_to_logical_map",
        policy=policy,
        method=DEFAULT_METHOD,
        tolerance=None,
        tolerance_scope="mean",
        as_torch=is_torch(tokens_per_expert),
    )


def rebalance_experts(
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    algorithm: EplbAlgorithm,
):
    """Plan SGLang's expert locations with lbkit (the signature of SGLang's dispatcher).

    Parameters
    ----------
    tokens_per_expert : torch.Tensor, shape (windows, layers, num_logical_experts)
        Tokens routed to each logical expert per recording window (SGLang's ``logical_count``;
        summed over windows). Any real dtype and device; a numpy array gives numpy results.
    num_physical_experts : int
        Slots per layer over all GPUs; at least the number of logical experts.
    num_local_physical_experts : int
        Slots per GPU; divides ``num_physical_experts`` (the quotient is the GPU count).
    num_groups : int or None
        Expert groups (``None``: the model has none, only for global algorithms); divides the
        number of logical experts.
    num_nodes : int
        Nodes; divides the GPU count.
    algorithm : EplbAlgorithm or str
        One of :data:`LBKIT_ALGORITHMS` (an ``EplbAlgorithm`` member or its name):
        ``*_hierarchical`` plans under lbkit's hierarchical policy, the others globally.

    Returns
    -------
    EplbPlan
        A tuple ``(physical_to_logical_map [L, P], logical_to_all_physical_map [L, E, K],
        expert_count [L, E])`` of ``int64`` CPU torch tensors (numpy arrays for numpy input):
        the expert of each slot, the slots of each expert padded with -1, and replica counts.

    Raises
    ------
    TypeError
        Non-numeric loads, non-integer sizes, an ``algorithm`` that is neither a member nor a
        string.
    ValueError
        Loads not 3-D, negative, NaN or infinite; sizes that do not divide as stated; an
        algorithm lbkit does not plan for; ``num_groups=None`` with a hierarchical algorithm;
        what :func:`lbkit.eplb.rebalance_experts` rejects.

    Runtime complexity: that of :func:`lbkit.eplb.rebalance_experts`, plus O(windows × layers ×
    experts) to sum the windows.

    Examples
    --------
    >>> counts = [[[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]]]
    >>> phy2log, log2phy, count = rebalance_experts(counts, 16, 2, 4, 2, "deepseek_hierarchical")
    >>> phy2log.shape, log2phy.shape[:2], int(count.sum())
    ((1, 16), (1, 12), 16)
    """
    return replan_experts(
        tokens_per_expert,
        num_physical_experts,
        num_local_physical_experts,
        num_groups,
        num_nodes,
        algorithm,
    )


def _plan_in_service() -> Any:
    """SGLang's current ``physical_to_logical_map`` (CPU copy), or ``None`` before the first."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    metadata = get_global_expert_location_metadata()
    if metadata is None:
        return None
    cpu = getattr(metadata, "physical_to_logical_map_cpu", None)
    return metadata.physical_to_logical_map if cpu is None else cpu


def _installed(original: Callable[..., Any], keep_plan: bool) -> Callable[..., Any]:
    def rebalance_experts(
        tokens_per_expert,
        num_physical_experts,
        num_local_physical_experts,
        num_groups,
        num_nodes,
        algorithm,
    ):
        args = (
            tokens_per_expert,
            num_physical_experts,
            num_local_physical_experts,
            num_groups,
            num_nodes,
            algorithm,
        )
        if _algorithm_name(algorithm) not in LBKIT_ALGORITHMS:
            return original(*args)
        previous = _plan_in_service() if keep_plan else None
        return replan_experts(*args, previous_physical_to_logical_map=previous)

    rebalance_experts.__doc__ = "SGLang's EPLB dispatcher with lbkit planning (lbkit.integrations)."
    setattr(rebalance_experts, _ORIGINAL, original)
    return rebalance_experts


def _algorithms_module() -> Any:
    try:
        from sglang.srt.eplb import eplb_algorithms
    except ImportError as exc:
        raise ImportError(
            "lbkit.integrations.sglang.register: SGLang is not importable; install SGLang (the "
            f"algorithm interface was checked against SGLang {SGLANG_VERSION_CHECKED}) ({exc})"
        ) from exc
    if not callable(getattr(eplb_algorithms, "rebalance_experts", None)):
        raise ImportError(
            "lbkit.integrations.sglang.register: sglang.srt.eplb.eplb_algorithms has no "
            "rebalance_experts dispatcher (an SGLang release with another EPLB interface)"
        )
    return eplb_algorithms


def register(*, keep_plan: bool = True) -> None:
    """Route SGLang's ``deepseek*`` EPLB algorithms to lbkit in this process.

    Replaces ``sglang.srt.eplb.eplb_algorithms.rebalance_experts`` (looked up through the module
    at every call by ``init_by_eplb``) with a dispatcher that plans with lbkit for the
    algorithms of :data:`LBKIT_ALGORITHMS` and calls SGLang's own for the others. Idempotent
    (a second call only changes ``keep_plan``); :func:`unregister` restores SGLang's.

    Parameters
    ----------
    keep_plan : bool, default True
        Re-plan from SGLang's plan in service (few moves, :func:`replan_experts`); ``False``
        plans afresh every time, as SGLang's algorithms do.

    Raises
    ------
    ImportError
        SGLang is not importable or has no ``eplb_algorithms.rebalance_experts``.
    TypeError
        ``keep_plan`` is not a bool.

    """
    if not isinstance(keep_plan, bool):
        raise TypeError(f"keep_plan: must be a bool, got {keep_plan!r}")
    module = _algorithms_module()
    current = module.rebalance_experts
    original = getattr(current, _ORIGINAL, current)
    module.rebalance_experts = _installed(original, keep_plan)


def unregister() -> None:
    """Restore SGLang's own dispatcher if :func:`register` replaced it.

    Raises
    ------
    ImportError
        SGLang is not importable.

    """
    module = _algorithms_module()
    original = getattr(module.rebalance_experts, _ORIGINAL, None)
    if original is not None:
        module.rebalance_experts = original


def load_plugin() -> None:
    """SGLang plugin entry point (group ``sglang.srt.plugins``): :func:`register` if enabled.

    Does nothing unless the environment variable :data:`ENABLE_ENV` (``LBKIT_EPLB``) is ``"1"``.
    SGLang runs it in each of its processes (``SGLANG_PLUGINS``, if set, must name
    ``lbkit_eplb``).

    """
    if os.environ.get(ENABLE_ENV, "") == "1":
        register()
