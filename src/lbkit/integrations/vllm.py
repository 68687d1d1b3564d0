"""vLLM EPLB policy backed by lbkit: :class:`LbkitEplbPolicy`, :func:`register`, the plugin.

vLLM (checked against release 0.33.0, ``vllm/distributed/eplb/policy/``) chooses its expert
placement with a policy class: ``EplbState`` looks up ``EPLB_POLICIES[eplb_config.policy]``
(``eplb_state.py``) and calls the class method ``rebalance_experts(weight, num_replicas,
num_groups, num_nodes, num_ranks, old_global_expert_indices)`` of ``AbstractEplbPolicy``
(``policy/abstract.py``) on the host, with the loads of the window, the sizes and the map in
service; it returns the new physical-to-logical map ``[layers, num_replicas]``. In that release
``eplb_config.policy`` accepts only ``"default"`` (``EPLBPolicyOption = Literal["default"]`` in
``vllm/config/parallel.py``; asynchronous EPLB, on by default, also requires it), so lbkit's
policy is installed under that name.

Enable it in every vLLM process with vLLM's plugin mechanism: lbkit declares the entry point
``lbkit_eplb = "lbkit.integrations.vllm:load_plugin"`` in the ``vllm.general_plugins`` group,
which vLLM loads in the API server, the engine core and every worker; the plugin does nothing
unless ``LBKIT_EPLB=1`` is set. Calling :func:`register` by hand works only in the process that
builds the model (vLLM's engine core runs in a separate process by default).

Importing this module needs neither vLLM nor torch: the policy converts tensors with their own
methods and imports torch only when it returns tensors.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

from lbkit.core.validation import as_float_array, check_int
from lbkit.eplb import DEFAULT_METHOD
from lbkit.integrations._planning import is_torch, plan_for_engine

if TYPE_CHECKING:
    import torch

__all__ = ["ENABLE_ENV", "VLLM_VERSION_CHECKED", "LbkitEplbPolicy", "load_plugin", "register"]

#: Environment variable that makes :func:`load_plugin` register the policy (value ``"1"``).
ENABLE_ENV = "LBKIT_EPLB"

#: vLLM release whose policy interface this module was written against.
VLLM_VERSION_CHECKED = "0.33.0"


class LbkitEplbPolicy:
    """vLLM EPLB policy (``AbstractEplbPolicy`` interface) planning with :mod:`lbkit.eplb`.

    A fresh plan is :func:`lbkit.eplb.rebalance_experts`; with ``old_global_expert_indices``
    (vLLM always passes its map in service) the plan is :func:`lbkit.eplb.replan_experts` from
    that map, so a re-plan moves few experts. The map is re-planned from only when it can be
    (same slot count, no empty ``-1`` slot, and under the hierarchical policy every group on
    one node); otherwise the plan is fresh (:mod:`lbkit.integrations._planning`). The policy
    follows vLLM's rule: hierarchical when ``num_nodes`` divides ``num_groups``, else global.

    Subclass to change the knobs (class attributes) and pass the subclass to :func:`register`.

    Attributes
    ----------
    method : str
        Fresh-plan method, a key of :data:`lbkit.eplb.METHODS`.
    tolerance : float or None
        Balance a re-plan may give up against a fresh plan, relative; ``None`` keeps the
        default of :func:`lbkit.eplb.replan_experts`.
    tolerance_scope : {"mean", "layer"}
        As in :func:`lbkit.eplb.replan_experts` (``"layer"`` is faster and moves more).
    """

    method: ClassVar[str] = DEFAULT_METHOD
    tolerance: ClassVar[float | None] = None
    tolerance_scope: ClassVar[str] = "mean"

    @classmethod
    def rebalance_experts(
        cls,
        weight: torch.Tensor,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Plan ``num_replicas`` slots per layer over ``num_ranks`` ranks for the loads ``weight``.

        Parameters
        ----------
        weight : torch.Tensor, shape (layers, num_logical_experts)
            Load of each logical expert over the window (vLLM passes ``int64`` token counts on
            the CPU; any real dtype and device is accepted). All zeros (vLLM's profile run) is
            allowed. A numpy array is accepted too and gives a numpy result.
        num_replicas : int
            Physical experts (slots) per layer; a multiple of ``num_ranks`` and at least the
            number of logical experts.
        num_groups : int
            Expert groups; must divide the number of logical experts.
        num_nodes : int
            Nodes; must divide ``num_ranks``. Rank ``r`` is on node ``r // (num_ranks /
            num_nodes)``.
        num_ranks : int
            Expert-parallel ranks (GPUs); rank ``r`` holds slots ``r*S .. (r+1)*S-1`` with ``S =
            num_replicas / num_ranks``.
        old_global_expert_indices : torch.Tensor of int, shape (layers, slots), optional
            vLLM's map in service (``physical_to_logical_map``, despite the name and vLLM's
            docstring); re-planned from when usable (class docstring).

        Returns
        -------
        torch.Tensor of int64, shape (layers, num_replicas)
            Physical-to-logical map on the CPU: the logical expert of each slot. Every logical
            expert has at least one slot in every layer.

        Raises
        ------
        TypeError
            Non-numeric ``weight``, non-integer sizes or map.
        ValueError
            ``weight`` not 2-D, empty, negative, NaN or infinite; ``num_ranks`` not dividing
            ``num_replicas``; ``num_nodes`` not dividing ``num_ranks``; what
            :func:`lbkit.eplb.rebalance_experts` rejects; a map with another number of layers
            than ``weight``, entries outside ``[-1, num_logical_experts)`` or a logical expert
            without a slot.

        Runtime complexity: that of :func:`lbkit.eplb.replan_experts` (with a usable map) or
        :func:`lbkit.eplb.rebalance_experts` (without), plus O(layers × slots × log slots) to
        check the map.

        Examples
        --------
        >>> import numpy as np
        >>> from lbkit.eplb import drift, synthetic_expert_load
        >>> w = synthetic_expert_load(2, 16, rng=0)
        >>> old = LbkitEplbPolicy.rebalance_experts(w, 24, 4, 1, 4)
        >>> old.shape, old.dtype
        ((2, 24), dtype('int64'))
        >>> new = LbkitEplbPolicy.rebalance_experts(drift(w, sigma=0.1, rng=1), 24, 4, 1, 4, old)
        >>> int((new != old).sum()) <= 24  # few of the 48 slots change
        True
        """
        num_replicas = check_int(num_replicas, "num_replicas", min_value=1)
        num_groups = check_int(num_groups, "num_groups", min_value=1)
        num_nodes = check_int(num_nodes, "num_nodes", min_value=1)
        num_ranks = check_int(num_ranks, "num_ranks", min_value=1)
        if num_replicas % num_ranks:
            raise ValueError(
                f"num_ranks: must divide num_replicas ({num_replicas}), got {num_ranks}"
            )
        if num_ranks % num_nodes:
            raise ValueError(f"num_nodes: must divide num_ranks ({num_ranks}), got {num_nodes}")
        w = as_float_array(weight, "weight", ndim=2, nonnegative=True)
        plan = plan_for_engine(
            w,
            num_replicas,
            num_groups,
            num_nodes,
            num_ranks,
            previous=old_global_expert_indices,
            previous_name="old_global_expert_indices",
            policy=None,  # vLLM's rule, which is DeepSeek's and lbkit's default
            method=cls.method,
            tolerance=cls.tolerance,
            tolerance_scope=cls.tolerance_scope,
            as_torch=is_torch(weight),
        )
        return plan.phy2log


