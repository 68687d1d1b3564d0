"""Engine adapters: lbkit's EPLB behind the interfaces of vLLM and SGLang.

- :mod:`lbkit.integrations.vllm`: :class:`~lbkit.integrations.vllm.LbkitEplbPolicy`, a vLLM EPLB
  policy class, and ``register()`` / the ``vllm.general_plugins`` entry point that install it.
- :mod:`lbkit.integrations.sglang`: ``rebalance_experts`` with the signature of SGLang's EPLB
  algorithm dispatcher, and ``register()`` / the ``sglang.srt.plugins`` entry point.

Importing either module needs neither engine nor torch; the modules are not imported here, so
``import lbkit.integrations`` costs nothing. Both plugins stay inactive unless ``LBKIT_EPLB=1``.
How to switch them on: ``docs/howto-vllm-sglang-eplb.md``.
"""

__all__: list[str] = []
