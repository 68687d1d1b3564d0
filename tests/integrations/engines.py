"""Stand-ins for the engine interfaces that lbkit's adapters plug into, written from the sources.

Installing vLLM or SGLang in the test environment is not practical (GPU builds, gigabytes of
dependencies), so these stand-ins reproduce, in our own words, the parts of each engine that an
EPLB policy meets: the names it is looked up by, the exact signature it is called with, how the
engine calls it and what the engine does with the result. The planning algorithms themselves are
not reproduced.

- **vLLM 0.33.0** (the release's source distribution): ``vllm/distributed/eplb/policy/abstract.py``
  (``AbstractEplbPolicy``: an ABC whose abstract *class method* ``rebalance_experts`` returns the
  physical-to-logical map), ``policy/__init__.py`` (``EPLB_POLICIES = {"default": ...}``),
  ``vllm/config/parallel.py`` (``EPLBConfig.policy``, a ``Literal["default"]``),
  ``eplb_state.py`` (``EplbState`` picks ``EPLB_POLICIES[eplb_config.policy]`` when a model is
  added and calls the policy with the all-reduced load window, the sizes and
  ``physical_to_logical_map.cpu()``; the asynchronous commit requires the new map to keep the
  old shape) and ``async_worker.py`` (asserts that the new map is on the CPU), ``vllm/plugins``
  (``vllm.general_plugins`` entry points run in every process).
- **SGLang 0.5.23** (the release's wheel): ``sglang/srt/eplb/eplb_algorithms/__init__.py``
  (``EplbAlgorithm``, the dispatcher ``rebalance_experts`` and ``compute_algorithm``),
  ``sglang/srt/eplb/expert_location.py`` (``init_by_eplb`` calls the dispatcher with keyword
  arguments through the module; ``_init_raw`` pads ``logical_to_all_physical_map`` with -1 to
  ``num_physical_experts`` columns and counts the valid entries;
  ``get_global_expert_location_metadata()`` holds the plan in service, with a
  ``physical_to_logical_map_cpu`` copy), ``sglang/srt/plugins`` (``sglang.srt.plugins`` entry
  points run in every process).

Signatures are kept textually (``from __future__ import annotations``), so ``inspect.signature``
compares parameter names, kinds, defaults and annotation text. One normalisation: SGLang writes
``Optional[int]``, lbkit ``int | None`` (see :func:`normalised_signature`).
"""

from __future__ import annotations

import abc
import enum
import inspect
import re
import sys
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"


def normalised_signature(func: Any) -> inspect.Signature:
    """``inspect.signature`` with ``Optional[X]`` annotations written ``X | None``."""
    sig = inspect.signature(func)

    def norm(annotation: Any) -> Any:
        if isinstance(annotation, str):
            return re.sub(r"^Optional\[(.*)\]$", r"\1 | None", annotation)
        return annotation

    params = [p.replace(annotation=norm(p.annotation)) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=norm(sig.return_annotation))


def _install(monkeypatch: Any, modules: dict[str, types.ModuleType]) -> None:
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)


# --------------------------------------------------------------------------------------- vLLM


@dataclass
class VllmEngine:
    """The vLLM pieces a policy meets: its registry, its base class and the calling code."""

    AbstractEplbPolicy: type
    DefaultEplbPolicy: type
    EPLB_POLICIES: dict[str, type]
    policy_module: types.ModuleType

    def rearrange(
        self,
        policy_name: str,
        global_expert_load_window: Any,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_gpus: int,
        physical_to_logical_map: Any,
    ) -> Any:
        """One rearrangement as ``EplbState`` runs it: select, call on the host, check, commit."""
        policy = self.EPLB_POLICIES[policy_name]  # EplbState.add_model
        new_map = policy.rebalance_experts(  # EplbState.rearrange / async_worker, positional
            global_expert_load_window.cpu(),
            num_replicas,
            num_groups,
            num_nodes,
            num_gpus,
            physical_to_logical_map.cpu(),
        )
        assert new_map.device.type == "cpu"  # async_worker.run_rebalance_experts
        if new_map.shape[1] == physical_to_logical_map.shape[1]:
            for layer in range(new_map.shape[0]):  # _commit_eplb_maps_for_layer
                assert new_map[layer].shape == physical_to_logical_map[layer].shape
                physical_to_logical_map[layer].copy_(new_map[layer])
        return new_map


def install_vllm(monkeypatch: Any) -> VllmEngine:
    """Put a stand-in ``vllm.distributed.eplb.policy`` in ``sys.modules`` until the test ends."""

    class AbstractEplbPolicy(abc.ABC):
        @classmethod
        @abc.abstractmethod
        def rebalance_experts(
            cls,
            weight: torch.Tensor,
            num_replicas: int,
            num_groups: int,
            num_nodes: int,
            num_ranks: int,
            old_global_expert_indices: torch.Tensor | None = None,
        ) -> torch.Tensor:
            raise NotImplementedError

    class DefaultEplbPolicy(AbstractEplbPolicy):
        @classmethod
        def rebalance_experts(
            cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old=None
        ):  # stand-in only: vLLM's algorithm is not reproduced
            raise NotImplementedError("stand-in for vLLM's default policy")

    policies: dict[str, type] = {"default": DefaultEplbPolicy}
    mods = {
        name: types.ModuleType(name)
        for name in (
            "vllm",
            "vllm.distributed",
            "vllm.distributed.eplb",
            "vllm.distributed.eplb.policy",
        )
    }
    policy_module = mods["vllm.distributed.eplb.policy"]
    policy_module.AbstractEplbPolicy = AbstractEplbPolicy
    policy_module.DefaultEplbPolicy = DefaultEplbPolicy
    policy_module.EPLB_POLICIES = policies
    mods["vllm"].__version__ = VLLM_VERSION
    _install(monkeypatch, mods)
    return VllmEngine(AbstractEplbPolicy, DefaultEplbPolicy, policies, policy_module)


