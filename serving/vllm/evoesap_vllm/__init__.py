"""vLLM plugin that serves EvoESAP's non-uniformly pruned MoE checkpoints on stock vLLM.

Installed beside vLLM, it registers `EvoESAP<StockArchitecture>` (the name EvoESAP's save_pruned writes
for a checkpoint whose MoE layers keep different expert counts) through the `vllm.general_plugins`
entry point. Uniformly pruned checkpoints keep their stock name and need no plugin.
"""

from __future__ import annotations

from evoesap_vllm.families import ARCHITECTURE_PREFIX, BY_NAME, FAMILIES, PER_LAYER_KEY

__all__ = ["ARCHITECTURE_PREFIX", "FAMILIES", "PER_LAYER_KEY", "register"]


def register() -> None:
    """Register every variant lazily (`module:Class`), so loading the plugin imports no model code."""
    from vllm import ModelRegistry

    for name in BY_NAME:
        ModelRegistry.register_model(name, f"evoesap_vllm.models:{name}")