def register(policy: type | None = None, *, name: str = "default") -> Any:
    """Install ``policy`` (default :class:`LbkitEplbPolicy`) as vLLM's EPLB policy ``name``.

    Sets ``vllm.distributed.eplb.policy.EPLB_POLICIES[name]`` and registers the class as a
    virtual subclass of vLLM's ``AbstractEplbPolicy``. Idempotent. Call it before vLLM builds
    the model, in the process that builds it: the plugin entry point (module docstring) does
    that in every vLLM process.

    Parameters
    ----------
    policy : type, optional
        A class with vLLM's ``rebalance_experts`` class method, e.g. a subclass of
        :class:`LbkitEplbPolicy` with other knobs.
    name : str, default "default"
        Key in ``EPLB_POLICIES``: the value of ``eplb_config.policy`` that selects it. vLLM
        0.33.0 accepts only ``"default"`` there.

    Returns
    -------
    type or None
        The class previously registered under ``name`` (pass it back to restore vLLM's own).

    Raises
    ------
    ImportError
        vLLM is not importable, or has no ``EPLB_POLICIES`` (a release older than the policy
        interface).
    TypeError
        ``policy`` is not a class with a callable ``rebalance_experts``, or ``name`` is not a
        non-empty string.

    """
    policy = LbkitEplbPolicy if policy is None else policy
    if not isinstance(policy, type) or not callable(getattr(policy, "rebalance_experts", None)):
        raise TypeError(
            f"policy: must be a class with a rebalance_experts class method, got {policy!r}"
        )
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: must be a non-empty string, got {name!r}")
    try:
        from vllm.distributed.eplb.policy import EPLB_POLICIES, AbstractEplbPolicy
    except ImportError as exc:
        raise ImportError(
            "lbkit.integrations.vllm.register: vLLM is not importable; install vLLM (the "
            f"policy interface was checked against vLLM {VLLM_VERSION_CHECKED}), or a release "
            f"without vllm.distributed.eplb.policy.EPLB_POLICIES is installed ({exc})"
        ) from exc
    if not issubclass(policy, AbstractEplbPolicy):
        AbstractEplbPolicy.register(policy)
    previous = EPLB_POLICIES.get(name)
    EPLB_POLICIES[name] = policy
    return previous


def load_plugin() -> None:
    """vLLM plugin entry point (group ``vllm.general_plugins``): :func:`register` if enabled.

    Does nothing unless the environment variable :data:`ENABLE_ENV` (``LBKIT_EPLB``) is ``"1"``,
    so installing lbkit beside vLLM changes nothing by itself. vLLM calls it in every process,
    possibly more than once; :func:`register` is idempotent.

    """
    if os.environ.get(ENABLE_ENV, "") == "1":
        register()