# ------------------------------------------------------------------------------------- SGLang


class EplbAlgorithm(enum.Enum):
    """SGLang's algorithm names (members in SGLang's order)."""

    deepseek = enum.auto()
    deepseek_hierarchical = enum.auto()
    deepseek_vec = enum.auto()
    deepseek_vec_hierarchical = enum.auto()
    elasticity_aware = enum.auto()
    elasticity_aware_hierarchical = enum.auto()


def rebalance_experts(
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: Optional[int],  # noqa: UP045 - SGLang's spelling, kept as in its source
    num_nodes: int,
    algorithm: EplbAlgorithm,
):
    """SGLang's dispatcher signature; this stand-in records the call instead of planning."""
    SGLANG_CALLS.append(algorithm)
    return ("sglang's own plan", algorithm)


def compute_algorithm(raw_algorithm: str, num_groups: int | None, num_nodes: int) -> EplbAlgorithm:
    """SGLang's choice: a named algorithm, or for ``auto`` hierarchical when nodes divide groups."""
    if raw_algorithm != "auto":
        return EplbAlgorithm[raw_algorithm]
    if num_groups is not None and num_groups % num_nodes == 0:
        return EplbAlgorithm.deepseek_hierarchical
    return EplbAlgorithm.deepseek


#: Algorithms the stand-in dispatcher was asked to plan (SGLang's own path).
SGLANG_CALLS: list[Any] = []


@dataclass
class ExpertLocationMetadata:
    """The fields of SGLang's metadata that the adapter and these tests read."""

    physical_to_logical_map: Any
    physical_to_logical_map_cpu: Any
    logical_to_all_physical_map: Any
    logical_to_all_physical_map_num_valid: Any


@dataclass
class SglangEngine:
    algorithms: types.ModuleType
    expert_location: types.ModuleType

    def set_plan_in_service(self, metadata: ExpertLocationMetadata | None) -> None:
        self.expert_location._metadata = metadata

    def init_by_eplb(
        self,
        logical_count: Any,
        *,
        num_physical_experts: int,
        ep_size: int,
        num_groups: int | None,
        num_nodes: int,
        raw_algorithm: str = "auto",
    ) -> ExpertLocationMetadata:
        """``ExpertLocationMetadata.init_by_eplb`` followed by ``_init_raw``'s post-processing."""
        import torch
        import torch.nn.functional as F

        if logical_count.dim() == 2:
            logical_count = logical_count.unsqueeze(0)
        algorithms = self.algorithms  # looked up through the module at every call
        p2l, l2p, _count = algorithms.rebalance_experts(
            tokens_per_expert=logical_count,
            num_physical_experts=num_physical_experts,
            num_local_physical_experts=num_physical_experts // ep_size,
            num_groups=num_groups,
            num_nodes=num_nodes,
            algorithm=algorithms.compute_algorithm(
                raw_algorithm=raw_algorithm, num_groups=num_groups, num_nodes=num_nodes
            ),
        )
        padded = F.pad(l2p, (0, num_physical_experts - l2p.shape[-1]), value=-1)
        return ExpertLocationMetadata(
            physical_to_logical_map=p2l,
            physical_to_logical_map_cpu=p2l.cpu(),
            logical_to_all_physical_map=padded,
            logical_to_all_physical_map_num_valid=torch.count_nonzero(padded != -1, dim=-1),
        )


def install_sglang(monkeypatch: Any) -> SglangEngine:
    """Put stand-in ``sglang.srt.eplb`` modules in ``sys.modules`` (undone after the test)."""
    names = (
        "sglang",
        "sglang.srt",
        "sglang.srt.eplb",
        "sglang.srt.eplb.eplb_algorithms",
        "sglang.srt.eplb.expert_location",
    )
    mods = {name: types.ModuleType(name) for name in names}
    algorithms = mods["sglang.srt.eplb.eplb_algorithms"]
    algorithms.EplbAlgorithm = EplbAlgorithm
    algorithms.rebalance_experts = rebalance_experts
    algorithms.compute_algorithm = compute_algorithm
    location = mods["sglang.srt.eplb.expert_location"]
    location._metadata = None
    location.get_global_expert_location_metadata = lambda: location._metadata
    mods["sglang"].__version__ = SGLANG_VERSION
    SGLANG_CALLS.clear()
    _install(monkeypatch, mods)
    return SglangEngine(algorithms, location)
